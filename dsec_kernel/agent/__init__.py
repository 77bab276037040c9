"""The gRPC agent protocol (``agent.proto``) and the edge's one client for it."""

from dsec_kernel.agent.client import AgentClient, collect_exec

__all__ = ["AgentClient", "collect_exec"]
