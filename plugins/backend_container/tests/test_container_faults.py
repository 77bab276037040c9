"""Bad layers and full disks: typed errors, and nothing left behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import pytest
from dsec_backend_container.backend import ContainerBackend
from dsec_backend_container.inodes import InodeLimits
from dsec_backend_container.layout import Trash
from dsec_backend_container.upperfs import UpperFs

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import ExecCall, SandboxRef
from dsec_kernel.contract.conformance import started
from dsec_kernel.contract.wire import (
    EdgeSandbox,
    Env,
    Limits,
    RestoreRequest,
    SandboxSpec,
    WriteFileRequest,
)
from dsec_kernel.loader import open_store

pytestmark = pytest.mark.asyncio(loop_scope="module")


def new(env: Env) -> EdgeSandbox:
    return EdgeSandbox(
        id="sb-" + os.urandom(8).hex(),
        tenant="t",
        spec=SandboxSpec(backend="container", env=env),
        created_at=time.time(),
    )


def leftovers(backend: ContainerBackend, sandbox_id: str) -> list[str]:
    found = []
    if (backend.root / sandbox_id).exists():
        found.append("directory")
    if any(d.exists() for d in backend._group(sandbox_id).dirs.values()):
        found.append("cgroup")
    if sandbox_id in backend.metas:
        found.append("record")
    return found


@pytest.fixture
def small_layer(store_config, tmp_path):
    """A fresh workspace layer this test may damage or remove."""
    store = open_store("3fs", store_config)
    src = tmp_path / "src"
    (src / "work").mkdir(parents=True)
    (src / "work" / "f").write_text(os.urandom(8).hex())
    name = "w" + os.urandom(4).hex()
    layer = store.import_layer(str(src), "workspace", name, "1")
    yield store, layer
    try:
        store.remove(name, "1", force=True)
    except errors.NotFound:
        pass


async def test_a_missing_layer_is_not_found_and_nothing_is_left(backend):
    sb = new(Env(base="busybox:1", workspace="no-such-layer:1"))
    with pytest.raises(errors.NotFound, match="no-such-layer"):
        await backend.create(sb)
    assert leftovers(backend, sb.id) == []


async def test_a_corrupt_layer_is_refused_and_nothing_is_left(backend, small_layer):
    store, layer = small_layer
    image = store.image_path(layer.digest)
    with open(image, "r+b") as f:  # damage the EROFS superblock's magic
        f.seek(1024)
        f.write(b"\0\0\0\0")
    sb = new(Env(base="busybox:1", workspace=layer.ref))
    with pytest.raises(errors.InvalidArgument):
        await backend.create(sb)
    assert leftovers(backend, sb.id) == []
    assert layer.digest not in store.mounted()


async def test_a_layer_in_use_cannot_be_removed(backend, small_layer):
    store, layer = small_layer
    sb = new(Env(base="busybox:1", workspace=layer.ref))
    await backend.create(sb)
    with pytest.raises(errors.Conflict, match=sb.id):
        store.remove(layer.name, layer.version)
    await backend.destroy(SandboxRef(sandbox_id=sb.id))
    store.remove(layer.name, layer.version)
    assert layer.digest not in store.mounted()


async def test_a_sandbox_over_its_disk_quota_fails_alone(backend):
    """Limits.disk_mb holds inside (EDQUOT), bytes and inodes alike; the sandbox and its
    neighbours go on, and deleting frees the room."""
    sb = new(Env(base="busybox:1"))
    sb.spec.limits.disk_mb = 32
    other = new(Env(base="busybox:1"))
    await backend.create(sb)
    await backend.create(other)
    try:
        fill = ["dd", "if=/dev/zero", "of=/big", "bs=1M", "count=64"]
        r = await backend.exec(
            ExecCall(sandbox_id=sb.id, argv=fill, timeout_s=30, max_output_bytes=4096)
        )
        assert r.exit_code != 0 and b"quota" in r.stderr.lower(), r
        # inodes count too: with most of the quota taken, a flood of empty files ends soon
        flood = [
            "/bin/sh",
            "-c",
            "rm /big; dd if=/dev/zero of=/big bs=1M count=31 2>/dev/null; mkdir /many && "
            "cd /many && seq 1 100000 | xargs touch; ls | wc -l",
        ]
        r = await backend.exec(
            ExecCall(sandbox_id=sb.id, argv=flood, timeout_s=120, max_output_bytes=4096)
        )
        assert b"quota" in r.stderr.lower() and int(r.stdout) < 50_000, r
        ok = ["/bin/sh", "-c", "head -c 64000000 /dev/zero > /big && echo ok"]
        r = await backend.exec(
            ExecCall(sandbox_id=other.id, argv=ok, timeout_s=30, max_output_bytes=64)
        )
        assert r.stdout == b"ok\n", r  # the neighbour has its own room
        rm = ["rm", "-rf", "/big", "/many"]
        await backend.exec(ExecCall(sandbox_id=sb.id, argv=rm, timeout_s=60, max_output_bytes=10))
        small = ["/bin/sh", "-c", "head -c 1000000 /dev/zero > /small && echo ok"]
        r = await backend.exec(
            ExecCall(sandbox_id=sb.id, argv=small, timeout_s=30, max_output_bytes=64)
        )
        assert r.stdout == b"ok\n", r
    finally:
        for s in (sb, other):
            await backend.destroy(SandboxRef(sandbox_id=s.id))


async def test_a_sandbox_at_its_inode_limit_makes_no_more_until_it_deletes(
    make_config, tmp_path, monkeypatch
):
    """Limits.inodes holds inside: once a look finds the sandbox at its limit, making a file
    fails (EDQUOT) in the sandbox and through write_file (QuotaExceeded), a guard event says
    so, the neighbour goes on, and deleting files gives the room back."""
    config = make_config(inode_check_s=0.05)
    async with started(ContainerBackend(config), tmp_path) as b:
        events: list[tuple[str, str, dict]] = []

        async def guard_event(sandbox_id: str, kind: str, detail: dict) -> None:
            events.append((sandbox_id, kind, detail))

        monkeypatch.setattr(b.hooks, "guard_event", guard_event)
        sb, other = new(Env(base="busybox:1")), new(Env(base="busybox:1"))
        sb.spec.limits.inodes = other.spec.limits.inodes = 3000
        await b.create(sb)
        await b.create(other)
        try:
            await _inode_flood(b, sb.id, other.id, events)
        finally:
            for s in (sb, other):
                await b.destroy(SandboxRef(sandbox_id=s.id))


async def test_sandboxes_kept_just_under_their_inode_limit_cost_a_bounded_share(
    make_config, tmp_path
):
    """A sandbox that stays just under its limit while it makes and deletes files would be
    counted at every look; all counting together gets at most its share of a core."""
    async with started(ContainerBackend(make_config()), tmp_path) as b:
        sb = new(Env(base="busybox:1"))
        await b.create(sb)
        try:
            script = "mkdir /f; cd /f; seq 1 19990 | xargs touch"
            call = ExecCall(
                sandbox_id=sb.id, argv=["/bin/sh", "-c", script], timeout_s=120,
                max_output_bytes=1 << 16,
            )  # fmt: skip
            assert (await b.exec(call)).exit_code == 0
            files = b.root / sb.id / "rw" / "upper" / "f"
            limits = InodeLimits(b.fs, share=0.05, burst_s=0.05)
            os.sync()  # (btrfs drops a deleted inode's item from its tree at a commit)
            fd = os.open(files.parent.parent, os.O_RDONLY | os.O_DIRECTORY)
            held = UpperFs.count_inodes(fd)
            os.close(fd)
            limits.watch(sb.id, files.parent.parent, held + 1, 1 << 30, known=False)
            t = time.monotonic()
            for i in range(100):
                changes = limits.check()
                assert changes == [] or i == 0, (i, changes)  # (the first: its quota set)
                churn = f"rm /f/{i + 1}; touch /f/m{i}; sync"  # a new number: up to the limit
                assert (
                    await b.exec(call.model_copy(update={"argv": ["sh", "-c", churn]}))
                ).exit_code == 0
            took = time.monotonic() - t
            assert 0 < limits.counted_s <= 0.05 + took * 0.05 + 0.05, (limits.counted_s, took)
        finally:
            await b.destroy(SandboxRef(sandbox_id=sb.id))


async def _inode_flood(b: ContainerBackend, sb: str, other: str, events: list) -> None:
    async def sh(sid: str, script: str):
        argv = ["/bin/sh", "-c", script]
        call = ExecCall(sandbox_id=sid, argv=argv, timeout_s=120, max_output_bytes=1 << 16)
        return await b.exec(call)

    # (true: a failed redirection of a special builtin such as ':' ends the shell)
    flood = "mkdir /f; i=0; while [ $i -lt 99999 ] && true > /f/$i; do i=$((i+1)); done; echo $i"
    r = await sh(sb, flood)
    assert r.stdout.strip().isdigit(), r
    made = int(r.stdout)
    assert 3000 <= made < 20_000 and b"quota" in r.stderr.lower(), (made, r.stderr[-200:])
    assert any(i == sb and k == "inodes_exceeded" for i, k, _ in events), events
    with pytest.raises(errors.QuotaExceeded, match="disk is full"):
        await b.write_file(WriteFileRequest(sandbox_id=sb, path="/x", data=b"x"))
    r = await sh(other, "mkdir /f && cd /f && seq 1 2000 | xargs touch && ls | wc -l")
    assert r.stdout == b"2000\n", r
    await sh(sb, "rm -rf /f")
    for _ in range(200):  # counted again within MAX_SKIP looks
        if (await sh(sb, "touch /again && echo ok")).stdout == b"ok\n":
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the quota was not reopened after the files went")


async def test_a_tenant_fills_its_share_of_the_node_disk_not_the_rest(make_config, tmp_path):
    """Quotas are thin: a tenant whose sandboxes together write past its share of the node's
    disk gets EDQUOT in them, however large their own quotas, and another tenant still
    writes; a quota larger than the share is refused."""
    async with started(ContainerBackend(make_config(tenant_disk_mb=64)), tmp_path) as b:
        with pytest.raises(errors.InvalidArgument, match="over the 64 MiB"):
            await b.create(new(Env(base="busybox:1")).model_copy(
                update={"spec": SandboxSpec(backend="container", env=Env(base="busybox:1"),
                                            limits=Limits(disk_mb=65))}
            ))  # fmt: skip
        mine = [new(Env(base="busybox:1")) for _ in range(2)]
        theirs = new(Env(base="busybox:1")).model_copy(update={"tenant": "u"})
        for sb in mine:
            sb.spec.limits.disk_mb = 64
        try:
            wrote = []
            for sb in [*mine, theirs]:
                await b.create(sb)
                fill = "dd if=/dev/zero of=/big bs=1M count=40 2>/dev/null; sync; wc -c < /big"
                call = ExecCall(
                    sandbox_id=sb.id, argv=["sh", "-c", fill], timeout_s=60, max_output_bytes=4096
                )
                wrote.append(int((await b.exec(call)).stdout) >> 20)
            assert wrote[0] == 40 and wrote[1] < 40 and wrote[2] == 40, wrote
        finally:
            for sb in [*mine, theirs]:
                await b.destroy(SandboxRef(sandbox_id=sb.id))
            assert all(leftovers(b, sb.id) == [] for sb in [*mine, theirs])


async def test_a_destroyed_sandbox_gives_its_bytes_back_to_its_tenant(make_config, tmp_path):
    """What a destroyed (or restored) sandbox had written stops counting against its tenant's
    share at once: three rounds of writing 40 of a 64 MiB share each, destroying in between,
    all fit (the second had got EDQUOT: a deleted subvolume's bytes stayed in the group)."""
    async with started(ContainerBackend(make_config(tenant_disk_mb=64)), tmp_path) as b:
        fill = "dd if=/dev/zero of=/big bs=1M count=40 2>/dev/null; sync; wc -c < /big"
        for _ in range(3):
            sb = new(Env(base="busybox:1"))
            sb.spec.limits.disk_mb = 64
            await b.create(sb)
            try:
                call = ExecCall(sandbox_id=sb.id, argv=["sh", "-c", fill], timeout_s=60,
                                max_output_bytes=4096)  # fmt: skip
                assert int((await b.exec(call)).stdout) >> 20 == 40
                await b.restore(RestoreRequest(sandbox_id=sb.id))  # its upper, emptied
                await trash_emptied(b)
                assert int((await b.exec(call)).stdout) >> 20 == 40
            finally:
                await b.destroy(SandboxRef(sandbox_id=sb.id))
            await trash_emptied(b)


async def trash_emptied(b: ContainerBackend) -> None:
    """Until the trash's thread has deleted what was discarded (milliseconds)."""
    deadline = time.monotonic() + 30
    while any(b.trash.root.iterdir()):
        assert time.monotonic() < deadline, list(b.trash.root.iterdir())
        await asyncio.sleep(0.05)


async def test_a_full_node_disk_fails_the_sandbox_not_the_node(make_config, tmp_path):
    made: list[EdgeSandbox] = []
    # the sandboxes' filesystem, smaller than one quota, and all of it the tenant's
    cfg = make_config(upper_fs_gb=0.25, tenant_disk_mb=1024)
    async with started(ContainerBackend(cfg), tmp_path / "st") as b:
        try:
            sb = new(Env(base="busybox:1"))
            await b.create(sb)
            made.append(sb)
            fill = ["dd", "if=/dev/zero", "of=/big", "bs=1M", "count=400"]
            r = await b.exec(
                ExecCall(sandbox_id=sb.id, argv=fill, timeout_s=60, max_output_bytes=4096)
            )
            assert r.exit_code != 0 and r.stderr, r  # ENOSPC, inside the sandbox only
            other = new(Env(base="busybox:1"))
            try:  # may fit (an empty sandbox is a few directories) or be refused, typed
                await b.create(other)
                made.append(other)
            except errors.CapacityExceeded:
                assert leftovers(b, other.id) == []
            rm = ["rm", "/big"]
            await b.exec(ExecCall(sandbox_id=sb.id, argv=rm, timeout_s=5, max_output_bytes=10))
            again = new(Env(base="busybox:1"))
            await b.create(again)
            made.append(again)
        finally:
            for s in made:
                await b.destroy(SandboxRef(sandbox_id=s.id))
    assert not (tmp_path / "st" / "sandboxes").is_mount()  # unmounted with the last sandbox


async def test_the_trash_deletes_what_it_is_given_and_what_a_crash_left(tmp_path):
    crashed = tmp_path / ".trash" / "left-by-a-crash" / "upper"
    crashed.mkdir(parents=True)
    (crashed / "f").write_bytes(b"x")
    trash = Trash(tmp_path / ".trash", shutil.rmtree)
    upper = tmp_path / "upper"
    (upper / "deep").mkdir(parents=True)
    (upper / "deep" / "g").write_bytes(b"y")
    trash.discard(upper)
    assert not upper.exists()  # gone at once; deleted in the background
    trash.discard(tmp_path / "missing")  # nothing to do
    trash.close()
    assert list(tmp_path.iterdir()) == []


async def test_a_sandbox_whose_init_dies_is_lost_at_once(make_config, tmp_path):
    """Killed from the host (nothing inside can), the init takes its sandbox with it: the
    backend reports it at once, refuses every operation, leaves it out of list_sandboxes
    (the edge's reconciliation works from it) and releases everything on destroy."""
    reported: list[tuple[str, str]] = []
    lost = lambda sandbox_id, reason: reported.append((sandbox_id, reason))  # noqa: E731
    async with started(ContainerBackend(make_config()), tmp_path / "st", lost=lost) as b:
        sb = new(Env(base="busybox:1"))
        await b.create(sb)
        try:
            os.kill(b.metas[sb.id].init_pid, signal.SIGKILL)
            for _ in range(100):
                if reported:
                    break
                await asyncio.sleep(0.02)
            assert [i for i, _ in reported] == [sb.id]
            assert str(b.metas[sb.id].init_pid) not in reported[0][1]  # no host pid to tenants
            assert (await b.status(SandboxRef(sandbox_id=sb.id))).state == "lost"
            assert sb.id not in await b.list_sandboxes()
            with pytest.raises(errors.SandboxLost) as lost_error:
                await b.exec(
                    ExecCall(sandbox_id=sb.id, argv=["true"], timeout_s=5, max_output_bytes=10)
                )
            assert str(b.metas[sb.id].init_pid) not in lost_error.value.message
        finally:
            await b.destroy(SandboxRef(sandbox_id=sb.id))
        assert leftovers(b, sb.id) == []


async def test_pidfds_past_1024_are_watched_and_used(backend):
    """A node holds thousands of pidfds: nothing may use select() on them (FD_SETSIZE)."""
    sb = new(Env(base="busybox:1"))
    await backend.create(sb)
    high = 4000
    try:
        low = backend.inits.take(sb.id)
        os.dup2(low, high)
        os.close(low)
        backend.inits.watch(sb.id, high)
        r = await backend.exec(ExecCall(sandbox_id=sb.id, argv=["echo", "ok"], timeout_s=10,
                                        max_output_bytes=10))  # fmt: skip
        assert r.stdout == b"ok\n" and backend.inits.alive(sb.id)
    finally:
        await backend.destroy(SandboxRef(sandbox_id=sb.id))
    assert leftovers(backend, sb.id) == []
