"""What the container benchmarks share: the check that a run left nothing behind."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from dsec_backend_container.inits import process_start
from dsec_storage_3fs.mounts import mount_table


def leftovers(tmp: Path, cgroups: Iterable[Path], inits: Iterable[tuple[int, int]]) -> list[str]:
    """Mounts under ``tmp``, ``cgroups`` that still exist, and sandbox inits ((pid, start
    time) pairs) still running, described for a report; empty if none."""
    found = []
    top = os.path.realpath(tmp) + "/"
    mounts = [t for t, _ in mount_table() if t.startswith(top)]
    if mounts:
        found.append(f"{len(mounts)} mount(s) under {tmp}")
    groups = [str(g) for g in cgroups if g.exists()]
    if groups:
        found.append(f"cgroups {', '.join(groups)}")
    alive = [pid for pid, start in inits if start and process_start(pid) == start]
    if alive:
        found.append(f"{len(alive)} sandbox init(s) still running, e.g. pid {alive[0]}")
    return found
