"""Reading and writing trees in overlayfs's upper format.

A delta tree says what a layer changes on top of the layers below it: files, directories and
symlinks it adds or replaces; *whiteouts* (character devices 0/0) for paths it deletes; and
*opaque* directories (``trusted.overlay.opaque=y``) that hide everything below them. The
sandbox's own upper directory, snapshot deltas and published layers are all such trees.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OPAQUE", "Entry", "apply", "copy_entry", "is_whiteout", "scan", "whiteout"]

OPAQUE = "trusted.overlay.opaque"


@dataclass(frozen=True)
class Entry:
    """What a path is, enough to tell whether it changed (ctime moves on every change)."""

    kind: str  # f(ile) d(ir) l(ink) w(hiteout) o(ther)
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    opaque: bool = False

    def as_list(self) -> list:
        return [self.kind, self.mode, self.uid, self.gid, self.size, self.mtime_ns,
                self.ctime_ns, self.opaque]  # fmt: skip

    @classmethod
    def from_list(cls, v: list) -> Entry:
        return cls(*v)

    def same_content(self, other: Entry) -> bool:
        """Equal as the sandbox sees it (for diffs between copies of a file)."""
        return (self.kind, self.mode, self.size, self.mtime_ns) == (
            other.kind, other.mode, other.size, other.mtime_ns,
        )  # fmt: skip


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def entry_of(path: str, st: os.stat_result | None = None) -> Entry:
    st = st or os.lstat(path)
    if is_whiteout(st):
        kind = "w"
    elif stat.S_ISDIR(st.st_mode):
        kind = "d"
    elif stat.S_ISREG(st.st_mode):
        kind = "f"
    elif stat.S_ISLNK(st.st_mode):
        kind = "l"
    else:
        kind = "o"
    return Entry(kind, st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                 st.st_ctime_ns, kind == "d" and _opaque(path))  # fmt: skip


def scan(root: Path) -> dict[str, Entry]:
    """Every path below ``root`` (``/a/b`` form, ``root`` itself excluded), parents first."""
    out: dict[str, Entry] = {}
    stack = [("", str(root))]
    while stack:
        rel, path = stack.pop()
        try:
            it = os.scandir(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            children = sorted(it, key=lambda e: e.name)
        for de in children:
            r = f"{rel}/{de.name}"
            e = entry_of(de.path, de.stat(follow_symlinks=False))
            out[r] = e
            if e.kind == "d":
                stack.append((r, de.path))
    return dict(sorted(out.items()))


def whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def _copy_meta(src: str, dst: str, st: os.stat_result, opaque: bool) -> None:
    """Owner, mode, times and xattrs (overlayfs's own ``trusted.overlay.*`` only as opacity)."""
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    try:
        names = os.listxattr(src, follow_symlinks=False)
    except OSError:
        names = []
    for name in names:
        if name.startswith("trusted.overlay."):
            continue
        try:
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False),
                        follow_symlinks=False)  # fmt: skip
        except OSError:
            pass
    if opaque:
        os.setxattr(dst, OPAQUE, b"y")
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def copy_entry(src: str, dst: str, opaque: bool | None = None) -> int:
    """Copy one path (not its children) keeping metadata; returns bytes copied.

    ``opaque`` None keeps the source's opacity; True or False sets it.
    """
    st = os.lstat(src)
    if is_whiteout(st):
        whiteout(Path(dst))
        return 0
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(dst)
        _copy_meta(src, dst, st, _opaque(src) if opaque is None else opaque)
        return 0
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
        _copy_meta(src, dst, st, False)
        return 0
    if stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dst, follow_symlinks=False)
        _copy_meta(src, dst, st, False)
        return st.st_size
    os.mknod(dst, st.st_mode, st.st_rdev)  # fifos, devices
    _copy_meta(src, dst, st, False)
    return 0


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def apply(delta: Path, target: Path, keep_whiteouts: bool = True) -> None:
    """Apply one delta tree onto ``target`` with overlay semantics (later wins).

    With ``keep_whiteouts`` (the result is itself a delta), deletions stay as whiteouts so
    they still hide paths of the layers below; without, they are simply removed.
    """
    for rel, e in scan(delta).items():
        src, dst = str(delta) + rel, str(target) + rel
        if e.kind == "w":
            _remove(dst)
            if keep_whiteouts:
                whiteout(Path(dst))
        elif e.kind == "d":
            existing = os.path.lexists(dst)
            if existing and (e.opaque or not os.path.isdir(dst) or os.path.islink(dst)):
                _remove(dst)
                existing = False
            if not existing:
                copy_entry(src, dst, opaque=e.opaque and keep_whiteouts)
        else:
            _remove(dst)
            copy_entry(src, dst)
