"""Pausing a sandbox: freeze its processes, then push its memory out of RAM.

Freezing uses the sandbox's v1 freezer group. Reclaim writes ``memory.force_empty`` on its
memory group, which drops its page cache and, where swap exists, swaps out its anonymous
memory. :class:`ZramSwap` gives a node without swap a compressed-RAM swap device for that
(zram, lz4) while something on it is paused, so a paused sandbox's memory shrinks to what
compresses instead of vanishing.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from dsec_kernel.contract import errors
from dsec_kernel.linuxhost.cgroups import Group

__all__ = [
    "LABEL",
    "ZramSwap",
    "freeze",
    "hierarchy_root",
    "is_frozen",
    "memory_charge",
    "paused_anywhere",
    "reclaim",
]

log = logging.getLogger(__name__)

_ZRAM_CONTROL = Path("/sys/class/zram-control")
_EDGE_GROUPS = "dsec-container-"  # the parent group of one edge's sandboxes, in each hierarchy
#: the label of the swap DSec makes (a swap header holds 16 bytes of it)
LABEL = "dsec-paused"


def freeze(group: Group, frozen: bool, timeout: float = 10.0) -> None:
    """Freeze (or thaw) every process of ``group``; returns once the kernel says so."""
    state = "FROZEN" if frozen else "THAWED"
    group.set("freezer", "freezer.state", state)
    deadline = time.monotonic() + timeout
    while frozen and (group.dirs["freezer"] / "freezer.state").read_text().strip() != state:
        if time.monotonic() > deadline:
            raise errors.Unavailable(f"the sandbox did not freeze within {timeout:g} s")
        time.sleep(0.001)


def is_frozen(group: Group) -> bool:
    try:
        return (group.dirs["freezer"] / "freezer.state").read_text().strip() != "THAWED"
    except FileNotFoundError:
        return False


def memory_charge(group: Group) -> tuple[int, int]:
    """(bytes in RAM, bytes in swap) charged to the group's memory cgroup."""
    d = group.dirs["memory"]
    ram = int((d / "memory.usage_in_bytes").read_text())
    stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    return ram, int(stat.get("total_swap", 0))


def reclaim(group: Group) -> None:
    """Reclaim as much of the (frozen) group's memory as the kernel can."""
    try:
        group.set("memory", "memory.force_empty", 0)
    except OSError as exc:  # EBUSY: some of it could not go (no swap, or swap full)
        log.debug("force_empty on %s: %s", group.dirs["memory"], exc)


class ZramSwap:
    """Compressed-RAM swap for paused sandboxes, made on the first pause if the node has no
    swap at all, shared by every edge on the node, and removed once nothing on it is paused.

    An operator's own swap is used as it is and never touched. The device DSec made is
    named in ``record`` and carries :data:`LABEL` in its swap header; a device that does
    not (named by the record of an edge that died, and since someone else's) is never
    touched either.

    Pauses and the removal exclude each other through a lock next to the record (flock): a
    pause holds it shared from finding swap until its sandbox is frozen and reclaimed
    (:meth:`pausing`); making the device and removing it hold it exclusively, and a removal
    looks for paused sandboxes (in the whole freezer hierarchy: every edge's) only once it
    holds it. So no pause freezes during a swapoff, and no swapoff starts while a sandbox is
    paused or a pause is under way.
    """

    def __init__(
        self,
        size_mb: int,
        freezer_root: Path,
        memory_root: Path,
        record: Path = Path("/run/dsec/zram-swap"),
        retry_s: float = 600.0,
    ) -> None:
        self.size_mb = size_mb
        self.freezer_root = freezer_root
        self.memory_root = memory_root
        self.record = record
        self.retry_s = retry_s
        self._not_before = 0.0  # after a failed swapoff: no other before this (monotonic)
        self._said = ""  # why the last removal kept the device

    @staticmethod
    def active() -> list[str]:
        lines = Path("/proc/swaps").read_text().splitlines()[1:]
        return [line.split()[0] for line in lines if line.strip()]

    @contextlib.contextmanager
    def pausing(self, make: bool = True) -> Iterator[str | None]:
        """Hold the node's swap for a pause: within, the swap there is (made now if the node
        has none and ``make``) is not removed. Yields None, or why there is no swap (a pause
        then gives back page cache only)."""
        for _ in range(3):  # a removal may come between making the device and holding it
            with self._locked(fcntl.LOCK_SH):
                if not make or self.active():
                    yield None
                    return
            with self._locked(fcntl.LOCK_EX):
                if why := self._make():
                    break
        else:
            why = "the node's swap was removed as often as it was made"
        yield why

    def _make(self) -> str | None:
        if self.active():  # another pause made it meanwhile
            return None
        if not _ZRAM_CONTROL.exists():
            return "no swap and no zram: a paused sandbox gives back its page cache only"
        if (old := self._ours()) is not None:  # an edge died before it was quite gone
            _remove_zram(old.removeprefix("/dev/zram"))
        index = (_ZRAM_CONTROL / "hot_add").read_text().strip()
        dev, block = f"/dev/zram{index}", Path(f"/sys/block/zram{index}")
        size = self.size_mb or _mem_total_mb() // 2
        try:
            algorithms = (block / "comp_algorithm").read_text()
            if "lz4" in algorithms.replace("[", " ").replace("]", " ").split():
                (block / "comp_algorithm").write_text("lz4")
            (block / "disksize").write_text(f"{size}M")
            subprocess.run(["mkswap", "-L", LABEL, dev], check=True, capture_output=True)
            self.record.write_text(f"{dev}\n")  # before swapon: an edge may die there
            subprocess.run(["swapon", "-p", "100", dev], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            _remove_zram(index)
            self.record.unlink(missing_ok=True)
            return f"cannot make zram swap ({exc}): paused sandboxes keep their memory"
        log.info("made %s (%d MiB) as swap for paused sandboxes", dev, size)
        return None

    def remove_if_unused(self) -> str | None:
        """Remove the device DSec made if nothing on the node is paused and what it holds
        (pages of resumed sandboxes and of host processes) fits back in RAM: in the node's
        available memory and under every memory cgroup's limit. The swapoff moves it all
        back (~1 s per GiB here) and a signal does not stop it; where it would not fit, it
        has the kernel kill processes and fail with ENOMEM (measured). Never waits for the
        lock: whoever holds it is pausing (so the device is needed) or making or removing
        it. After a failed swapoff the device is kept ``retry_s``. Returns what was done
        (logged), None if nothing was to do."""
        if time.monotonic() < self._not_before:
            return None
        with self._locked(fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
            if not held or (dev := self._ours()) is None:
                return None
            if paused_anywhere(self.freezer_root):
                return None
            used = _swap_used(dev)
            if used and (why := _unfit(used, self.memory_root)):
                return self._kept("unfit", f"kept {dev}: {why}")
            started = time.monotonic()
            if used is not None:
                done = subprocess.run(["swapoff", dev], capture_output=True, text=True)
                if done.returncode:
                    back = used - (_swap_used(dev) or 0)
                    why = done.stderr.strip() or f"exit status {done.returncode}"
                    self._not_before = time.monotonic() + self.retry_s
                    return self._kept("failed", f"kept {dev}: swapoff: {why}, after moving "
                                      f"{back >> 20} MiB back to RAM; trying again in "
                                      f"{self.retry_s:g} s")  # fmt: skip
            _remove_zram(dev.removeprefix("/dev/zram"))
            self.record.unlink()
            self._said = ""
            said = (f"removed {dev}: nothing on the node is paused ({(used or 0) >> 20} MiB "
                    f"moved back to RAM in {time.monotonic() - started:.2f} s)")  # fmt: skip
            log.info("%s", said)
            return said

    def _ours(self) -> str | None:
        """The recorded device if it carries :data:`LABEL`. A record naming an active device
        that does not (someone else's, or an older DSec's, which removes its own) is left
        as it is; one naming nothing active goes. Called with the lock held exclusively."""
        try:
            dev = self.record.read_text().strip()
        except FileNotFoundError:
            return None
        if _swap_label(dev) == LABEL:
            return dev
        if dev in self.active():
            self._kept("foreign", f"{self.record} names {dev}, which DSec did not make "
                       f"(its swap header has no label {LABEL!r}): left alone")  # fmt: skip
        else:
            self.record.unlink()
        return None

    def _kept(self, kind: str, said: str) -> str:
        """Log why the device stays: a warning the first time for a reason of this kind."""
        (log.warning if kind != self._said else log.debug)("%s", said)
        self._said = kind
        return said

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[bool]:
        self.record.parent.mkdir(parents=True, exist_ok=True)
        with open(self.record.with_suffix(".lock"), "w") as lock:
            try:
                fcntl.flock(lock, how)
            except BlockingIOError:
                yield False
                return
            yield True


def paused_anywhere(freezer_root: Path) -> bool:
    """Whether any container sandbox on the node, of any edge, is frozen with processes in
    it. ``freezer_root``: the freezer hierarchy's root; an edge's groups may be anywhere
    below it (each edge makes them below its own cgroup)."""
    for top, dirs, _ in os.walk(freezer_root):
        for edge in [d for d in dirs if d.startswith(_EDGE_GROUPS)]:
            dirs.remove(edge)  # not into its sandboxes' exec groups
            if any(_paused(sb) for sb in Path(top, edge).glob("sb-*")):
                return True
    return False


def _paused(sandbox: Path) -> bool:
    """Frozen, and holding processes (a frozen group left empty holds no memory)."""
    try:
        if (sandbox / "freezer.state").read_text().strip() == "THAWED":
            return False
        procs = [sandbox / "cgroup.procs", *sandbox.glob("*/cgroup.procs")]
        return any(p.read_text().strip() for p in procs)
    except FileNotFoundError:  # removed meanwhile
        return False


def hierarchy_root(group: Path) -> Path:
    """The root of the v1 hierarchy ``group`` is in (only the root has
    ``cgroup.sane_behavior``)."""
    while not (group / "cgroup.sane_behavior").exists() and group.parent != group:
        group = group.parent
    return group


def _unfit(used: int, memory_root: Path) -> str | None:
    """Why ``used`` bytes moved from swap to RAM might not fit (None: they fit): the node
    keeps a tenth of its memory free, and no memory cgroup is pushed over its limit (a
    cgroup's RAM and swap together are what it holds once the swap is gone)."""
    meminfo = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    available, total = (int(meminfo[k].split()[0]) << 10 for k in ("MemAvailable", "MemTotal"))
    if used + total // 10 > available:
        return (f"its {used >> 20} MiB do not fit in RAM ({available >> 20} MiB available, "
                f"{total // 10 >> 20} MiB kept free)")  # fmt: skip
    for top, _, _ in os.walk(memory_root):
        d = Path(top)
        try:
            limit = int((d / "memory.limit_in_bytes").read_text())
            held = int((d / "memory.memsw.usage_in_bytes").read_text())
        except (FileNotFoundError, ValueError):  # removed meanwhile, or no swap accounting
            continue
        if held > limit:
            return (f"the memory cgroup {d} holds {held >> 20} MiB in RAM and swap, over its "
                    f"limit of {limit >> 20} MiB")  # fmt: skip
    return None


def _swap_used(dev: str) -> int | None:
    """Bytes ``dev`` holds as active swap (None: not active)."""
    for line in Path("/proc/swaps").read_text().splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == dev:
            return int(fields[3]) << 10
    return None


def _swap_label(dev: str) -> str | None:
    """The label in ``dev``'s swap header (None: no such device, or no swap header)."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open(dev, "rb") as f:
            header = f.read(page)
    except OSError:
        return None
    if header[page - 10 :] != b"SWAPSPACE2":
        return None
    return header[1052:1068].rstrip(b"\0").decode(errors="replace")


def _remove_zram(index: str) -> None:
    try:
        Path(f"/sys/block/zram{index}/reset").write_text("1")
        (_ZRAM_CONTROL / "hot_remove").write_text(index)
    except OSError as exc:
        log.warning("cannot remove /dev/zram%s: %s", index, exc)


def _mem_total_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
