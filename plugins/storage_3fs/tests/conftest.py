"""Fixtures for the ``3fs`` store tests: a store in a temporary directory, checked clean after.

The tests use the real mkfs.erofs and real mounts, so they need root and erofs-utils. Tests
marked ``slow`` (debootstrap from a Debian mirror) run only with ``DSEC_SLOW_TESTS=1``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from dsec_storage_3fs import ThreeFsConfig, ThreeFsStore

from dsec_kernel.linuxhost import syscalls

_HERE = str(Path(__file__).parent)
_NEEDS = [
    (os.geteuid() != 0, "needs root (file owners, device nodes, mounts)"),
    (shutil.which("mkfs.erofs") is None, "needs mkfs.erofs: apt-get install erofs-utils"),
    ("erofs" not in Path("/proc/filesystems").read_text(), "this kernel has no EROFS"),
]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: takes tens of seconds and the network; runs with DSEC_SLOW_TESTS=1"
    )


def pytest_collection_modifyitems(items):
    slow_skip = pytest.mark.skip(
        reason="slow (debootstrap from a Debian mirror, 1-2 min): set DSEC_SLOW_TESTS=1 to run it"
    )
    for item in items:
        if not str(item.path).startswith(_HERE):
            continue
        for missing, reason in _NEEDS:
            item.add_marker(pytest.mark.skipif(missing, reason=reason))
        if item.get_closest_marker("slow") and os.environ.get("DSEC_SLOW_TESTS") != "1":
            item.add_marker(slow_skip)


def _mounts_under(path: Path) -> list[str]:
    return [m for m in Path("/proc/self/mounts").read_text().splitlines() if f"{path}/" in m]


@pytest.fixture
def store_with(tmp_path):
    """``store_with(**fields)``: a store rooted in ``tmp_path`` with those settings (gc
    without grace period). After the test: nothing of it is mounted and no import left
    temporary files; then the directory is removed."""

    def make(**fields):
        config = ThreeFsConfig(
            root=tmp_path / "store", cache_dir=tmp_path / "cache", gc_grace_s=0, **fields
        )
        return ThreeFsStore(config)

    yield make
    left = _mounts_under(tmp_path)
    for line in left:
        syscalls.umount(line.split()[1], syscalls.MNT_DETACH)
    tmp_files = list((tmp_path / "store" / "tmp").glob("*"))
    shutil.rmtree(tmp_path)
    assert not left, f"mounts left behind: {left}"
    assert not tmp_files, f"temporary files left behind: {tmp_files}"


@pytest.fixture
def store(store_with):
    """A store with the default settings (see ``store_with``)."""
    return store_with()


@pytest.fixture
def mounted(store):
    """``mounted(layer, holder)`` -> its mount point; released at the end of the test."""
    held = []

    def mount(layer, holder="node-a/sb-1"):
        held.append((layer.digest, holder))
        return store.mount(layer.digest, holder)

    yield mount
    for digest, holder in held:
        store.release(digest, holder)


@pytest.fixture
def sample_tree(tmp_path):
    """A directory with a file, a setuid binary owned by 1234:5678, a symlink, a hard link,
    an empty directory and an overlay-opaque directory (trusted.overlay.opaque=y)."""
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "hello.txt").write_text("hello\n")
    (src / "bin" / "tool").write_bytes(b"#!/bin/sh\necho tool\n")
    os.chown(src / "bin" / "tool", 1234, 5678)
    os.chmod(src / "bin" / "tool", 0o4755)
    (src / "link").symlink_to("hello.txt")
    os.link(src / "hello.txt", src / "hard")
    (src / "empty").mkdir()
    (src / "opaque").mkdir()
    os.setxattr(src / "opaque", "trusted.overlay.opaque", b"y")
    return src
