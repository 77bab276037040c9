"""cgroup v1 groups for sandboxes: create, put processes in, limit, remove.

Standard library only (the fncall zygote imports it). Groups are made below the calling
process's own cgroup in each hierarchy (``/proc/self/cgroup``), so DSec works inside a
nested cgroup as well as at the root. Every function raises OSError on failure.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from dsec_kernel.linuxhost import syscalls

__all__ = ["Group", "favor_dynamic_changes", "host_reserve", "v1_controllers", "v2_own"]


def v1_controllers() -> dict[str, Path]:
    """controller -> the directory of this process's own cgroup in that v1 hierarchy."""
    mounts: dict[str, Path] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _src, opts = right.split()[:3]
            if fstype == "cgroup":
                for opt in opts.split(","):
                    mounts.setdefault(opt, Path(left.split()[4]))
    own: dict[str, Path] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(","):
                if name in mounts:
                    own[name] = mounts[name] / path.lstrip("/")
    return own


def v2_own() -> Path | None:
    """This process's own cgroup in the cgroup2 hierarchy, if one is mounted (here it has no
    controllers: it serves ``cgroup.kill`` and eBPF programs)."""
    with open("/proc/self/mountinfo") as f:
        points = [left.split()[4] for left, _, right in (line.partition(" - ") for line in f)
                  if right.split()[0] == "cgroup2"]  # fmt: skip
    with open("/proc/self/cgroup") as f:
        own = next((line[3:].strip() for line in f if line.startswith("0::")), None)
    if not points or own is None:
        return None
    return Path(points[0]) / own.lstrip("/")


def favor_dynamic_changes() -> str | None:
    """Make moving processes between cgroups cheap, system-wide: set ``favordynmods`` on
    a cgroup2 mount (kept with its other options). Without it every move waits for an RCU
    grace period (5-15 ms measured on this kernel); with it a move takes ~0.2 ms, and
    forks and exits get marginally dearer. Returns None, or why it could not be set."""
    with open("/proc/self/mountinfo") as f:
        v2 = [(left.split()[4], right.split()[2]) for left, _, right in
              (line.partition(" - ") for line in f) if right.split()[0] == "cgroup2"]  # fmt: skip
    if not v2:
        return "no cgroup2 mount to set favordynmods on"
    if any("favordynmods" in opts.split(",") for _, opts in v2):
        return None
    mountpoint, opts = v2[0]
    try:
        syscalls.mount(None, mountpoint, None, syscalls.MS_REMOUNT, f"{opts},favordynmods")
    except OSError as exc:
        return f"cannot remount {mountpoint} with favordynmods: {exc}"
    return None


def host_reserve() -> tuple[int, int]:
    """What every sandbox of a backend may use together, so that the host keeps some of its
    own whatever the sandboxes' limits add up to: (bytes of memory: the node's less a tenth,
    at least 1 GiB, less; processes: three quarters of the kernel's ``pid_max``)."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemTotal:"))
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    return max(total - max(total // 10, 1 << 30), total // 2), pid_max * 3 // 4


class Group:
    """One cgroup, the same relative path in several v1 hierarchies (e.g. memory and pids)."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    @classmethod
    def under(cls, parent: dict[str, Path], name: str) -> Group:
        return cls({c: d / name for c, d in parent.items()})

    def create(self) -> Group:
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)
        return self

    def add(self, pid: int) -> None:
        for d in self.dirs.values():
            (d / "cgroup.procs").write_text(str(pid))

    def set(self, controller: str, name: str, value: int | str) -> None:
        (self.dirs[controller] / name).write_text(str(value))

    def kill(self) -> None:
        """SIGKILL every process in the group and its descendants (in each hierarchy). With a
        freezer among its hierarchies the group is frozen meanwhile, so no process in it can
        fork, or exit and have its number taken by another, between being listed and being
        killed; without one, a number is signalled as listed."""
        freezer = self.dirs.get("freezer")
        frozen = freezer is not None and _set_frozen(freezer, True)
        try:
            for d in self.dirs.values():
                for group in [d, *(p for p in d.rglob("*") if p.is_dir())]:
                    try:
                        pids = (group / "cgroup.procs").read_text().split()
                    except FileNotFoundError:
                        continue
                    for pid in pids:
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        finally:
            if frozen:  # the killed die once thawed
                _set_frozen(freezer, False)

    def remove(self, timeout: float = 5.0, kill: bool = False) -> None:
        """Remove the group and its children once they are empty (waits up to ``timeout``).
        With ``kill``, whatever is (or arrives) in them meanwhile is killed."""
        deadline = time.monotonic() + timeout
        for d in self.dirs.values():
            if not d.exists():
                continue
            for child in sorted((p for p in d.rglob("*") if p.is_dir()), reverse=True):
                _rmdir(child, deadline, self.kill if kill else None)
            _rmdir(d, deadline, self.kill if kill else None)


def _rmdir(path: Path, deadline: float, kill: Callable[[], None] | None) -> None:
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: processes are still leaving
            if time.monotonic() > deadline:
                raise
            if kill is not None:
                kill()
            time.sleep(0.01)


def _set_frozen(freezer: Path, frozen: bool, timeout: float = 10.0) -> bool:
    """Freeze (waiting until every task is, at most ``timeout``) or thaw a v1 freezer group;
    False if there is no such group."""
    state = "FROZEN" if frozen else "THAWED"
    try:
        (freezer / "freezer.state").write_text(state)
        deadline = time.monotonic() + timeout
        while frozen and (freezer / "freezer.state").read_text().strip() != state:
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
    except FileNotFoundError:
        return False
    return True
