"""The examples run against `dsec up`, as the README says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dsec_backend_container.backend import ContainerBackend

ROOT = Path(__file__).resolve().parent.parent
REASON = ContainerBackend.unavailable_reason()


def up(tmp_path: Path, example: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsec_kernel.cli", "up", "--state-dir", str(tmp_path / "up"), "--",
         sys.executable, str(ROOT / "examples" / example)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.mark.skipif(bool(REASON), reason=f"the container backend cannot run here: {REASON}")
def test_swe_episode(tmp_path):
    proc = up(tmp_path, "swe_episode.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by = {}
    for s in steps:
        by.setdefault(s["step"], []).append(s)
    assert by["run tests"][0]["result"] == "OK" and by["run tests"][0]["tests"] > 700
    assert by["apply an edit"][0]["modified"] == ["/workspace/more_itertools/more.py"]
    assert by["run tests again"][0]["result"] != "OK" and by["run tests again"][0]["exit_code"] != 0
    assert by["restore"][0]["changed_before"] > 0 and by["restore"][0]["changed_after"] == 0
    variants = {v["fix"]: v["result"] for v in by["variant"]}
    assert len(variants) == 8 and variants["len(chunk) != n"] == "OK"
    assert variants["len(chunk) > n"] != "OK"
    assert by["done"][0]["left"] == 0
