"""What sandboxes' files take, counted against their limits and the node's (FileSpace alone,
on a real directory)."""

from __future__ import annotations

import json
import os

import pytest
from dsec_backend_fncall.filespace import BLOCK, FileSpace

from dsec_kernel.contract import errors
from dsec_kernel.linuxhost.fileio import remove_tree


def test_sandboxes_are_held_to_their_limits_and_the_node_to_its_own(tmp_path):
    for sid, limits in (("sb-a", {"disk_mb": 1, "inodes": 3}), ("sb-b", {})):
        (tmp_path / sid / "files").mkdir(parents=True)
        (tmp_path / sid / "limits.json").write_text(json.dumps(limits))
    (tmp_path / "sb-a" / "files" / "there").write_bytes(b"x" * 1000)  # counted at start:
    space = FileSpace(tmp_path, disk_mb=2, inodes=10, total_mb=3, total_inodes=12)  # a block
    space.charge("sb-a", (1 << 20) - BLOCK, 1)
    with pytest.raises(errors.QuotaExceeded, match="disk limit"):
        space.charge("sb-a", 1, 0)
    space.charge("sb-a", -BLOCK, 1)  # a file made smaller gives room back
    with pytest.raises(errors.QuotaExceeded, match="inodes"):
        space.charge("sb-a", 0, 1)
    space.charge("sb-b", 2 << 20, 5)  # the backend's defaults: 2 MiB
    (tmp_path / "sb-c" / "files").mkdir(parents=True)
    with pytest.raises(errors.QuotaExceeded, match="node's disk"):
        space.charge("sb-c", 1 << 20, 1)  # 1 MiB + 2 MiB + 1 MiB > 3 MiB
    with pytest.raises(errors.QuotaExceeded, match="node's disk"):
        space.charge("sb-c", 0, 5)  # 3 + 5 + 5 entries > 12
    space.forget("sb-b")
    space.charge("sb-c", 1 << 20, 5)  # destroyed files give the node room back


def test_what_a_tree_takes_is_counted_without_recursion(tmp_path):
    """Entries count a block each at least (4,096 one-byte files took 64 MiB of disk and
    were counted as 4 KiB), and a tree of any depth is walked."""
    files = tmp_path / "sb-a" / "files"
    files.mkdir(parents=True)
    fd = os.open(files, os.O_RDONLY)
    for _ in range(1500):  # deeper than a path can name: made relative to each level
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)
    for i in range(10):
        (files / f"f{i}").write_bytes(b"x")
    try:
        space = FileSpace(tmp_path, disk_mb=64, inodes=4096, total_mb=4096, total_inodes=1 << 20)
        assert space._used["sb-a"] == [(1500 + 10) * BLOCK, 1510]
    finally:  # (pytest's own clean-up of tmp_path recurses)
        remove_tree(files)
