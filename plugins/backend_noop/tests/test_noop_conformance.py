"""The kernel's conformance suite against the no-op backend."""

import pytest
import pytest_asyncio
from dsec_backend_noop import NoopBackend, NoopConfig

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import SandboxRef
from dsec_kernel.contract.conformance import BackendConformance, started
from dsec_kernel.contract.wire import EdgeSandbox, SandboxSpec


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def backend(tmp_path_factory):
    async with started(NoopBackend(), tmp_path_factory.mktemp("noop")) as b:
        yield b


class TestNoopConformance(BackendConformance):
    pass


async def test_capacity_is_enforced(tmp_path):
    async with started(NoopBackend(NoopConfig(max_sandboxes=2)), tmp_path) as b:
        specs = [
            EdgeSandbox(
                id=f"sb-{i:016x}", tenant="t", spec=SandboxSpec(backend="noop"), created_at=0
            )
            for i in range(3)
        ]
        await b.create(specs[0])
        await b.create(specs[1])
        with pytest.raises(errors.CapacityExceeded):
            await b.create(specs[2])
        await b.destroy(SandboxRef(sandbox_id=specs[0].id))
        await b.create(specs[2])
