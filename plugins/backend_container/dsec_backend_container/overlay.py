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

What the sandbox put there also decides how much work a walk is, so every walk is bounded:
at most :data:`MAX_DEPTH` directories deep (:class:`TooDeep` past it), no path longer than
:data:`PATH_MAX` bytes (:class:`TooLong`; 510 directories of 255-byte names made 130 KB
paths, a few MB on disk listed as 156 MiB), at most :data:`MAX_LISTING` bytes listed by one
scan (:class:`TooLarge`), one descriptor per level of the current path and a few dozen cached
(thousands of sibling directories once held a descriptor each and ran the edge out of them),
never recursive, sparse files copied as sparse and hard links as links (a 2 GB hole or 60
links to one file were written out in full to the store). Every entry and every chunk of
data copied is a :func:`~.lanes.checkpoint`: cancelled lane work stops there.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dsec_backend_container.lanes import checkpoint
from dsec_kernel.contract import errors
from dsec_kernel.linuxhost.fileio import remove_tree

__all__ = [
    "MAX_DEPTH",
    "MAX_LISTING",
    "OPAQUE",
    "PATH_MAX",
    "Budget",
    "Entry",
    "Links",
    "TooDeep",
    "TooLarge",
    "TooLong",
    "Tree",
    "apply",
    "copy_entry",
    "date_dirs",
    "is_whiteout",
    "kind_at",
    "lookup",
    "remove",
    "scan",
    "whiteout",
]

OPAQUE = "trusted.overlay.opaque"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: deepest nesting of directories a walk goes (far past any real project's)
MAX_DEPTH = 512
#: longest path (``/a/b`` below the tree's root) a walk takes, in bytes: Linux's PATH_MAX,
#: the longest a system call takes, so no program opens a longer one by its name either
PATH_MAX = 4096
#: most bytes one scan lists: each entry's path (as a snapshot's manifest writes it) and
#: :data:`ENTRY_BYTES` for the rest of it. A manifest is at most that; what a scan holds in
#: memory is about that (a million files of 130-byte paths list 250 MB)
MAX_LISTING = 256 << 20
#: what an entry of a listing costs besides its path: the most its manifest line's
#: metadata can take (20 digits for each of size and two times, ...)
ENTRY_BYTES = 120
#: characters JSON writes escaped (a control character as ``\u00XX``: 5 bytes more)
_ESCAPED = re.compile(r'[\x00-\x1f"\\]')
#: most data copied per system call (a checkpoint between two)
_COPY_CHUNK = 64 << 20
#: directory descriptors a Tree keeps open besides its root
_CACHED = 64
#: hard links copied so far in one piece of work: (device, inode) -> the path of the copy
Links = dict[tuple[int, int], str]


class TooDeep(errors.InvalidArgument):
    """A tree nests deeper than :data:`MAX_DEPTH`."""

    def __init__(self, rel: str) -> None:
        super().__init__(
            f"the sandbox's files nest deeper than {MAX_DEPTH} directories (below "
            f"{rel[:200]!r}...); snapshots and diffs stop there: flatten that tree first"
        )


class TooLong(errors.InvalidArgument):
    """A path in a tree is longer than :data:`PATH_MAX` bytes."""

    def __init__(self, rel: str) -> None:
        super().__init__(
            f"a path in the sandbox's files is longer than {PATH_MAX} bytes ({rel[:200]!r}...); "
            "snapshots and diffs stop there: rename or move that tree to shorten it first"
        )


class TooLarge(errors.InvalidArgument):
    """Trees list more than a scan's :class:`Budget` allows (:data:`MAX_LISTING`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the sandbox's files list more than {limit >> 20} MiB of paths (and metadata), too "
            "many to snapshot or diff: remove or archive some of them (a tar file is one entry)"
        )


def _depth(rel: str) -> int:
    return rel.count("/")


def _name_bytes(name: str) -> tuple[int, int]:
    """(bytes of ``name`` on disk, bytes it takes in a manifest)."""
    n = len(name) if name.isascii() else len(os.fsencode(name))
    return n, n + 5 * len(_ESCAPED.findall(name))


@dataclass(frozen=True, slots=True)
class Entry:
    """What a path is, enough to tell whether it changed (ctime moves on every change).
    (Slotted: a scan holds one per path, up to millions.)"""

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
    """A directory tree reached only through ``O_NOFOLLOW`` directory descriptors: the
    root's, and the last ``cached`` others used (one piece of work; :meth:`close` them). A
    descriptor :meth:`dir` returns is good until the next call."""

    def __init__(self, root: Path, cached: int = _CACHED) -> None:
        self.root = root
        self.cached = cached
        self._root = os.open(root, _DIR)
        self._dirs: OrderedDict[str, int] = OrderedDict()

    def dir(self, rel: str) -> int:
        """A descriptor of directory ``rel`` (``/a/b`` form; ``""`` is the root), opened
        from its nearest cached ancestor down, component by component."""
        if not rel:
            return self._root
        fd = self._dirs.get(rel)
        if fd is not None:
            self._dirs.move_to_end(rel)
            return fd
        if _depth(rel) > MAX_DEPTH:
            raise TooDeep(rel)
        if len(rel) > PATH_MAX // 4 and len(os.fsencode(rel)) > PATH_MAX:
            raise TooLong(rel)
        base = rel
        while base and base not in self._dirs:
            base = base.rpartition("/")[0]
        fd = self._dirs[base] if base else self._root
        for name in rel[len(base) + 1 :].split("/"):
            base = f"{base}/{name}"
            fd = os.open(name, _DIR, dir_fd=fd)
            self._dirs[base] = fd
            self._dirs.move_to_end(base)
        while len(self._dirs) > self.cached:
            os.close(self._dirs.popitem(last=False)[1])
        return fd

    def parent(self, rel: str) -> tuple[int, str]:
        """(descriptor of ``rel``'s directory, ``rel``'s last component)."""
        parent, _, name = rel.rpartition("/")
        return self.dir(parent), name

    def forget(self, rel: str) -> None:
        """Drop cached descriptors of ``rel`` and below (it was removed or replaced)."""
        for key in [k for k in self._dirs if k == rel or k.startswith(rel + "/")]:
            os.close(self._dirs.pop(key))

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

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


class Budget:
    """Bytes scans may still list (see :data:`MAX_LISTING`): one scan's, or shared by the
    scans of one piece of work, which holds all their listings at once."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int = MAX_LISTING) -> None:
        self.left = self.limit = limit

    def take(self, n: int) -> None:
        """TooLarge if ``n`` more bytes are more than is left."""
        self.left -= n
        if self.left < 0:
            raise TooLarge(self.limit)


def scan(root: Path, budget: Budget | None = None) -> dict[str, Entry]:
    """Every path below ``root`` (``/a/b`` form, ``root`` itself excluded), sorted. What
    vanishes or changes type while being read is left out (or seen as it became); TooDeep
    past :data:`MAX_DEPTH`, TooLong for a path past :data:`PATH_MAX` bytes, TooLarge past
    what ``budget`` allows (None: a budget of its own, :data:`MAX_LISTING`). Holds a
    descriptor per level of the current path only. Every entry's parent is listed before it
    (each path is its parent's, then ``/`` and its name), so callers can work parent first
    instead of ancestor by ancestor."""
    out: dict[str, Entry] = {}
    try:
        top = os.open(root, _DIR)
    except FileNotFoundError:
        return out
    left = budget if budget is not None else Budget()
    try:
        listed = _list_into(top, ("", 0, 0), out, left)
    except BaseException:
        os.close(top)
        raise
    stack: list[tuple[str, int, list[_Subdir]]] = [("", top, listed)]  # (rel, fd, to list)
    try:
        while stack:
            rel, fd, subdirs = stack[-1]
            if not subdirs:
                stack.pop()
                os.close(fd)
                continue
            name, size, cost = subdirs.pop()
            r = f"{rel}/{name}"
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                continue  # gone, or no longer a directory
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # became a symlink
                    continue
                raise
            try:
                out[r] = _entry(os.fstat(child), _opaque(child))
                if len(stack) > MAX_DEPTH:
                    raise TooDeep(r)
                listed = _list_into(child, (r, size, cost), out, left)
            except BaseException:
                os.close(child)
                raise
            stack.append((r, child, listed))
    finally:
        for _, fd, _ in stack:
            os.close(fd)
    return dict(sorted(out.items()))


#: a directory still to list: (name, bytes of its path, bytes of its path in a manifest)
_Subdir = tuple[str, int, int]


def _list_into(
    fd: int, at: tuple[str, int, int], out: dict[str, Entry], left: Budget
) -> list[_Subdir]:
    """Enter the non-directories of directory ``fd`` (``at``: its path as a :data:`_Subdir`)
    in ``out``, charging each entry to ``left``; return its subdirectories, last first."""
    rel, size, cost = at
    subdirs = []
    with os.scandir(fd) as it:
        for de in it:
            checkpoint()
            n, m = _name_bytes(de.name)
            if size + 1 + n > PATH_MAX:
                raise TooLong(f"{rel}/{de.name}")
            left.take(cost + 1 + m + ENTRY_BYTES)
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                subdirs.append((de.name, size + 1 + n, cost + 1 + m))
            else:
                out[f"{rel}/{de.name}"] = _entry(st)
    subdirs.sort(reverse=True)
    return subdirs


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


def copy_entry(
    src: Tree, dst: Tree, rel: str, opaque: bool | None = None, links: Links | None = None
) -> int:
    """Copy one path (not its children) from ``src`` to the same place in ``dst``, keeping
    metadata and holes; returns bytes of data copied. ``opaque`` None keeps the source's
    opacity. A file with more links, when ``links`` has a copy of it from this piece of
    work, becomes a link to that copy."""
    sd, name = src.parent(rel)
    st = os.stat(name, dir_fd=sd, follow_symlinks=False)
    if links is not None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        first = links.get((st.st_dev, st.st_ino))
        if first is not None:
            fd, fname = dst.parent(first)
            first_fd = os.dup(fd)  # (the next lookup may close the cached one)
            try:
                dd, dname = dst.parent(rel)
                os.link(fname, dname, src_dir_fd=first_fd, dst_dir_fd=dd, follow_symlinks=False)
            finally:
                os.close(first_fd)
            return 0
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
        if links is not None and st.st_nlink > 1:
            links[(st.st_dev, st.st_ino)] = rel
        return copied
    finally:
        os.close(fd)


def _copy_data(src: int, dst: int, size: int) -> int:
    """Copy the data of ``src``'s first ``size`` bytes into ``dst``, holes left holes (a
    reflink where both are on one btrfs); returns the bytes of data copied. Between
    filesystems of different types copy_file_range refuses, pread/pwrite does not."""
    copied = off = 0
    while off < size:
        checkpoint()
        try:
            data = os.lseek(src, off, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole up to the end
                break
            raise
        end = min(os.lseek(src, data, os.SEEK_HOLE), size)
        copied += _copy_range(src, dst, data, end)
        off = end
    os.ftruncate(dst, size)
    return copied


def _copy_range(src: int, dst: int, start: int, end: int) -> int:
    pos = start
    try:
        while pos < end and (
            n := os.copy_file_range(src, dst, min(end - pos, _COPY_CHUNK), pos, pos)
        ):
            pos += n
            checkpoint()
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        while pos < end and (chunk := os.pread(src, min(end - pos, 1 << 20), pos)):
            pos += os.pwrite(dst, chunk, pos)
            checkpoint()
    return pos - start


def remove(tree: Tree, rel: str) -> None:
    """Remove ``rel`` (a whole directory too, of any depth) if it exists."""
    d, name = tree.parent(rel)
    tree.forget(rel)
    remove_tree(name, dir_fd=d)


def kind_at(tree: Tree, rel: str) -> str | None:
    """What ``rel`` is in ``tree`` (an :class:`Entry` kind), None if missing."""
    d, name = tree.parent(rel)
    try:
        return _kind(os.stat(name, dir_fd=d, follow_symlinks=False))
    except FileNotFoundError:
        return None


def date_dirs(tree: Tree, listing: dict[str, Entry], dirs: Iterable[str], top: Tree) -> None:
    """Give each of the directories ``dirs`` of ``tree`` its mtime in ``listing``, and the
    root of ``tree`` that of ``top``'s (the tree ``listing`` is of): what is written into a
    directory after it was copied dates it now (a published layer's directories had the
    time of the publish, so no two publishes of one tree were one image). Reached through
    the trees' descriptors; what is no longer a directory there is left alone."""
    mtime = os.fstat(top.dir("")).st_mtime_ns
    os.utime(tree.dir(""), ns=(mtime, mtime))
    for rel in dirs:
        e = listing.get(rel)
        if e is None or e.kind != "d":
            continue
        try:
            d, name = tree.parent(rel)
            os.utime(name, ns=(e.mtime_ns, e.mtime_ns), dir_fd=d, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise


def apply(delta: Path, target: Path, keep_whiteouts: bool = True) -> None:
    """Apply one delta tree onto ``target`` with overlay semantics (later wins), the
    delta's directories keeping their mtimes.

    With ``keep_whiteouts`` (the result is itself a delta), deletions stay as whiteouts so
    they still hide paths of the layers below; without, they are simply removed.
    """
    links: Links = {}
    listing = scan(delta)
    with Tree(delta) as src, Tree(target) as dst:
        for rel, e in listing.items():
            checkpoint()
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
                copy_entry(src, dst, rel, links=links)
        date_dirs(dst, listing, listing, src)
