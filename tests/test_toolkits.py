"""Toolkit layers of pip packages (``dsec layer build toolkit``), built in a container sandbox
of debian-python:12 on a platform of processes, with pip reaching PyPI from that sandbox.

The base comes from the debian-python recipe's cache (``dsec layer build debian-python``
makes it, debootstrap 1-2 minutes, once per machine); without it, these tests run only with
``DSEC_SLOW_TESTS=1``, which builds it first.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from dsec_backend_container.backend import ContainerBackend
from dsec_storage_3fs.images import Busybox, DebianPython, busybox_tree

import dsec_kernel as dsec
from dsec_kernel.contract import errors
from dsec_kernel.contract.store import ensure_layer
from dsec_kernel.loader import open_store


def _pypi() -> str | None:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as e:
        return f"PyPI is out of reach from here ({e})"
    return None


def _needs() -> str | None:
    if reason := ContainerBackend.unavailable_reason():
        return f"the container backend cannot run here: {reason}"
    if reason := DebianPython.unavailable_reason() or Busybox.unavailable_reason():
        return reason
    if not DebianPython()._cached() and os.environ.get("DSEC_SLOW_TESTS") != "1":
        return (
            "slow: no debian-python:12 tree on this machine (debootstrap, 1-2 min): run "
            "`dsec layer build debian-python` once, or set DSEC_SLOW_TESTS=1"
        )
    return _pypi()


NEEDS = _needs()
pytestmark = pytest.mark.skipif(bool(NEEDS), reason=f"cannot build toolkits here: {NEEDS}")
#: a CA bundle for pip where a proxy re-signs TLS, as the command line takes it
CERT = Path(os.environ["PIP_CERT"]).read_bytes() if os.environ.get("PIP_CERT") else None
SMOKE = "def test_one():\n    assert 1 + 1 == 2\n"


@pytest.fixture(scope="module")
def layers(tmp_path_factory) -> dict[str, str]:
    """A store holding debian-python:12 and busybox:1, as the settings naming it."""
    root = tmp_path_factory.mktemp("toolkit-layers")
    store = open_store("3fs", {"root": str(root / "store"), "cache_dir": str(root / "cache")})
    recipe = DebianPython()
    ensure_layer(store, "base", "debian-python", "12", lambda tree: recipe.build(tree, print))
    ensure_layer(store, "base", "busybox", "1", busybox_tree)
    return {"DSEC_STORAGE_CONFIG__ROOT": str(root / "store")}


@pytest.fixture
async def platform(local_cluster, layers):
    cluster = local_cluster(layers)
    cluster.start_apiserver()
    cluster.start_edge("n1", ["container"])
    await cluster.ready()
    return cluster


def _dsec(cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **cluster.env, "DSEC_URL": cluster.conn.url,
           "DSEC_TOKEN": cluster.conn.token, "COLUMNS": "200"}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "dsec_kernel.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


async def test_a_toolkit_from_pip_runs_in_any_sandbox_of_its_base(platform):
    made = _dsec(platform, "layer", "build", "toolkit", "pytest:8.3", "--pip", "pytest==8.3.5")
    assert made.returncode == 0, made.stderr
    # pip's own lines, as they came
    assert "pytest:8.3: Collecting pytest==8.3.5" in made.stderr, made.stderr
    assert re.search(r"Successfully installed .*pytest-8\.3\.5", made.stderr), made.stderr
    ref, kind, digest, _size, _ = made.stdout.split()
    assert (ref, kind) == ("pytest:8.3", "toolkit")
    env = dsec.Env(base="debian-python:12", toolkits=["pytest:8.3"])
    async with platform.client() as c:
        [sb] = dsec.check(await c.create(count=1, backend="container", env=env))
        await sb.write_file("/work/test_smoke.py", SMOKE)
        for command in (
            "python3 -m pytest -q -p no:cacheprovider",
            "pytest -q -p no:cacheprovider",
        ):
            r = await sb.exec(command, cwd="/work", timeout=60)
            assert r.exit_code == 0 and b"1 passed" in r.stdout, (command, r.stdout, r.stderr)
        r = await sb.exec("echo ${PYTHONPATH:-unset}; pytest --version 2>&1", timeout=30)
        assert r.stdout == b"unset\npytest 8.3.5\n", r
        # the same requirements, pinned, give the same files: building again is a no-op
        again = await dsec.build_toolkit(c, "pytest:8.3", ["pytest==8.3.5"], cert=CERT)
        assert again.digest == digest
        await c.destroy([sb])
        assert await c.list() == []  # the build sandboxes went too


async def test_a_toolkit_that_cannot_be_built_leaves_nothing_behind(platform, layers):
    async with platform.client() as c:
        with pytest.raises(errors.Unavailable, match="No matching distribution found for no-"):
            await dsec.build_toolkit(c, "nope:1", ["no-such-dist-dsec-test"], cert=CERT)
        with pytest.raises(errors.InvalidArgument, match="base busybox:1 cannot build toolkits"):
            await dsec.build_toolkit(c, "nope:1", ["pytest"], base="busybox:1", cert=CERT)
        with pytest.raises(errors.InvalidArgument, match="expected requirements"):
            await dsec.build_toolkit(c, "nope:1", ["--index-url=http://example.com"])
        assert await c.list() == []
    store = open_store("3fs", {"root": layers["DSEC_STORAGE_CONFIG__ROOT"]})
    assert "nope:1" not in {x.ref for x in store.list_layers()}
