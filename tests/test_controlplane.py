"""The control plane on a real nats-server: apiservers and edges in this process (noop backend).

Covers placement across edges, batching, tenants, bad input, TTLs, several apiservers,
apiserver restarts, nodes going down, edge reconciliation, and admission control (a full
cluster queues creates and answers every one, bounded queues, quotas).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import pytest
from dsec_placement_basic import LeastLoaded

import dsec_kernel as dsec
from dsec_kernel import bus
from dsec_kernel.apiserver import ApiServer
from dsec_kernel.bus.serving import InFlight
from dsec_kernel.cluster import ensure_tenant
from dsec_kernel.config import ApiSettings, EdgeSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import Backend, Capabilities, SandboxRef, SandboxStatus
from dsec_kernel.contract.wire import (
    CreateRequest,
    CreateResponse,
    EdgeSandbox,
    Limits,
    ListRequest,
    ListResponse,
    Quota,
    SandboxSpec,
)
from dsec_kernel.edge import Edge, load_backends
from dsec_kernel.loader import load_hooks
from dsec_kernel.natsserver import NatsServer
from dsec_kernel.state.facade import ClusterState

HEARTBEAT = 0.2
NODE_TIMEOUT = 1.5


class Platform:
    """apiservers and edges sharing one real nats-server, all in this event loop."""

    def __init__(self, server: NatsServer, tmp_path) -> None:
        self.url = server.service_url
        self.client_url = server.client_url
        self.tmp = tmp_path
        self.apis: list[ApiServer] = []
        self.edges: dict[str, Edge] = {}
        self.conns = []

    async def _nc(self, name: str):
        nc = await bus.connect(self.url, name=name)
        self.conns.append(nc)
        return nc

    async def add_apiserver(self, **cfg) -> ApiServer:
        hooks = load_hooks(guards=[])
        settings = ApiSettings(
            nats_url=self.url, node_timeout_s=NODE_TIMEOUT, heartbeat_s=HEARTBEAT, **cfg
        )
        api = ApiServer(
            await self._nc("api"), settings, hooks, LeastLoaded(LeastLoaded.Config(), hooks)
        )
        await api.start()
        self.apis.append(api)
        return api

    async def add_edge(self, node: str, backends: dict[str, Backend] | None = None, **cfg) -> Edge:
        settings = EdgeSettings(
            nats_url=self.url,
            node=node,
            state_dir=self.tmp / node,
            backends=["noop"],
            heartbeat_s=HEARTBEAT,
            **cfg,
        )
        if backends is None:
            backends, _ = load_backends(settings)
        edge = Edge(
            await self._nc(node), settings, backends, load_hooks(guards=[]),
            connect=lambda: bus.connect(self.url, name=f"{node}-heartbeat"),
        )  # fmt: skip
        await edge.start()
        self.edges[node] = edge
        return edge

    async def stop_edge(self, node: str) -> None:
        await self.edges.pop(node).stop()

    async def crash_edge(self, node: str) -> None:
        """As if the node died: its connection goes first, so it cannot say it stops."""
        edge = self.edges.pop(node)
        assert edge.heartbeat is not None
        await asyncio.to_thread(edge.heartbeat.stop)  # (its thread dies with the process)
        await edge.nc.close()
        await edge.stop()

    async def tenant(self, name: str) -> dsec.AsyncClient:
        conn = await ensure_tenant(self.url, name, client_url=self.client_url)
        return await dsec.AsyncClient(url=conn.url, token=conn.token).connect()

    async def close(self) -> None:
        for edge in self.edges.values():
            await edge.stop()
        for api in self.apis:
            await api.stop()
        for nc in self.conns:
            await nc.close()


@pytest.fixture
async def platform(tmp_path):
    with NatsServer(tmp_path / "nats") as server:
        p = Platform(server, tmp_path)
        await p.add_apiserver()
        yield p
        await p.close()


async def until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def test_placement_spreads_sandboxes_across_three_edges(platform):
    for node in ("e1", "e2", "e3"):
        await platform.add_edge(node)
    c = await platform.tenant("alice")
    sbs = await c.create(count=30, backend="noop")
    assert Counter(sb.node for sb in sbs) == {"e1": 10, "e2": 10, "e3": 10}
    more = await c.create(count=3, backend="noop")
    assert Counter(sb.node for sb in more) == {"e1": 1, "e2": 1, "e3": 1}
    await until(lambda: _loads(c, {"e1": 11, "e2": 11, "e3": 11}))
    await c.destroy(sbs + more)
    assert sum(len(e.sandboxes) for e in platform.edges.values()) == 0
    await c.close()


async def _loads(c, want):
    return {n.node: n.load.sandboxes for n in await c.nodes()} == want


async def test_big_creates_are_batched_and_all_listed(platform):
    await platform.add_edge("e1")
    c = await platform.tenant("alice")
    seen = []
    sbs = await c.create(
        count=1200,
        backend="noop",
        batch_size=500,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert len({sb.id for sb in sbs}) == 1200 and len(seen) == 3 and seen[-1] == (1200, 1200)
    assert len(await c.list()) == 1200
    assert len(await c.destroy(sbs)) == 1200
    assert await c.list() == []
    await c.close()


async def test_list_comes_in_pages_by_id(platform):
    await platform.add_edge("e1", backend_config={"noop": {"max_sandboxes": 2000}})
    c = await platform.tenant("alice")
    sbs = await c.create(count=1200, backend="noop")  # (two batches)
    listed = [sb.id for sb in await c.list()]
    assert listed == sorted(sb.id for sb in sbs)
    page = await c._call("list", ListRequest(limit=10), ListResponse)
    assert len(page.sandboxes) == 10 and page.next == page.sandboxes[-1].id
    rest = await c._call("list", ListRequest(after=page.next, limit=1000), ListResponse)
    assert [i.id for i in page.sandboxes + rest.sandboxes] == listed[:1010]
    await c.destroy(sbs)
    await c.close()


async def test_tenants_see_and_touch_only_their_own(platform):
    await platform.add_edge("e1")
    alice = await platform.tenant("alice")
    bob = await platform.tenant("bob")
    sbs = await alice.create(count=2, backend="noop", labels={"job": "a"})
    assert await bob.list() == []
    with pytest.raises(errors.NotFound):
        await bob.get(sbs[0].id)
    assert [(r.found, r.error) for r in await bob.destroy(sbs)] == [(False, None)] * 2
    assert {type(r.error) for r in await bob.exec_many(sbs, "true")} == {errors.NotFound}
    assert len(await alice.list(labels={"job": "a"})) == 2
    assert await alice.list(labels={"job": "b"}) == []
    with pytest.raises(errors.Unauthenticated):  # NATS has no login for an unknown token
        await dsec.AsyncClient(url=platform.client_url, token="dsec_wrong").connect()
    with pytest.raises(errors.DeadlineExceeded):  # no token: no inbox the answer may go to
        await bus.request_raw(alice._nc, bus.api_subject("list"), b"{}", timeout=1)
    await alice.destroy(sbs)
    await alice.close()
    await bob.close()


async def test_bad_input_gets_typed_errors_and_changes_nothing(platform):
    await platform.add_edge("e1")
    c = await platform.tenant("alice")
    with pytest.raises(errors.UnknownBackend, match="noop"):
        await c.create(count=1, backend="nope")
    with pytest.raises(errors.InvalidArgument):
        await c.create(count=0, backend="noop")
    with pytest.raises(errors.InvalidArgument, match=r"ttl: must be > 0"):  # as the SDK names it
        await c.create(count=1, backend="noop", ttl=-5)
    with pytest.raises(errors.InvalidArgument, match="labels"):
        await c.create(count=1, backend="noop", labels={"k": "v" * 257})
    forked = SandboxSpec(backend="noop", snapshot="snap-" + "0" * 16)
    with pytest.raises(errors.Unsupported, match="snapshot"):
        await c._call("create", CreateRequest(spec=forked), CreateResponse)
    headers = c._headers
    for raw in (
        b"not json",
        b'{"type": "io.dsec.sandbox.v1.create_request"}',
        json.dumps({"spec": {"backend": "noop"}, "count": 10**6}).encode(),
        json.dumps({"spec": {"backend": "noop", "ttl_s": -1}}).encode(),
    ):
        with pytest.raises(errors.InvalidArgument):
            await bus.request_raw(c._nc, bus.api_subject("create"), raw, timeout=5, headers=headers)
    with pytest.raises(errors.InvalidArgument):
        await bus.request_raw(
            c._nc,
            bus.api_subject("exec"),
            json.dumps(
                {"sandbox_ids": ["sb-0123456789abcdef"], "command": "x", "timeout_s": -3}
            ).encode(),
            timeout=5,
            headers=headers,
        )
    sbs = await c.create(count=1, backend="noop")
    with pytest.raises(errors.Unsupported):
        await sbs[0].exec("true")
    with pytest.raises(errors.Unsupported):
        await sbs[0].read_file("/etc/hostname")
    assert [sb.id for sb in await c.list()] == [sbs[0].id]
    await c.destroy(sbs)
    await c.close()


async def test_the_apiservers_stats_count_its_typed_errors(platform):
    """An endpoint's error reply (here the apiserver's own Unsupported) is counted in
    ``$SRV.STATS.dsec-apiserver``, which the bus keeps for every declared endpoint."""
    c = await platform.tenant("alice")
    with pytest.raises(errors.Unsupported, match="no node serves 'python' fncalls"):
        await c.fncall("print(1)")
    await c.list()
    nc = await platform._nc("stats")
    reply = json.loads((await nc.request("$SRV.STATS.dsec-apiserver", b"", timeout=2)).data)
    by_subject = {e["subject"]: e for e in reply["endpoints"]}
    fncall, listed = by_subject[bus.api_subject("fncall")], by_subject[bus.api_subject("list")]
    assert (fncall["num_requests"], fncall["num_errors"]) == (1, 1), fncall
    assert fncall["last_error"] == "unsupported:no node serves 'python' fncalls", fncall
    assert (listed["num_requests"], listed["num_errors"]) == (1, 0), listed
    await c.close()


class Flaky(Backend):
    """Fails the n-th create with a non-retryable error."""

    name = "noop"
    capabilities = Capabilities(exec=False, files=False, max_sandboxes=1000)

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.made = 0
        self.ids: set[str] = set()

    async def create(self, sandbox: EdgeSandbox) -> SandboxStatus:
        self.made += 1
        if self.made == self.fail_at:
            raise errors.InvalidArgument("this node cannot make that sandbox")
        self.ids.add(sandbox.id)
        return SandboxStatus(sandbox_id=sandbox.id, state="ready")

    async def destroy(self, ref: SandboxRef) -> None:
        self.ids.discard(ref.sandbox_id)

    async def status(self, ref: SandboxRef) -> SandboxStatus:
        return SandboxStatus(sandbox_id=ref.sandbox_id, state="ready")

    async def list_sandboxes(self) -> list[str]:
        return sorted(self.ids)


async def test_a_failed_create_leaves_nothing_behind(platform):
    """A create of all or none (the wire's default) that a node fails in part leaves none;
    the SDK's create keeps what was made and reports each sandbox it could not make, of
    which nothing is left either; it raises only when it made none."""
    flaky = Flaky(fail_at=7)
    await platform.add_edge("e1", backends={"noop": flaky})
    c = await platform.tenant("alice")
    whole = CreateRequest(spec=SandboxSpec(backend="noop"), count=10)
    with pytest.raises(errors.InvalidArgument, match="cannot make"):
        await c._call("create", whole, CreateResponse)
    assert flaky.ids == set() and await c.list() == []
    state = platform.apis[0].state
    assert await state.scan_sandboxes() == {}

    flaky.made, flaky.fail_at = 0, 3
    made = await c.create(count=10, backend="noop")
    ok = [sb for sb in made if sb.error is None]
    assert len(ok) == 9 and isinstance(made[9], dsec.NotCreated), made
    assert isinstance(made[9].error, errors.InvalidArgument) and "cannot make" in str(made[9].error)
    assert flaky.ids == {sb.id for sb in ok} == {sb.id for sb in await c.list()}
    assert len(await state.scan_sandboxes()) == 9
    with pytest.raises(
        errors.InvalidArgument, match=r"node e1: this node cannot make that sandbox$"
    ):
        dsec.check(made)
    with pytest.raises(errors.InvalidArgument, match=r"sandboxes\[9\]"):
        await c.exec_many(made, "true")
    reports = await c.destroy(made)  # as create answered: the one not made, nothing to do
    assert [(r.found, r.error) for r in reports] == [(True, None)] * 9 + [(False, None)]
    assert flaky.ids == set()

    made = await c.create(count=1500, backend="noop", wait=0)  # room for 1,000 at most
    ok = [sb for sb in made if sb.error is None]
    assert 500 <= len(ok) <= 1000 and len(made) == 1500, len(ok)
    assert all(isinstance(sb.error, errors.CapacityExceeded) for sb in made[len(ok) :])
    assert made[-1].error.retryable and flaky.ids == {sb.id for sb in ok}
    with pytest.raises(errors.CapacityExceeded) as exc:  # none could be made: raised
        await c.create(count=1000, backend="noop", wait=0)
    assert exc.value.retryable
    await c.destroy(ok)
    assert flaky.ids == set()
    await c.close()


class Slow(Flaky):
    """Takes ``delay`` seconds per create."""

    def __init__(self, delay: float) -> None:
        super().__init__(fail_at=0)
        self.delay = delay

    async def create(self, sandbox: EdgeSandbox) -> SandboxStatus:
        await asyncio.sleep(self.delay)
        return await super().create(sandbox)


async def test_a_create_whose_answer_times_out_leaves_nothing_on_the_node(tmp_path):
    """The apiserver gives up on an edge that answers too late; what the edge makes all the
    same is destroyed there at once, not left to its reconciliation minutes later (nor
    counted by no quota meanwhile)."""
    with NatsServer(tmp_path / "nats") as server:
        p = Platform(server, tmp_path)
        try:
            await p.add_apiserver(edge_timeout_s=0.5)
            slow = Slow(delay=1.5)
            await p.add_edge("e1", backends={"noop": slow})
            c = await p.tenant("alice")
            with pytest.raises(errors.DsecError):
                await c.create(count=3, backend="noop", wait=0)
            await asyncio.sleep(2.0)  # the edge finishes making them
            assert slow.made == 3 and slow.ids == set(), slow.ids
            assert await c.list() == []
            await c.close()
        finally:
            await p.close()


async def test_ttl_destroys_expired_sandboxes(platform):
    await platform.add_edge("e1")
    c = await platform.tenant("alice")
    short = await c.create(count=3, backend="noop", ttl=0.5)
    long = await c.create(count=1, backend="noop", ttl=600)
    assert short[0].info.expires_at < long[0].info.expires_at
    await until(lambda: _ids(c, {long[0].id}), timeout=10)
    assert set(platform.edges["e1"].sandboxes) == {long[0].id}
    await c.destroy(long)
    await c.close()


async def _ids(c, want):
    return {sb.id for sb in await c.list()} == want


async def test_two_apiservers_share_the_work_and_survive_one_stopping(platform):
    await platform.add_apiserver()
    await platform.add_edge("e1")
    c = await platform.tenant("alice")
    sbs = await asyncio.gather(*(c.create(count=5, backend="noop") for _ in range(20)))
    assert sum(len(s) for s in sbs) == 100
    await platform.apis.pop(0).stop()
    assert len(await c.list()) == 100
    await c.destroy([sb for s in sbs for sb in s])
    await c.close()


async def test_apiserver_restart_loses_nothing(platform):
    await platform.add_edge("e1")
    c = await platform.tenant("alice")
    sbs = await c.create(count=25, backend="noop", ttl=600)
    await platform.apis.pop().stop()
    with pytest.raises(errors.Unavailable):
        await c.list()
    await platform.add_apiserver()
    assert {sb.id for sb in await c.list()} == {sb.id for sb in sbs}
    assert (await c.get(sbs[0].id)).info.expires_at == pytest.approx(sbs[0].info.expires_at)
    await c.destroy(sbs)
    await c.close()


async def test_a_silent_node_is_marked_down_and_its_sandboxes_lost(platform):
    await platform.add_edge("e1")
    await platform.add_edge("e2")
    c = await platform.tenant("alice")
    sbs = await c.create(count=10, backend="noop")
    on_e2 = [sb for sb in sbs if sb.node == "e2"]
    await platform.crash_edge("e2")
    nodes = await until(lambda: _down(c, "e2"), timeout=NODE_TIMEOUT + 5)
    assert nodes
    lost = await c.get(on_e2[0].id)
    assert lost.info.state == "lost"
    (result,) = await c.exec_many([lost], "true")
    assert isinstance(result.error, errors.SandboxLost), result
    fresh = await c.create(count=4, backend="noop")
    assert {sb.node for sb in fresh} == {"e1"}
    destroyed = await c.destroy(sbs + fresh)
    assert len(destroyed) == 14 and await c.list() == []
    await c.close()


async def _down(c, node):
    return any(n.node == node and n.state == "down" for n in await c.nodes())


async def test_an_edge_whose_loop_is_held_past_the_node_timeout_stays_up(platform):
    """Tenants' work runs on the edge's event loop; a flood of it that holds the loop past the
    node timeout does not cost the node its sandboxes: the heartbeat has a thread of its own.
    (The edge runs in a loop of its own here, as in its own process.)"""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def on_edge_loop(coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    async def start() -> Edge:
        settings = EdgeSettings(
            nats_url=platform.url, node="e1", state_dir=platform.tmp / "e1", backends=["noop"],
            heartbeat_s=HEARTBEAT,
        )  # fmt: skip
        edge = Edge(
            await bus.connect(platform.url, name="e1"), settings, load_backends(settings)[0],
            load_hooks(guards=[]), connect=lambda: bus.connect(platform.url, name="e1-beat"),
        )  # fmt: skip
        await edge.start()
        return edge

    async def stop(edge: Edge) -> None:
        await edge.stop()
        await edge.nc.close()

    edge = await on_edge_loop(start())
    try:
        c = await platform.tenant("alice")
        sbs = await c.create(count=3, backend="noop")
        loop.call_soon_threadsafe(time.sleep, NODE_TIMEOUT * 3)  # the edge's loop held
        await asyncio.sleep(NODE_TIMEOUT * 2)
        assert not await _down(c, "e1")
        assert {(await c.get(sb.id)).info.state for sb in sbs} == {"ready"}
        assert len(await c.destroy(sbs)) == 3  # (answered once the loop is free)
        await c.close()
    finally:
        await on_edge_loop(stop(edge))
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def test_an_edge_stopped_on_purpose_keeps_its_sandboxes_past_the_node_timeout(platform):
    """A restart (or an upgrade) that takes longer than the node timeout loses nothing: the
    stopping edge says so, gets no new work meanwhile, and takes its sandboxes back."""
    await platform.add_edge("e1")
    await platform.add_edge("e2")
    c = await platform.tenant("alice")
    sbs = await c.create(count=6, backend="noop")
    await platform.stop_edge("e2")
    await asyncio.sleep(NODE_TIMEOUT * 2)
    assert not await _down(c, "e2")
    assert {(await c.get(sb.id)).info.state for sb in sbs} == {"ready"}
    assert {sb.node for sb in await c.create(count=4, backend="noop")} == {"e1"}
    await platform.add_edge("e2")
    assert {sb.node for sb in await c.list()} == {"e1", "e2"}
    await c.destroy(await c.list())
    await c.close()


async def test_edge_reconciles_with_cluster_state(platform):
    edge = await platform.add_edge("e1")
    c = await platform.tenant("alice")
    kept = await c.create(count=3, backend="noop")
    noop = edge.backends["noop"]
    orphan = EdgeSandbox(
        id="sb-00000000000000aa",
        tenant="x",
        spec=SandboxSpec(backend="noop"),
        created_at=time.time(),
    )
    await noop.create(orphan)  # on the node, unknown to the cluster
    await noop.destroy(
        SandboxRef(sandbox_id=kept[0].id)
    )  # known to the cluster, gone from the node
    await edge.reconcile()
    assert orphan.id not in await noop.list_sandboxes()
    assert (await c.get(kept[0].id)).info.state == "lost"
    assert (await c.get(kept[1].id)).info.state == "ready"
    await platform.stop_edge("e1")
    restarted = await platform.add_edge("e1")  # a fresh noop backend holds nothing
    assert not restarted.sandboxes
    assert {sb.info.state for sb in await c.list()} == {"lost"}
    await c.destroy(kept)
    await c.close()


async def test_clients_reach_only_the_apiservers(platform, nats_as):
    """A tenant's NATS login cannot call edges, read or forge KV records (tenants included)."""
    import nats.errors

    edge = await platform.add_edge("e1")
    c = await platform.tenant("alice")
    [sb] = await c.create(count=1, backend="noop")
    nc, errors_seen = await nats_as(platform.client_url, c._headers[bus.TOKEN_HEADER])
    with pytest.raises((errors.DeadlineExceeded, errors.Unavailable)):
        await bus.request_raw(
            nc, bus.edge_subject("e1", "destroy"), json.dumps({"ids": [sb.id]}).encode(), timeout=1
        )
    with pytest.raises(nats.errors.TimeoutError):  # the JetStream API is not theirs to call
        await nc.jetstream(timeout=1).key_value("dsec-tenants")
    await nc.publish("$KV.dsec-tenants.x", b'{"tenant": "alice"}')
    await nc.flush()
    await asyncio.sleep(0.2)
    assert any("permissions violation" in e for e in errors_seen), errors_seen
    await nc.close()
    assert sb.id in edge.sandboxes
    await c.destroy([sb])
    await c.close()


# -- admission ---------------------------------------------------------------------------

SMALL = {"backend_config": {"noop": {"max_sandboxes": 10}}}


async def test_a_full_cluster_queues_creates_and_admits_them_as_room_frees(platform):
    await platform.add_edge("e1", **SMALL)
    c = await platform.tenant("alice")
    first = await c.create(count=10, backend="noop")
    waiting = [asyncio.ensure_future(c.create(backend="noop", wait=10)) for _ in range(5)]
    await asyncio.sleep(0.5)
    assert not any(w.done() for w in waiting), "they wait for room, not fail"
    await c.destroy(first[:5])
    made = await asyncio.wait_for(asyncio.gather(*waiting), 10)
    assert len({sb.id for group in made for sb in group}) == 5
    await c.destroy(first[5:] + [sb for group in made for sb in group])
    await c.close()


async def test_the_wait_runs_out_with_a_retryable_error_naming_the_position(platform):
    await platform.add_edge("e1", **SMALL)
    c = await platform.tenant("alice")
    full = await c.create(count=10, backend="noop")
    with pytest.raises(errors.CapacityExceeded, match="position 1") as exc:
        await c.create(backend="noop", wait=0.3)
    assert exc.value.retryable
    assert len(await c.list()) == 10  # nothing half-made
    await c.destroy(full)
    await c.close()


async def test_the_queue_of_a_tenant_is_bounded(platform):
    await platform.add_edge("e1", **SMALL)
    platform.apis[0].settings.queue_per_tenant = 3
    c = await platform.tenant("alice")
    full = await c.create(count=10, backend="noop")
    waiting = [asyncio.ensure_future(c.create(backend="noop", wait=10)) for _ in range(3)]
    await asyncio.sleep(0.3)
    with pytest.raises(errors.QueueFull) as exc:
        await c.create(backend="noop", wait=10)
    assert exc.value.retryable
    other = await platform.tenant("bob")  # another tenant's queue is its own
    bobs = asyncio.ensure_future(other.create(backend="noop", wait=10))
    await c.destroy(full[:4])
    await asyncio.wait_for(asyncio.gather(*waiting, bobs), 10)
    await c.destroy(full[4:] + [sb for w in waiting for sb in w.result()])
    await other.destroy(bobs.result())
    await c.close()
    await other.close()


async def test_a_credential_past_its_requests_in_flight_is_refused_at_once(tmp_path):
    """One tenant's requests that wait (creates queued for room) hold at most its share of
    the apiserver: one more is refused at once (QueueFull), and another tenant is answered
    meanwhile."""
    with NatsServer(tmp_path / "nats") as server:
        p = Platform(server, tmp_path)
        try:
            await p.add_apiserver(requests_per_credential=8)
            await p.add_edge("e1", **SMALL)
            alice, bob = await p.tenant("alice"), await p.tenant("bob")
            full = await alice.create(count=10, backend="noop")
            waiting = [asyncio.ensure_future(alice.create(backend="noop", wait=3))
                       for _ in range(8)]  # fmt: skip
            await asyncio.sleep(0.3)
            t = time.monotonic()
            with pytest.raises(errors.QueueFull, match="in flight") as exc:
                await alice.create(backend="noop", wait=3)
            assert exc.value.retryable and time.monotonic() - t < 1, "refused, not queued"
            assert await asyncio.wait_for(bob.list(), 1) == []
            done = await asyncio.gather(*waiting, return_exceptions=True)
            assert all(isinstance(d, errors.CapacityExceeded) for d in done), done
            await alice.destroy(full)  # its requests done: it is answered again
            await alice.close()
            await bob.close()
        finally:
            await p.close()


def test_requests_in_flight_are_bounded_by_count_and_bytes():
    """The same policy for bytes: a credential's request bodies in flight stay under
    ``caller_bytes`` (16 MiB calls queued on an edge filled three services' memory)."""
    runner = InFlight(10, 3, 100, None)
    runner.running["a"], runner.holding["a"] = 1, 10
    assert runner.refusal("a", 90) is None
    assert isinstance(runner.refusal("a", 91), errors.QueueFull)
    assert runner.refusal("b", 100) is None  # another credential's own
    runner.running["a"] = 3
    assert isinstance(runner.refusal("a", 1), errors.QueueFull)


async def test_quotas_limit_sandboxes_cpus_and_memory(platform):
    await platform.add_edge("e1")
    state = await ClusterState.open(await platform._nc("admin"))
    await state.quotas.put(
        "alice", Quota(sandboxes=5, cpus=4, memory_mb=8192).model_dump_json().encode()
    )
    c = await platform.tenant("alice")
    await until(lambda: _has_quota(platform))
    three = await c.create(count=3, backend="noop")  # 3 CPUs, 6 GiB by default
    fourth, over = await c.create(count=2, backend="noop")  # room for one CPU more
    assert fourth.error is None and isinstance(over.error, errors.QuotaExceeded), over
    assert "CPUs" in over.error.message and len(await c.list()) == 4
    with pytest.raises(errors.QuotaExceeded, match="CPUs"):  # room for none: raised
        await c.create(count=1, backend="noop")
    await c.destroy([fourth])
    again = CreateRequest(spec=SandboxSpec(backend="noop"), count=2, partial=True, request_id="r")
    first = await c._call("create", again, CreateResponse)
    assert len(first.sandboxes) == 1 and first.failed[0].error.code == "quota_exceeded"
    resent = await c._call("create", again, CreateResponse)  # (its answer lost, say)
    assert [i.id for i in resent.sandboxes] == [i.id for i in first.sandboxes]
    assert [(f.count, f.error.code) for f in resent.failed] == [(1, "unavailable")]
    await c.destroy([i.id for i in first.sandboxes])
    one = await c.create(backend="noop", limits=Limits(cpus=0.5, memory_mb=512))
    with pytest.raises(errors.QuotaExceeded, match="memory"):
        await c.create(backend="noop", limits=Limits(cpus=0.5, memory_mb=4096))
    await c.destroy(three)
    more = await c.create(count=4, backend="noop", limits=Limits(cpus=0.5, memory_mb=256))
    with pytest.raises(errors.QuotaExceeded, match="sandboxes"):
        await c.create(backend="noop", limits=Limits(cpus=0.1, memory_mb=64))
    await c.destroy(one + more)
    await c.close()


async def test_pools_fill_and_hand_out_within_the_quota(platform):
    """A warm pool is the tenant's sandboxes like any others: its fills and acquires pass
    admission, so the quota holds (a pool of 10 under a quota of 2 gave 40 sandboxes)."""
    platform.apis[0].settings.pools_per_tenant = 2
    await platform.add_edge("e1")
    state = await ClusterState.open(await platform._nc("admin"))
    await state.quotas.put("alice", Quota(sandboxes=2).model_dump_json().encode())
    c = await platform.tenant("alice")
    await until(lambda: _has_quota(platform))
    pool = await c.pool(backend="noop", size=10)
    await asyncio.sleep(1.5)  # three refill rounds
    assert len(await c.list()) == 2, "filled up to the quota, not the pool's size"
    taken = await pool.acquire_many(2)
    with pytest.raises(errors.QuotaExceeded, match="sandboxes"):
        await pool.acquire_many(20)
    await c.pool(backend="noop", size=1, name="second")
    with pytest.raises(errors.QuotaExceeded, match="pools"):
        await c.pool(backend="noop", size=1, name="third")
    await c.destroy(taken)
    await pool.close()
    await c.close()


async def _has_quota(platform) -> bool:
    return platform.apis[0].admission.quotas.get("alice") is not None
