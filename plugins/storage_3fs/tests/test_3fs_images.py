"""Base trees: busybox (fast) and Debian with python3 (slow: debootstrap, DSEC_SLOW_TESTS=1)."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
from dsec_storage_3fs.images import BUSYBOX, busybox_tree, debian_tree, ensure_layer


def _unbuildable(tree):
    raise AssertionError("ensure_layer rebuilt a layer the store has")


def test_busybox_layer_mounts_and_runs(store, tmp_path, mounted):
    if not BUSYBOX.is_file():
        pytest.skip(f"{BUSYBOX} is missing: apt-get install busybox-static")
    layer = ensure_layer(store, "base", "busybox", "1", busybox_tree)
    assert ensure_layer(store, "base", "busybox", "1", _unbuildable) == layer
    mp = mounted(layer)
    assert stat.S_IMODE(os.stat(mp / "bin/busybox").st_mode) == 0o755
    assert os.readlink(mp / "bin/sh") == "busybox"
    assert stat.S_IMODE(os.stat(mp / "tmp").st_mode) == 0o1777
    assert "nobody" in (mp / "etc/passwd").read_text()
    run = subprocess.run([mp / "bin/busybox", "echo", "hi"], capture_output=True, text=True)
    assert run.stdout == "hi\n"
    # reproducible: the same busybox gives the same image
    again = store.import_layer(str(busybox_tree(tmp_path / "again")), "base", "busybox-b", "1")
    assert again.digest == layer.digest


@pytest.mark.slow
def test_debian_python_layer_runs_python(store, mounted):
    layer = ensure_layer(store, "base", "debian-python", "12", debian_tree)
    assert ensure_layer(store, "base", "debian-python", "12", _unbuildable) == layer
    mp = mounted(layer)
    assert not list((mp / "var/cache/apt/archives").glob("*.deb"))
    run = subprocess.run(
        ["chroot", mp, "/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
    )
    assert run.stdout == "(3, 11)\n", run.stderr
