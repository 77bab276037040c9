"""The one deadline along a request's path: what a call made while handling a request may
wait (dsec_kernel.deadline)."""

import asyncio

from dsec_kernel import deadline


def test_outside_a_request_a_call_waits_what_it_wants():
    assert deadline.time_left() is None
    assert deadline.inner(30.0) == 30.0 and deadline.inner(None) is None


async def test_inside_a_request_every_wait_is_cut_to_less_than_the_callers():
    async def handling(waits: float) -> tuple:
        deadline.start(waits)
        inner_task = asyncio.create_task(asyncio.sleep(0, result=deadline.inner(None)))
        return deadline.inner(30.0), deadline.inner(2.0), deadline.inner(None), await inner_task

    cut, short, unbounded, in_task = await asyncio.create_task(handling(10.0))
    assert 8.9 < cut <= 9.0 and short == 2.0 and 8.9 < unbounded <= 9.0
    assert 8.9 < in_task <= 9.0  # a task the handler starts keeps the deadline
    almost_gone = await asyncio.create_task(handling(0.5))
    assert almost_gone == (0.1, 0.1, 0.1, 0.1)  # fails fast rather than not at all
    assert deadline.time_left() is None  # (each request's deadline stays in its own task)
