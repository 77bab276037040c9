"""Reading and writing trees in overlayfs's upper format, safely from the host.

A delta tree says what a layer changes on top of the layers below it: files, directories and
symlinks it adds or replaces; *whiteouts* (character devices 0/0) for paths it deletes; and
*opaque* directories (``trusted.overlay.opaque=y``) that hide everything below them. The
sandbox's own upper directory, snapshot deltas and published layers are all such trees.

A sandbox's upper directory changes under the edge while it is read, as its owner likes: a
directory may become a symlink to ``/`` between two calls. So trees are only ever reached
through directory descriptors opened component by component with ``O_NOFOLLOW``
(:class:`Tree`): a symlink or non-directory where a directory was expected ends the walk
with an error, and no path the edge follows as host root can lead out of the tree.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "OPAQUE",
    "Entry",
    "Tree",
    "apply",
    "copy_entry",
    "is_whiteout",
    "kind_at",
    "lookup",
    "remove",
    "scan",
    "whiteout",
]

OPAQUE = "trusted.overlay.opaque"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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

    def same_meta(self, other: Entry) -> bool:
        """Equal type, mode, size and mtime (copies of a file differ in ctime)."""
        return (self.kind, self.mode, self.size, self.mtime_ns) == (
            other.kind, other.mode, other.size, other.mtime_ns,
        )  # fmt: skip


class Tree:
    """A directory tree reached only through ``O_NOFOLLOW`` directory descriptors (cached
    per directory for one piece of work; :meth:`close` them)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs = {"": os.open(root, _DIR)}

    def dir(self, rel: str) -> int:
        """A descriptor of directory ``rel`` (``/a/b`` form; ``""`` is the root)."""
        fd = self._dirs.get(rel)
        if fd is None:
            parent, _, name = rel.rpartition("/")
            fd = self._dirs[rel] = os.open(name, _DIR, dir_fd=self.dir(parent))
        return fd

    def parent(self, rel: str) -> tuple[int, str]:
        """(descriptor of ``rel``'s directory, ``rel``'s last component)."""
        parent, _, name = rel.rpartition("/")
        return self.dir(parent), name

    def forget(self, rel: str) -> None:
        """Drop cached descriptors of ``rel`` and below (it was removed or replaced)."""
        for key in [k for k in self._dirs if k == rel or k.startswith(rel + "/")]:
            if key:
                os.close(self._dirs.pop(key))

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, OPAQUE) == b"y"
    except OSError:
        return False


def _kind(st: os.stat_result) -> str:
    if is_whiteout(st):
        return "w"
    if stat.S_ISDIR(st.st_mode):
        return "d"
    if stat.S_ISREG(st.st_mode):
        return "f"
    return "l" if stat.S_ISLNK(st.st_mode) else "o"


def _entry(st: os.stat_result, opaque: bool = False) -> Entry:
    return Entry(_kind(st), st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                 st.st_ctime_ns, opaque)  # fmt: skip


def scan(root: Path) -> dict[str, Entry]:
    """Every path below ``root`` (``/a/b`` form, ``root`` itself excluded), parents first.
    What vanishes or changes type while being read is left out (or seen as it became)."""
    out: dict[str, Entry] = {}
    try:
        top = os.open(root, _DIR)
    except FileNotFoundError:
        return out
    stack = [("", top)]
    while stack:
        rel, fd = stack.pop()
        try:
            with os.scandir(fd) as it:
                children = sorted(it, key=lambda e: e.name)
            for de in children:
                r = f"{rel}/{de.name}"
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    out[r] = _entry(st)
                    continue
                try:
                    child = os.open(de.name, _DIR, dir_fd=fd)
                except OSError:  # gone, or no longer a directory
                    continue
                out[r] = _entry(os.fstat(child), _opaque(child))
                stack.append((r, child))
        finally:
            os.close(fd)
    return dict(sorted(out.items()))


def lookup(root: Path, rel: str) -> Entry | None:
    """``rel``'s entry in the tree at ``root`` without following any symlink (None if it is
    missing, or below something that is not a directory there)."""
    try:
        with Tree(root) as t:
            d, name = t.parent(rel)
            st = os.stat(name, dir_fd=d, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                return _entry(st)
            fd = os.open(name, _DIR, dir_fd=d)
            try:
                return _entry(os.fstat(fd), _opaque(fd))
            finally:
                os.close(fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink where a directory would be
            return None
        raise


def whiteout(tree: Tree, rel: str) -> None:
    d, name = tree.parent(rel)
    os.mknod(name, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=d)


def _copy_meta(src: int | None, dst: Tree, rel: str, st: os.stat_result, opaque: bool) -> None:
    """Owner, mode, times and xattrs (from ``src``, an open fd; overlayfs's own
    ``trusted.overlay.*`` only as opacity). Symlinks keep owner and times only."""
    d, name = dst.parent(rel)
    os.chown(name, st.st_uid, st.st_gid, dir_fd=d, follow_symlinks=False)
    if src is not None:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=d)
        try:
            os.chmod(fd, stat.S_IMODE(st.st_mode))
            try:
                names = os.listxattr(src)
            except OSError:
                names = []
            for x in names:
                if not x.startswith("trusted.overlay."):
                    try:
                        os.setxattr(fd, x, os.getxattr(src, x))
                    except OSError:
                        pass
            if opaque:
                os.setxattr(fd, OPAQUE, b"y")
        finally:
            os.close(fd)
    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d, follow_symlinks=False)


def copy_entry(src: Tree, dst: Tree, rel: str, opaque: bool | None = None) -> int:
    """Copy one path (not its children) from ``src`` to the same place in ``dst``, keeping
    metadata; returns bytes copied. ``opaque`` None keeps the source's opacity."""
    sd, name = src.parent(rel)
    st = os.stat(name, dir_fd=sd, follow_symlinks=False)
    dd, dname = dst.parent(rel)
    if is_whiteout(st):
        os.mknod(dname, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=dd)
        return 0
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=sd), dname, dir_fd=dd)
        _copy_meta(None, dst, rel, st, False)
        return 0
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        os.mknod(dname, st.st_mode, st.st_rdev, dir_fd=dd)  # fifos, sockets, devices
        _copy_meta(None, dst, rel, st, False)
        os.chmod(dname, stat.S_IMODE(st.st_mode), dir_fd=dd)  # just made: not a symlink
        return 0
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fd = os.open(name, flags | (os.O_DIRECTORY if stat.S_ISDIR(st.st_mode) else 0), dir_fd=sd)
    try:
        st = os.fstat(fd)  # what was opened, whatever the path became meanwhile
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(dname, 0o700, dir_fd=dd)
            _copy_meta(fd, dst, rel, st, _opaque(fd) if opaque is None else opaque)
            return 0
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", rel)
        out = os.open(dname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=dd)  # fmt: skip
        try:
            copied = _copy_data(fd, out, st.st_size)
        finally:
            os.close(out)
        _copy_meta(fd, dst, rel, st, False)
        return copied
    finally:
        os.close(fd)


def _copy_data(src: int, dst: int, size: int) -> int:
    """Copy up to ``size`` bytes in the kernel (a reflink where both are on one btrfs);
    between filesystems of different types copy_file_range refuses, sendfile does not."""
    done = 0
    try:
        while done < size and (n := os.copy_file_range(src, dst, size - done)):
            done += n
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        while done < size and (n := os.sendfile(dst, src, done, size - done)):
            done += n
    return done


def remove(tree: Tree, rel: str) -> None:
    """Remove ``rel`` (a whole directory too) if it exists."""
    d, name = tree.parent(rel)
    try:
        st = os.stat(name, dir_fd=d, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        tree.forget(rel)
        shutil.rmtree(name, dir_fd=d)
    else:
        os.unlink(name, dir_fd=d)


def kind_at(tree: Tree, rel: str) -> str | None:
    """What ``rel`` is in ``tree`` (an :class:`Entry` kind), None if missing."""
    d, name = tree.parent(rel)
    try:
        return _kind(os.stat(name, dir_fd=d, follow_symlinks=False))
    except FileNotFoundError:
        return None


def apply(delta: Path, target: Path, keep_whiteouts: bool = True) -> None:
    """Apply one delta tree onto ``target`` with overlay semantics (later wins).

    With ``keep_whiteouts`` (the result is itself a delta), deletions stay as whiteouts so
    they still hide paths of the layers below; without, they are simply removed.
    """
    with Tree(delta) as src, Tree(target) as dst:
        for rel, e in scan(delta).items():
            if e.kind == "w":
                remove(dst, rel)
                if keep_whiteouts:
                    whiteout(dst, rel)
            elif e.kind == "d":
                have = kind_at(dst, rel)
                if have is not None and (e.opaque or have != "d"):
                    remove(dst, rel)
                    have = None
                if have is None:
                    copy_entry(src, dst, rel, opaque=e.opaque and keep_whiteouts)
            else:
                remove(dst, rel)
                copy_entry(src, dst, rel)
