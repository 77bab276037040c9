"""A burst of 2,000 concurrent create requests against room for 500, with and without the
admission queue.

    python benchmarks/bench_burst.py [--requests 2000] [--capacity 500] [--hold 0.5]

Processes as in production: nats-server, one apiserver, and simulated edges (the noop
backend, ``--capacity`` sandboxes in all). Each request is a trainer's episode: create one
sandbox, hold it ``--hold`` seconds, destroy it. All are sent at once.

* DSec: requests that do not fit wait in the admission queue (``wait`` 120 s) and are
  admitted in order as episodes end and give their room back.
* Baseline, same run, same cluster: the same burst with ``wait=0`` — what a pool without
  admission control does (a request that does not fit now fails; OpenSandbox saw 51 %
  success at 20 concurrent creates).

Printed: how many were answered (target: all), created, refused and by which error, p50/p99
time to a ready sandbox, queue positions, and requests left hanging (target: none).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections import Counter

from simcluster import simulated
from stats import pct

import dsec_kernel as dsec
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import CreateRequest, CreateResponse, SandboxSpec

EDGES = 10


async def episode(
    c: dsec.AsyncClient, wait: float, hold: float, out: list[tuple[str, float, int]]
) -> None:
    t = time.perf_counter()
    req = CreateRequest(
        spec=SandboxSpec(backend="noop"), count=1, wait_s=wait, request_id=uuid.uuid4().hex
    )
    try:
        resp = await asyncio.wait_for(c._call("create", req, CreateResponse, wait + 60), wait + 90)
    except TimeoutError:
        out.append(("hung", time.perf_counter() - t, 0))
        return
    except errors.DsecError as exc:
        out.append((exc.code, time.perf_counter() - t, 0))
        return
    out.append(("created", time.perf_counter() - t, resp.queue_position))
    await asyncio.sleep(hold)
    await c.destroy([info.id for info in resp.sandboxes])


async def burst(c: dsec.AsyncClient, n: int, wait: float, hold: float) -> dict[str, object]:
    out: list[tuple[str, float, int]] = []
    t = time.perf_counter()
    await asyncio.gather(*(episode(c, wait, hold, out) for _ in range(n)))
    took = time.perf_counter() - t
    ready = [s for code, s, _ in out if code == "created"]
    return {
        "answered": sum(code != "hung" for code, _, _ in out),
        "outcomes": Counter(code for code, _, _ in out),
        "ready": ready,
        "queued": sum(pos > 0 for code, _, pos in out if code == "created"),
        "max_position": max((pos for _, _, pos in out), default=0),
        "took": took,
    }


def report(name: str, n: int, r: dict) -> None:
    ready = r["ready"]
    print(f"{name}: {n} requests in {r['took']:.1f} s")
    print(f"  answered {r['answered']}/{n} ({100 * r['answered'] / n:.1f} %), "
          f"outcomes {dict(r['outcomes'])}")  # fmt: skip
    print(f"  created {len(ready)} ({100 * len(ready) / n:.1f} %); "
          f"time to ready p50 {statistics.median(ready):.3f} s, p99 {pct(ready, 99):.3f} s"
          if ready else "  created none")  # fmt: skip
    print(f"  waited in the queue: {r['queued']} (deepest position {r['max_position']})")
    print(f"  hung: {r['outcomes'].get('hung', 0)}")


async def run(url: str, token: str, n: int, capacity: int, hold: float) -> None:
    async with dsec.AsyncClient(url=url, token=token, timeout=120) as c:
        nodes = await c.nodes()
        room = sum(b.capabilities.max_sandboxes for x in nodes for b in x.backends)
        print(f"{len(nodes)} nodes, room for {room} sandboxes; {n} concurrent requests")
        dsec_side = await burst(c, n, wait=120.0, hold=hold)
        report("DSec (admission queue)", n, dsec_side)
        await asyncio.sleep(1.5)  # heartbeats catch up: the cluster is empty again
        base = await burst(c, n, wait=0.0, hold=hold)
        report("baseline (no queue: fail when full)", n, base)
        ok, b_ok = len(dsec_side["ready"]), len(base["ready"])
        print(f"success: DSec {100 * ok / n:.1f} % vs baseline {100 * b_ok / n:.1f} % "
              f"({ok / max(b_ok, 1):.1f}x)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--capacity", type=int, default=500)
    ap.add_argument("--hold", type=float, default=0.5)
    args = ap.parse_args()
    with simulated(EDGES, args.capacity // EDGES) as cluster:
        url, token = cluster.nats.client_url, cluster.conn.token
        asyncio.run(run(url, token, args.requests, args.capacity, args.hold))


if __name__ == "__main__":
    main()
