"""Getting a ready container sandbox from a warm pool, next to creating one, in the same run.

    python benchmarks/bench_pool.py [--rounds 100] [--size 16]

A platform of processes (`dsec up`'s shape: nats-server, an apiserver, one edge with the
container backend on the busybox layer). Each round, through the SDK: ``pool.acquire()``
then one command in it (time to first command), and ``pool.release(sb)`` (reset to its
clean state, back to the pool); the baseline is ``create(count=1)`` plus the same command,
then ``destroy``. The pool is refilled in the background between rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from dsec_storage_3fs.images import busybox_tree, ensure_layer
from stats import p50_p99_ms

import dsec_kernel as dsec
from dsec_kernel.cluster import LocalCluster
from dsec_kernel.loader import open_store

ENV = dsec.Env(base="busybox:1")


async def run(cluster: LocalCluster, rounds: int, size: int) -> None:
    await cluster.ready()
    async with cluster.client() as c:
        pool = await c.pool(backend="container", env=ENV, size=size)
        while sum(sb.info.in_pool for sb in await c.list()) < size:
            await asyncio.sleep(0.2)
        acquire, first, release = [], [], []
        for _ in range(rounds):
            t = time.perf_counter()
            sb = await pool.acquire()
            acquire.append(time.perf_counter() - t)
            await sb.exec("true")
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            await pool.release(sb)
            release.append(time.perf_counter() - t)
        create, created_first = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            (sb,) = await c.create(backend="container", env=ENV)
            create.append(time.perf_counter() - t)
            await sb.exec("true")
            created_first.append(time.perf_counter() - t)
            await sb.destroy()
        await pool.close()
    print(f"pool.acquire():            {p50_p99_ms(acquire)}")
    print(f"  to the first command:    {p50_p99_ms(first)}")
    print(f"pool.release() (reset):    {p50_p99_ms(release)}")
    print(f"baseline create(count=1):  {p50_p99_ms(create)}")
    print(f"  to the first command:    {p50_p99_ms(created_first)}")
    ratio = statistics.median(created_first) / statistics.median(first)
    print(f"time to first command: the pool is {ratio:.1f}x faster than a create")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--size", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-pool-") as tmp:
        root = str(Path(tmp) / "store")
        store = open_store("3fs", {"root": root, "cache_dir": str(Path(tmp) / "cache")})
        ensure_layer(store, "base", "busybox", "1", busybox_tree)
        with LocalCluster(Path(tmp) / "c", {"DSEC_STORAGE_CONFIG__ROOT": root}) as cluster:
            cluster.start_nats()
            cluster.start_apiserver()
            cluster.start_edge("n1", ["container"])
            asyncio.run(run(cluster, args.rounds, args.size))


if __name__ == "__main__":
    main()
