"""Placement policies: least-loaded, bin-pack, spread-by-job; layer locality; cloud burst."""

from collections import Counter

import pytest
from dsec_placement_basic import BinPack, LeastLoaded, SpreadByJob

from dsec_kernel.contract import errors
from dsec_kernel.contract.hookspecs import hookimpl
from dsec_kernel.contract.placement import NodeView, PlacementRequest
from dsec_kernel.contract.wire import (
    BackendInfo,
    Capabilities,
    Env,
    NodeInfo,
    NodeLoad,
    SandboxSpec,
)
from dsec_kernel.loader import load_hooks

HOOKS = load_hooks(guards=[])


def make(policy, **config):
    """``policy`` as the apiserver loads it: its Config validated, the hooks given."""
    return policy(policy.Config.model_validate(config), HOOKS)


def node(name, cap=100, used=0, state="up", backend="noop", pool="default", layers=()):
    return NodeView(
        NodeInfo(
            node=name,
            edge_id=name,
            state=state,
            pool=pool,
            layers=list(layers),
            backends=[BackendInfo(name=backend, capabilities=Capabilities(max_sandboxes=cap))],
            load=NodeLoad(sandboxes=used, by_backend={backend: used}),
        )
    )


def request(count, backend="noop", jobs=None, **spec):
    return PlacementRequest("t", SandboxSpec(backend=backend, **spec), count, jobs or {})


def test_spreads_evenly_and_fills_by_ratio():
    policy = make(LeastLoaded)
    placed = Counter(policy.place(request(30), [node("a"), node("b"), node("c")]))
    assert placed == {"a": 10, "b": 10, "c": 10}
    placed = Counter(
        policy.place(request(30), [node("big", cap=200, used=0), node("small", cap=50, used=25)])
    )
    assert placed["big"] > placed["small"]


def test_skips_down_full_and_other_backend_nodes():
    policy = make(LeastLoaded)
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

    policy = LeastLoaded(LeastLoaded.Config(), load_hooks(plugins=[PreferB()], guards=[]))
    placed = Counter(policy.place(request(10), [node("a"), node("b"), node("c")]))
    assert placed == {"b": 10}


def test_bin_pack_fills_the_fullest_node_first():
    policy = make(BinPack)
    nodes = [node("a", cap=10, used=2), node("b", cap=10, used=7), node("c", cap=10)]
    assert Counter(policy.place(request(5), nodes)) == {"b": 3, "a": 2}


def test_spread_by_job_puts_one_job_on_as_many_nodes_as_it_can():
    policy = make(SpreadByJob)
    nodes = [node("a", used=90), node("b"), node("c"), node("d")]
    placed = Counter(policy.place(request(4, job="j"), nodes))
    assert placed == {"a": 1, "b": 1, "c": 1, "d": 1}  # even the busy node: the job spreads
    already = {"b": 2, "c": 2, "d": 2}
    placed = Counter(policy.place(request(3, job="j", jobs=already), nodes))
    assert placed["a"] >= 2, placed
    assert Counter(policy.place(request(3), nodes))["a"] == 0  # no job: least loaded


def test_nodes_with_the_layers_cached_are_preferred():
    env = Env(base="py:3", workspace="repo:1")
    nodes = [
        node("cold"),
        node("warm", used=10, layers=["py:3", "repo:1"]),
        node("half", layers=["py:3"]),
    ]
    placed = Counter(make(LeastLoaded).place(request(1, env=env), nodes))
    assert placed == {"warm": 1}
    placed = Counter(make(LeastLoaded, locality_weight=0).place(request(1, env=env), nodes))
    assert placed["warm"] == 0


def test_a_tenants_own_layers_count_as_cached_for_it_alone():
    env = Env(base="py:3", workspace="repo:1")  # request() asks as tenant "t"
    nodes = [
        node("cold"),
        node("mine", used=10, layers=["py:3", "t/repo:1"]),  # t's own repo:1
        node("theirs", used=10, layers=["py:3", "u/repo:1"]),  # u's, not t's
    ]
    assert Counter(make(LeastLoaded).place(request(1, env=env), nodes)) == {"mine": 1}
    nodes = [node("cold"), node("theirs", used=10, layers=["u/py:3", "u/repo:1"])]
    assert Counter(make(LeastLoaded).place(request(1, env=env), nodes)) == {"cold": 1}


def test_the_cloud_pool_takes_sandboxes_only_past_the_threshold():
    policy = make(LeastLoaded)  # burst_pool "cloud" at 80 %
    cloud = node("c1", pool="cloud")
    assert set(policy.place(request(10), [node("p1", cap=100, used=50), cloud])) == {"p1"}
    assert set(policy.place(request(10), [node("p1", cap=100, used=85), cloud])) == {"c1"}
    # on-prem cannot take them all: the overflow goes to the cloud
    placed = Counter(policy.place(request(20), [node("p1", cap=100, used=50, state="up"),
                                                node("p2", cap=10, used=0), cloud]))  # fmt: skip
    assert placed["c1"] == 0  # 60 free on-prem: enough
    placed = Counter(policy.place(request(20), [node("p1", cap=20, used=10), cloud]))
    assert placed["c1"] >= 10  # at least what on-prem has no room for
    assert set(make(BinPack).place(request(5), [node("p1", used=10), cloud])) == {"p1"}
    # full nodes count towards the fill too: 17 of 20 on-prem is past 80 %
    full_and_busy = [node("p1", cap=10, used=10), node("p2", cap=10, used=7), cloud]
    assert set(policy.place(request(2), full_and_busy)) == {"c1"}


def test_nodes_short_of_memory_or_overloaded_are_avoided():
    calm, short = node("calm", used=30), node("short", used=10)
    short.info.memory_mb, short.info.load.mem_available_mb = 1000, 50  # 95 % of memory used
    calm.info.memory_mb, calm.info.load.mem_available_mb = 1000, 600
    assert make(LeastLoaded).place(request(1), [short, calm]) == ["calm"]
    hot = node("hot", used=10)
    hot.info.load.cpu_load = 2.0  # twice as many runnable tasks as CPUs
    assert make(LeastLoaded).place(request(1), [hot, node("cool", used=30)]) == ["cool"]
    warm = node("warm")
    warm.info.load.cpu_load = 0.6  # busy, not overloaded: only breaks a tie
    assert make(LeastLoaded).place(request(1), [warm, node("idle", used=1)]) == ["warm"]
    assert make(LeastLoaded).place(request(1), [warm, node("idle")]) == ["idle"]
