"""Lanes: long work a tenant asks for, one at a time per tenant, a bounded backlog each."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from dsec_backend_container.lanes import Lanes

from dsec_kernel.contract import errors


async def test_one_call_per_tenant_at_a_time_and_others_go_on():
    lanes = Lanes(2, waiting=8)
    running: dict[str, int] = {"a": 0, "b": 0}
    most = {"a": 0, "b": 0}
    lock = threading.Lock()

    def work(tenant: str) -> None:
        with lock:
            running[tenant] += 1
            most[tenant] = max(most[tenant], running[tenant])
        time.sleep(0.05)
        with lock:
            running[tenant] -= 1

    try:
        calls = [lanes.run("a", work, "a") for _ in range(4)]
        t = time.monotonic()
        await lanes.run("b", work, "b")  # a's backlog does not hold b up
        assert time.monotonic() - t < 0.15
        await asyncio.gather(*calls)
        assert most == {"a": 1, "b": 1}
    finally:
        lanes.close()


async def test_a_tenants_backlog_is_bounded_and_its_turn_ends_with_the_work():
    lanes = Lanes(1, waiting=2)
    release = threading.Event()
    try:
        first = asyncio.ensure_future(lanes.run("a", release.wait))
        waiting = [asyncio.ensure_future(lanes.run("a", lambda: None)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(errors.QueueFull, match="wait on this node"):
            await lanes.run("a", lambda: None)
        first.cancel()  # the caller gives up: the work (and the tenant's turn) goes on
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in waiting)
        release.set()
        await asyncio.gather(*waiting)
    finally:
        lanes.close()
