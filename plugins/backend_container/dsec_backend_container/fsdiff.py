"""Which paths differ between two states of a sandbox's filesystem.

A state is a stack of delta trees (the upper, then snapshot deltas, newest first) on top of
the environment's layers. Only paths some non-shared delta mentions can differ; each is
resolved in both stacks with overlay's rules (whiteouts and opaque directories hide what is
below, and so does a non-directory where a path's ancestor would be) and compared: a file is
modified when its type, mode, size or mtime differ, or else its bytes do (an edit that puts
size and times back is still an edit). Nothing is ever resolved through a symlink: the
layers and deltas hold the sandbox's own symlinks, which would point the host's lookups at
its own files.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dsec_backend_container.overlay import Entry, Tree, is_whiteout, scan
from dsec_kernel.wire import FsDiff

__all__ = ["diff"]

_CHUNK = 1 << 20
#: where a path was found: its entry and the tree it lies in
Found = tuple[Entry, Path]


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _in_layer(t: Tree, path: str) -> tuple[str, Entry | None]:
    """Look ``path`` up in one environment layer: ("found", entry), ("hidden", None) (a
    whiteout, or a non-directory on the way: nothing below shows), ("opaque", None)
    (missing below an opaque directory) or ("missing", None)."""
    parts = path.strip("/").split("/")
    opaque = False
    try:
        for i in range(len(parts) - 1):
            rel = "/" + "/".join(parts[: i + 1])
            d, name = t.parent(rel)
            st = os.stat(name, dir_fd=d, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                return "hidden", None
            opaque = opaque or _opaque_dir(t, rel)
        d, name = t.parent(path)
        st = os.stat(name, dir_fd=d, follow_symlinks=False)
    except FileNotFoundError:
        return ("opaque" if opaque else "missing"), None
    if is_whiteout(st):
        return "hidden", None
    opaque_here = stat.S_ISDIR(st.st_mode) and _opaque_dir(t, path)
    return "found", Entry(_kind(st), st.st_mode, st.st_uid, st.st_gid, st.st_size,
                          st.st_mtime_ns, st.st_ctime_ns, opaque_here)  # fmt: skip


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


def _resolve(
    path: str, stack: list[tuple[Path, dict[str, Entry]]], env: list[Path], trees: _Trees
) -> Found | None:
    ancestors = _ancestors(path)
    for root, layer in stack:
        for a in ancestors:
            e = layer.get(a)
            if e is not None and e.kind != "d":  # a whiteout (or a file) replaced the directory
                return None
        e = layer.get(path)
        if e is not None:
            return None if e.kind == "w" else (e, root)
        if any(layer.get(a) is not None and layer[a].opaque for a in ancestors):
            return None
    for root in env:
        how, e = _in_layer(trees[root], path)
        if how == "found":
            assert e is not None
            return e, root
        if how in ("hidden", "opaque"):
            return None
    return None


def _same_bytes(path: str, ta: Tree, tb: Tree) -> bool:
    """Whether ``path`` holds the same bytes (a file) or target (a symlink) in trees a and b;
    False if either cannot be read as such."""
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
                if not all(stat.S_ISREG(os.fstat(f).st_mode) for f in (fa, fb)):
                    return False
                while True:
                    x, y = os.read(fa, _CHUNK), os.read(fb, _CHUNK)
                    if x != y:
                        return False
                    if not x:
                        return True
            finally:
                os.close(fb)
        finally:
            os.close(fa)
    except OSError:
        return False


class _Trees(dict):
    """A :class:`Tree` per root, opened when first asked for, each caching few descriptors
    (a diff reaches into every layer and delta of two chains)."""

    def __missing__(self, root: Path) -> Tree:
        tree = self[root] = Tree(root, cached=8)
        return tree

    def close(self) -> None:
        for tree in self.values():
            tree.close()


def diff(now: list[Path], then: list[Path], env: list[Path]) -> FsDiff:
    """What ``now`` changed relative to ``then`` (both delta stacks, newest first)."""
    shared = 0
    while shared < min(len(now), len(then)) and now[-1 - shared] == then[-1 - shared]:
        shared += 1
    scans: dict[Path, dict[str, Entry]] = {p: scan(p) for p in {*now, *then}}
    candidates = set()
    for p in [*now[: len(now) - shared], *then[: len(then) - shared]]:
        candidates.update(scans[p])
    out = FsDiff()
    trees = _Trees()
    try:
        for path in sorted(candidates):
            a = _resolve(path, [(p, scans[p]) for p in now], env, trees)
            b = _resolve(path, [(p, scans[p]) for p in then], env, trees)
            if a is not None and b is None:
                out.added.append(path)
            elif a is None and b is not None:
                out.deleted.append(path)
            elif a is not None and b is not None and a[0].kind != "d":
                if a[1] == b[1]:
                    continue  # the same copy
                if not a[0].same_meta(b[0]) or not _same_bytes(path, trees[a[1]], trees[b[1]]):
                    out.modified.append(path)
    finally:
        trees.close()
    return out
