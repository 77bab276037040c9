"""Base trees, the recipes ``dsec layer build`` runs, and :func:`ensure_layer`.

* :func:`busybox_tree` — a minimal root filesystem: the static busybox and links for all its
  applets (``busybox --list``; a fixed list of common ones if it cannot tell),
  ``/etc/passwd`` and ``/etc/group`` (root, nobody), empty ``/proc /dev /sys /tmp /root
  /home``. Reproducible: every entry gets busybox's mtime, so the same busybox binary gives
  the same image digest on every node. Conventionally ``busybox:1`` (base).
* :func:`debian_tree` — Debian 12 ``minbase`` by debootstrap with extra packages (default
  :data:`SWE_PACKAGES`: python3 with pip, venv and its headers, git, build-essential; about
  80 s from a nearby mirror), apt caches trimmed, debootstrap's steps reported as they go.
  Reproducible: the same packages from the same mirror give the same tree, whenever and on
  whichever machine it is built (:func:`normalize_debian_tree`). Conventionally
  ``debian-python:12`` (base).
* :class:`Busybox` and :class:`DebianPython` — those two as recipes (entry-point group
  ``dsec.recipes``: ``dsec layer build busybox``, ``dsec layer build debian-python
  [--packages a,b]``), each Debian tree debootstrapped once per machine and cached.
* :func:`ensure_layer` (the kernel's) — resolve ``name:version``, or build the tree and
  import it; :func:`debian_python` — ``debian-python:12`` that way.
"""

from __future__ import annotations

import collections
import contextlib
import email.utils
import fcntl
import os
import re
import shutil
import signal
import stat
import subprocess
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from dsec_kernel.contract.errors import Internal, InvalidArgument, Unavailable
from dsec_kernel.contract.store import Layer, LayerRecipe, LayerStore, Progress, ensure_layer
from dsec_storage_3fs.mounts import unmount_under

__all__ = [
    "APPLETS",
    "BUSYBOX",
    "DEBIAN_MIRROR",
    "NAMESERVERS",
    "SWE_PACKAGES",
    "Busybox",
    "DebianPython",
    "busybox_tree",
    "debian_python",
    "debian_tree",
    "ensure_layer",
    "normalize_debian_tree",
]

BUSYBOX = Path("/usr/bin/busybox")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
#: what ``debian-python:12`` installs on minbase: what a software-engineering task takes to
#: run a Python project's tests (python3; pip and venv to install it and its dependencies;
#: the headers, C and C++ compilers and make that building extensions from sdists takes;
#: git). build-essential rather than gcc, g++, make and libc6-dev alone: the rest it brings
#: (dpkg-dev, patch, xz-utils, bzip2) is 6 MB of the tree's 607 MB, and patch and xz are
#: tools such tasks use
SWE_PACKAGES = ("python3", "python3-pip", "python3-venv", "python3-dev", "git", "build-essential")
#: a Debian package name (Debian policy 5.6.1), which is all ``--include`` takes (no versions)
_DEBIAN_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
_NO_DEBOOTSTRAP = "debootstrap is not installed (apt-get install debootstrap)"
# /etc/resolv.conf of Debian trees (debootstrap copies the host's: a resolver of the host's
# network, which a sandbox's egress cannot reach): public resolvers, which it can
NAMESERVERS = ("1.1.1.1", "1.0.0.1")
# what debootstrap and dpkg leave that says when or where a tree was built, not what is in it
_BUILD_RECORDS = (
    "var/log/dpkg.log", "var/log/bootstrap.log", "var/log/alternatives.log",
    "var/log/apt/history.log", "var/log/apt/term.log", "var/log/apt/eipp.log.xz",
    "var/cache/ldconfig/aux-cache", "run/mount/utab",
)  # fmt: skip
# fmt: off
APPLETS = (
    "sh", "ls", "cat", "echo", "sleep", "mkdir", "rm", "cp", "mv", "ps", "id", "hostname",
    "wc", "head", "tail", "grep", "sed", "env", "true", "false", "test", "touch", "chmod",
    "stat", "find", "sort", "uniq", "tee", "date", "dd", "yes", "kill", "which", "readlink",
    "du", "df", "seq", "printf", "xargs", "ln", "pwd", "basename", "dirname", "tr", "cut",
    "md5sum", "sha256sum", "diff", "awk", "vi", "tar", "gzip",
)
# fmt: on
_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = "root:x:0:\nnobody:x:65534:\n"


def busybox_tree(dest: Path) -> Path:
    """Build the busybox root filesystem in ``dest`` (created if missing) and return it.
    Unavailable if this machine has no static busybox (Debian: busybox-static)."""
    if reason := Busybox.unavailable_reason():
        raise Unavailable(reason, retryable=False)
    modes = {"bin": 0o755, "etc": 0o755, "proc": 0o555, "dev": 0o755, "sys": 0o555,
             "tmp": 0o1777, "root": 0o700, "home": 0o755}  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o755)
    for name, mode in modes.items():
        (dest / name).mkdir(exist_ok=True)
        os.chmod(dest / name, mode)
    shutil.copyfile(BUSYBOX, dest / "bin/busybox")
    os.chmod(dest / "bin/busybox", 0o755)
    for applet in _applets():
        os.symlink("busybox", dest / "bin" / applet)
    for name, text in (("passwd", _PASSWD), ("group", _GROUP), ("hostname", "")):
        (dest / "etc" / name).write_text(text)
        os.chmod(dest / "etc" / name, 0o644)
    stamp = BUSYBOX.stat().st_mtime
    for path in (dest, *dest.rglob("*")):
        os.utime(path, (stamp, stamp), follow_symlinks=False)
    return dest


def _applets() -> list[str]:
    try:
        names = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                               timeout=10).stdout.split()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        names = []
    return sorted({n for n in names if "/" not in n} - {"busybox"}) or list(APPLETS)


def debian_tree(
    dest: Path,
    packages: Iterable[str] = SWE_PACKAGES,
    mirror: str | None = None,
    timeout: float = 900.0,
    progress: Progress | None = None,
) -> Path:
    """Install Debian 12 (bookworm) ``minbase`` plus ``packages`` into ``dest`` with
    debootstrap, then drop apt's caches and what says when and where it was built
    (:func:`normalize_debian_tree`). ``progress`` hears each of debootstrap's steps as it
    comes (``"retrieving packages: 37 (git 1:2.39.5-0+deb12u2)"``, ``"configuring packages:
    120/191 (git)"``). Unavailable if debootstrap is missing or fails (its output's tail
    says why; usually the mirror). On failure or timeout nothing it started keeps running
    and nothing stays mounted under ``dest``."""
    exe = shutil.which("debootstrap")
    if exe is None:
        raise Unavailable(_NO_DEBOOTSTRAP, retryable=False)
    dest.mkdir(parents=True, exist_ok=True)
    mirror = mirror or DEBIAN_MIRROR
    include = ",".join(packages)
    cmd = [exe, "--variant=minbase", *([f"--include={include}"] if include else [])]
    proc = subprocess.Popen(
        [*cmd, "bookworm", str(dest), mirror],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # its own process group: one kill reaches dpkg, chroot...
    )
    late = threading.Event()

    def stop_late() -> None:
        late.set()
        _kill_group(proc)

    timer = threading.Timer(timeout, stop_late)
    timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=30)
    steps = _DebootstrapSteps(progress or (lambda _step: None))
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            tail.append(line)
            steps.line(line)
        proc.wait()
    except BaseException:
        _kill_group(proc)
        proc.wait()
        unmount_under(dest)
        raise
    finally:
        timer.cancel()
        proc.stdout.close()
    if proc.returncode:
        unmount_under(dest)
        if late.is_set():
            raise Unavailable(
                f"debootstrap from {mirror} did not finish in {timeout:.0f} s; stopped it",
                retryable=False,
            )
        said = [line for line in tail if line[:3] in ("E: ", "W: ")] or list(tail)[-3:]
        raise Unavailable(
            f"debootstrap of bookworm from {mirror} failed (exit {proc.returncode}); check "
            "the mirror is reachable and the packages exist. It said: "
            + " / ".join(line.strip()[:300] for line in said[-3:]),
            retryable=False,
        )
    normalize_debian_tree(dest)
    return dest


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


class _DebootstrapSteps:
    """debootstrap's ``I: <Step> <package> [<version>]`` lines as progress: each package
    retrieved or extracted (the required ones) is counted, and each unpacked or configured
    counted out of those retrieved; its other steps (resolving dependencies...) are passed
    on as they are."""

    _COUNTED = ("Extracting", "Unpacking", "Configuring")
    _SAID = ("Resolving", "Checking", "Installing")

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.retrieved = 0
        self.done: collections.Counter[str] = collections.Counter()

    def line(self, line: str) -> None:
        if not line.startswith("I: "):
            return
        text = line[3:].strip().rstrip(".")
        word, _, package = text.partition(" ")
        if word == "Retrieving" and package not in ("InRelease", "Release", "Packages"):
            self.retrieved += 1
            self.progress(f"retrieving packages: {self.retrieved} ({package})")
        elif word in self._COUNTED and package:
            self.done[word] += 1
            n = self.done[word]
            count = f"{n}/{max(self.retrieved, n)}" if word != "Extracting" else str(n)
            self.progress(f"{word.lower()} packages: {count} ({package.split()[0]})")
        elif word in self._SAID:
            self.progress(f"debootstrap: {text[0].lower()}{text[1:]}")


def normalize_debian_tree(tree: Path) -> int:
    """Make a debootstrapped ``tree`` a function of its packages (and mirror) alone, as
    Debian's own reproducible images (debuerreotype) do, and return its epoch: the ``Date`` of
    the suite's Release file debootstrap fetched, which no package's files are newer than.

    Drops apt's caches and lists and the logs and caches that record the build; replaces
    ``/etc/hostname`` (empty) and ``/etc/resolv.conf`` (:data:`NAMESERVERS`), which
    debootstrap copies from the host, and SSH host keys a package generated (every sandbox of
    a public layer would share them); empties ``/etc/machine-id``; dates password changes in
    ``/etc/shadow`` no later than the epoch; makes ``/`` root's, mode 0755; and gives
    everything newer than the epoch (what was made during the build) the epoch as mtime.
    Nothing is written or removed through a symlink in the tree. Once only: the Release file
    goes with apt's lists."""
    epoch = _release_epoch(tree)
    for where, pattern in (("var/cache/apt/archives", "*.deb"), ("var/cache/apt", "*.bin"),
                           ("var/lib/apt/lists", "*"), ("etc/ssh", "ssh_host_*key*")):  # fmt: skip
        for path in _subdir(tree, where).glob(pattern):
            if path.is_file() and not path.is_symlink():
                path.unlink()
    for rel in _BUILD_RECORDS:
        (_subdir(tree, os.path.dirname(rel)) / os.path.basename(rel)).unlink(missing_ok=True)
    etc = _subdir(tree, "etc")
    _replace(etc / "hostname", "")
    _replace(etc / "resolv.conf", "".join(f"nameserver {ns}\n" for ns in NAMESERVERS))
    if os.path.lexists(etc / "machine-id"):
        _replace(etc / "machine-id", "")
    day = epoch // 86400
    for path in (etc / "shadow", etc / "shadow-"):
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            lines = [_shadow_line(line, day) for line in path.read_text().splitlines(True)]
            _replace(path, "".join(lines), stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid))
    os.chown(tree, 0, 0)
    os.chmod(tree, 0o755)
    stamp = epoch * 1_000_000_000
    for dirpath, dirs, files in os.walk(tree):  # symlinks to directories are not followed
        for name in (*dirs, *files):
            path = os.path.join(dirpath, name)
            if os.lstat(path).st_mtime_ns > stamp:
                os.utime(path, ns=(stamp, stamp), follow_symlinks=False)
    if os.lstat(tree).st_mtime_ns > stamp:
        os.utime(tree, ns=(stamp, stamp))
    return epoch


def _subdir(tree: Path, rel: str) -> Path:
    """``tree/rel`` if each of its components is a directory, not a symlink (so what is done
    under it stays in the tree); else a path under ``tree`` that does not exist."""
    path = tree
    for part in rel.split("/"):
        path = path / part
        if not path.is_dir() or path.is_symlink():
            return tree / ".missing" / rel
    return path


def _release_epoch(tree: Path) -> int:
    """The ``Date:`` of the Release (or InRelease) file debootstrap left in apt's lists."""
    for path in sorted(_subdir(tree, "var/lib/apt/lists").glob("*Release")):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("Date:"):
                return int(email.utils.parsedate_to_datetime(line[5:].strip()).timestamp())
    raise Unavailable(
        f"{tree} has no Release file from debootstrap (var/lib/apt/lists/*Release) to date "
        "it by; debootstrap it again",
        retryable=False,
    )


def _shadow_line(line: str, day: int) -> str:
    fields = line.split(":")
    if len(fields) > 2 and fields[2].isdigit() and int(fields[2]) > day:
        fields[2] = str(day)  # the day of the last password change: the day it was built
    return ":".join(fields)


def _replace(path: Path, text: str, mode: int = 0o644, owner: tuple[int, int] = (0, 0)) -> None:
    """``path`` as a new regular file holding ``text`` (whatever was there, a symlink too, is
    removed first: nothing is written through it)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        os.fchown(f.fileno(), *owner)
        os.fchmod(f.fileno(), mode)


class Busybox(LayerRecipe):
    """``busybox:1`` (``dsec layer build busybox``): :func:`busybox_tree`."""

    kind = "base"
    name = "busybox"
    version = "1"
    summary = "static busybox and its applets (2 MB; a second)"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if BUSYBOX.is_file() and _is_static(BUSYBOX):
            return None
        return (
            f"{BUSYBOX} is missing or not statically linked; install busybox-static "
            "(apt-get install busybox-static)"
        )

    def build(self, tree: Path, progress: Progress) -> None:
        busybox_tree(tree)


class DebianPython(LayerRecipe):
    """``debian-python:12`` (``dsec layer build debian-python``): :func:`debian_tree` with
    :data:`SWE_PACKAGES`, and with ``--packages`` more of them, as ``debian-python:12-<hash
    of those>`` (:meth:`~dsec_kernel.contract.store.LayerRecipe.version_for`). Each package set is
    debootstrapped once per machine into ``cache`` (default
    ``~/.cache/dsec/debian-python-<version>.v3``, or under ``$DSEC_IMAGE_CACHE``) and
    hard-linked from there (an import only reads the tree)."""

    kind = "base"
    name = "debian-python"
    version = "12"
    summary = (
        "Debian 12 minbase, python3 with pip and venv, git, build-essential, by debootstrap "
        "(607 MB; 1-2 minutes once a machine; --packages adds Debian packages)"
    )
    packages_from = "Debian 12"

    def __init__(self, packages: Sequence[str] = (), cache: Path | None = None) -> None:
        super().__init__(packages)
        root = Path(os.environ.get("DSEC_IMAGE_CACHE", Path.home() / ".cache" / "dsec"))
        # .v3: trees of other default packages (.v2: python3 alone) are other images
        self.cache = cache or root / f"debian-python-{self.version}.v3"
        self._legacy = () if cache else (root / "debian-python-12", root / "debian-python-12.v2")

    @classmethod
    def extra_packages(cls, packages: Sequence[str]) -> tuple[str, ...]:
        bad = [p for p in packages if not _DEBIAN_PACKAGE.match(p)]
        if bad:
            raise InvalidArgument(
                f"--packages: {bad[0]!r} is not a Debian package name (lower-case letters, "
                "digits and + - . ; no versions), e.g. --packages ripgrep,libxml2-dev"
            )
        return tuple(sorted(set(packages) - set(SWE_PACKAGES)))

    @property
    def packages(self) -> tuple[str, ...]:
        return (*SWE_PACKAGES, *self.extra)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _NO_DEBOOTSTRAP if shutil.which("debootstrap") is None else None

    def _cached(self) -> bool:
        return (self.cache / "usr/bin/python3").exists()

    def build(self, tree: Path, progress: Progress) -> None:
        for old in self._legacy:
            shutil.rmtree(old, ignore_errors=True)
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        with open(self.cache.with_name(self.cache.name + ".lock"), "w") as lock:
            try:  # one build of a cache at a time, whatever the process
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                progress(f"waiting for another build of {self.cache}")
                fcntl.flock(lock, fcntl.LOCK_EX)
            if not self._cached():
                progress(f"debootstrap of Debian 12 with {', '.join(self.packages)} "
                         "(once per machine)")  # fmt: skip
                partial = self.cache.with_name(self.cache.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                try:
                    debian_tree(partial, self.packages, progress=progress)
                except BaseException:
                    shutil.rmtree(partial, ignore_errors=True)
                    raise
                partial.rename(self.cache)
        progress("linking the Debian tree")
        for how in ("-al", "-a"):  # hard links (1 s); a copy (5 s) if on another filesystem
            done = subprocess.run(["cp", how, self.cache, tree], capture_output=True, text=True)
            if done.returncode == 0:
                return
            shutil.rmtree(tree, ignore_errors=True)
        raise Internal(f"copying {self.cache} failed: {done.stderr.strip()[-500:]}")


def debian_python(
    store: LayerStore, cache: Path | None = None, progress: Progress | None = None
) -> Layer:
    """``debian-python:12`` (base) in ``store``, built by :class:`DebianPython` if missing."""
    recipe = DebianPython(cache=cache)
    say = progress or (lambda _msg: None)
    return ensure_layer(
        store, recipe.kind, recipe.name, recipe.version, lambda t: recipe.build(t, say), progress
    )


def _is_static(path: Path) -> bool:
    """A 64-bit little-endian ELF executable without an interpreter (PT_INTERP)."""
    with path.open("rb") as f:
        head = f.read(64)
        if head[:6] != b"\x7fELF\x02\x01":
            return False
        phoff = int.from_bytes(head[0x20:0x28], "little")
        entsize = int.from_bytes(head[0x36:0x38], "little")
        count = int.from_bytes(head[0x38:0x3A], "little")
        f.seek(phoff)
        table = f.read(entsize * count)
    types = {int.from_bytes(table[i : i + 4], "little") for i in range(0, len(table), entsize)}
    return 3 not in types
