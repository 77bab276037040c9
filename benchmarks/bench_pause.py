"""Pause and resume of idle container sandboxes that hold dirty memory, next to a bare freeze.

    python benchmarks/bench_pause.py [--sandboxes 200] [--mb 50]

Each sandbox holds ``--mb`` MB of dirty memory: a tmpfs file in its own /dev/shm (shared
memory, charged to the sandbox and swappable like a heap), filled with its busybox binary
over and over — program-like bytes that compress about 2:1, not zeros. Then every sandbox is

* paused: its processes frozen (cgroup freezer) and its memory pushed out of RAM into the
  compressed swap the backend makes on the first pause (zram, lz4), and
* resumed: thawed, then its 50 MB read back (the pages come back from zram on demand).

Printed: pause and resume p50/p99, RAM held before and after, what went to swap and what
zram really spent on it, and the baseline measured in the same run: freezing the same
sandboxes without reclaiming anything (the cheapest possible "pause", which frees nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import leftovers
from dsec_backend_container.backend import ContainerBackend
from dsec_backend_container.reclaim import ZramSwap, freeze
from dsec_storage_3fs.images import busybox_tree, ensure_layer
from stats import p50_p99_ms

from dsec_kernel.contract.backend import ExecCall, SandboxRef
from dsec_kernel.contract.conformance import started
from dsec_kernel.contract.wire import EdgeSandbox, Env, SandboxSpec
from dsec_kernel.loader import open_store


async def sh(b: ContainerBackend, sid: str, script: str) -> bytes:
    argv = ["/bin/sh", "-c", script]
    call = ExecCall(sandbox_id=sid, argv=argv, timeout_s=120, max_output_bytes=1 << 16)
    r = await b.exec(call)
    if r.exit_code != 0:
        raise SystemExit(f"{script!r} failed in {sid}: {r}")
    return r.stdout


def zram_used() -> tuple[int, int]:
    """(bytes stored, bytes of RAM zram uses for them) over the zram swap devices."""
    stored = used = 0
    for dev in ZramSwap.active():
        if "zram" in dev:
            mm = Path(f"/sys/block/{Path(dev).name}/mm_stat").read_text().split()
            stored, used = stored + int(mm[0]), used + int(mm[2])
    return stored, used


async def run(n: int, mb: int, tmp: Path) -> None:
    store = {"root": str(tmp / "store"), "cache_dir": str(tmp / "cache")}
    ensure_layer(open_store("3fs", store), "base", "busybox", "1", busybox_tree)
    os.environ["DSEC_STORAGE_CONFIG__ROOT"] = store["root"]
    backend = ContainerBackend(ContainerBackend.Config(memory_mb=max(256, mb * 3)))
    inits: list[tuple[int, int]] = []
    async with started(backend, tmp / "edge") as b:
        ids = [f"sb-{i:016x}" for i in range(n)]
        fill = (
            f"while cat /bin/busybox; do :; done | head -c {mb << 20} > /dev/shm/heap; "
            "wc -c < /dev/shm/heap"
        )
        t = time.perf_counter()
        try:
            for sid in ids:
                spec = SandboxSpec(backend="container", env=Env(base="busybox:1"))
                sb = EdgeSandbox(id=sid, tenant="bench", spec=spec, created_at=time.time())
                await b.create(sb)
                inits.append((b.metas[sid].init_pid, b.metas[sid].init_start))
                assert int(await sh(b, sid, fill)) == mb << 20
            print(f"{n} sandboxes holding {mb} MB each, made in {time.perf_counter() - t:.1f} s")
            freezes, thaws = [], []
            for sid in ids:  # the baseline: freeze only
                group = b._group(sid)
                t = time.perf_counter()
                await asyncio.to_thread(freeze, group, True)
                freezes.append(time.perf_counter() - t)
                t = time.perf_counter()
                await asyncio.to_thread(freeze, group, False)
                thaws.append(time.perf_counter() - t)
            pauses, reports = [], []
            for sid in ids:
                t = time.perf_counter()
                reports.append(await b.pause(SandboxRef(sandbox_id=sid)))
                pauses.append(time.perf_counter() - t)
            stored, spent = zram_used()
            resumes, reads = [], []
            for sid in ids:
                t = time.perf_counter()
                await b.resume(SandboxRef(sandbox_id=sid))
                resumes.append(time.perf_counter() - t)
                t = time.perf_counter()
                await sh(b, sid, "cat /dev/shm/heap > /dev/null")
                reads.append(time.perf_counter() - t)
            warm = []
            for sid in ids[: min(n, 20)]:
                t = time.perf_counter()
                await sh(b, sid, "cat /dev/shm/heap > /dev/null")
                warm.append(time.perf_counter() - t)
        finally:
            for sid in ids:
                await b.destroy(SandboxRef(sandbox_id=sid))
        before = sum(r.memory_before_bytes for r in reports)
        after = sum(r.memory_after_bytes for r in reports)
        swapped = sum(r.swapped_bytes for r in reports)
        print(f"pause  (freeze + reclaim): {p50_p99_ms(pauses)}")
        print(f"resume (thaw):             {p50_p99_ms(resumes)}")
        print(f"  then reading the {mb} MB back from zram: {p50_p99_ms(reads)}")
        print(f"                      and from RAM:       {p50_p99_ms(warm)}")
        print(f"baseline, freeze only:     {p50_p99_ms(freezes)}; thaw {p50_p99_ms(thaws)}")
        ratio = statistics.median(pauses) / statistics.median(freezes)
        print(f"  pause / freeze-only p50: {ratio:.1f}x (the price of giving the memory back)")
        print(
            f"memory charged: {before / 2**30:.2f} GiB before the pauses, {after / 2**30:.3f} GiB "
            f"in RAM after ({100 * (1 - after / before):.1f} % reclaimed); freeze-only frees 0"
        )
        if stored:
            print(
                f"swapped {swapped / 2**30:.2f} GiB; zram keeps it in {spent / 2**30:.2f} GiB of "
                f"RAM (compression {stored / max(spent, 1):.1f}:1): net RAM given back "
                f"{(before - after - spent) / 2**30:.2f} GiB"
            )
        else:
            print("no zram swap: only page cache could be reclaimed")
    left = leftovers(tmp, [backend.cgroups.dirs["memory"]], inits)
    if left:
        print("LEFT BEHIND:", "; ".join(left))
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=200)
    ap.add_argument("--mb", type=int, default=50)
    args = ap.parse_args()
    if reason := ContainerBackend.unavailable_reason():
        raise SystemExit(f"the container backend cannot run here: {reason}")
    with tempfile.TemporaryDirectory(prefix="dsec-bench-pause-") as tmp:
        asyncio.run(run(args.sandboxes, args.mb, Path(tmp)))


if __name__ == "__main__":
    main()
