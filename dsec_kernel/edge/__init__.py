"""The edge: one daemon per node that runs the node's backends (see :mod:`.service`)."""

from dsec_kernel.edge.backends import load_backends
from dsec_kernel.edge.service import Edge

__all__ = ["Edge", "load_backends"]
