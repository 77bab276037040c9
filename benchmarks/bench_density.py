"""Idle container sandboxes one node holds, and the host memory each one costs.

    python benchmarks/bench_density.py [--count 3200] [--baseline-count 500] [--concurrency 4]

Runs the container backend in this process, without NATS
(``dsec_kernel.contract.conformance.started``),
on a temporary layer store holding ``busybox:1`` and a temporary state directory (both under
$TMPDIR, or --tmp-dir: a local disk, not tmpfs). It fills the node with --count idle sandboxes
(env busybox:1, default limits: each has its init, its namespaces, an overlay root on the shared
EROFS layer, its cgroups) and measures, before and after the fill (each time the median of 5
readings 0.5 s apart, after a 2 s pause):

* host memory in use, /proc/meminfo MemTotal - MemAvailable: its delta / count is the figure;
* the deltas of Slab, SUnreclaim, PageTables, KernelStack, Percpu (kernel objects), the slab
  caches that grew most, the sum of the inits' PSS (/proc/PID/smaps_rollup) and this process's
  RSS (the backend's records); and a cross-check, SUnreclaim + PageTables + KernelStack +
  Percpu + PSS, which page cache swings do not move;
* the create rate while filling (--concurrency creates in flight); at the end, that a random
  sample of 20 sandboxes still answers ``echo ok``; after destroying them all, what is still
  held a few seconds later.

Baseline, measured in the same run the same way: --baseline-count sandboxes of a home-made
"Docker pool" kind, ``unshare --fork --pid --mount --uts --ipc --net --kill-child sleep
infinity`` (util-linux): a process in its own namespaces, with no overlay root, no cgroups, no
seccomp. ``unshare --fork`` stays as the parent of the sleep (much as a container shim does);
both processes are counted. Fewer of them by default: the figure is per sandbox.

Target: 3,200 idle sandboxes on this 24 GiB machine (DSec's per-node figure) at <= 1 MiB of
host memory each. Needs root. Everything is destroyed at the end, on errors and Ctrl-C too:
sandboxes, baseline processes, cgroups, mounts, the temporary directory.

The figures are machine-wide, so other work on the machine moves them (the PSS sum excepted).
The kernel frees the memory cgroups of destroyed sandboxes lazily, for minutes after a large
run: before each measurement the script waits (--settle-timeout) until their number stops
falling. It also prints what an empty memory cgroup costs on this node at the moment: on Linux
6.7+ that is mostly the cgroup's shrinker maps, sized by the most filesystems (superblocks)
mounted at once since boot, so a node that has held many sandboxes pays more per sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import leftovers
from dsec_backend_container.backend import ContainerBackend, ContainerConfig
from dsec_storage_3fs.images import busybox_tree, ensure_layer
from dsec_storage_3fs.mounts import unmount_under

from dsec_kernel.contract.backend import ExecCall, SandboxRef
from dsec_kernel.contract.conformance import started
from dsec_kernel.contract.errors import DsecError
from dsec_kernel.contract.wire import SANDBOX_ID_PATTERN, EdgeSandbox, Env, SandboxSpec
from dsec_kernel.linuxhost.cgroups import v1_controllers
from dsec_kernel.loader import open_store

TARGET_COUNT = 3200
TARGET_MIB = 1.0
MEMINFO_KEYS = ("Slab", "SUnreclaim", "PageTables", "KernelStack", "Percpu", "Shmem")
UNRECLAIMABLE = ("SUnreclaim", "PageTables", "KernelStack", "Percpu")
BASELINE_ARGV = ["unshare", "--fork", "--pid", "--mount", "--uts", "--ipc", "--net",
                 "--kill-child", "sleep", "infinity"]  # fmt: skip
PROGRESS_EVERY = 500
SAMPLE = 20


# -- measuring ---------------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB, plus ``Used`` = MemTotal - MemAvailable."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        info[name] = int(value.split()[0])
    info["Used"] = info["MemTotal"] - info["MemAvailable"]
    return info


def slabinfo() -> dict[str, int]:
    """Bytes of each slab cache (active objects x object size), from /proc/slabinfo."""
    caches = {}
    with open("/proc/slabinfo") as f:
        for line in f.readlines()[2:]:
            fields = line.split()
            caches[fields[0]] = int(fields[1]) * int(fields[3])
    return caches


def memory_cgroups() -> int:
    """Memory cgroups in the kernel, removed ones still being freed included."""
    for line in Path("/proc/cgroups").read_text().splitlines():
        fields = line.split()
        if fields[0] == "memory":
            return int(fields[2])
    return 0


def empty_memcg_kib(parent: Path, prefix: str, n: int = 20, rounds: int = 3) -> float:
    """Slab KiB one new, empty memory cgroup takes here (median of ``rounds`` of ``n``, made
    and removed under ``parent``)."""
    dirs = [parent / f"{prefix}-{i}" for i in range(n)]
    costs = []
    for _ in range(rounds):
        before = sum(slabinfo().values())
        try:
            for d in dirs:
                d.mkdir()
            costs.append((sum(slabinfo().values()) - before) / 1024 / n)
        finally:
            for d in dirs:
                with contextlib.suppress(OSError):
                    d.rmdir()
    return statistics.median(costs)


def quiesce(timeout: float, window: float = 10.0) -> None:
    """Wait until the kernel has finished freeing memory cgroups of sandboxes destroyed
    earlier (it does so lazily, for minutes after a large run; other runs' too): memory coming
    back during a measurement would be subtracted from the sandboxes' cost. Done when their
    number has not dropped for ``window`` seconds."""
    t0 = time.monotonic()
    start = low = memory_cgroups()
    since = t0
    said = False
    while time.monotonic() - since < window:
        if time.monotonic() - t0 > timeout:
            print(f"  (memory cgroups still being freed after {timeout:.0f} s; measuring anyway)")
            return
        time.sleep(1)
        now = memory_cgroups()
        if now < low:
            low, since = now, time.monotonic()
            if not said:
                print("  waiting while the kernel frees removed memory cgroups ...", flush=True)
                said = True
    if said:
        print(f"  ... {start - low} freed in {time.monotonic() - t0:.0f} s")


class Reading:
    """The machine's memory, settled: medians of a few /proc/meminfo readings, slab caches."""

    def __init__(self, readings: int = 5, pause: float = 0.5) -> None:
        time.sleep(2.0)  # for deferred frees (RCU, exiting processes) to land
        samples = []
        for i in range(readings):
            if i:
                time.sleep(pause)
            samples.append(meminfo())
        self.kib = {k: statistics.median(s[k] for s in samples) for k in ("Used", *MEMINFO_KEYS)}
        self.slabs = slabinfo()
        self.memcgs = memory_cgroups()

    def __getitem__(self, key: str) -> float:
        return self.kib[key]


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def own_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def kernel_limits() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    lines = [
        f"  ulimit -n {soft} (hard {hard}); ulimit -u {'unlimited' if nproc < 0 else nproc}",
        f"  kernel.pid_max {_read('/proc/sys/kernel/pid_max')}, "
        f"kernel.threads-max {_read('/proc/sys/kernel/threads-max')}, "
        f"processes now {sum(1 for p in os.listdir('/proc') if p.isdigit())}",
    ]
    ns = [
        f"{p.name.removeprefix('max_').removesuffix('_namespaces')} {_read(p)}"
        for p in sorted(Path("/proc/sys/user").glob("max_*_namespaces"))
    ]
    lines.append("  /proc/sys/user/max_*_namespaces: " + ", ".join(ns))
    lines.append("  (cgroup v1: at most 65,535 memory cgroups per machine)")
    return "\n".join(lines)


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        return f"? ({e.strerror})"


def mib(kib: float) -> float:
    return kib / 1024


def report(before: Reading, after: Reading, pss: list[int], n: int) -> float:
    """Print the memory one sandbox costs; returns MiB per sandbox (MemTotal - MemAvailable)."""
    used = mib(after["Used"] - before["Used"])
    print(f"  host memory used {used:+.1f} MiB: {used / n:.3f} MiB per sandbox")
    parts = [f"{k} {(after[k] - before[k]) / n:+.1f}" for k in MEMINFO_KEYS]
    print("  KiB per sandbox: " + ", ".join(parts))
    kib = sum(after[k] - before[k] for k in UNRECLAIMABLE) + sum(pss)
    print(
        f"  cross-check, {' + '.join(UNRECLAIMABLE)} + PSS: {mib(kib) / n:.3f} MiB per sandbox "
        "(unmoved by page cache swings)"
    )
    if abs(mib(kib) - used) > 0.3 * max(abs(used), mib(kib)) and abs(mib(kib) - used) / n > 0.05:
        print(
            "  note: these two disagree; other work on the machine moved MemAvailable "
            "during the measurement (use a quiet machine, or a larger count)"
        )
    growth = ((after.slabs.get(c, 0) - b, c) for c, b in before.slabs.items())
    grown = sorted(growth, reverse=True)[:4]
    print(
        "  largest slab growth, KiB per sandbox: "
        + ", ".join(f"{c} {d / 1024 / n:.1f}" for d, c in grown)
        + f"; memory cgroups {after.memcgs - before.memcgs:+d}"
    )
    return used / n


# -- the baseline: unshare + sleep -------------------------------------------------------------


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def comm(pid: int) -> str:
    return _read(f"/proc/{pid}/comm")


def spawn_baseline(n: int, log: Path, procs: list[subprocess.Popen]) -> list[int]:
    """Start ``n`` unshare'd sleeps (appended to ``procs`` as they start, for cleanup) and
    wait until every sleep runs; returns the pids of all their processes."""
    with log.open("ab") as err:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    BASELINE_ARGV,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,  # a process group of its own: one kill gets both
                )
            )
    deadline = time.monotonic() + 60
    pids = []
    for p in procs:
        while True:
            kids = children(p.pid)
            if kids and comm(kids[0]) == "sleep":
                pids += [p.pid, kids[0]]
                break
            if p.poll() is not None:
                raise RuntimeError(
                    f"a baseline sandbox exited ({p.returncode}): "
                    f"{log.read_text(errors='replace')[-500:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("baseline sandboxes did not all start within 60 s")
            time.sleep(0.005)
    return pids


def kill_baseline(procs: list[subprocess.Popen]) -> None:
    strays = [pid for pid in children(os.getpid()) if comm(pid) == "unshare"]  # a Popen cut short
    for pgid in {p.pid for p in procs} | set(strays):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    for p in procs:
        p.wait()
    for pid in strays:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def run_baseline(n: int, tmp: Path, settle_timeout: float) -> float | None:
    """Per-sandbox MiB (MemTotal - MemAvailable) of ``n`` baseline sandboxes, printed."""
    if n <= 0:
        return None
    quiesce(settle_timeout)
    procs: list[subprocess.Popen] = []
    before = Reading()
    rss0 = own_rss_kib()
    t = time.perf_counter()
    try:
        pids = spawn_baseline(n, tmp / "baseline.log", procs)
        spawn_s = time.perf_counter() - t
        after = Reading()
        pss = [pss_kib(pid) for pid in pids]
        rss = own_rss_kib() - rss0
    except BaseException:
        print("baseline failed; kernel limits:\n" + kernel_limits(), file=sys.stderr)
        raise
    finally:
        kill_baseline(procs)
    print(
        f"baseline: {n} x `{' '.join(BASELINE_ARGV)}` started in {spawn_s:.1f}s "
        f"({n / spawn_s:,.0f}/s)"
    )
    per = report(before, after, pss, n)
    pair = [pss[i] + pss[i + 1] for i in range(0, len(pss), 2)]
    print(
        f"  PSS of unshare + sleep: sum {mib(sum(pss)):.1f} MiB, median {statistics.median(pair)} "
        f"KiB per sandbox; this process's RSS {rss / n:+.1f} KiB per sandbox"
    )
    return per


# -- the container sandboxes -------------------------------------------------------------------


def new(sandbox_id: str) -> EdgeSandbox:
    return EdgeSandbox(
        id=sandbox_id,
        tenant="bench",
        spec=SandboxSpec(backend="container", env=Env(base="busybox:1")),
        created_at=time.time(),
    )


def echo_ok(sandbox_id: str) -> ExecCall:
    return ExecCall(sandbox_id=sandbox_id, argv=["echo", "ok"], timeout_s=30, max_output_bytes=64)


class Fill:
    """Creates with a bounded number in flight. Its tasks are not cancelled with the caller
    (a create cut short in its thread would leave a sandbox nobody knows of): after a Ctrl-C,
    :meth:`stop` lets those in flight finish and starts no more."""

    def __init__(self, backend: ContainerBackend, n: int, concurrency: int, seen: Seen) -> None:
        self.backend, self.n, self.seen = backend, n, seen
        self.slots = asyncio.Semaphore(concurrency)
        self.created: list[str] = []
        self.latency: list[float] = []
        self.error: BaseException | None = None
        self.stopped = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.t0 = 0.0

    async def run(self) -> float:
        self.t0 = time.perf_counter()
        self.tasks = {asyncio.create_task(self._one()) for _ in range(self.n)}
        await asyncio.wait(self.tasks)
        return time.perf_counter() - self.t0

    async def stop(self) -> None:
        self.stopped = True
        if self.tasks:
            await asyncio.wait(self.tasks)

    async def _one(self) -> None:
        async with self.slots:
            if self.stopped or self.error is not None:
                return
            sid = "sb-" + secrets.token_hex(8)
            t = time.perf_counter()
            try:
                await self.backend.create(new(sid))
            except Exception as e:
                if self.error is None:
                    self.error = e
                return
            self.latency.append(time.perf_counter() - t)
            self.created.append(sid)
            meta = self.backend.metas[sid]
            self.seen.inits.append((meta.init_pid, meta.init_start))
            k = len(self.created)
            if k % PROGRESS_EVERY == 0:
                s = time.perf_counter() - self.t0
                print(
                    f"  {k:>6} created in {s:6.1f}s ({k / s:5.1f}/s); host memory used "
                    f"{mib(meminfo()['Used']):,.0f} MiB",
                    flush=True,
                )


class Seen:
    """What the run made, for the check that nothing is left."""

    def __init__(self) -> None:
        self.inits: list[tuple[int, int]] = []
        self.cgroups: list[Path] = []


async def destroy_all(backend: ContainerBackend, concurrency: int = 8) -> int:
    """Destroy every sandbox the backend knows of, and any whose directory is left."""
    ids = set(backend.metas)
    with contextlib.suppress(OSError):
        ids |= {d.name for d in backend.root.iterdir() if re.fullmatch(SANDBOX_ID_PATTERN, d.name)}
    slots = asyncio.Semaphore(concurrency)

    async def one(sid: str) -> None:
        async with slots:
            await backend.destroy(SandboxRef(sandbox_id=sid))

    results = await asyncio.gather(*(one(s) for s in sorted(ids)), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            print(f"  destroy failed: {r!r}", file=sys.stderr)
    return len(ids)


async def run_containers(
    n: int,
    concurrency: int,
    settle_timeout: float,
    tmp: Path,
    store_cfg: dict,
    seen: Seen,
    problems: list[str],
) -> float | None:
    """Fill, measure, check, destroy; MiB per sandbox (None if none was created)."""
    config = ContainerConfig(
        storage="3fs", storage_config=store_cfg, max_sandboxes=n + 100, snapshot_grace_s=0
    )
    async with started(ContainerBackend(config), tmp / "state", node="bench") as backend:
        assert isinstance(backend, ContainerBackend)
        seen.cgroups = list(backend.cgroups.dirs.values())
        fill = Fill(backend, n, concurrency, seen)
        try:
            warm = "sb-" + secrets.token_hex(8)  # load the code paths once, outside the figures
            await backend.create(new(warm))
            await backend.exec(echo_ok(warm))
            await backend.destroy(SandboxRef(sandbox_id=warm))

            await asyncio.to_thread(quiesce, settle_timeout)
            before = await asyncio.to_thread(Reading)
            rss0 = own_rss_kib()
            print(f"filling: {n} idle sandboxes (env busybox:1), {concurrency} creates in flight")
            fill_s = await fill.run()
            done = len(fill.created)
            if fill.error is not None:
                problems.append(f"creation failed after {done}: {fill.error}")
                print(
                    f"creation failed after {done} sandboxes: {fill.error}\n"
                    f"kernel limits:\n{kernel_limits()}",
                    file=sys.stderr,
                )
            if done == 0:
                return None
            after = await asyncio.to_thread(Reading)
            rss = own_rss_kib() - rss0
            pss = [pss_kib(backend.metas[s].init_pid) for s in fill.created]
            lat = sorted(fill.latency)
            print(
                f"created {done} in {fill_s:.1f}s: {done / fill_s:.1f} sandboxes/s; create "
                f"latency p50 {statistics.median(lat) * 1e3:.0f} ms, "
                f"p99 {lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3:.0f} ms"
            )
            per = report(before, after, pss, done)
            print(
                f"  PSS of the inits: sum {mib(sum(pss)):.1f} MiB, median "
                f"{statistics.median(pss)} KiB; this process's RSS {rss / done:+.1f} KiB per "
                "sandbox (the backend's records)"
            )
            if per > 0:
                room = mib(meminfo()["MemTotal"] - before["Used"]) / per
                print(f"  memory alone would allow ~{room:,.0f} idle sandboxes on this machine")

            sample = random.sample(fill.created, min(SAMPLE, done))
            answers = await asyncio.gather(
                *(backend.exec(echo_ok(s)) for s in sample), return_exceptions=True
            )
            ok = sum(1 for a in answers if not isinstance(a, BaseException) and a.stdout == b"ok\n")
            print(f"  {ok}/{len(sample)} sandboxes of a random sample answered `echo ok`")
            if ok < len(sample):
                problems.append(f"only {ok}/{len(sample)} sampled sandboxes answered")
                print(f"  answers: {answers!r}"[:2000], file=sys.stderr)

            t = time.perf_counter()
            gone = await destroy_all(backend)
            s = time.perf_counter() - t
            print(f"destroyed {gone} in {s:.1f}s ({gone / s:.0f}/s)")
            later = await asyncio.to_thread(Reading)
            print(
                f"  seconds later: host memory used {mib(later['Used'] - before['Used']):+.1f} MiB "
                f"over the start, {later.memcgs - before.memcgs:+d} memory cgroups (the kernel "
                "frees removed ones lazily)"
            )
            return per
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
            if backend.metas or any(not t.done() for t in fill.tasks):
                print("destroying what is left ...", flush=True)
            await fill.stop()
            await destroy_all(backend)
            if backend.store.mounted():
                problems.append(f"layers still mounted: {sorted(backend.store.mounted())}")


# -- cleanup check -----------------------------------------------------------------------------


def left_behind(tmp: Path, seen: Seen) -> list[str]:
    found = leftovers(tmp, seen.cgroups, seen.inits)
    kids = [pid for pid in children(os.getpid()) if comm(pid) in ("unshare", "sleep")]
    if kids:
        found.append(f"{len(kids)} baseline process(es) still running")
    return found


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--count", type=int, default=TARGET_COUNT, help="idle sandboxes to create")
    ap.add_argument(
        "--baseline-count", type=int, default=500, help="baseline sandboxes (0: skip them)"
    )
    ap.add_argument("--concurrency", type=int, default=4, help="creates in flight")
    ap.add_argument(
        "--settle-timeout",
        type=float,
        default=300,
        help="seconds to wait at most, before measuring, for the kernel to finish freeing "
        "memory cgroups of sandboxes destroyed earlier",
    )
    ap.add_argument("--tmp-dir", type=Path, default=None, help="where the store and state go")
    args = ap.parse_args()
    reason = ContainerBackend.unavailable_reason()
    if reason is not None:
        print(f"the container backend cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)
    if shutil.which("unshare") is None and args.baseline_count > 0:
        print("the baseline needs util-linux `unshare`", file=sys.stderr)
        sys.exit(2)

    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-density-", dir=args.tmp_dir))
    seen = Seen()
    problems: list[str] = []
    per = base = None
    try:
        store_cfg = {"root": str(tmp / "store"), "cache_dir": str(tmp / "cache"), "gc_grace_s": 0}
        try:
            ensure_layer(open_store("3fs", store_cfg), "base", "busybox", "1", busybox_tree)
        except DsecError as e:
            print(f"cannot make the busybox:1 layer: {e}", file=sys.stderr)
            sys.exit(2)
        print(
            f"machine: {os.cpu_count()} CPUs, {mib(meminfo()['MemTotal']) / 1024:.1f} GiB, "
            f"kernel {os.uname().release}; store and state in {tmp}"
        )
        quiesce(args.settle_timeout)
        probe = empty_memcg_kib(v1_controllers()["memory"], f"dsec-bench-probe-{os.getpid()}")
        print(
            f"an empty memory cgroup costs ~{probe:.0f} KiB of slab here now (on Linux 6.7+ "
            "mostly shrinker maps, sized by the most filesystems mounted at once since boot)"
        )
        base = run_baseline(args.baseline_count, tmp, args.settle_timeout)
        per = asyncio.run(
            run_containers(
                args.count, args.concurrency, args.settle_timeout, tmp, store_cfg, seen, problems
            )
        )
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        unmount_under(tmp)
        left = left_behind(tmp, seen)
        shutil.rmtree(tmp, ignore_errors=True)
        print("cleanup: " + ("; ".join(left) if left else "no sandboxes, cgroups or mounts left"))
        signal.signal(signal.SIGINT, signal.default_int_handler)

    if per is not None and base:
        print(
            f"ratio to the baseline (MiB per sandbox): {per / base:.2f}x ({per:.3f} / {base:.3f})"
        )
    if per is None:
        verdict = "NOT met: no sandbox was created"
    elif problems:
        verdict = "NOT met: " + "; ".join(problems)
    elif args.count < TARGET_COUNT:
        verdict = (
            f"{per:.3f} MiB per idle sandbox at {args.count} "
            f"({'within' if per <= TARGET_MIB else 'over'} {TARGET_MIB:g} MiB); the count is "
            f"checked only with --count {TARGET_COUNT}"
        )
    else:
        met = "met" if per <= TARGET_MIB else "NOT met"
        verdict = f"{met}: {args.count:,} idle sandboxes, {per:.3f} MiB each"
    target = f"{TARGET_COUNT:,} idle sandboxes at <= {TARGET_MIB:g} MiB each"
    print(f"verdict (target {target}): {verdict}")
    sys.exit(0 if per is not None and not problems else 1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
