"""Lane work stops when asked: one sandbox's (its destroy) or all (the edge closing), waiting
or running, at the walks' next checkpoint, leaving nothing behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from dsec_backend_container.fsdiff import diff
from dsec_backend_container.lanes import Cancelled, Lanes, Token, cancellable, checkpoint
from dsec_backend_container.overlay import apply, scan
from dsec_backend_container.snapshots import Snapshots

from dsec_kernel.loader import open_store


class Counting(Token):
    """A token that counts the checkpoints passed: the work a walk does, in entries and
    chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        super().check()


class CancelAt(Counting):
    """A real token, cancelled from the walk's own thread at its ``at``-th checkpoint: what
    a destroy arriving just then does, without racing a thread to get there."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def check(self) -> None:
        if self.checks + 1 == self.at:
            self.cancel("the sandbox was destroyed while this ran", retryable=False)
        super().check()


def forever(started: threading.Event, ended: threading.Event) -> None:
    """Lane work that ends only when cancelled."""
    started.set()
    try:
        while True:
            checkpoint()
            time.sleep(0.001)
    finally:
        ended.set()


async def until(event: threading.Event) -> None:
    await asyncio.to_thread(event.wait)


def descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def base(tmp_path):
    yield tmp_path
    shutil.rmtree(tmp_path)


@pytest.fixture
def tree(base) -> Path:
    """Enough to walk: 20 directories of 5 files of 2 MiB (two chunks each)."""
    root = base / "upper"
    for d in range(20):
        (root / f"d{d:02d}").mkdir(parents=True)
        for f in range(5):
            (root / f"d{d:02d}" / f"f{f}").write_bytes(os.urandom(2 << 20))
    return root


# -- lanes -------------------------------------------------------------------------------------


async def test_cancel_stops_a_sandboxs_work_running_and_waiting_and_no_other():
    lanes = Lanes(2, waiting=8)
    started = {k: threading.Event() for k in ("sb-1", "sb-2", "sb-3")}
    ended = {k: threading.Event() for k in started}
    ran_late = threading.Event()
    try:
        running = asyncio.ensure_future(
            lanes.run("t", forever, started["sb-1"], ended["sb-1"], key="sb-1")
        )
        other_tenant = asyncio.ensure_future(
            lanes.run("u", forever, started["sb-2"], ended["sb-2"], key="sb-2")
        )
        await until(started["sb-1"])
        await until(started["sb-2"])
        waiting = asyncio.ensure_future(lanes.run("t", ran_late.set, key="sb-1"))
        await asyncio.sleep(0)
        await lanes.cancel("sb-1")
        assert ended["sb-1"].is_set()  # the work has stopped when cancel returns
        for call in (running, waiting):
            with pytest.raises(Cancelled, match="destroyed") as got:
                await call
            assert not got.value.retryable
        assert not ran_late.is_set() and not other_tenant.done()

        # waiting behind another sandbox of the same tenant: woken at once, not at its turn
        third = asyncio.ensure_future(
            lanes.run("u", forever, started["sb-3"], ended["sb-3"], key="sb-3")
        )
        await asyncio.sleep(0)
        await lanes.cancel("sb-3")
        with pytest.raises(Cancelled):
            await third
        assert not started["sb-3"].is_set() and not other_tenant.done()
        assert await lanes.run("t", lambda: 42, key="sb-1") == 42  # later calls are not
    finally:
        await asyncio.to_thread(lanes.close)
    with pytest.raises(Cancelled, match="shutting down") as got:
        await other_tenant
    assert got.value.retryable and ended["sb-2"].is_set()


async def test_close_stops_work_running_and_waiting_and_refuses_more():
    lanes = Lanes(1, waiting=8)
    started, ended, ran_late = threading.Event(), threading.Event(), threading.Event()
    running = asyncio.ensure_future(lanes.run("t", forever, started, ended))
    await until(started)
    waiting = asyncio.ensure_future(lanes.run("u", ran_late.set))
    await asyncio.sleep(0)
    await asyncio.to_thread(lanes.close)  # returns: the running work stopped
    assert ended.is_set()
    for call in (running, waiting):
        with pytest.raises(Cancelled, match="shutting down"):
            await call
    assert not ran_late.is_set()
    with pytest.raises(Cancelled):
        await lanes.run("t", ran_late.set)


async def test_a_walk_on_a_lane_stops_at_its_next_entry(tree):
    lanes = Lanes(1)
    started, scans = threading.Event(), []

    def walk_forever() -> None:
        started.set()
        while True:
            scans.append(len(scan(tree)))

    try:
        call = asyncio.ensure_future(lanes.run("t", walk_forever, key="sb-1"))
        await until(started)
        await lanes.cancel("sb-1")
        with pytest.raises(Cancelled):
            await call
    finally:
        await asyncio.to_thread(lanes.close)
    assert all(n == 120 for n in scans)


def test_outside_lane_work_a_checkpoint_does_nothing():
    checkpoint()
    token = Token()
    token.cancel("stop")
    with cancellable(token), pytest.raises(Cancelled, match="stop"):
        checkpoint()
    checkpoint()  # the block is over


# -- what cancelled walks leave ----------------------------------------------------------------


def points(walk) -> int:
    """Checkpoints a whole ``walk()`` passes."""
    with cancellable(token := Counting()):
        walk()
    return token.checks


def cancelled_at(walk, at: int) -> None:
    with cancellable(token := CancelAt(at)), pytest.raises(Cancelled):
        walk()
    assert token.checks == at  # it stopped at once


def test_a_cancelled_snapshot_leaves_no_temp_dir_wherever_it_stops(base, tree):
    store = open_store("3fs", {"root": str(base / "store"), "cache_dir": str(base / "cache")})
    snaps = Snapshots(store)

    def take():
        return snaps.take(
            tree, tenant="t", sandbox_id="sb-1", backend="container", layers=[], parent=None,
            baseline=None, keep=False,
        )  # fmt: skip

    fds = descriptors()
    total = points(take)
    assert total > 300  # entries (120), chunks copied, a scan of the delta for its size
    for p in snaps.root.iterdir():
        shutil.rmtree(p)
    for at in sorted({1, 2, 50, 121, 122, 200, total // 2, total - 1, total}):
        cancelled_at(take, at)
        assert os.listdir(snaps.root) == [], at  # no .tmp-*, no snapshot
    assert descriptors() == fds
    assert len(scan(tree)) == 120  # the upper as it was


def test_a_cancelled_diff_and_apply_stop_and_let_go_of_their_files(base, tree):
    then = base / "then"
    shutil.copytree(tree, then)  # the same bytes and times: compared chunk by chunk
    fds = descriptors()
    whole = points(lambda: diff([tree], [then], []))
    assert whole > 2 * 120 + 100 * 2  # two scans, every path, every chunk compared
    for at in (1, 130, 250, whole - 1):
        cancelled_at(lambda: diff([tree], [then], []), at)
    target = base / "target"
    target.mkdir()
    copying = points(lambda: apply(tree, target))
    shutil.rmtree(target)
    target.mkdir()
    cancelled_at(lambda: apply(tree, target), copying // 2)
    assert descriptors() == fds
