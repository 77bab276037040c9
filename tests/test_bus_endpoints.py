"""Endpoints declared once (``bus.Endpoint``): the bus parses the request, resolves the
caller's tenant and maps errors; ``$SRV.STATS`` counts errors and the time from a request's
receipt to its reply. Against a real nats-server (one for the module)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import pytest
from pydantic import BaseModel, Field

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.natsserver import NatsServer

ALICE = "alice-token"
TENANTS = {bus.token_key(ALICE): "alice"}


class Greet(BaseModel):
    name: str
    times: int = Field(default=1, ge=1)


class Greeting(BaseModel):
    text: str


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with NatsServer(tmp_path_factory.mktemp("bus") / "nats", follow_tenants=False) as server:
        yield server


@pytest.fixture
async def nc(server):
    nc = await bus.connect(server.service_url, name="bus-test")
    try:
        yield nc
    finally:
        await bus.disconnect(nc)


async def authenticate(key: str) -> str | None:
    return TENANTS.get(key)


@pytest.fixture
async def serve(nc):
    """``await serve(endpoints, **options)``: a service of its own name on ``nc``, whose
    endpoints are ``test.<name>.<op>``; returns the name and the subject of each op."""
    drains = []

    async def start(endpoints: dict, **options):
        name = f"t{uuid.uuid4().hex[:8]}"
        subjects = {op: f"test.{name}.{op}" for op in endpoints}
        _, drain = await bus.serve(
            nc,
            name=name,
            version="1.0.0",
            description="a test service",
            queue_group=name,
            endpoints={subjects[op]: e for op, e in endpoints.items()},
            **{"authenticate": authenticate, **options},
        )
        drains.append(drain)
        return name, subjects

    yield start
    for drain in drains:
        await drain()


async def ask(nc, subject: str, body: BaseModel | bytes, token: str | None = ALICE) -> Greeting:
    headers = {bus.TOKEN_HEADER: token} if token else {}
    return await bus.request(nc, subject, body, Greeting, timeout=5, headers=headers)


async def stats(nc, name: str) -> dict[str, dict]:
    """The service's endpoint stats from ``$SRV.STATS.<name>``, by subject."""
    msg = await nc.request(f"$SRV.STATS.{name}", b"", timeout=2)
    reply = json.loads(msg.data)
    assert reply["type"] == "io.nats.micro.v1.stats_response"
    return {e["subject"]: e for e in reply["endpoints"]}


async def test_a_declared_endpoint_gets_its_parsed_request_and_tenant(nc, serve):
    seen = []

    async def greet(r: Greet, call: bus.Call) -> Greeting:
        seen.append((r, call.tenant, call.subject, call.headers.get(bus.TOKEN_HEADER)))
        left = call.time_left()
        assert left is not None and 3 < left <= 5  # what the caller's Dsec-Timeout said
        return Greeting(text=f"hello {r.name} from {call.tenant}" * r.times)

    async def raw(body: bytes, call: bus.Call) -> bytes:
        assert body == call.data
        return Greeting(text=body.decode()).model_dump_json().encode()

    _, at = await serve(
        {"greet": bus.Endpoint(greet, request=Greet, tenant=True), "raw": bus.Endpoint(raw)}
    )
    assert (await ask(nc, at["greet"], Greet(name="bob"))).text == "hello bob from alice"
    assert seen == [(Greet(name="bob"), "alice", at["greet"], ALICE)]
    assert (await ask(nc, at["raw"], b"as it came", token=None)).text == "as it came"


async def test_a_bad_body_is_an_invalid_argument_naming_the_field(nc, serve):
    async def greet(r: Greet, call: bus.Call) -> Greeting:
        raise AssertionError("not called")

    _, at = await serve({"greet": bus.Endpoint(greet, request=Greet, tenant=True)})
    with pytest.raises(errors.InvalidArgument, match=r"^\[invalid_argument\] times: must be >= 1"):
        await ask(nc, at["greet"], b'{"name": "bob", "times": 0}')
    with pytest.raises(errors.InvalidArgument, match="name: Field required"):
        await ask(nc, at["greet"], b"{}")
    with pytest.raises(errors.InvalidArgument, match="Invalid JSON"):
        await ask(nc, at["greet"], b"{not json")


async def test_a_tenant_endpoint_refuses_a_caller_without_a_known_credential(nc, serve):
    ran = []

    async def greet(r: Greet, call: bus.Call) -> Greeting:
        ran.append(r)
        return Greeting(text="")

    name, at = await serve({"greet": bus.Endpoint(greet, request=Greet, tenant=True)})
    for token in (None, "someone-elses"):
        with pytest.raises(errors.Unauthenticated, match="missing or unknown credential"):
            await ask(nc, at["greet"], b"{not even json", token=token)  # (before the body)
    assert ran == []
    assert (await stats(nc, name))[at["greet"]]["num_errors"] == 2


async def test_serving_a_tenant_endpoint_needs_authenticate(nc, serve):
    async def greet(r: Greet, call: bus.Call) -> Greeting:
        return Greeting(text="")

    with pytest.raises(ValueError, match="authenticate"):
        await serve({"greet": bus.Endpoint(greet, request=Greet, tenant=True)}, authenticate=None)


async def test_stats_count_error_replies_and_time_to_the_reply(nc, serve):
    """An Unsupported raised after 50 ms is an error in ``$SRV.STATS``, and the endpoint's
    processing time is that of the whole request (nats.micro alone counted 0 errors and the
    microseconds it took to start the request's task)."""

    async def slow(r: Greet, call: bus.Call) -> Greeting:
        await asyncio.sleep(0.05)
        if r.name == "no":
            raise errors.Unsupported("not this one\nsecond line")
        return Greeting(text="yes")

    name, at = await serve({"slow": bus.Endpoint(slow, request=Greet)})
    assert (await ask(nc, at["slow"], Greet(name="yes"))).text == "yes"
    with pytest.raises(errors.Unsupported, match="not this one"):
        await ask(nc, at["slow"], Greet(name="no"))
    s = (await stats(nc, name))[at["slow"]]
    assert s["num_requests"] == 2 and s["num_errors"] == 1, s
    assert s["last_error"] == "unsupported:not this one second line", s
    assert 50e6 <= s["average_processing_time"] < 1e9, s
    assert s["processing_time"] == pytest.approx(2 * s["average_processing_time"], abs=1)
    assert s["queue_group"] == name and s["name"] == at["slow"].replace(".", "-")


async def test_stats_count_refusals_for_the_limits(nc, serve):
    release = asyncio.Event()

    async def wait(r: Greet, call: bus.Call) -> Greeting:
        await release.wait()
        return Greeting(text="done")

    name, at = await serve({"wait": bus.Endpoint(wait, request=Greet)}, per_caller=1)
    first = asyncio.ensure_future(ask(nc, at["wait"], Greet(name="a")))
    await asyncio.sleep(0.1)
    with pytest.raises(errors.QueueFull, match="in flight"):
        await ask(nc, at["wait"], Greet(name="b"))
    s = (await stats(nc, name))[at["wait"]]
    assert (s["num_requests"], s["num_errors"]) == (1, 1), "the refusal, answered"
    assert s["last_error"].startswith("queue_full:this credential has 1 requests in flight")
    release.set()
    assert (await first).text == "done"
    assert (await stats(nc, name))[at["wait"]]["num_requests"] == 2


async def test_an_unexpected_failure_is_internal_with_a_log_reference(nc, serve, caplog):
    async def broken(r: Greet, call: bus.Call) -> Greeting:
        raise RuntimeError("/srv/secret/path")

    name, at = await serve({"broken": bus.Endpoint(broken, request=Greet)})
    with (
        caplog.at_level(logging.ERROR, logger="dsec_kernel.bus.endpoints"),
        pytest.raises(errors.Internal, match=r"ref [0-9a-f]{8} in the log") as exc,
    ):
        await ask(nc, at["broken"], Greet(name="x"))
    assert "/srv/secret" not in str(exc.value)
    ref = str(exc.value).split("ref ")[1][:8]
    assert any(ref in r.getMessage() and r.exc_info for r in caplog.records)
    assert (await stats(nc, name))[at["broken"]]["last_error"].startswith("internal:")


async def test_a_request_not_accepted_is_dropped_and_counted(nc, serve):
    async def greet(r: Greet, call: bus.Call) -> Greeting:
        raise AssertionError("not called")

    name, at = await serve({"greet": bus.Endpoint(greet, request=Greet)}, accept=lambda req: False)
    with pytest.raises(errors.DeadlineExceeded):
        await bus.request(nc, at["greet"], Greet(name="x"), Greeting, timeout=0.3)
    s = (await stats(nc, name))[at["greet"]]
    assert (s["num_requests"], s["num_errors"]) == (1, 1) and s["last_error"].startswith("dropped")


async def test_plain_handlers_are_served_beside_declared_ones(nc, serve):
    async def plain(req: bus.Request) -> Greeting:
        r = Greet.model_validate_json(req.data)
        if r.name == "no":
            raise errors.Unsupported("no")
        return Greeting(text=f"plain {r.name}")

    name, at = await serve({"plain": plain})
    assert (await ask(nc, at["plain"], Greet(name="x"))).text == "plain x"
    with pytest.raises(errors.InvalidArgument, match="name: Field required"):
        await ask(nc, at["plain"], b"{}")
    with pytest.raises(errors.Unsupported):
        await ask(nc, at["plain"], Greet(name="no"))
    s = (await stats(nc, name))[at["plain"]]
    assert (s["num_requests"], s["num_errors"]) == (3, 2), s


async def test_ping_and_info_still_answer(nc, serve):
    async def greet(r: Greet, call: bus.Call) -> Greeting:
        return Greeting(text="")

    name, at = await serve({"greet": bus.Endpoint(greet, request=Greet)})
    ping = json.loads((await nc.request(f"$SRV.PING.{name}", b"", timeout=2)).data)
    info = json.loads((await nc.request(f"$SRV.INFO.{name}", b"", timeout=2)).data)
    assert ping["name"] == name and ping["type"] == "io.nats.micro.v1.ping_response"
    assert [e["subject"] for e in info["endpoints"]] == [at["greet"]]


async def test_a_call_made_while_handling_a_request_waits_less_than_its_caller(nc, serve):
    """One deadline along the path: the inner service hears a shorter wait than the outer
    one did (by deadline.MARGIN_S), and gives up first."""
    heard: dict[str, float | None] = {}

    async def inner(r: bytes, call: bus.Call) -> Greeting:
        heard["inner"] = call.time_left()
        await asyncio.sleep(4)  # longer than anyone waits
        return Greeting(text="late")

    _, inner_subjects = await serve({"slow": bus.Endpoint(inner)})

    async def outer(r: bytes, call: bus.Call) -> Greeting:
        heard["outer"] = call.time_left()
        # asks for 60 s, yet waits what its own caller left it, less the margin
        return await bus.request(nc, inner_subjects["slow"], b"", Greeting, timeout=60)

    _, subjects = await serve({"ask": bus.Endpoint(outer)})
    started = asyncio.get_running_loop().time()
    with pytest.raises(errors.DeadlineExceeded) as exc:
        await bus.request(nc, subjects["ask"], b"", Greeting, timeout=3)
    took = asyncio.get_running_loop().time() - started
    assert heard["outer"] is not None and 2.5 < heard["outer"] <= 3.0
    assert heard["inner"] is not None and heard["inner"] <= heard["outer"] - 0.9
    # the outer service's answer (its inner call timed out) reached this caller in time
    assert "no reply on test." in str(exc.value) and took < 3.0, (took, exc.value)
