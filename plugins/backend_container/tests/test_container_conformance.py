"""The kernel's conformance suite against the container backend (busybox base)."""

from typing import ClassVar

from dsec_kernel.contract.conformance import BackendConformance
from dsec_kernel.contract.wire import Env


class TestContainerConformance(BackendConformance):
    spec: ClassVar[dict[str, object]] = {"env": Env(base="busybox:1")}
