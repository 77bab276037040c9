"""What a real task reads of its layers, and cold starts from the store versus copying first.

    python benchmarks/bench_layers.py [--starts 100] [--only fraction|cold] [--sdist FILE]

Runs the container backend in this process, without NATS
(``dsec_kernel.contract.conformance.started``),
on a fresh layer store in a temporary directory ($TMPDIR, or --tmp-dir: a local disk, not
tmpfs), so nothing else on the node has its images mounted or holds them. Into it go
``debian-python:12`` (base; its tree is built by debootstrap once per machine and cached in
~/.cache/dsec/debian-python-12.v2) and ``more-itertools:10.2.0`` (workspace: the sdist from PyPI,
``pip download --no-binary :all: --no-deps``, or --sdist FILE, unpacked at /workspace; its
tests included). Layers already in the store are reused.

(a) Fraction of the image bytes a realistic task reads. The page cache of both image files is
dropped (posix_fadvise DONTNEED; nothing has them mounted), then one sandbox on base +
workspace runs the project's test suite (``python3 -m unittest discover -s tests`` in
/workspace, 774 tests). ``store.usage(digest)`` then gives, per layer, the bytes the node read
of the image on demand through the EROFS mount (mincore): the image file's own pages (metadata
and inline data; all of it, with buffered mounts) plus the pages of the files in the mount
(file data, which direct-I/O mounts, the default, read past the image's page cache). Reported
per layer and for the whole environment. Target: <= 15 % overall. For context it also prints
the file data alone. usage() walks the mount (reading its metadata), so it is taken once, after
the tests.

(b) --starts cold starts each way, interleaved (alternating which goes first). A cold start:
the images' pages are not in the page cache and no image is mounted on the node (the backend
unmounts a layer when its last sandbox goes; checked with ``store.mounted()`` before each
start); create a sandbox on base + workspace, run ``python3 -c 'import json; print(1)'``, and
take the time until its output is back; destroy the sandbox (not timed).

* from the store (what the backend does): it mounts each image straight from its file in the
  store and reads pages on demand; the store's image files have their page cache dropped
  before each start.
* copy first (the baseline: "pull the full image, then start"): the node has no copy; the
  timed start first copies every image of the environment (``store.image_path``) with
  ``shutil.copyfile`` into a second store on node-local disk, fsyncs each copy, then creates
  the sandbox on a second backend whose store is that copy (its catalog records were copied
  once beforehand, untimed) and runs the command. The source's page cache is dropped before
  each start; the copies are deleted after each start (so each start pulls again). The copy
  stays in the page cache once written, as a real pull's would.

Reported: the median time to the first output of each, its parts (copy, create, command), the
bytes the store side read, and the ratio copy first / from the store. Target: >= 1.7x (DSec's
figure). On one machine the "store" and the "node-local disk" are the same disk; the copy still
costs reading and writing the whole images, which is what the figure is about (a real pull
also crosses the network, so the ratio here is a lower bound).

Needs root. Everything it makes goes at the end, on errors and Ctrl-C too: sandboxes, mounts,
cgroups, the temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from benchlib import leftovers
from dsec_backend_container.backend import ContainerBackend, ContainerConfig
from dsec_storage_3fs.images import debian_python
from dsec_storage_3fs.mounts import unmount_under
from dsec_storage_3fs.pagecache import tree_resident_bytes
from stats import pct

from dsec_kernel.contract.backend import ExecCall, SandboxRef
from dsec_kernel.contract.conformance import started
from dsec_kernel.contract.errors import DsecError, NotFound
from dsec_kernel.contract.store import Layer, LayerStore, LayerUsage
from dsec_kernel.contract.wire import SANDBOX_ID_PATTERN, EdgeSandbox, Env, ExecResult, SandboxSpec
from dsec_kernel.loader import open_store

PROJECT, VERSION = "more-itertools", "10.2.0"
ENV = Env(base="debian-python:12", workspace=f"{PROJECT}:{VERSION}")
TESTS = ["python3", "-m", "unittest", "discover", "-s", "tests"]
FIRST = ["python3", "-c", "import json; print(1)"]
TARGET_FRACTION = 0.15
TARGET_RATIO = 1.7
MiB = 1 << 20
T = TypeVar("T")


# -- layers and page cache ---------------------------------------------------------------------


def workspace_layer(store: LayerStore, sdist: Path | None, tmp: Path) -> Layer:
    """more-itertools 10.2.0 as a workspace layer (/workspace), imported unless present."""
    try:
        return store.resolve(PROJECT, VERSION, "workspace")
    except NotFound:
        pass
    work = Path(tempfile.mkdtemp(prefix="sdist-", dir=tmp))
    try:
        if sdist is None:
            pip = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
                 "--no-deps", "--dest", str(work), f"{PROJECT}=={VERSION}"],
                capture_output=True, text=True,
            )  # fmt: skip
            if pip.returncode != 0:
                sys.exit(f"downloading the {PROJECT} sdist failed (or pass --sdist):\n{pip.stderr}")
            sdist = next(work.glob("*.tar.gz"))
        return store.import_layer(  # more-itertools-10.2.0/... as /workspace/...
            str(sdist), "workspace", PROJECT, VERSION, under="workspace", strip=1
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def drop_cache(path: Path) -> None:
    """Evict ``path``'s pages from the page cache (clean, unmapped ones: all of an image's)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def readahead_kib(path: Path) -> int | None:
    """The read-ahead limit of the device ``path`` is on, in KiB (None if unknown)."""
    dev = os.stat(path).st_dev
    for f in (
        f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb",
        f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/read_ahead_kb",
    ):
        with contextlib.suppress(OSError, ValueError):
            return int(Path(f).read_text())
    return None


def copy_synced(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` (through a temporary name), fsynced: a node-local pull."""
    tmp = dst.with_name(f".{dst.name}.part")
    shutil.copyfile(src, tmp)
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, dst)


# -- sandboxes ---------------------------------------------------------------------------------


def new_sandbox() -> EdgeSandbox:
    return EdgeSandbox(
        id="sb-" + secrets.token_hex(8),
        tenant="bench",
        spec=SandboxSpec(backend="container", env=ENV),
        created_at=time.time(),
    )


def call(sandbox_id: str, argv: list[str], timeout: float, **kw: object) -> ExecCall:
    return ExecCall(
        sandbox_id=sandbox_id,
        argv=argv,
        timeout_s=timeout,
        max_output_bytes=4 * MiB,
        env={"PYTHONDONTWRITEBYTECODE": "1"},
        **kw,  # type: ignore[arg-type]
    )


async def finish(aw: Awaitable[T]) -> T:
    """Await ``aw``; if this task is cancelled meanwhile (Ctrl-C), let it complete first (a
    create cut short in its thread would leave a sandbox nobody knows of), then re-raise."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


async def destroy_all(backend: ContainerBackend) -> None:
    """Destroy every sandbox the backend knows of, and any whose directory is left."""
    ids = set(backend.metas)
    with contextlib.suppress(OSError):
        ids |= {d.name for d in backend.root.iterdir() if re.fullmatch(SANDBOX_ID_PATTERN, d.name)}
    for sid in sorted(ids):
        try:
            await backend.destroy(SandboxRef(sandbox_id=sid))
        except Exception as e:
            print(f"  destroy {sid} failed: {e!r}", file=sys.stderr)


class Side:
    """One way to start: a started backend on its store, and the images its sandboxes use."""

    def __init__(self, name: str, backend: ContainerBackend, sources: list[Path]) -> None:
        self.name = name
        self.backend = backend
        self.store = backend.store
        self.sources = sources  # the image files whose page cache each start drops
        self.total: list[float] = []
        self.copy: list[float] = []
        self.create: list[float] = []
        self.command: list[float] = []
        self.read: list[int] = []
        self.inits: list[tuple[int, int]] = []

    def check_cold(self) -> None:
        if self.store.mounted():
            raise RuntimeError(
                f"{self.name}: images still mounted before a cold start: "
                f"{sorted(self.store.mounted())}"
            )
        for src in self.sources:
            drop_cache(src)

    async def run(
        self, argv: list[str], timeout: float, inspect: Callable[[], object] | None = None
    ) -> tuple[float, float, ExecResult]:
        """Create a sandbox, run ``argv``, call ``inspect()`` (in a thread), destroy the
        sandbox: (create s, command s, result)."""
        sb = new_sandbox()
        t = time.perf_counter()
        await finish(self.backend.create(sb))
        created = time.perf_counter()
        meta = self.backend.metas[sb.id]
        self.inits.append((meta.init_pid, meta.init_start))
        try:
            result = await self.backend.exec(call(sb.id, argv, timeout, cwd="/workspace"))
            done = time.perf_counter()
            if inspect is not None:  # it measures; usage() walks the mount, reading metadata
                await asyncio.to_thread(inspect)
            else:
                self.read.append(sum(self.store.usage(d).bytes_read for d in meta.layers))
        finally:
            await finish(self.backend.destroy(SandboxRef(sandbox_id=sb.id)))
        if self.store.mounted():
            raise RuntimeError(f"{self.name}: the images stayed mounted after the last sandbox")
        return created - t, done - created, result


# -- (a) fraction read -------------------------------------------------------------------------


async def fraction(side: Side, layers: list[Layer]) -> float:
    side.check_cold()
    for layer in layers:
        left = side.store.usage(layer.digest).bytes_read
        if left > layer.size // 100:
            print(f"  note: {left / MiB:.1f} MiB of {layer.ref} stayed in the page cache")
    print(f"(a) running {PROJECT} {VERSION}'s tests in one sandbox, its layers read cold ...")
    usage: dict[str, LayerUsage] = {}
    in_files: dict[str, int] = {}

    def inspect() -> None:  # while the layers are still mounted
        for layer in layers:
            usage[layer.digest] = side.store.usage(layer.digest)
        mounts = side.store.mounted()  # (walking them reads metadata: after the usage)
        for layer in layers:
            in_files[layer.digest] = tree_resident_bytes(mounts[layer.digest])

    create_s, run_s, r = await side.run(TESTS, timeout=900, inspect=inspect)
    err = r.stderr.decode(errors="replace")
    ran = re.search(r"Ran (\d+) tests?", err)
    ok = r.exit_code == 0 and re.search(r"^OK", err, re.M) is not None
    print(
        f"  create {create_s * 1e3:.0f} ms; tests {run_s:.1f}s, exit {r.exit_code}: "
        f"{ran.group(0) if ran else 'no test count'}, {'OK' if ok else err[-300:]}"
    )
    print(f"  {'layer':<32} {'image MiB':>9} {'read MiB':>9} {'fraction':>8}   {'files MiB':>9}")
    size = read = touched = 0
    for layer in layers:
        u = usage[layer.digest]
        size += u.size
        read += u.bytes_read
        touched += in_files[layer.digest]
        print(
            f"  {layer.kind + ' ' + layer.ref:<32} {u.size / MiB:9.1f} "
            f"{u.bytes_read / MiB:9.1f} {u.fraction:8.1%}   {in_files[layer.digest] / MiB:9.1f}"
        )
    frac = read / size
    print(
        f"  {'environment':<32} {size / MiB:9.1f} {read / MiB:9.1f} {frac:8.1%}   "
        f"{touched / MiB:9.1f} ({touched / size:.1%})"
    )
    if read == 0:
        print("  note: nothing read shows in the page cache of the images (direct I/O mounts?)")
    ra = readahead_kib(side.store.image_path(layers[0].digest))
    print(
        "  read: the image's pages in the page cache (store.usage), read-ahead and metadata "
        "included" + (f"; the store's device reads ahead up to {ra} KiB" if ra is not None else "")
    )
    print("  files: the data of the layer's files in the page cache of its mount (what was used)")
    verdict = "met" if frac <= TARGET_FRACTION and ok else "NOT met"
    print(
        f"verdict (a) (target <= {TARGET_FRACTION:.0%} of the image bytes read): {verdict}, "
        f"{frac:.1%}{'' if ok else ' (the tests did not pass)'}"
    )
    return frac


# -- (b) cold starts ---------------------------------------------------------------------------


async def store_start(side: Side) -> None:
    side.check_cold()
    create_s, command_s, r = await side.run(FIRST, timeout=120)
    if r.stdout != b"1\n":
        raise RuntimeError(f"{side.name}: the first command failed: {r!r}")
    side.create.append(create_s)
    side.command.append(command_s)
    side.total.append(create_s + command_s)


async def copy_start(side: Side, copies: list[tuple[Path, Path]]) -> None:
    for _, dst in copies:
        dst.unlink(missing_ok=True)
    side.check_cold()
    t = time.perf_counter()
    for src, dst in copies:
        await asyncio.to_thread(copy_synced, src, dst)
    copy_s = time.perf_counter() - t
    try:
        create_s, command_s, r = await side.run(FIRST, timeout=120)
    finally:
        for _, dst in copies:
            dst.unlink(missing_ok=True)
    if r.stdout != b"1\n":
        raise RuntimeError(f"{side.name}: the first command failed: {r!r}")
    side.copy.append(copy_s)
    side.create.append(create_s)
    side.command.append(command_s)
    side.total.append(copy_s + create_s + command_s)


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.0f}" if xs else "-"


async def cold_starts(
    starts: int, ours: Side, theirs: Side, copies: list[tuple[Path, Path]], size: int
) -> float:
    print(
        f"(b) {starts} cold starts each way, interleaved: create a sandbox on {ENV.base} + "
        f"{ENV.workspace} ({size / MiB:.1f} MiB of images), run `{shlex.join(FIRST)}`"
    )
    await store_start(ours)  # warm this process's code paths; not counted
    await copy_start(theirs, copies)
    for s in (ours, theirs):
        for xs in (s.total, s.copy, s.create, s.command, s.read):
            xs.clear()
    t0 = time.perf_counter()
    for i in range(starts):
        order = [lambda: store_start(ours), lambda: copy_start(theirs, copies)]
        for start in order if i % 2 == 0 else order[::-1]:
            await start()
        if (i + 1) % 10 == 0 or i + 1 == starts:
            print(
                f"  {i + 1:>4}/{starts} in {time.perf_counter() - t0:5.0f}s; medians so far: "
                f"from the store {statistics.median(ours.total) * 1e3:.0f} ms, copy first "
                f"{statistics.median(theirs.total) * 1e3:.0f} ms",
                flush=True,
            )
    print(
        f"  {'ms':<16} {'first output':>12} {'p10':>6} {'p90':>6}   medians of its parts: "
        f"{'copy':>6} {'create':>6} {'command':>7}"
    )
    for s in (ours, theirs):
        print(
            f"  {s.name:<16} {ms(s.total):>12} {pct(s.total, 10) * 1e3:6.0f} "
            f"{pct(s.total, 90) * 1e3:6.0f}   {'':21}{ms(s.copy):>6} {ms(s.create):>6} "
            f"{ms(s.command):>7}"
        )
    read = statistics.median(ours.read)
    copy_rate = size / MiB / statistics.median(theirs.copy)
    print(
        f"  from the store, a cold start read a median {read / MiB:.1f} MiB of the "
        f"{size / MiB:.1f} MiB of images ({read / size:.1%}); copy first copied all of it "
        f"({copy_rate:.0f} MiB/s, read + write + fsync)"
    )
    print(
        "  note: on this one machine the store and the node-local disk are the same disk; the "
        "copy still reads and writes the whole images (a real pull also crosses the network)"
    )
    ratio = statistics.median(theirs.total) / statistics.median(ours.total)
    print(
        f"verdict (b) (target: copy first / from the store >= {TARGET_RATIO}x): "
        f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}, {ratio:.2f}x "
        f"({statistics.median(theirs.total) * 1e3:.0f} ms vs "
        f"{statistics.median(ours.total) * 1e3:.0f} ms)"
    )
    return ratio


# -- run ---------------------------------------------------------------------------------------


def config(store_cfg: dict) -> ContainerConfig:
    return ContainerConfig(storage="3fs", storage_config=store_cfg, snapshot_grace_s=0)


async def run(args: argparse.Namespace, tmp: Path, seen: dict[str, list]) -> None:
    store_cfg = {"root": str(tmp / "store"), "cache_dir": str(tmp / "cache"), "gc_grace_s": 0}
    store = open_store("3fs", store_cfg)
    t = time.perf_counter()
    say = lambda m: print(f"  importing {ENV.base}: {m}", flush=True)  # noqa: E731
    base = await asyncio.to_thread(debian_python, store, None, say)
    ws = await asyncio.to_thread(workspace_layer, store, args.sdist, tmp)
    layers = [base, ws]
    size = sum(layer.size for layer in layers)
    print(
        f"layers in {time.perf_counter() - t:.1f}s: {base.ref} {base.size / MiB:.1f} MiB, "
        f"{ws.ref} {ws.size / MiB:.2f} MiB ({ws.files} entries); store in {tmp}"
    )
    sources = [store.image_path(layer.digest) for layer in layers]
    copy_root = tmp / "node-local"
    copy_cfg = {
        "root": str(copy_root / "store"),
        "cache_dir": str(copy_root / "cache"),
        "gc_grace_s": 0,
    }
    shutil.copytree(Path(store_cfg["root"]) / "layers", copy_root / "store" / "layers")
    blobs = copy_root / "store" / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    copies = [(src, blobs / src.name) for src in sources]

    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(started(ContainerBackend(config(store_cfg)), tmp / "a"))
        b = await stack.enter_async_context(started(ContainerBackend(config(copy_cfg)), tmp / "b"))
        assert isinstance(a, ContainerBackend) and isinstance(b, ContainerBackend)
        ours = Side("from the store", a, sources)
        theirs = Side("copy first", b, sources)
        seen["cgroups"] += [*a.cgroups.dirs.values(), *b.cgroups.dirs.values()]
        seen["sides"] += [ours, theirs]
        try:
            if args.only in (None, "fraction"):
                await fraction(ours, layers)
            if args.only in (None, "cold") and args.starts > 0:
                await cold_starts(args.starts, ours, theirs, copies, size)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
            await destroy_all(a)
            await destroy_all(b)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--starts", type=int, default=100, help="cold starts of each kind")
    ap.add_argument("--only", choices=["fraction", "cold"], help="run one measurement only")
    ap.add_argument("--sdist", type=Path, help=f"a local {PROJECT} {VERSION} sdist (.tar.gz)")
    ap.add_argument("--tmp-dir", type=Path, help="where the temporary store goes (local disk)")
    args = ap.parse_args()
    reason = ContainerBackend.unavailable_reason()
    if reason is not None:
        print(f"the container backend cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-layers-", dir=args.tmp_dir))
    seen: dict[str, list] = {"cgroups": [], "sides": []}
    failed = True
    try:
        asyncio.run(run(args, tmp, seen))
        failed = False
    except DsecError as e:
        print(f"failed: {e}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        unmount_under(tmp)
        left = leftovers(tmp, seen["cgroups"], [i for s in seen["sides"] for i in s.inits])
        shutil.rmtree(tmp, ignore_errors=True)
        print("cleanup: " + ("; ".join(left) if left else "no sandboxes, cgroups or mounts left"))
        signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
