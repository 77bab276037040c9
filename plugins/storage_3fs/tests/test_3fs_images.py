"""Base trees: busybox (fast) and the Debian SWE base (slow: debootstrap, DSEC_SLOW_TESTS=1)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
from dsec_storage_3fs.images import (
    BUSYBOX,
    NAMESERVERS,
    SWE_PACKAGES,
    Busybox,
    DebianPython,
    _DebootstrapSteps,
    busybox_tree,
    debian_tree,
    ensure_layer,
    normalize_debian_tree,
)

from dsec_kernel.contract.errors import InvalidArgument

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


#: what a software-engineering task runs in debian-python:12, and the start of what it prints
SWE_COMMANDS = {
    "python3 -c 'import sys; print(sys.version_info[:2])'": "(3, 11)",
    "git --version": "git version 2.",
    "pip install six 2>&1 || true": "error: externally-managed-environment",  # PEP 668
    "python3 -m venv /tmp/venv && /tmp/venv/bin/pip --version": "pip 23.",
    "printf '#include <Python.h>\\nint main(void) { return PY_MAJOR_VERSION - 3; }' > /tmp/x.c"
    " && gcc $(python3-config --includes) /tmp/x.c -o /tmp/x && /tmp/x && echo built": "built",
    "echo 'int main() {}' | g++ -x c++ - -o /tmp/y && make --version": "GNU Make 4.",
}


@pytest.mark.slow
def test_debian_python_is_a_base_for_software_engineering(store, mounted, tmp_path):
    """python3 with pip (which refuses system-wide installs: PEP 668) and venv, git, and the
    compilers and headers that building a C extension takes, in the layer the recipe makes
    (from its cache; debootstrapped first if this machine has none)."""
    recipe = DebianPython()
    layer = ensure_layer(store, "base", "debian-python", "12", lambda t: recipe.build(t, print))
    assert ensure_layer(store, "base", "debian-python", "12", _unbuildable) == layer
    mp = mounted(layer)
    assert not list((mp / "var/cache/apt/archives").glob("*.deb"))
    work = tmp_path / "work"  # a writable copy: venvs and builds write
    subprocess.run(["cp", "-a", mp, work], check=True)
    for command, start in SWE_COMMANDS.items():
        run = subprocess.run(["chroot", work, "/bin/sh", "-c", command], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert run.stdout.startswith(start), f"{command}: {run.stdout}{run.stderr}"


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
    recipe = DebianPython(cache=cache)
    steps = []
    layer = ensure_layer(
        store, "base", "debian-python", "12", lambda t: recipe.build(t, steps.append)
    )
    assert layer.digest == store.import_layer(str(cache), "base", "cached", "1").digest
    assert "linking the Debian tree" in steps and not any("debootstrap" in s for s in steps)
    assert (cache / "usr/bin/python3").read_text() == "#!/bin/false\n"  # the cache stays
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("dsec-debian-python-*"))


def test_one_build_of_a_cached_tree_at_a_time(store, tmp_path):
    """A build that finds another process building its cache waits for it and uses what
    it made, instead of debootstrapping into the same directory (two builds at once had
    removed each other's half-made tree)."""
    cache = tmp_path / "cache" / "debian"
    cache.parent.mkdir()
    recipe = DebianPython(cache=cache)
    steps: list[str] = []
    with open(cache.with_name("debian.lock"), "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        build = threading.Thread(target=recipe.build, args=(tmp_path / "tree", steps.append))
        build.start()
        while not steps:
            time.sleep(0.01)
        (cache / "usr/bin").mkdir(parents=True)  # the other build's tree, done
        (cache / "usr/bin/python3").write_text("#!/bin/false\n")
    build.join(10)
    assert steps == [f"waiting for another build of {cache}", "linking the Debian tree"]
    assert (tmp_path / "tree/usr/bin/python3").read_text() == "#!/bin/false\n"


def test_more_packages_make_another_version_of_the_layer():
    extra = hashlib.sha256(b"libxml2-dev,ripgrep").hexdigest()[:8]
    recipe = DebianPython(["ripgrep", "git", "libxml2-dev", "ripgrep"])
    assert (recipe.version, recipe.extra) == (f"12-{extra}", ("libxml2-dev", "ripgrep"))
    assert recipe.packages == (*SWE_PACKAGES, "libxml2-dev", "ripgrep")
    assert DebianPython(["libxml2-dev", "ripgrep"]).cache == recipe.cache != DebianPython().cache
    assert DebianPython(["git", "python3"]).version == "12" == DebianPython.version
    for bad in ("Ripgrep", "ripgrep=13.0", "../x", "-x"):
        with pytest.raises(InvalidArgument, match="is not a Debian package name"):
            DebianPython([bad])
    with pytest.raises(InvalidArgument, match="recipe busybox takes no packages"):
        Busybox(["ripgrep"])


def test_debootstraps_lines_are_counted_steps():
    lines = """I: Retrieving InRelease
I: Checking Release signature
I: Resolving dependencies of required packages...
I: Retrieving adduser 3.134
I: Validating adduser 3.134
I: Retrieving git 1:2.39.5-0+deb12u2
I: Validating git 1:2.39.5-0+deb12u2
I: Extracting base-files...
I: Unpacking git...
I: Configuring git...
I: Base system installed successfully.
W: a warning
""".splitlines(True)
    steps: list[str] = []
    parse = _DebootstrapSteps(steps.append)
    for line in lines:
        parse.line(line)
    assert steps == [
        "debootstrap: checking Release signature",
        "debootstrap: resolving dependencies of required packages",
        "retrieving packages: 1 (adduser 3.134)",
        "retrieving packages: 2 (git 1:2.39.5-0+deb12u2)",
        "extracting packages: 1 (base-files)",
        "unpacking packages: 1/2 (git)",
        "configuring packages: 1/2 (git)",
    ]


@pytest.mark.slow
def test_debian_python_is_reproducible(store, tmp_path):
    """Two debootstraps, one after the other, give one image; each reports its steps."""
    steps: list[str] = []
    first = store.import_layer(
        str(debian_tree(tmp_path / "a", progress=steps.append)), "base", "debian-a", "12"
    )
    time.sleep(1.5)
    second = store.import_layer(str(debian_tree(tmp_path / "b")), "base", "debian-b", "12")
    assert first.digest == second.digest
    configured = [s for s in steps if s.startswith("configuring packages: ")]
    assert len(configured) > 150 and configured[-1].startswith(
        f"configuring packages: {len(configured)}/"
    )
