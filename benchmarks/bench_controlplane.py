"""Sandbox creates/s through the apiserver with 160 simulated edges (noop backend).

    python benchmarks/bench_controlplane.py [--edges 160] [--sandboxes 20000]

Processes, as in production: nats-server (JetStream), one apiserver, one process holding
the simulated edges, and this client. The baseline, measured in the same run, is the floor
the control plane cannot go below: storing one record per sandbox in JetStream KV
(pipelined puts of the same records from this process). Target: >= 5,000 creates/s on 2
cores. Also prints where the CPU went (per process) so a shortfall can be explained.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from simcluster import simulated

import dsec_kernel as dsec
from dsec_kernel import bus
from dsec_kernel.contract.wire import SandboxInfo
from dsec_kernel.state.facade import ClusterState


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def kv_baseline(url: str, n: int) -> float:
    nc = await bus.connect(url, name="bench-kv")
    state = await ClusterState.open(nc)
    now = time.time()
    infos = [
        SandboxInfo(
            id=f"sb-{i:016x}", tenant="bench", backend="noop", node="sim000", created_at=now
        )
        for i in range(n)
    ]
    t = time.perf_counter()
    for i in range(0, n, 500):
        await state.put_sandboxes(infos[i : i + 500])
    rate = n / (time.perf_counter() - t)
    await state.delete_sandboxes([i.id for i in infos])
    await nc.drain()
    return rate


async def run(
    url: str, service_url: str, token: str, n: int, batch: int, procs: dict[str, int]
) -> None:
    async with dsec.AsyncClient(url=url, token=token, timeout=120) as c:
        lat = []
        for _ in range(50):
            t = time.perf_counter()
            sb = dsec.check(await c.create(count=1, backend="noop"))
            lat.append(time.perf_counter() - t)
            await c.destroy(sb)
        before = {name: cpu_seconds(pid) for name, pid in procs.items()}
        t = time.perf_counter()
        sbs = dsec.check(await c.create(count=n, backend="noop", batch_size=batch, concurrency=4))
        create_s = time.perf_counter() - t
        after = {name: cpu_seconds(pid) for name, pid in procs.items()}
        nodes = {sb.node for sb in sbs}
        t = time.perf_counter()
        await c.destroy(sbs)
        destroy_s = time.perf_counter() - t
    rate = n / create_s
    floor = await kv_baseline(service_url, n)
    print(
        f"created {n} sandboxes on {len(nodes)} nodes in {create_s:.2f}s: {rate:,.0f} creates/s "
        f"(target 5,000: {'met' if rate >= 5000 else 'NOT met'})"
    )
    print(f"destroyed them in {destroy_s:.2f}s: {n / destroy_s:,.0f}/s")
    print(f"single-sandbox create: p50 {statistics.median(lat) * 1e3:.2f} ms")
    print(f"baseline, bare KV puts of the same records: {floor:,.0f}/s; ratio {rate / floor:.2f}")
    print("CPU per created sandbox, by process:")
    for name in procs:
        print(f"  {name:<12} {(after[name] - before[name]) / n * 1e6:7.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", type=int, default=160)
    ap.add_argument("--sandboxes", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=500)
    args = ap.parse_args()
    with simulated(args.edges) as cluster:
        nats = cluster.nats
        assert nats.proc is not None
        procs = {
            "apiserver": cluster.api.proc.pid,
            "edges": cluster.sim.pid,
            "nats-server": nats.proc.pid,
            "client": os.getpid(),
        }
        token = cluster.conn.token
        asyncio.run(
            run(nats.client_url, nats.service_url, token, args.sandboxes, args.batch, procs)
        )


if __name__ == "__main__":
    main()
