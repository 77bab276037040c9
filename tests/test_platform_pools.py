"""Warm pools: filled in the background, acquire is the fast path, release resets and
returns, demand grows the pool, close empties it."""

from __future__ import annotations

import asyncio
import time

import pytest
from dsec_backend_container.backend import ContainerBackend

import dsec_kernel as dsec
from dsec_kernel.contract import errors

REASON = ContainerBackend.unavailable_reason()
pytestmark = pytest.mark.skipif(
    bool(REASON), reason=f"the container backend cannot run here: {REASON}"
)
BUSYBOX = dsec.Env(base="busybox:1")


@pytest.fixture
async def cluster(local_cluster, busybox_env):
    c = local_cluster(busybox_env)
    c.start_apiserver()
    c.start_edge("e", ["container"], "--heartbeat", "0.2")
    await c.ready()
    return c


async def _idle(c, pool) -> int:
    return sum(1 for sb in await c.list() if sb.info.pool == pool.name and sb.info.in_pool)


async def _until(fn, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not await fn():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_a_pool_fills_hands_out_resets_and_refills(cluster):
    async with cluster.client() as c:
        pool = await c.pool(backend="container", env=BUSYBOX, size=3)
        assert pool.info.size == 3 and pool.info.max_size == 12
        await _until(lambda: _is(c, pool, 3))
        sb = await pool.acquire()
        assert sb.info.pool == pool.name and not sb.info.in_pool
        await sb.exec("echo dirty > /tmp/x")
        await _until(lambda: _is(c, pool, 3))  # refilled behind the one taken
        assert await pool.release(sb) == []
        assert await _idle(c, pool) == 4
        again = [await pool.acquire() for _ in range(4)]
        assert sb.id in {s.id for s in again}
        back = next(s for s in again if s.id == sb.id)
        r = await back.exec("test -e /tmp/x || echo clean")
        assert r.stdout == b"clean\n"  # released sandboxes come back reset
        same = await c.pool(backend="container", env=BUSYBOX, size=3)
        assert same.name == pool.name  # the same spec finds the same pool
        await pool.release(again)
        destroyed = await pool.close()
        assert len(destroyed) >= 4 and await c.list() == []
        with pytest.raises(errors.NotFound, match="open it first"):
            await pool.acquire()


async def test_an_empty_pool_still_answers_and_grows_with_demand(cluster):
    async with cluster.client() as c:
        pool = await c.pool(backend="container", env=BUSYBOX, size=0, max_size=5)
        taken = await pool.acquire_many(4)  # nothing ready: made on the spot
        assert len(taken) == 4
        await _until(lambda: _is(c, pool, 4))  # demand raised the target from 0 to 4
        taken += await pool.acquire_many(3)
        assert len({sb.id for sb in taken}) == 7
        await c.destroy(taken)
        await pool.close()
        assert await c.list() == []


async def test_bad_pool_requests(cluster):
    async with cluster.client() as c:
        with pytest.raises(errors.UnknownBackend):
            await c.pool(backend="nope", size=1)
        with pytest.raises(errors.InvalidArgument):
            await c.pool(backend="container", env=BUSYBOX, size=5, max_size=2)
        p = await c.pool(backend="container", env=BUSYBOX, size=0, name="p")
        with pytest.raises(errors.Conflict, match="another spec"):
            await c.pool(backend="container", env=BUSYBOX, size=0, name="p", network="egress")
        (stranger,) = await c.create(backend="container", env=BUSYBOX)
        with pytest.raises(errors.InvalidArgument, match="not from pool"):
            await p.release(stranger)
        await stranger.destroy()
        await p.close()


async def _is(c, pool, n) -> bool:
    return await _idle(c, pool) == n


async def test_the_sync_client_has_jobs_and_pools(cluster):
    """``dsec.Client`` (synchronous) with a job and a pool, as a script without asyncio."""
    conn = cluster.conn

    def script() -> list[str]:
        with dsec.Client(url=conn.url, token=conn.token) as c:
            with c.job("sync-job", lease_s=5) as job:
                (sb,) = job.create(backend="container", env=BUSYBOX)
                assert [s.id for s in job.sandboxes()] == [sb.id]
                job.stop_renewing()
                job.renew()
                assert sb.exec("echo hi").stdout == b"hi\n"
            with c.pool(backend="container", env=BUSYBOX, size=0, max_size=2, name="s") as pool:
                got = pool.acquire()
                assert got.info.pool == "s"
                assert pool.release(got) == []
            return [s.id for s in c.list()]

    assert await asyncio.to_thread(script) == []  # the job and the pool took theirs along
