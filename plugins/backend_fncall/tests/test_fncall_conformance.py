"""The kernel's conformance suite against the fncall backend."""

import pytest_asyncio
from dsec_backend_fncall.backend import FncallBackend, FncallConfig

from dsec_kernel.contract.conformance import BackendConformance, started


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def backend(tmp_path_factory):
    async with started(
        FncallBackend(FncallConfig(pool_size=4)), tmp_path_factory.mktemp("fn")
    ) as b:
        yield b


class TestFncallConformance(BackendConformance):
    pass
