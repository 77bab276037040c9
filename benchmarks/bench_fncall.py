"""fncall through the SDK: latency (p50/p99) and throughput, next to subprocess.run.

    python benchmarks/bench_fncall.py [--calls 400] [--concurrency 16]

Starts its own platform (nats-server, apiserver, one edge with the fncall backend) in a
temporary directory. The baseline, measured in the same run on the same machine, is
``subprocess.run([python, "-c", "print(1)"])`` and ``subprocess.run(["bash", "-c", "true"])``
from this process: no isolation at all. Targets: p50 <= 5 ms and >= 300 calls/s on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from stats import pct

import dsec_kernel as dsec
from dsec_kernel.cluster import LocalCluster

CASES = {
    "python print(1)": ("print(1)", "python", [sys.executable, "-c", "print(1)"]),
    "bash true": ("true", "bash", ["bash", "-c", "true"]),
}


def baseline(argv: list[str], calls: int, concurrency: int) -> tuple[list[float], float]:
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(
            pool.map(lambda _: subprocess.run(argv, check=True, capture_output=True), range(calls))
        )
    return lat, calls / (time.perf_counter() - t)


async def through_sdk(
    c: dsec.AsyncClient, code: str, language: str, calls: int, concurrency: int
) -> tuple[list[float], float]:
    for _ in range(20):  # warm the path
        await c.fncall(code, language=language)
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        r = await c.fncall(code, language=language)
        lat.append(time.perf_counter() - t)
        assert r.exit_code == 0, r
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            r = await c.fncall(code, language=language)
            assert r.exit_code == 0, r

    t = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    return lat, calls / (time.perf_counter() - t)


async def run(cluster: LocalCluster, calls: int, concurrency: int) -> None:
    await cluster.ready()
    print(
        f"{'case':<18} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9}   "
        f"{'baseline p50':>12} {'calls/s':>8}   p50 ratio  rate ratio"
    )
    async with cluster.client() as c:
        for name, (code, language, argv) in CASES.items():
            lat, rate = await through_sdk(c, code, language, calls, concurrency)
            blat, brate = await asyncio.to_thread(baseline, argv, calls, concurrency)
            print(
                f"{name:<18} {pct(lat, 50) * 1e3:8.2f} {pct(lat, 99) * 1e3:8.2f} {rate:9.0f}   "
                f"{pct(blat, 50) * 1e3:12.2f} {brate:8.0f}   "
                f"{pct(lat, 50) / pct(blat, 50):9.2f}x {rate / brate:10.2f}x"
            )
            print(
                f"{'':<18} mean {statistics.mean(lat) * 1e3:.2f} ms over {calls} sequential calls; "
                f"throughput with {concurrency} in flight"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--pool-size", type=int, default=16)
    ap.add_argument("--uvloop", action="store_true", help="run this client on uvloop")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-") as tmp:
        env = {"DSEC_BACKEND_CONFIG__FNCALL__POOL_SIZE": str(args.pool_size)}
        with LocalCluster(Path(tmp), env) as cluster:
            cluster.start_nats()
            cluster.start_apiserver()
            cluster.start_edge("bench", ["fncall"])
            if args.uvloop:
                import uvloop

                uvloop.install()
            asyncio.run(run(cluster, args.calls, args.concurrency))


if __name__ == "__main__":
    main()
