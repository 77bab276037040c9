"""Which paths differ between two states of a sandbox's filesystem.

A state is a stack of delta trees (the upper, then snapshot deltas, newest first) on top of
the environment's layers. Only paths some non-shared delta mentions can differ; each is
resolved in both stacks with overlay's rules (whiteouts and opaque directories hide what is
below) and compared.
"""

from __future__ import annotations

from pathlib import Path

from dsec_backend_container.overlay import Entry, entry_of, scan
from dsec_kernel.wire import FsDiff

__all__ = ["diff"]


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _resolve(path: str, stack: list[dict[str, Entry]], env: list[Path]) -> Entry | None:
    ancestors = _ancestors(path)
    for layer in stack:
        for a in ancestors:
            e = layer.get(a)
            if e is not None and e.kind != "d":  # a whiteout (or a file) replaced the directory
                return None
        e = layer.get(path)
        if e is not None:
            return None if e.kind == "w" else e
        if any(layer.get(a) is not None and layer[a].opaque for a in ancestors):
            return None
    for root in env:
        try:
            return entry_of(str(root) + path)
        except (FileNotFoundError, NotADirectoryError):
            continue
    return None


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
    for path in sorted(candidates):
        a = _resolve(path, [scans[p] for p in now], env)
        b = _resolve(path, [scans[p] for p in then], env)
        if a is not None and b is None:
            out.added.append(path)
        elif a is None and b is not None:
            out.deleted.append(path)
        elif a is not None and b is not None and a.kind != "d" and not a.same_content(b):
            out.modified.append(path)
    return out
