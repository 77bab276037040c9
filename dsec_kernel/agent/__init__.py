"""The edge's client for the agent protocol (:mod:`dsec_kernel.contract.agent`)."""

from dsec_kernel.agent.client import AgentClient, collect_exec

__all__ = ["AgentClient", "collect_exec"]
