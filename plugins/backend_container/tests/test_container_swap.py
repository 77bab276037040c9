"""The zram swap a node without swap gets for paused sandboxes: made at the first pause,
shared by every edge, removed once nothing on the node is paused, never while something
is, and never when it is not DSec's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from dsec_backend_container.reclaim import ZramSwap, freeze, paused_anywhere

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import ExecCall, SandboxRef
from dsec_kernel.contract.wire import EdgeSandbox, Env, Limits, SandboxSpec

pytestmark = pytest.mark.asyncio(loop_scope="module")
ZRAM = Path("/sys/class/zram-control")
SOMEONE_PAUSED = "another edge on this node has a paused sandbox: the swap stays for it"


def new(**spec) -> EdgeSandbox:
    return EdgeSandbox(
        id="sb-" + os.urandom(8).hex(),
        tenant="t",
        spec=SandboxSpec(backend="container", env=Env(base="busybox:1"), **spec),
        created_at=time.time(),
    )


async def sh(backend, sid: str, script: str, timeout_s: float = 20):
    argv = ["/bin/sh", "-c", script]
    call = ExecCall(sandbox_id=sid, argv=argv, timeout_s=timeout_s, max_output_bytes=1 << 16)
    return await backend.exec(call)


def _recorded(backend) -> tuple[str, uuid.UUID | None] | None:
    """The device DSec's record names, and the UUID in its swap header (which tells it from
    a later device of the same name)."""
    try:
        dev = backend.swap.record.read_text().strip()
    except FileNotFoundError:
        return None
    return dev, _tag(dev)


def _tag(dev: str) -> uuid.UUID | None:
    """The UUID in ``dev``'s swap header (None: no such device)."""
    try:
        with open(dev, "rb") as f:
            return uuid.UUID(bytes=f.read(4096)[1036:1052])
    except OSError:
        return None


def _carrier(tag: uuid.UUID) -> str | None:
    """The active swap device whose header carries ``tag``."""
    return next((dev for dev in ZramSwap.active() if _tag(dev) == tag), None)


async def _gone(backend, tag: uuid.UUID) -> None:
    """Wait until no active swap carries ``tag`` and the record names it no more."""
    for _ in range(300):
        if _carrier(tag) is None and (_recorded(backend) or ("", None))[1] != tag:
            return
        await asyncio.sleep(0.05)
    if paused_anywhere(backend.swap.freezer_root):  # ours are not, here
        pytest.skip(SOMEONE_PAUSED)
    raise AssertionError(f"the swap with UUID {tag} is still there: {ZramSwap.active()}")


def _paused_elsewhere(backend, mine: list[SandboxRef]) -> bool:
    """Whether a sandbox of another edge on the node is paused (so the swap stays)."""
    ours = {ref.sandbox_id for ref in mine}
    states = backend.swap.freezer_root.rglob("dsec-container-*/sb-*/freezer.state")
    return any(
        p.parent.name not in ours
        and p.read_text().strip() != "THAWED"
        and (p.parent / "cgroup.procs").read_text().strip()
        for p in states
    )


def _swappiness(backend, sid: str) -> int:
    return int((backend._group(sid).dirs["memory"] / "memory.swappiness").read_text())


async def _hold(backend, sid: str, mb: int) -> None:
    """Have a process of the sandbox hold ``mb`` MiB of random bytes (incompressible)."""
    keep = f'x=$(head -c {mb << 20} /dev/urandom | tr -d "\\000"); touch /tmp/held; '
    keep += "while :; do sleep 9; done"  # not the last command alone: sh would exec it
    r = await sh(backend, sid, f"(setsid sh -c '{keep}' > /dev/null 2>&1 &); "
                 "while [ ! -e /tmp/held ]; do sleep 0.1; done", timeout_s=60)  # fmt: skip
    assert r.exit_code == 0, r


@pytest.fixture
def dsec_swap(backend):
    """Skip unless the node has zram and no swap (so the first pause makes DSec's)."""
    if not ZRAM.exists():
        pytest.skip("no zram on this node: DSec makes no swap")
    if active := ZramSwap.active():
        pytest.skip(f"the node has swap already ({active}): these tests need a node without")


@pytest.fixture
async def pair(backend):
    sbs = [new() for _ in range(2)]
    for sb in sbs:
        await backend.create(sb)
    yield [SandboxRef(sandbox_id=sb.id) for sb in sbs]
    for sb in sbs:
        await backend.destroy(SandboxRef(sandbox_id=sb.id))


@pytest.fixture
async def box(backend):
    sb = new(limits=Limits(memory_mb=48))
    await backend.create(sb)
    yield sb.id
    await backend.destroy(SandboxRef(sandbox_id=sb.id))


async def test_the_swap_stays_while_a_sandbox_is_paused_and_goes_with_the_last(
    backend, pair, dsec_swap
):
    a, b = pair
    assert _swappiness(backend, a.sandbox_id) == 0  # a running sandbox is not swapped out
    await backend.pause(a)
    assert _swappiness(backend, a.sandbox_id) == 100
    dev, tag = _recorded(backend)
    assert _carrier(tag) == dev
    s = backend.swap  # another edge's pause finds it and makes none
    with ZramSwap(64, s.freezer_root, s.memory_root, s.record).pausing() as why:
        assert why is None and _recorded(backend) == (dev, tag) and len(ZramSwap.active()) == 1
    await backend.pause(b)
    await backend.resume(a)
    assert _swappiness(backend, a.sandbox_id) == 0
    assert await asyncio.to_thread(backend.swap.remove_if_unused) is None
    await asyncio.sleep(0.5)  # the removal the resume asked for has looked too
    assert _carrier(tag) == dev, "b is paused"
    await backend.destroy(b)  # paused: the last one
    await _gone(backend, tag)

    await backend.pause(a)
    again = _recorded(backend)[1]
    assert again != tag and _carrier(again)
    await backend.resume(a)
    await _gone(backend, again)


async def test_a_pause_waits_for_a_removal_under_way_and_a_removal_for_a_pause(
    backend, pair, dsec_swap
):
    """The removal of the swap that holds a's pages once a is thawed (a swapoff moving them
    back to RAM) holds the lock a pause must share: b's pause, begun during the swapoff,
    gets a device of its own once the old one is gone, and its memory goes there. A removal
    while a pause holds the lock does nothing."""
    a, b = pair
    await _hold(backend, a.sandbox_id, 400)
    await _hold(backend, b.sandbox_id, 40)
    await backend.pause(a)
    dev, tag = _recorded(backend)
    used = _used(dev)
    assert used > 300 << 20, used
    if _paused_elsewhere(backend, pair):
        pytest.skip(SOMEONE_PAUSED)
    group = backend._group(a.sandbox_id)  # as a resume does, but the removal is this test's
    group.set("memory", "memory.swappiness", 0)
    freeze(group, False)
    removal = asyncio.ensure_future(asyncio.to_thread(backend.swap.remove_if_unused))
    while _used(dev) >= used and not removal.done():
        await asyncio.sleep(0.002)
    if removal.done():
        pytest.skip(f"the removal was over before a pause could begin during it: {removal}")
    report = await backend.pause(b)
    said = await removal  # None: the edge's own removal (its gc timer) was the one under way
    assert said is None or said.startswith(f"removed {dev}"), said
    assert _carrier(tag) is None
    assert report.swapped_bytes > 30 << 20, report  # not pushed into a device going away
    _, mine = _recorded(backend)
    assert _carrier(mine)

    holding = backend.swap.pausing()  # as a pause of another edge, between check and freeze
    assert await asyncio.to_thread(holding.__enter__) is None
    try:
        await backend.resume(b)
        assert await asyncio.to_thread(backend.swap.remove_if_unused) is None
        assert _carrier(mine)
    finally:
        holding.__exit__(None, None, None)
    said = await asyncio.to_thread(backend.swap.remove_if_unused)
    assert said is None or said.startswith("removed")  # None: the background one did it
    await _gone(backend, mine)


def _used(dev: str) -> int:
    """Bytes the active swap ``dev`` holds (0: not active)."""
    for line in Path("/proc/swaps").read_text().splitlines()[1:]:
        if line.split()[0] == dev:
            return int(line.split()[3]) << 10
    return 0


async def test_the_swap_stays_while_what_it_holds_would_not_fit(backend, pair, dsec_swap):
    """A swapoff whose pages would push a memory cgroup over its limit makes the kernel
    kill processes there and fail with ENOMEM (measured): it is not tried until they fit."""
    a, _ = pair
    await _hold(backend, a.sandbox_id, 40)
    await backend.pause(a)
    _, tag = _recorded(backend)
    edge = backend.cgroups.dirs["memory"]  # all sandboxes of the edge: RAM only
    usage = int((edge / "memory.usage_in_bytes").read_text())
    (edge / "memory.limit_in_bytes").write_text(str(usage + (16 << 20)))
    try:
        await backend.resume(a)
        for _ in range(100):  # until the removal the resume asked for is not under way
            if said := await asyncio.to_thread(backend.swap.remove_if_unused):
                break
            await asyncio.sleep(0.05)
        assert said and "over its limit" in said, said
        assert _carrier(tag)
        r = await sh(backend, a.sandbox_id, "ps -o args | grep -c '^sh -c x='")
        assert r.stdout == b"1\n", r  # nothing was killed
    finally:
        (edge / "memory.limit_in_bytes").write_text(str(backend.memory_cap))
    assert (await asyncio.to_thread(backend.swap.remove_if_unused)).startswith("removed")
    assert _carrier(tag) is None


async def test_swap_dsec_did_not_make_is_left_alone(backend, box, dsec_swap):
    index = (ZRAM / "hot_add").read_text().strip()
    dev = f"/dev/zram{index}"
    try:
        (Path(f"/sys/block/zram{index}") / "disksize").write_text("64M")
        subprocess.run(["mkswap", dev], check=True, capture_output=True)
        subprocess.run(["swapon", "-p", "5", dev], check=True, capture_output=True)
        tag = _tag(dev)
        ref = SandboxRef(sandbox_id=box)
        await backend.pause(ref)  # the node has swap now: it is used, none is made
        assert ZramSwap.active() == [dev] and _recorded(backend) is None
        await backend.resume(ref)
        assert await asyncio.to_thread(backend.swap.remove_if_unused) is None
        # a record left by an edge that died, naming what is now someone else's device
        backend.swap.record.write_text(f"{dev}\n")
        assert await asyncio.to_thread(backend.swap.remove_if_unused) is None
        assert _carrier(tag) == dev  # as it was
    finally:
        if _recorded(backend) == (dev, tag):
            backend.swap.record.unlink()
        subprocess.run(["swapoff", dev], capture_output=True)
        Path(f"/sys/block/zram{index}/reset").write_text("1")
        (ZRAM / "hot_remove").write_text(index)


async def test_a_resumed_sandbox_with_memory_in_swap_keeps_to_its_limit(backend, box, dsec_swap):
    """What a resumed sandbox still has in swap counts against its memory limit: with 30
    MiB there, 30 MiB more do not fit in its 48 MiB (they would in RAM alone)."""
    ref = SandboxRef(sandbox_id=box)
    r = await sh(backend, box, f"head -c {30 << 20} /dev/urandom > /dev/shm/held")
    assert r.exit_code == 0, r
    assert (await backend.pause(ref)).swapped_bytes > 25 << 20
    await backend.resume(ref)
    d = backend._group(box).dirs["memory"]
    assert int((d / "memory.memsw.usage_in_bytes").read_text()) > 25 << 20  # swap counts
    # refused: the writer, what starts it, or init (which cannot always spare itself) is
    # killed, or gets ENOMEM; the sandbox may be lost
    with contextlib.suppress(errors.Unavailable, errors.SandboxLost):
        await sh(backend, box, f"head -c {30 << 20} /dev/zero > /dev/shm/more")
    assert int((d / "memory.memsw.max_usage_in_bytes").read_text()) <= 48 << 20
