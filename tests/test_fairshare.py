"""The slot policy alone: a tenant's cap, the fewest-running tenant first, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from dsec_kernel.contract import errors
from dsec_kernel.fairshare import TenantSlots


async def _start(slots: TenantSlots, tenant: str, granted: list[str]) -> asyncio.Task[None]:
    async def one() -> None:
        await slots.acquire(tenant)
        granted.append(tenant)

    task = asyncio.ensure_future(one())
    await asyncio.sleep(0)
    return task


async def test_a_tenant_never_holds_more_than_its_share():
    slots = TenantSlots(total=4, per_tenant=3)
    granted: list[str] = []
    for _ in range(10):
        await _start(slots, "a", granted)
    assert granted == ["a"] * 3
    await _start(slots, "b", granted)
    assert granted[-1] == "b" and slots.used == 4


async def test_a_freed_slot_goes_to_the_tenant_running_fewest():
    slots = TenantSlots(total=2, per_tenant=2)
    granted: list[str] = []
    for _ in range(2):
        await _start(slots, "a", granted)
    for _ in range(50):  # a long backlog, queued first
        await _start(slots, "a", granted)
    await _start(slots, "b", granted)
    slots.release("a")
    await asyncio.sleep(0)
    assert granted[-1] == "b", granted[-3:]
    slots.release("a")
    await asyncio.sleep(0)
    assert granted[-1] == "a" and slots.running == {"a": 1, "b": 1}


async def test_cancelled_waiters_leave_the_queue():
    slots = TenantSlots(total=1, per_tenant=1)
    granted: list[str] = []
    await _start(slots, "a", granted)
    waiting = [await _start(slots, "b", granted) for _ in range(3)]
    waiting[0].cancel()
    waiting[1].cancel()
    await asyncio.sleep(0)
    slots.release("a")
    await asyncio.sleep(0)
    assert granted == ["a", "b"] and slots.running == {"b": 1}
    slots.release("b")
    assert slots.used == 0 and not slots.waiting
    async with slots.hold("c"):
        assert slots.running == {"c": 1}
    assert slots.used == 0


async def test_bad_shares_are_refused():
    with pytest.raises(ValueError):
        TenantSlots(total=4, per_tenant=5)


async def test_a_tenants_queue_is_bounded_and_waits_end_at_the_callers_deadline():
    slots = TenantSlots(total=1, per_tenant=1, waiting=2)
    granted: list[str] = []
    await _start(slots, "a", granted)
    waiters = [await _start(slots, "a", granted) for _ in range(2)]
    with pytest.raises(errors.QueueFull, match="2 of this tenant's calls are waiting"):
        await slots.acquire("a")
    await _start(slots, "b", granted)  # another tenant's queue is its own
    with pytest.raises(errors.DeadlineExceeded):
        await slots.acquire("b", timeout=0.01)
    assert len(slots.waiting["b"]) == 2  # (the one that gave up is dropped at the head)
    for w in waiters:
        w.cancel()
    slots.release("a")
    await asyncio.sleep(0)
    assert granted == ["a", "b"] and slots.running == {"b": 1}
