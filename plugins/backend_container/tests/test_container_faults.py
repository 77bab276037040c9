"""Bad layers and full disks: typed errors, and nothing left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from dsec_backend_container.backend import ContainerBackend
from dsec_backend_container.layout import Trash

from dsec_kernel import errors, linux
from dsec_kernel.backend import ExecCall, SandboxRef
from dsec_kernel.conformance import started
from dsec_kernel.storage import open_store
from dsec_kernel.wire import EdgeSandbox, Env, SandboxSpec

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


async def test_a_full_upper_disk_fails_the_sandbox_not_the_node(make_config, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    linux.mount("tmpfs", str(disk), "tmpfs", 0, "size=8m")
    made: list[EdgeSandbox] = []
    try:
        async with started(ContainerBackend(make_config(upper_root=disk)), tmp_path / "st") as b:
            try:
                sb = new(Env(base="busybox:1"))
                await b.create(sb)
                made.append(sb)
                fill = ["/bin/sh", "-c", "head -c 20000000 /dev/zero > /big"]
                r = await b.exec(
                    ExecCall(sandbox_id=sb.id, argv=fill, timeout_s=20, max_output_bytes=4096)
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
        assert list(disk.iterdir()) == []
    finally:
        linux.umount(str(disk), linux.MNT_DETACH)


async def test_the_trash_deletes_what_it_is_given_and_what_a_crash_left(tmp_path):
    crashed = tmp_path / ".trash" / "left-by-a-crash" / "upper"
    crashed.mkdir(parents=True)
    (crashed / "f").write_bytes(b"x")
    trash = Trash(tmp_path / ".trash")
    upper = tmp_path / "upper"
    (upper / "deep").mkdir(parents=True)
    (upper / "deep" / "g").write_bytes(b"y")
    trash.discard(upper)
    assert not upper.exists()  # gone at once; deleted in the background
    trash.discard(tmp_path / "missing")  # nothing to do
    trash.close()
    assert list(tmp_path.iterdir()) == []


async def test_a_sandbox_whose_init_dies_is_reported_failed_and_left_out(backend):
    """The edge's reconciliation works from list_sandboxes: a dead init must not be listed."""
    sb = new(Env(base="busybox:1"))
    await backend.create(sb)
    try:
        os.kill(backend.metas[sb.id].init_pid, signal.SIGKILL)
        for _ in range(100):
            if (await backend.status(SandboxRef(sandbox_id=sb.id))).state == "failed":
                break
            await asyncio.sleep(0.02)
        assert (await backend.status(SandboxRef(sandbox_id=sb.id))).state == "failed"
        assert sb.id not in await backend.list_sandboxes()
    finally:
        await backend.destroy(SandboxRef(sandbox_id=sb.id))
    assert leftovers(backend, sb.id) == []
