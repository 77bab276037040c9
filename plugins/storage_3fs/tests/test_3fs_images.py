"""Base trees: busybox (fast) and Debian with python3 (slow: debootstrap, DSEC_SLOW_TESTS=1)."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
from dsec_storage_3fs.images import (
    BUSYBOX,
    NAMESERVERS,
    DebianPython,
    busybox_tree,
    debian_tree,
    ensure_layer,
    normalize_debian_tree,
)

RELEASED = 1_762_593_754  # Sat, 08 Nov 2025 09:22:34 UTC
PACKAGED = 1_735_689_600  # a file's own mtime in its package: older than the release


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


def _debootstrapped(tree: Path, built_at: int, host: str, host_resolv: Path) -> Path:
    """A tree as debootstrap leaves one, built at ``built_at`` on the machine ``host``."""
    for d in ("usr/bin", "etc/ssh", "var/log/apt", "var/cache/ldconfig", "var/lib/apt/lists",
              "var/cache/apt/archives"):  # fmt: skip
        (tree / d).mkdir(parents=True, exist_ok=True)
    lists = tree / "var/lib/apt/lists"
    (lists / "deb.debian.org_debian_dists_bookworm_InRelease").write_text(
        "-----BEGIN PGP SIGNED MESSAGE-----\nOrigin: Debian\n"
        "Date: Sat, 08 Nov 2025 09:22:34 UTC\nSuite: stable\n"
    )
    (lists / "deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages").write_text("x")
    (tree / "var/cache/apt/archives/python3_3.11.deb").write_bytes(b"deb")
    (tree / "var/cache/apt/pkgcache.bin").write_bytes(os.urandom(8))
    (tree / "var/log/dpkg.log").write_text(f"{built_at} status installed python3\n")
    (tree / "var/log/apt/history.log").write_text(f"Start-Date: {built_at}\n")
    (tree / "var/cache/ldconfig/aux-cache").write_bytes(os.urandom(16))
    (tree / "etc/ssh/ssh_host_ed25519_key").write_bytes(os.urandom(32))
    (tree / "etc/hostname").write_text(host + "\n")
    os.chmod(tree / "etc/hostname", 0o755)  # as copied from this host
    (tree / "etc/resolv.conf").symlink_to(host_resolv)  # a host whose resolv.conf is a link
    (tree / "etc/machine-id").write_text(os.urandom(16).hex() + "\n")
    (tree / "etc/shadow").write_text(f"root:*:{built_at // 86400}:0:99999:7:::\n")
    os.chown(tree / "etc/shadow", 0, 42)
    os.chmod(tree / "etc/shadow", 0o640)
    (tree / "usr/bin/tool").write_text("#!/bin/sh\n")
    os.utime(tree / "usr/bin/tool", (PACKAGED, PACKAGED))
    os.chmod(tree, 0o700)  # as mkdtemp made it
    for path in [tree, *tree.rglob("*")]:
        if path != tree / "usr/bin/tool":
            os.utime(path, (built_at, built_at), follow_symlinks=False)
    return tree


def test_debian_trees_built_at_other_times_on_other_hosts_are_one_image(store, tmp_path):
    host_resolv = tmp_path / "host-resolv.conf"
    host_resolv.write_text("nameserver 10.0.0.2\n")
    digests = set()
    for i, (built_at, host) in enumerate([(1_767_225_600, "vm"), (1_780_000_000, "ci-7")]):
        tree = _debootstrapped(tmp_path / f"tree{i}", built_at, host, host_resolv)
        assert normalize_debian_tree(tree) == RELEASED
        digests.add(store.import_layer(str(tree), "base", "deb", str(i)).digest)
    assert len(digests) == 1
    assert host_resolv.read_text() == "nameserver 10.0.0.2\n"  # replaced, not written through
    assert not list(tree.glob("var/lib/apt/lists/*")) and not list(
        tree.glob("var/cache/apt/**/*.*")
    )
    for gone in ("var/log/dpkg.log", "var/log/apt/history.log", "var/cache/ldconfig/aux-cache",
                 "etc/ssh/ssh_host_ed25519_key"):  # fmt: skip
        assert not (tree / gone).exists(), gone
    assert (tree / "etc/resolv.conf").read_text() == "".join(
        f"nameserver {n}\n" for n in NAMESERVERS
    )
    assert (tree / "etc/hostname").read_text() == (tree / "etc/machine-id").read_text() == ""
    assert stat.S_IMODE(os.stat(tree / "etc/hostname").st_mode) == 0o644
    shadow = os.stat(tree / "etc/shadow")
    assert (stat.S_IMODE(shadow.st_mode), shadow.st_gid) == (0o640, 42)
    assert (tree / "etc/shadow").read_text() == f"root:*:{RELEASED // 86400}:0:99999:7:::\n"
    assert stat.S_IMODE(os.stat(tree).st_mode) == 0o755
    assert os.stat(tree / "usr/bin/tool").st_mtime == PACKAGED  # a package's own: kept
    assert max(os.lstat(p).st_mtime for p in [tree, *tree.rglob("*")]) == RELEASED


def test_the_debian_recipe_imports_its_cached_tree_and_keeps_it(store, tmp_path):
    cache = tmp_path / "cache" / "debian"
    (cache / "usr/bin").mkdir(parents=True)
    (cache / "usr/bin/python3").write_text("#!/bin/false\n")
    os.chown(cache / "usr/bin/python3", 0, 42)
    recipe = DebianPython(cache)
    steps = []
    layer = ensure_layer(
        store, "base", "debian-python", "12", lambda t: recipe.build(t, steps.append)
    )
    assert layer.digest == store.import_layer(str(cache), "base", "cached", "1").digest
    assert "linking the Debian tree" in steps and not any("debootstrap" in s for s in steps)
    assert (cache / "usr/bin/python3").read_text() == "#!/bin/false\n"  # the cache stays
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("dsec-debian-python-*"))


@pytest.mark.slow
def test_debian_python_is_reproducible(store, tmp_path):
    """Two debootstraps, one after the other, give one image."""
    first = store.import_layer(str(debian_tree(tmp_path / "a")), "base", "debian-a", "12")
    time.sleep(1.5)
    second = store.import_layer(str(debian_tree(tmp_path / "b")), "base", "debian-b", "12")
    assert first.digest == second.digest
