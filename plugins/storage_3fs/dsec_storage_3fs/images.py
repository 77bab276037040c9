"""Base trees for tests and examples, and :func:`ensure_layer` to import one only once.

* :func:`busybox_tree` — a minimal root filesystem: the static busybox and links for all its
  applets (``busybox --list``; a fixed list of common ones if it cannot tell),
  ``/etc/passwd`` and ``/etc/group`` (root, nobody), empty ``/proc /dev /sys /tmp /root
  /home``. Reproducible: every entry gets busybox's mtime, so the same busybox binary gives
  the same image digest on every node. Conventionally ``busybox:1`` (base).
* :func:`debian_tree` — Debian 12 ``minbase`` by debootstrap with extra packages (default
  python3; about 25 s from a nearby mirror), apt caches trimmed. Conventionally
  ``debian-python:12`` (base).
* :func:`ensure_layer` — resolve ``name:version``, or build the tree and import it.
* :func:`debian_python` — ``debian-python:12``, its tree built once per machine and cached.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from dsec_kernel.errors import NotFound, Unavailable
from dsec_kernel.storage import Kind, Layer, LayerStore, Progress
from dsec_storage_3fs.mounts import unmount_under

__all__ = [
    "APPLETS",
    "BUSYBOX",
    "DEBIAN_MIRROR",
    "busybox_tree",
    "debian_python",
    "debian_tree",
    "ensure_layer",
]

BUSYBOX = Path("/usr/bin/busybox")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
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
    if not BUSYBOX.is_file() or not _is_static(BUSYBOX):
        raise Unavailable(
            f"{BUSYBOX} is missing or not statically linked; install busybox-static "
            "(apt-get install busybox-static)",
            retryable=False,
        )
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
    packages: Iterable[str] = ("python3",),
    mirror: str | None = None,
    timeout: float = 900.0,
) -> Path:
    """Install Debian 12 (bookworm) ``minbase`` plus ``packages`` into ``dest`` with
    debootstrap, then drop apt's caches. Unavailable if debootstrap is missing or fails (its
    output's tail says why; usually the mirror). On failure or timeout nothing it started
    keeps running and nothing stays mounted under ``dest``."""
    exe = shutil.which("debootstrap")
    if exe is None:
        raise Unavailable(
            "debootstrap is not installed (apt-get install debootstrap)", retryable=False
        )
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
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        unmount_under(dest)
        if isinstance(e, subprocess.TimeoutExpired):
            raise Unavailable(
                f"debootstrap from {mirror} did not finish in {timeout:.0f} s; stopped it",
                retryable=False,
            ) from None
        raise
    if proc.returncode:
        unmount_under(dest)
        raise Unavailable(
            f"debootstrap of bookworm from {mirror} failed (exit {proc.returncode}); "
            f"check the mirror is reachable. Last output: {out.strip()[-1500:]}",
            retryable=False,
        )
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*"):
        for path in dest.glob(pattern):
            if path.is_file():
                path.unlink()
    return dest


def ensure_layer(
    store: LayerStore,
    kind: Kind,
    name: str,
    version: str,
    builder: Callable[[Path], object],
    progress: Progress | None = None,
) -> Layer:
    """The layer ``name:version`` of ``kind``; if the store lacks it, ``builder(tree)`` fills
    a new temporary directory ``tree`` (under $TMPDIR) which is imported, then removed."""
    try:
        return store.resolve(name, version, kind)
    except NotFound:
        pass
    with tempfile.TemporaryDirectory(prefix=f"dsec-{name}-") as tmp:
        tree = Path(tmp) / "rootfs"
        builder(tree)
        return store.import_layer(str(tree), kind, name, version, progress)


def debian_python(
    store: LayerStore, cache: Path | None = None, progress: Progress | None = None
) -> Layer:
    """``debian-python:12`` (base) in ``store``. The debootstrapped tree is kept in ``cache``
    (default ``~/.cache/dsec/debian-python-12``, or ``$DSEC_IMAGE_CACHE``) and built only once
    per machine (~40 s); importing it takes about a second."""
    try:
        return store.resolve("debian-python", "12", "base")
    except NotFound:
        pass
    root = Path(os.environ.get("DSEC_IMAGE_CACHE", Path.home() / ".cache" / "dsec"))
    tree = cache or root / "debian-python-12"
    if not (tree / "usr/bin/python3").exists():
        if progress:
            progress("debootstrap of Debian 12 with python3 (once per machine)")
        partial = tree.with_name(tree.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        debian_tree(partial)
        partial.rename(tree)
    return store.import_layer(str(tree), "base", "debian-python", "12", progress)


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
