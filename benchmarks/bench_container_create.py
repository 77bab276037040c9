"""Container sandboxes: create→ready and destroy through the SDK, next to the bare kernel limit,
bwrap and crun on the same root filesystem.

    python benchmarks/bench_container_create.py [--sequential 100] [--burst 500]

DSec side: a platform of processes (nats-server, apiserver, one edge with the container
backend) and the SDK; ``create`` returns when the sandbox is ready (its init is PID 1 of new
namespaces on an overlay of the busybox EROFS layer, with cgroups), so create→ready is the
call's latency. Sequential: one sandbox per call. Burst: ``create(count=500)``.

Baselines, measured in the same run on the same root filesystem (the busybox layer, mounted
from the store), each starting a throw-away ``busybox true``:

* bare kernel limit — written here: fork, unshare(mnt, pid, uts, ipc, net), fork PID 1,
  overlay mount (that layer + an empty upper), pivot_root, exec. No cgroups, no records;
* bwrap — ``bwrap --unshare-all --ro-bind ROOTFS / --proc --dev --tmpfs /tmp``;
* crun — an OCI bundle on ROOTFS, ``crun run`` (in a mount namespace without the cgroup2
  mount, which crun cannot use on this machine's hybrid cgroup layout).

Targets: burst ≥ 50 % of the bare limit's rate, at least twice crun's, create p50 ≤ 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dsec_storage_3fs.images import busybox_tree, ensure_layer
from stats import pct

import dsec_kernel as dsec
from dsec_kernel.cluster import LocalCluster
from dsec_kernel.linuxhost import syscalls
from dsec_kernel.loader import open_store

BUSYBOX = dsec.Env(base="busybox:1")
TRUE = ["/bin/busybox", "true"]


# -- DSec through the SDK ---------------------------------------------------------------------


async def dsec_side(cluster: LocalCluster, sequential: int, burst: int) -> dict[str, float]:
    await cluster.ready()
    async with cluster.client(timeout=300) as c:
        for _ in range(5):  # warm the path
            await c.destroy(dsec.check(await c.create(count=1, backend="container", env=BUSYBOX)))
        create, destroy = [], []
        for _ in range(sequential):
            t = time.perf_counter()
            sbs = dsec.check(await c.create(count=1, backend="container", env=BUSYBOX))
            create.append(time.perf_counter() - t)
            t = time.perf_counter()
            await c.destroy(sbs)
            destroy.append(time.perf_counter() - t)
        t = time.perf_counter()
        sbs = dsec.check(
            await c.create(count=burst, backend="container", env=BUSYBOX, batch_size=burst)
        )
        burst_s = time.perf_counter() - t
        t = time.perf_counter()
        await c.destroy(sbs)
        destroy_s = time.perf_counter() - t
    return {
        "p50": pct(create, 50), "p99": pct(create, 99), "rate": burst / burst_s,
        "destroy_p50": pct(destroy, 50), "destroy_rate": burst / destroy_s,
    }  # fmt: skip


# -- the bare kernel limit --------------------------------------------------------------------


def bare_start(rootfs: str, scratch: str) -> None:
    """One sandbox the minimal way; returns when its `busybox true` has exited."""
    pid = os.fork()
    if pid == 0:
        try:
            syscalls.unshare(syscalls.CLONE_NEWNS | syscalls.CLONE_NEWPID | syscalls.CLONE_NEWUTS
                          | syscalls.CLONE_NEWIPC | syscalls.CLONE_NEWNET)  # fmt: skip
            init = os.fork()
            if init == 0:
                syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)
                os.makedirs(f"{scratch}/u")
                os.makedirs(f"{scratch}/w")
                os.makedirs(f"{scratch}/r")
                opts = f"lowerdir={rootfs},upperdir={scratch}/u,workdir={scratch}/w"
                syscalls.mount("overlay", f"{scratch}/r", "overlay", 0, opts)
                os.chdir(f"{scratch}/r")
                syscalls.pivot_root(".", ".")
                syscalls.umount(".", syscalls.MNT_DETACH)
                os.execv(TRUE[0], TRUE)
            _, status = os.waitpid(init, 0)
            os._exit(os.waitstatus_to_exitcode(status))
        except BaseException:
            os._exit(99)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status


def bare_worker(rootfs: str, scratch: str, n: int, out: str) -> None:
    lat = []
    for i in range(n):
        t = time.perf_counter()
        bare_start(rootfs, f"{scratch}/{i}")
        lat.append(time.perf_counter() - t)
    Path(out).write_text(json.dumps(lat))


# -- runners ----------------------------------------------------------------------------------


def timed_runs(argv_for: callable, n: int, parallel: int) -> tuple[list[float], float]:
    """Latencies of n sequential runs, and the rate of n more run ``parallel`` at a time."""
    lat = []
    for i in range(n):
        t = time.perf_counter()
        subprocess.run(argv_for(i), check=True, capture_output=True)
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda i: subprocess.run(argv_for(n + i), check=True, capture_output=True),
                      range(n)))  # fmt: skip
    return lat, n / (time.perf_counter() - t)


def bare_side(rootfs: str, scratch: Path, n: int, parallel: int) -> tuple[list[float], float]:
    me = [sys.executable, __file__, "--bare-worker", rootfs]
    lat_file = scratch / "seq.json"
    subprocess.run([*me, str(scratch / "seq"), str(n), str(lat_file)], check=True)
    t = time.perf_counter()
    procs = [subprocess.Popen([*me, str(scratch / f"par{k}"), str(n // parallel), "/dev/null"])
             for k in range(parallel)]  # fmt: skip
    for p in procs:
        assert p.wait() == 0
    return json.loads(lat_file.read_text()), (n // parallel * parallel) / (time.perf_counter() - t)


def crun_side(rootfs: str, scratch: Path, n: int, parallel: int) -> tuple[list[float], float]:
    bundle = scratch / "bundle"
    bundle.mkdir()
    subprocess.run(["crun", "spec"], cwd=bundle, check=True)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["root"] = {"path": rootfs, "readonly": True}
    cfg["process"].update(args=TRUE, terminal=False)
    (bundle / "config.json").write_text(json.dumps(cfg))

    def run(count: int, key: str) -> list[float]:
        out = scratch / f"{key}.json"
        worker = f"{sys.executable} {__file__} --crun-worker {bundle} {count} {key} {out}"
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c", f"umount /sys/fs/cgroup/unified; exec {worker}"],
            capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"crun failed: {proc.stderr[-500:]}")
        return json.loads(out.read_text())

    lat = run(n, "seq")
    t = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda k: run(n // parallel, f"par{k}"), range(parallel)))
    return lat, (n // parallel * parallel) / (time.perf_counter() - t)


def crun_worker(bundle: str, n: int, key: str, out: str) -> None:
    lat = []
    for i in range(n):
        t = time.perf_counter()
        subprocess.run(["crun", "run", "-b", bundle, f"{key}-{i}"], check=True, capture_output=True)
        lat.append(time.perf_counter() - t)
    Path(out).write_text(json.dumps(lat))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--bare-worker":
        bare_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--crun-worker":
        crun_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequential", type=int, default=100)
    ap.add_argument("--burst", type=int, default=500)
    ap.add_argument("--baseline-runs", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    from dsec_backend_container.backend import ContainerBackend

    if reason := ContainerBackend.unavailable_reason():
        sys.exit(f"the container backend cannot run here: {reason}")
    with tempfile.TemporaryDirectory(prefix="dsec-bench-") as tmp:
        root = Path(tmp)
        store_cfg = {"root": str(root / "store"), "cache_dir": str(root / "cache")}
        store = open_store("3fs", store_cfg)
        layer = ensure_layer(store, "base", "busybox", "1", busybox_tree)
        env = {"DSEC_STORAGE_CONFIG__ROOT": store_cfg["root"]}
        with LocalCluster(root / "cluster", env) as cluster:
            cluster.start_nats()
            cluster.start_apiserver()
            cluster.start_edge("bench", ["container"])
            ours = asyncio.run(dsec_side(cluster, args.sequential, args.burst))
        rootfs = str(store.mount(layer.digest, "bench/baselines"))
        try:
            scratch = root / "scratch"
            scratch.mkdir()
            syscalls.mount("tmpfs", str(scratch), "tmpfs", 0, "size=512m")
            try:
                bare = bare_side(rootfs, scratch, args.baseline_runs, args.parallel)
            finally:
                syscalls.umount(str(scratch), syscalls.MNT_DETACH)
            bw = ["bwrap", "--unshare-all", "--ro-bind", rootfs, "/", "--proc", "/proc",
                  "--dev", "/dev", "--tmpfs", "/tmp", *TRUE]  # fmt: skip
            bwrap = (
                timed_runs(lambda i: bw, args.baseline_runs, args.parallel)
                if shutil.which("bwrap")
                else None
            )
            (root / "crun").mkdir()
            crun = (
                crun_side(rootfs, root / "crun", args.baseline_runs, args.parallel)
                if shutil.which("crun")
                else None
            )
        finally:
            store.release(layer.digest, "bench/baselines")
    rows = [("dsec (SDK, create→ready)", ours["p50"], ours["p99"], ours["rate"])]
    for name, res in (("bare kernel limit", bare), ("bwrap", bwrap), ("crun", crun)):
        if res:
            rows.append((name, pct(res[0], 50), pct(res[0], 99), res[1]))
    print(f"{'':<26} {'p50 ms':>8} {'p99 ms':>8} {'per s':>8}")
    for name, p50, p99, rate in rows:
        print(f"{name:<26} {p50 * 1e3:8.2f} {p99 * 1e3:8.2f} {rate:8.0f}")
    print(
        f"dsec destroy: p50 {ours['destroy_p50'] * 1e3:.2f} ms, burst {ours['destroy_rate']:.0f}/s"
    )
    bare_rate = rows[1][3]
    print(f"burst rate vs bare limit: {ours['rate'] / bare_rate:.2f} (target >= 0.5)")
    if crun:
        print(f"burst rate vs crun: {ours['rate'] / crun[1]:.2f}x (target >= 2)")
    print(f"create p50: {ours['p50'] * 1e3:.2f} ms (target <= 10 ms)")


if __name__ == "__main__":
    main()
