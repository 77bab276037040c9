"""What sandboxes' files take, counted against their limits and the node's (FileSpace alone,
on a real directory)."""

from __future__ import annotations

import json

import pytest
from dsec_backend_fncall.filespace import FileSpace

from dsec_kernel import errors


def test_sandboxes_are_held_to_their_limits_and_the_node_to_its_own(tmp_path):
    for sid, limits in (("sb-a", {"disk_mb": 1, "inodes": 3}), ("sb-b", {})):
        (tmp_path / sid / "files").mkdir(parents=True)
        (tmp_path / sid / "limits.json").write_text(json.dumps(limits))
    (tmp_path / "sb-a" / "files" / "there").write_bytes(b"x" * 1000)  # counted at start
    space = FileSpace(tmp_path, disk_mb=2, inodes=10, total_mb=3)
    space.charge("sb-a", (1 << 20) - 1000, 1)
    with pytest.raises(errors.QuotaExceeded, match="disk limit"):
        space.charge("sb-a", 1, 0)
    space.charge("sb-a", -500, 1)  # a file made smaller gives room back
    with pytest.raises(errors.QuotaExceeded, match="inodes"):
        space.charge("sb-a", 0, 1)
    space.charge("sb-b", 2 << 20, 5)  # the backend's defaults: 2 MiB
    with pytest.raises(errors.QuotaExceeded, match="node's disk"):
        (tmp_path / "sb-c" / "files").mkdir(parents=True)
        space.charge("sb-c", 1 << 20, 1)  # 1 MiB + 2 MiB + 1 MiB > 3 MiB
    space.forget("sb-b")
    space.charge("sb-c", 1 << 20, 1)  # destroyed files give the node room back
