"""The least-loaded placement policy."""

from collections import Counter

import pytest

from dsec_kernel import errors, hookimpl
from dsec_kernel.placement import LeastLoaded, NodeView, PlacementRequest
from dsec_kernel.plugins import Hooks
from dsec_kernel.wire import BackendInfo, Capabilities, NodeInfo, NodeLoad, SandboxSpec


def node(name, cap=100, used=0, state="up", backend="noop"):
    return NodeView(
        NodeInfo(
            node=name,
            edge_id=name,
            state=state,
            backends=[BackendInfo(name=backend, capabilities=Capabilities(max_sandboxes=cap))],
            load=NodeLoad(sandboxes=used, by_backend={backend: used}),
        )
    )


def request(count, backend="noop"):
    return PlacementRequest("t", SandboxSpec(backend=backend), count)


def test_spreads_evenly_and_fills_by_ratio():
    policy = LeastLoaded(Hooks.load(guards=[]))
    placed = Counter(policy.place(request(30), [node("a"), node("b"), node("c")]))
    assert placed == {"a": 10, "b": 10, "c": 10}
    placed = Counter(
        policy.place(request(30), [node("big", cap=200, used=0), node("small", cap=50, used=25)])
    )
    assert placed["big"] > placed["small"]


def test_skips_down_full_and_other_backend_nodes():
    policy = LeastLoaded(Hooks.load(guards=[]))
    nodes = [
        node("down", state="down"),
        node("full", cap=5, used=5),
        node("other", backend="x"),
        node("ok", cap=3),
    ]
    assert policy.place(request(3), nodes) == ["ok"] * 3
    with pytest.raises(errors.CapacityExceeded) as exc:
        policy.place(request(4), nodes)
    assert exc.value.retryable


def test_plugins_filter_and_score():
    class PreferB:
        @hookimpl
        def dsec_placement_score(self, node, request):
            return 1.0 if node.name == "b" else None

        @hookimpl
        def dsec_placement_filter(self, node, request):
            return node.name != "c"

    policy = LeastLoaded(Hooks.load(plugins=[PreferB()], guards=[]))
    placed = Counter(policy.place(request(10), [node("a"), node("b"), node("c")]))
    assert placed == {"b": 10}
