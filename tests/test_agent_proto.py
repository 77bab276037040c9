"""The agent protocol's generated Python modules are current with agent.proto."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extra")
    (tmp_path / "dsec_kernel" / "contract" / "agent").mkdir(parents=True)
    shutil.copy(
        ROOT / "dsec_kernel/contract/agent/agent.proto",
        tmp_path / "dsec_kernel/contract/agent/agent.proto",
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--grpc_python_out=.",
            "dsec_kernel/contract/agent/agent.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in ("agent_pb2.py", "agent_pb2_grpc.py"):
        assert (tmp_path / "dsec_kernel/contract/agent" / name).read_text() == (
            ROOT / "dsec_kernel/contract/agent" / name
        ).read_text(), f"{name} is stale: regenerate it (see agent.proto's header)"
