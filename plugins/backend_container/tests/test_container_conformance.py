"""The kernel's conformance suite against the container backend (busybox base)."""

from dsec_kernel.conformance import BackendConformance
from dsec_kernel.wire import Env


class TestContainerConformance(BackendConformance):
    spec = {"env": Env(base="busybox:1")}
