"""Which paths differ between two states of a sandbox's filesystem.

A state is a stack of delta trees (the upper, then snapshot deltas, newest first) on top of
the environment's layers. Only paths some non-shared delta mentions can differ; each is
resolved in both stacks with overlay's rules (whiteouts and opaque directories hide what is
below, and so does a non-directory where a path's ancestor would be) and compared: a file is
modified when its type, mode, size or mtime differ, or else its bytes do (an edit that puts
size and times back is still an edit). Nothing is ever resolved through a symlink: the
layers and deltas hold the sandbox's own symlinks, which would point the host's lookups at
its own files.

The work is bounded by what the trees hold, not by what their names or sizes claim. Paths are
resolved parent first, each from its parent's state (a lookup per layer, not one per
ancestor: 1,000 files 510 directories deep had each build 510 ancestor paths, 110 s of CPU).
Bytes are compared only where either file has data (``SEEK_DATA``/``SEEK_HOLE``): a 15 TiB
sparse file was read to its end, three hours of a core. At most ``compare_bytes`` are read
in one diff; a file that would need more is reported modified without being read, which may
be wrong (it may be unchanged) but never hides a change. Every path and every chunk read is a
:func:`~.lanes.checkpoint`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from dsec_backend_container.lanes import checkpoint
from dsec_backend_container.overlay import MAX_LISTING, Budget, Entry, Tree, is_whiteout, scan
from dsec_kernel.contract.wire import FsDiff

__all__ = ["MAX_COMPARED", "MAX_LISTED", "diff"]

_CHUNK = 1 << 20
#: most bytes read to compare files in one diff (both copies counted)
MAX_COMPARED = 1 << 30
#: most bytes the deltas of one diff list together (:data:`~.overlay.MAX_LISTING`): it
#: holds all their listings at once, up to 33 (an upper and two chains of 16); twice what
#: one scan may, for an upper and a snapshot of all of it
MAX_LISTED = 2 * MAX_LISTING
#: where a path was found: its entry and the tree it lies in
Found = tuple[Entry, Path]
#: what a path is in an environment layer, for itself and for what lies below it:
#: ("found", entry, opaque: it or an ancestor is an opaque directory), ("hidden", ...) (a
#: whiteout, or a non-directory on the way: nothing below shows), ("opaque", ...) (missing
#: below an opaque directory) or ("missing", ...)
_InLayer = tuple[str, Entry | None, bool]
_TOP: _InLayer = ("found", None, False)  # a layer's root


class _State:
    """What holds for a path, for itself and what lies below it: in which deltas (bit i for
    delta i) it or an ancestor is a non-directory (``blocked``) or an opaque directory
    (``opaque``), and what it is in each environment layer."""

    __slots__ = ("blocked", "env", "opaque")

    def __init__(self, blocked: int, opaque: int, env: tuple[_InLayer, ...]) -> None:
        self.blocked, self.opaque, self.env = blocked, opaque, env


class _Resolver:
    """Paths resolved in delta stacks over the environment's layers, each from its parent's
    :class:`_State` (kept for directories only)."""

    def __init__(self, deltas: dict[Path, dict[str, Entry]], env: list[Path], trees: _Trees):
        self.index = {root: i for i, root in enumerate(deltas)}
        self.deltas = list(deltas.values())
        self.env = env
        self.trees = trees
        self.states = {"": _State(0, 0, tuple(_TOP for _ in env))}

    def state(self, path: str) -> _State:
        st = self.states.get(path)
        if st is not None:
            return st
        todo = [path]  # (parent first; only a path whose parent no delta lists has to climb)
        while (parent := todo[-1].rpartition("/")[0]) not in self.states:
            todo.append(parent)
        for p in reversed(todo):
            st = self._derive(p, self.states[p.rpartition("/")[0]])
            self.states[p] = st
        return st

    def _derive(self, path: str, up: _State) -> _State:
        blocked, opaque = up.blocked, up.opaque
        for i, layer in enumerate(self.deltas):
            e = layer.get(path)
            if e is not None:
                if e.kind != "d":
                    blocked |= 1 << i
                elif e.opaque:
                    opaque |= 1 << i
        env = tuple(
            self._in_layer(root, path, at) for root, at in zip(self.env, up.env, strict=True)
        )
        return _State(blocked, opaque, env)

    def _in_layer(self, root: Path, path: str, up: _InLayer) -> _InLayer:
        """``path`` in environment layer ``root``, its parent being ``up`` there."""
        how, e, opaque = up
        if how != "found":
            return up
        if e is not None and e.kind != "d":
            return "hidden", None, opaque
        t = self.trees[root]
        try:
            d, name = t.parent(path)
            st = os.stat(name, dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            return ("opaque" if opaque else "missing"), None, opaque
        if is_whiteout(st):
            return "hidden", None, opaque
        here = stat.S_ISDIR(st.st_mode) and _opaque_dir(t, path)
        return "found", Entry(_kind(st), st.st_mode, st.st_uid, st.st_gid, st.st_size,
                              st.st_mtime_ns, st.st_ctime_ns, here), opaque or here  # fmt: skip

    def resolve(self, path: str, stack: list[Path]) -> Found | None:
        """Where ``path`` shows in ``stack`` (deltas, newest first) over the environment;
        None if nowhere. Its parent's state must be known (:meth:`state` of it)."""
        up = self.states[path.rpartition("/")[0]]
        for root in stack:
            i = self.index[root]
            if up.blocked >> i & 1:  # a whiteout (or a file) replaced a directory above
                return None
            e = self.deltas[i].get(path)
            if e is not None:
                return None if e.kind == "w" else (e, root)
            if up.opaque >> i & 1:
                return None
        for root, (how, e, _) in zip(self.env, self.state(path).env, strict=True):
            if how == "found":
                assert e is not None
                return e, root
            if how in ("hidden", "opaque"):
                return None
        return None

    def done(self, path: str) -> None:
        """``path`` was resolved: keep its state only if it may be a parent (a directory in
        some delta: only deltas' paths are resolved)."""
        if not any(e.kind == "d" for layer in self.deltas if (e := layer.get(path))):
            self.states.pop(path, None)


def _opaque_dir(t: Tree, rel: str) -> bool:
    try:
        return os.getxattr(t.dir(rel), "trusted.overlay.opaque") == b"y"
    except OSError:
        return False


def _kind(st: os.stat_result) -> str:
    if stat.S_ISDIR(st.st_mode):
        return "d"
    if stat.S_ISREG(st.st_mode):
        return "f"
    return "l" if stat.S_ISLNK(st.st_mode) else "o"


class _Reads:
    """Bytes a diff may still read to compare files."""

    def __init__(self, left: int) -> None:
        self.left = left


def _same_bytes(path: str, ta: Tree, tb: Tree, reads: _Reads) -> bool:
    """Whether ``path`` holds the same bytes (a file) or target (a symlink) in trees a and b;
    False if either cannot be read as such, or if comparing would take more of ``reads``
    than is left (conservatively: the files may be the same)."""
    try:
        da, name = ta.parent(path)
        sa = os.stat(name, dir_fd=da, follow_symlinks=False)
        if stat.S_ISLNK(sa.st_mode):
            return os.readlink(name, dir_fd=da) == os.readlink(name, dir_fd=tb.parent(path)[0])
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fa = os.open(name, flags, dir_fd=da)
        try:
            fb = os.open(name, flags, dir_fd=tb.parent(path)[0])
            try:
                a, b = os.fstat(fa), os.fstat(fb)
                if not (stat.S_ISREG(a.st_mode) and stat.S_ISREG(b.st_mode)):
                    return False
                if a.st_size != b.st_size:
                    return False
                if 2 * 512 * max(a.st_blocks, b.st_blocks) > reads.left:
                    return False  # more data than is left to read: taken as changed
                return _same_data(fa, fb, a.st_size, reads)
            finally:
                os.close(fb)
        finally:
            os.close(fa)
    except OSError:
        return False


def _same_data(fa: int, fb: int, size: int, reads: _Reads) -> bool:
    """Whether files ``fa`` and ``fb`` (both ``size`` bytes) hold the same bytes, reading
    only the ranges where either has data: a hole reads as zeros, so a hole and zeros
    written are the same, and holes in both cost nothing."""
    off = 0
    while off < size:
        checkpoint()
        starts = (_data(fa, off), _data(fb, off))
        start = min(s for s in (*starts, size) if s is not None)
        if start >= size:
            return True
        end = size
        for fd, s in zip((fa, fb), starts, strict=True):
            if s == start:  # data here: to where its hole begins
                end = min(end, os.lseek(fd, start, os.SEEK_HOLE))
            elif s is not None:  # a hole here: to where its data begins
                end = min(end, s)
        if end <= start:
            return False  # (truncated meanwhile)
        if not _same_range(fa, fb, start, end, reads):
            return False
        off = end
    return True


def _data(fd: int, off: int) -> int | None:
    """Where ``fd``'s next data at or after ``off`` begins; None if only a hole follows."""
    try:
        return os.lseek(fd, off, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise


def _same_range(fa: int, fb: int, start: int, end: int, reads: _Reads) -> bool:
    pos = start
    while pos < end:
        checkpoint()
        n = min(end - pos, _CHUNK)
        if 2 * n > reads.left:
            return False  # more than is left to read: taken as changed
        reads.left -= 2 * n
        x = os.pread(fa, n, pos)
        if len(x) != n or x != os.pread(fb, n, pos):
            return False  # different, or truncated meanwhile
        pos += n
    return True


class _Trees(dict):
    """A :class:`Tree` per root, opened when first asked for, each caching few descriptors
    (a diff reaches into every layer and delta of two chains)."""

    def __missing__(self, root: Path) -> Tree:
        tree = self[root] = Tree(root, cached=8)
        return tree

    def close(self) -> None:
        for tree in self.values():
            tree.close()


def diff(
    now: list[Path],
    then: list[Path],
    env: list[Path],
    compare_bytes: int = MAX_COMPARED,
    listed: int = MAX_LISTED,
) -> FsDiff:
    """What ``now`` changed relative to ``then`` (both delta stacks, newest first), reading
    at most ``compare_bytes`` of files' data to tell whether they changed. TooDeep or
    TooLong (:mod:`.overlay`) if a delta is past a walk's bounds, TooLarge if the deltas
    list more than ``listed`` bytes together."""
    shared = 0
    while shared < min(len(now), len(then)) and now[-1 - shared] == then[-1 - shared]:
        shared += 1
    budget = Budget(listed)
    scans = {p: scan(p, budget) for p in dict.fromkeys([*now, *then])}
    candidates = set()
    for p in [*now[: len(now) - shared], *then[: len(then) - shared]]:
        candidates.update(scans[p])
    out = FsDiff()
    trees = _Trees()
    reads = _Reads(compare_bytes)
    try:
        paths = _Resolver(scans, env, trees)
        for path in sorted(candidates):
            checkpoint()
            paths.state(path.rpartition("/")[0])
            a = paths.resolve(path, now)
            b = paths.resolve(path, then)
            paths.done(path)
            if a is not None and b is None:
                out.added.append(path)
            elif a is None and b is not None:
                out.deleted.append(path)
            elif a is not None and b is not None and a[0].kind != "d":
                if a[1] == b[1]:
                    continue  # the same copy
                if not a[0].same_meta(b[0]) or not _same_bytes(
                    path, trees[a[1]], trees[b[1]], reads
                ):
                    out.modified.append(path)
    finally:
        trees.close()
    return out
