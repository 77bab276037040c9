"""Fixtures for the container backend's tests: a layer store with a busybox base, a started
backend."""

from __future__ import annotations

import pytest
import pytest_asyncio
from dsec_backend_container.backend import ContainerBackend, ContainerConfig
from dsec_storage_3fs.images import busybox_tree, ensure_layer

from dsec_kernel.contract.conformance import started
from dsec_kernel.loader import open_store

REASON = ContainerBackend.unavailable_reason()


def pytest_collection_modifyitems(items):
    if REASON:
        for item in items:
            if "backend_container" in str(item.fspath):
                item.add_marker(
                    pytest.mark.skip(reason=f"the container backend cannot run here: {REASON}")
                )


@pytest.fixture(scope="session")
def store_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("layers")
    cfg = {"root": str(root / "store"), "cache_dir": str(root / "cache"), "gc_grace_s": 0}
    if not REASON:
        ensure_layer(open_store("3fs", cfg), "base", "busybox", "1", busybox_tree)
    return cfg


@pytest.fixture(scope="session")
def make_config(store_config):
    """ContainerConfig(**changes) on the test store."""

    def make(**kw) -> ContainerConfig:
        return ContainerConfig(storage="3fs", storage_config=store_config, snapshot_grace_s=0, **kw)

    return make


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(make_config, tmp_path_factory):
    async with started(ContainerBackend(make_config()), tmp_path_factory.mktemp("ct")) as b:
        yield b
