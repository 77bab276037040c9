"""A destroyed sandbox's layer reads are reported through ``dsec_layer_read``, measured by the
store while the sandbox still has its layers mounted, and only while a plugin listens."""

from __future__ import annotations

import os
import time

import pytest

from dsec_kernel.contract.backend import SandboxRef
from dsec_kernel.contract.hookspecs import hookimpl
from dsec_kernel.contract.wire import EdgeSandbox, Env, SandboxSpec
from dsec_kernel.loader import open_store

pytestmark = pytest.mark.asyncio(loop_scope="module")


class Reads:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, int]] = []

    @hookimpl
    def dsec_layer_read(self, node, digest, sandbox_id, bytes_read):
        self.calls.append((node, digest, sandbox_id, bytes_read))


def new(env: Env) -> EdgeSandbox:
    return EdgeSandbox(
        id="sb-" + os.urandom(8).hex(),
        tenant="t",
        spec=SandboxSpec(backend="container", env=env),
        created_at=time.time(),
    )


async def test_a_destroyed_sandbox_reports_each_layer_it_read(backend, store_config, tmp_path):
    store = open_store("3fs", store_config)
    src = tmp_path / "src" / "work"
    src.mkdir(parents=True)
    (src / "data").write_bytes(os.urandom(256 << 10))
    name = "reads" + os.urandom(4).hex()
    work = store.import_layer(str(src.parent), "workspace", name, "1")
    base = store.resolve("busybox", "1", "base")
    measured = []
    usage = backend.store.usage
    backend.store.usage = lambda digest: measured.append(digest) or usage(digest)
    try:
        quiet = new(Env(base="busybox:1"))  # nobody listens: nothing measured
        await backend.create(quiet)
        await backend.destroy(SandboxRef(sandbox_id=quiet.id))
        assert measured == []

        reads = Reads()
        backend.hooks.register(reads)
        sb = new(Env(base="busybox:1", workspace=f"{name}:1"))
        await backend.create(sb)
        await backend.destroy(SandboxRef(sandbox_id=sb.id))
        await backend.destroy(SandboxRef(sandbox_id=sb.id))  # gone already: told once
    finally:
        backend.store.usage = usage
        store.remove(name, "1", force=True)
    assert measured == [work.digest, base.digest]  # top first, while mounted
    assert [(c[0], c[1], c[2]) for c in reads.calls] == [
        ("conformance", work.digest, sb.id),
        ("conformance", base.digest, sb.id),
    ]
    for (_, digest, _, bytes_read), layer in zip(reads.calls, (work, base), strict=True):
        assert 0 < bytes_read <= layer.size, (digest, bytes_read, layer.size)


async def test_many_sandboxes_of_one_layer_walk_it_once(backend):
    """Measuring walks the mounted image (a tenant's layer chooses its files): sandboxes of
    one env destroyed together measure it once, and each is still told."""
    measured = []
    usage = backend.store.usage
    backend.store.usage = lambda digest: measured.append(digest) or usage(digest)
    reads = Reads()
    backend.hooks.register(reads)
    sbs = [new(Env(base="busybox:1")) for _ in range(3)]
    try:
        for sb in sbs:
            await backend.create(sb)
        for sb in sbs:
            await backend.destroy(SandboxRef(sandbox_id=sb.id))
    finally:
        backend.store.usage = usage
        backend.hooks.pm.unregister(reads)
    assert len(measured) <= 1  # (none if an earlier test measured it just now)
    assert sorted(c[2] for c in reads.calls) == sorted(sb.id for sb in sbs)
    assert len({c[3] for c in reads.calls}) == 1  # the one measure, told to each
