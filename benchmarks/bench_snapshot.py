"""Snapshot and restore of a container sandbox with a 200 MB / 5,000-file workspace, next to
tar of the same workspace, measured in the same run.

    python benchmarks/bench_snapshot.py [--rounds 30] [--files 5000] [--mb 200]

The workspace is a layer in the store (5,000 files, 200 MB, sizes spread like a source tree:
many small files, a few large ones) on the busybox base. Each round, the agent edits 20
files (appending a line, so each is copied up whole into the writable layer), then:

* ``snapshot`` — ``await sb.snapshot()`` through the SDK: the writable layer's delta since
  the previous snapshot goes to the store;
* ``restore`` — the agent edits 20 more files and starts a background process, then
  ``await sb.restore(snap)`` through the SDK: files as at the snapshot, that process gone.

Every round's chain grows by one, so compaction (at the backend's chain bound) is inside the
numbers (it is the p99). Both sides start after ``sync``, so neither competes with the set-up's
writeback; the disk's speed still varies between runs, so run it more than once. The baseline
is what a home-made pool does: ``tar -cf`` of the workspace directory (snapshot) and ``rm -rf``
+ ``tar -xf`` (restore), on the host's local disk with a warm page cache — the most favourable
conditions for tar.

Targets: snapshot p50 ≤ 20 ms, restore p50 ≤ 50 ms, both at least 50 times faster than tar.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsec_storage_3fs.images import busybox_tree, ensure_layer
from stats import pct

import dsec_kernel as dsec
from dsec_kernel.cluster import LocalCluster
from dsec_kernel.loader import open_store

EDITS = 20


def build_workspace(dest: Path, files: int, total_mb: int) -> list[str]:
    """``dest/workspace/``: ``files`` files of ``total_mb`` MB in all, in 100-file
    directories, sizes log-normal (a source tree's shape). Returns the in-sandbox paths."""
    rng = random.Random(0)
    weights = [rng.lognormvariate(0, 1.5) for _ in range(files)]
    scale = total_mb * 2**20 / sum(weights)
    paths = []
    block = os.urandom(2**20)
    for i, w in enumerate(weights):
        rel = f"workspace/pkg{i // 100:02d}/mod{i:04d}.py"
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        size = max(1, int(w * scale))
        with open(path, "wb") as f:
            for off in range(0, size, len(block)):
                f.write(block[: min(len(block), size - off)])
        paths.append("/" + rel)
    return paths


def edit_script(paths: list[str], tag: str) -> str:
    return "for f in " + " ".join(paths) + f'; do echo "# {tag}" >> $f; done'


async def dsec_side(
    cluster: LocalCluster, env: dsec.Env, paths: list[str], rounds: int
) -> dict[str, list[float] | int]:
    await cluster.ready()
    rng = random.Random(1)
    snap_s: list[float] = []
    restore_s: list[float] = []
    delta_bytes: list[int] = []
    async with cluster.client(timeout=300) as c:
        [sb] = await c.create(count=1, backend="container", env=env)
        async with sb:
            for r in range(rounds):
                kept = rng.sample(paths, EDITS)
                assert (await sb.exec(edit_script(kept, f"round {r}"))).exit_code == 0
                t = time.perf_counter()
                snap = await sb.snapshot()
                snap_s.append(time.perf_counter() - t)
                delta_bytes.append(snap.info.bytes)
                lost = rng.sample(paths, EDITS)
                assert (await sb.exec(edit_script(lost, "lost") + "; sleep 600 &")).exit_code == 0
                t = time.perf_counter()
                await sb.restore(snap)
                restore_s.append(time.perf_counter() - t)
            # the last restore put back exactly the snapshot: its edit there, the later one gone
            tail = (await sb.exec(["tail", "-c", "64", kept[0]])).stdout
            assert tail.endswith(f"# round {rounds - 1}\n".encode()), tail
            gone = await sb.exec("pgrep sleep || echo none")
            assert gone.stdout.strip() == b"none", gone.stdout
    return {"snapshot": snap_s, "restore": restore_s, "delta": delta_bytes}


def tar_side(tree: Path, scratch: Path, runs: int) -> dict[str, list[float]]:
    archive = scratch / "ws.tar"
    dest = scratch / "restored"
    snap, restore = [], []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(["tar", "-cf", str(archive), "-C", str(tree), "workspace"], check=True)
        snap.append(time.perf_counter() - t)
        t = time.perf_counter()
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        subprocess.run(["tar", "-xf", str(archive), "-C", str(dest)], check=True)
        restore.append(time.perf_counter() - t)
    return {"snapshot": snap, "restore": restore}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--tar-runs", type=int, default=5)
    args = ap.parse_args()
    from dsec_backend_container.backend import ContainerBackend

    if reason := ContainerBackend.unavailable_reason():
        sys.exit(f"the container backend cannot run here: {reason}")
    with tempfile.TemporaryDirectory(prefix="dsec-bench-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        tree = root / "tree"
        t = time.perf_counter()
        paths = build_workspace(tree, args.files, args.mb)
        store_cfg = {"root": str(root / "store"), "cache_dir": str(root / "cache")}
        store = open_store("3fs", store_cfg)
        ensure_layer(store, "base", "busybox", "1", busybox_tree)
        ws = store.import_layer(str(tree), "workspace", "bench-ws", "1")
        print(f"workspace: {args.files} files, {args.mb} MB, layer image "
              f"{ws.size / 2**20:.0f} MiB, built in {time.perf_counter() - t:.1f} s")  # fmt: skip
        os.sync()  # the set-up's 400 MB of writes are not left to compete with what is timed
        env = dsec.Env(base="busybox:1", workspace="bench-ws:1")
        with LocalCluster(root / "cluster", {"DSEC_STORAGE_CONFIG__ROOT": store_cfg["root"]}) as cl:
            cl.start_nats()
            cl.start_apiserver()
            cl.start_edge("bench", ["container"])
            ours = asyncio.run(dsec_side(cl, env, paths, args.rounds))
        scratch = root / "scratch"
        scratch.mkdir()
        os.sync()
        tar = tar_side(tree, scratch, args.tar_runs)
    print(f"{'':<32} {'p50 ms':>9} {'p99 ms':>9}")
    for what in ("snapshot", "restore"):
        print(f"{'dsec ' + what + ' (SDK)':<32} {pct(ours[what], 50) * 1e3:9.2f} "
              f"{pct(ours[what], 99) * 1e3:9.2f}")  # fmt: skip
        print(
            f"{'tar ' + what:<32} {pct(tar[what], 50) * 1e3:9.2f} {pct(tar[what], 99) * 1e3:9.2f}"
        )
    print(f"snapshot delta: median {statistics.median(ours['delta']) / 2**20:.2f} MiB "
          f"({EDITS} edited files)")  # fmt: skip
    for what, target in (("snapshot", 20), ("restore", 50)):
        ratio = pct(tar[what], 50) / pct(ours[what], 50)
        print(f"{what}: p50 {pct(ours[what], 50) * 1e3:.2f} ms (target <= {target} ms), "
              f"{ratio:.0f}x faster than tar (target >= 50x)")  # fmt: skip


if __name__ == "__main__":
    main()
