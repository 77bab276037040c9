"""DSec's production scale on one machine: 160 simulated edges holding 2,400 sandboxes each
(384,000 at once, DSec reports >380k concurrent), with the noop backend.

    python benchmarks/bench_scale_sim.py [--edges 160] [--per-edge 2400] [--batch 1000]

Processes as in production: nats-server (JetStream), one apiserver, one process holding the
simulated edges, and this client. Measured: creates/s all the way up (and for the last 10 %,
when the cluster is 82-91 % full: nodes have 10 % headroom, as a real cluster keeps), the
KV bucket's size, the apiserver's memory and CPU, how
long a restarted apiserver takes to load the state back and serve, and destroys/s on the way
down. Baseline in the same run: bare pipelined KV puts of the same number of records, the
floor the control plane cannot beat. Target: >= 5,000 creates/s with 380k records held.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from bench_controlplane import cpu_seconds, kv_baseline
from simcluster import SimCluster, simulated

import dsec_kernel as dsec
from dsec_kernel import bus


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def kv_bytes(url: str) -> tuple[int, int]:
    nc = await bus.connect(url, name="bench-kv-size")
    info = await nc.jetstream().stream_info("KV_dsec-sandboxes")
    await nc.drain()
    return info.state.messages, info.state.bytes


async def create_all(c: dsec.AsyncClient, total: int, batch: int) -> tuple[list[str], float, float]:
    """Create ``total`` sandboxes; returns (ids, overall rate, rate over the last 10 %)."""
    ids: list[str] = []
    t0 = time.perf_counter()
    t90 = None
    step = max(batch * 4, total // 10)
    while len(ids) < total:
        n = min(step, total - len(ids))
        made = dsec.check(await c.create(count=n, backend="noop", batch_size=batch, concurrency=4))
        ids += [sb.id for sb in made]
        if t90 is None and len(ids) >= total * 0.9:
            t90, at90 = time.perf_counter(), len(ids)
        print(f"  {len(ids):>7,} held ({len(ids) / (time.perf_counter() - t0):,.0f}/s)", flush=True)
    took = time.perf_counter() - t0
    last = (len(ids) - at90) / (time.perf_counter() - t90) if t90 and len(ids) > at90 else 0.0
    return ids, total / took, last


async def run(args: argparse.Namespace, cluster: SimCluster) -> None:
    total = args.edges * args.per_edge
    api, conn = cluster.api, cluster.conn
    async with dsec.AsyncClient(url=cluster.nats.client_url, token=conn.token, timeout=300) as c:
        cpu0 = cpu_seconds(api.proc.pid)
        print(f"creating {total:,} sandboxes on {args.edges} simulated edges ...")
        ids, rate, last = await create_all(c, total, args.batch)
        api_cpu = (cpu_seconds(api.proc.pid) - cpu0) / total * 1e6
        records, size = await kv_bytes(cluster.nats.service_url)
        verdict = "met" if min(rate, last) >= 5000 else "NOT met"
        print(f"created {len(ids):,}: {rate:,.0f} creates/s overall, {last:,.0f}/s for the "
              f"last 10 % (target 5,000: {verdict})")  # fmt: skip
        print(f"KV bucket dsec-sandboxes: {records:,} records, {size / 2**20:,.0f} MiB "
              f"({size / max(records, 1):,.0f} B each)")  # fmt: skip
        api_mb, sim_mb = rss_mb(api.proc.pid), rss_mb(cluster.sim.pid)
        print(f"apiserver: {api_mb:,.0f} MiB resident, {api_cpu:.0f} us CPU per create; "
              f"edges process {sim_mb:,.0f} MiB")  # fmt: skip
        t = time.perf_counter()
        cluster.restart_apiserver()
        await cluster.ready(600)
        back = await c.get(ids[-1])
        print(f"a restarted apiserver served again after {time.perf_counter() - t:.1f} s "
              f"with all {records:,} records loaded ({back.id} {back.info.state})")  # fmt: skip
        t = time.perf_counter()
        await c.destroy(ids)
        print(f"destroyed them in {time.perf_counter() - t:.1f} s: "
              f"{len(ids) / (time.perf_counter() - t):,.0f}/s")  # fmt: skip
    floor = await kv_baseline(cluster.nats.service_url, min(total, 100_000))
    print(f"baseline, bare KV puts: {floor:,.0f}/s; ratio {rate / floor:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", type=int, default=160)
    ap.add_argument("--per-edge", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=1000)
    args = ap.parse_args()
    with simulated(args.edges, int(args.per_edge * 1.1)) as cluster:  # nodes 91 % full at the end
        asyncio.run(run(args, cluster))


if __name__ == "__main__":
    main()
