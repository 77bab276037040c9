"""Snapshots: increments, compaction, tenants, collection, and publishing a snapshot as a layer."""

from __future__ import annotations

import os
import time

import pytest
from dsec_backend_container.backend import ContainerBackend

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import ExecCall, SandboxRef
from dsec_kernel.contract.conformance import started
from dsec_kernel.contract.wire import (
    EdgeSandbox,
    Env,
    FsDiffRequest,
    PublishRequest,
    RestoreRequest,
    SandboxSpec,
    SnapshotRequest,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


def new(tenant: str = "t", **spec) -> EdgeSandbox:
    spec.setdefault("env", Env(base="busybox:1"))
    return EdgeSandbox(
        id="sb-" + os.urandom(8).hex(),
        tenant=tenant,
        spec=SandboxSpec(backend="container", **spec),
        created_at=time.time(),
    )


async def sh(b, sid: str, script: str) -> bytes:
    r = await b.exec(
        ExecCall(
            sandbox_id=sid, argv=["/bin/sh", "-c", script], timeout_s=20, max_output_bytes=1 << 20
        )
    )
    assert r.exit_code == 0, r
    return r.stdout


async def test_snapshots_store_only_what_changed(backend):
    sb = new()
    await backend.create(sb)
    try:
        await sh(backend, sb.id, "head -c 1000000 /dev/urandom > /tmp/big; echo a > /tmp/small")
        s1 = await backend.snapshot(SnapshotRequest(sandbox_id=sb.id))
        await sh(backend, sb.id, "echo b > /tmp/small")
        s2 = await backend.snapshot(SnapshotRequest(sandbox_id=sb.id))
        assert s1.bytes >= 1_000_000 and s2.bytes < 100, (s1.bytes, s2.bytes)
        s3 = await backend.snapshot(SnapshotRequest(sandbox_id=sb.id))  # nothing changed
        assert s3.bytes == 0 and s3.parent == s2.id and s3.depth == 3
    finally:
        await backend.destroy(SandboxRef(sandbox_id=sb.id))


async def test_long_chains_are_compacted(make_config, tmp_path):
    async with started(ContainerBackend(make_config(snapshot_max_depth=3)), tmp_path) as b:
        sb = new()
        await b.create(sb)
        depths = []
        for i in range(5):
            await sh(b, sb.id, f"echo {i} > /tmp/f{i}; rm -f /tmp/f{i - 2}")
            depths.append((await b.snapshot(SnapshotRequest(sandbox_id=sb.id))).depth)
        assert depths == [1, 2, 3, 1, 2], depths
        last = b.metas[sb.id].last_snapshot
        fork = new(snapshot=last)
        await b.create(fork)
        assert await sh(b, fork.id, "cd /tmp && ls f* | tr '\\n' ' '") == b"f3 f4 "
        for s in (sb, fork):
            await b.destroy(SandboxRef(sandbox_id=s.id))


async def test_a_fork_resets_to_its_origin_after_compaction_and_collection(make_config, tmp_path):
    """Holds are transitive (a snapshot holds its parent); a sandbox keeps its origin held
    for reset() even when its own chain has been compacted away from it."""
    async with started(ContainerBackend(make_config(snapshot_max_depth=2)), tmp_path) as b:
        src = new()
        await b.create(src)
        await sh(b, src.id, "echo origin > /tmp/o")
        origin = await b.snapshot(SnapshotRequest(sandbox_id=src.id))
        await b.destroy(SandboxRef(sandbox_id=src.id))
        fork = new(snapshot=origin.id)
        await b.create(fork)
        try:
            for i in range(2):  # depth 2, then 3: compacted to 1
                await sh(b, fork.id, f"echo {i} > /tmp/f{i}")
                snap = await b.snapshot(SnapshotRequest(sandbox_id=fork.id))
            assert snap.depth == 1 and snap.parent is None, snap
            await b.restore(RestoreRequest(sandbox_id=fork.id, snapshot_id=snap.id))
            b.snapshots.gc()
            await b.restore(RestoreRequest(sandbox_id=fork.id, snapshot_id=None))
            assert await sh(b, fork.id, "cat /tmp/o; ls /tmp") == b"origin\no\n"
        finally:
            await b.destroy(SandboxRef(sandbox_id=fork.id))
        assert origin.id in b.snapshots.gc()  # nothing holds it any more


async def test_another_tenants_snapshot_cannot_be_used(backend):
    mine = new("alice")
    await backend.create(mine)
    try:
        snap = await backend.snapshot(SnapshotRequest(sandbox_id=mine.id))
        with pytest.raises(errors.NotFound):
            await backend.create(new("bob", snapshot=snap.id))
        theirs = new("bob")
        await backend.create(theirs)
        with pytest.raises(errors.NotFound):
            await backend.restore(RestoreRequest(sandbox_id=theirs.id, snapshot_id=snap.id))
        with pytest.raises(errors.NotFound):
            await backend.fs_diff(FsDiffRequest(sandbox_id=theirs.id, since=snap.id))
        await backend.destroy(SandboxRef(sandbox_id=theirs.id))
    finally:
        await backend.destroy(SandboxRef(sandbox_id=mine.id))


async def test_unused_snapshots_are_collected_and_held_ones_are_not(backend):
    sb = new()
    await backend.create(sb)
    await sh(backend, sb.id, "echo x > /tmp/x")
    s1 = await backend.snapshot(SnapshotRequest(sandbox_id=sb.id))
    kept = await backend.snapshot(SnapshotRequest(sandbox_id=sb.id, keep=True))
    fork = new(snapshot=s1.id)
    await backend.create(fork)
    await backend.destroy(SandboxRef(sandbox_id=sb.id))
    backend.snapshots.gc()
    assert backend.snapshots.get(s1.id)  # the fork builds on it
    assert backend.snapshots.get(kept.id)  # kept for good
    await backend.destroy(SandboxRef(sandbox_id=fork.id))
    removed = backend.snapshots.gc()
    assert s1.id not in removed  # the kept snapshot is its child: it still needs s1
    assert backend.snapshots.get(kept.id).parent == s1.id


async def test_a_snapshot_published_as_a_layer_starts_new_sandboxes(backend):
    sb = new()
    await backend.create(sb)
    try:
        await sh(backend, sb.id, "mkdir -p /work && echo built > /work/artifact && rm /bin/vi")
        snap = await backend.snapshot(SnapshotRequest(sandbox_id=sb.id))
        layer = await backend.publish(
            PublishRequest(
                snapshot_id=snap.id, kind="workspace", name="built", version="1", tenant="t"
            )
        )
        assert layer.kind == "workspace" and layer.digest.startswith("sha256:")
        with pytest.raises(errors.NotFound):
            await backend.publish(
                PublishRequest(
                    snapshot_id=snap.id, kind="workspace", name="x", version="1", tenant="eve"
                )
            )
        user = new(env=Env(base="busybox:1", workspace="built:1"))
        await backend.create(user)
        out = await sh(
            backend, user.id, "cat /work/artifact; test -e /bin/vi || echo no-vi; ls /bin/ls"
        )
        assert out == b"built\nno-vi\n/bin/ls\n"
        await backend.destroy(SandboxRef(sandbox_id=user.id))
    finally:
        await backend.destroy(SandboxRef(sandbox_id=sb.id))


#: a tree of dated files and directories, and their dates as ``stat`` prints them
DATED = (
    "mkdir -p /work/a/b && echo x > /work/a/b/f && touch -d @1000000 /work/a/b/f /work/a/b "
    "/work/a /work /"
)
STAMPS = "stat -c '%Y %n' /work /work/a /work/a/b /work/a/b/f"


async def test_directories_keep_their_dates_through_snapshots_restores_and_publishes(backend):
    """A directory's mtime is the sandbox's, not the time its snapshot or publish wrote into
    it: a restore gives it back, and two publishes of the same files are one image (a
    toolkit built twice from the same pins, say)."""
    sb = new()
    await backend.create(sb)
    try:
        await sh(backend, sb.id, DATED)
        snap = await backend.snapshot(SnapshotRequest(sandbox_id=sb.id))
        await sh(backend, sb.id, "rm -r /work; mkdir /work")
        await backend.restore(RestoreRequest(sandbox_id=sb.id, snapshot_id=snap.id))
        paths = STAMPS.split("' ")[1].split()
        assert (await sh(backend, sb.id, STAMPS)).decode().splitlines() == [
            f"1000000 {path}" for path in paths
        ]
        digests = set()
        for version in ("1", "2"):
            await sh(backend, sb.id, f"sleep 1; {DATED}")  # written again, a second later
            again = await backend.snapshot(SnapshotRequest(sandbox_id=sb.id))
            req = PublishRequest(
                snapshot_id=again.id, kind="toolkit", name="dated", version=version, tenant="t"
            )
            digests.add((await backend.publish(req)).digest)
        assert len(digests) == 1, digests
    finally:
        await backend.destroy(SandboxRef(sandbox_id=sb.id))


async def test_a_snapshot_pins_its_layers_until_it_is_collected(backend, tmp_path):
    tree = tmp_path / "tk"
    (tree / "opt").mkdir(parents=True)
    (tree / "opt" / "tool").write_text("v1")
    store = backend.store
    store.import_layer(str(tree), "toolkit", "pinned", "1")
    sb = new(env=Env(base="busybox:1", toolkits=["pinned:1"]))
    await backend.create(sb)
    snap = await backend.snapshot(SnapshotRequest(sandbox_id=sb.id))
    await backend.destroy(SandboxRef(sandbox_id=sb.id))
    with pytest.raises(errors.Conflict, match=f"@snapshot/{snap.id}"):
        store.remove("pinned", "1")
    assert snap.id in backend.snapshots.gc()
    store.remove("pinned", "1")
