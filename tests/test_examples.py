"""The examples run as a user runs them: under `dsec up`, on a fresh state directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dsec_backend_container.backend import ContainerBackend

ROOT = Path(__file__).resolve().parents[1]
REASON = ContainerBackend.unavailable_reason()


@pytest.mark.skipif(bool(REASON), reason=f"the container backend cannot run here: {REASON}")
def test_the_rl_rollout_survives_a_preempted_trainer(tmp_path):
    env = {**os.environ, "DSEC_STORAGE_CONFIG__ROOT": str(tmp_path / "layers")}
    up = [sys.executable, "-m", "dsec_kernel.cli", "up", "--state-dir", str(tmp_path / "up")]
    proc = subprocess.run(
        [*up, "--", sys.executable, str(ROOT / "examples" / "rl_rollout.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "result: correct" in out and "paused by the platform (reason: lease)" in out, out
    assert "agents alive after the pause: 8/8" in out, out
