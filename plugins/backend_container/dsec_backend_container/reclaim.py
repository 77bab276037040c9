"""Pausing a sandbox: freeze its processes, then push its memory out of RAM.

Freezing uses the sandbox's v1 freezer group. Reclaim writes ``memory.force_empty`` on its
memory group, which drops its page cache and, where swap exists, swaps out its anonymous
memory. :class:`ZramSwap` gives a node without swap a compressed-RAM swap device for that
(zram, lz4), so a paused sandbox's memory shrinks to what compresses instead of vanishing.
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

from dsec_kernel import errors
from dsec_kernel.cgroups import Group

__all__ = ["ZramSwap", "freeze", "is_frozen", "memory_charge", "paused_anywhere", "reclaim"]

log = logging.getLogger(__name__)

_ZRAM_CONTROL = Path("/sys/class/zram-control")


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
    swap at all, and shared by every edge on the node.

    An operator's own swap is used as it is and never touched. The device DSec made is
    recorded in ``record``; :meth:`remove_if_unused` takes it away (swapoff, then the zram
    device goes) when no sandbox on the node is paused any more.
    """

    def __init__(self, size_mb: int, record: Path = Path("/run/dsec/zram-swap")) -> None:
        self.size_mb = size_mb
        self.record = record

    @staticmethod
    def active() -> list[str]:
        lines = Path("/proc/swaps").read_text().splitlines()[1:]
        return [line.split()[0] for line in lines if line.strip()]

    def ensure(self) -> str | None:
        """Swap exists afterwards, or the returned reason says why reclaim is partial."""
        with self._locked():
            if self.active():
                return None
            if not _ZRAM_CONTROL.exists():
                return "no swap and no zram: a paused sandbox gives back its page cache only"
            index = (_ZRAM_CONTROL / "hot_add").read_text().strip()
            dev, block = f"/dev/zram{index}", Path(f"/sys/block/zram{index}")
            size = self.size_mb or _mem_total_mb() // 2
            try:
                algorithms = (block / "comp_algorithm").read_text()
                if "lz4" in algorithms.replace("[", " ").replace("]", " ").split():
                    (block / "comp_algorithm").write_text("lz4")
                (block / "disksize").write_text(f"{size}M")
                subprocess.run(["mkswap", dev], check=True, capture_output=True)
                subprocess.run(["swapon", "-p", "100", dev], check=True, capture_output=True)
            except (OSError, subprocess.CalledProcessError) as exc:
                _remove_zram(index)
                return f"cannot make zram swap ({exc}): paused sandboxes keep their memory"
            self.record.write_text(dev)
            log.info("made %s (%d MiB) as swap for paused sandboxes", dev, size)
            return None

    def remove_if_unused(self, paused_on_node: bool) -> None:
        """Remove the device DSec made, unless a sandbox on the node is paused."""
        with self._locked():
            try:
                dev = self.record.read_text().strip()
            except FileNotFoundError:
                return
            if paused_on_node:
                return
            if dev in self.active():
                subprocess.run(["swapoff", dev], capture_output=True)
            _remove_zram(dev.removeprefix("/dev/zram"))
            self.record.unlink()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.record.parent.mkdir(parents=True, exist_ok=True)
        with open(self.record.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield


def paused_anywhere(freezer_root: Path) -> bool:
    """Whether any container sandbox on the node (of any edge) is frozen."""
    return any(
        f.read_text().strip() != "THAWED"
        for f in freezer_root.glob("dsec-container-*/sb-*/freezer.state")
    )


def _remove_zram(index: str) -> None:
    try:
        Path(f"/sys/block/zram{index}/reset").write_text("1")
        (_ZRAM_CONTROL / "hot_remove").write_text(index)
    except OSError as exc:
        log.warning("cannot remove /dev/zram%s: %s", index, exc)


def _mem_total_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
