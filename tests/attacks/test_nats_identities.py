"""A hostile tenant on the bus (issue 7, items 1 and 5): with its own NATS login, the attacker
snoops on inboxes while the victim works, injects replies into the victim's inbox, calls an
edge, reads and forges KV, and guesses other logins; the services' environments, which
every sandbox's processes descend from, are searched for the service password.

What must hold: a tenant's login publishes only to the API subjects and hears only its own
inbox; the apiserver answers only into the inbox of the token a request carries; the service
password is in no process environment.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest

import dsec_kernel as dsec
from dsec_kernel import bus
from dsec_kernel.bus.replies import replies_of
from dsec_kernel.contract import errors
from dsec_kernel.state.facade import ClusterState

BUSYBOX = dsec.Env(base="busybox:1")


async def work(platform, client: dsec.AsyncClient) -> dsec.Sandbox:
    """A sandbox that execs and holds files: container if it runs here, else fncall."""
    if "container" in platform.backends:
        [sb] = await client.create(count=1, backend="container", env=BUSYBOX)
    elif "fncall" in platform.backends:
        [sb] = await client.create(count=1, backend="fncall")
    else:
        pytest.skip("neither the container nor the fncall backend runs on this machine")
    return sb


def refused(seen: list[str], kind: str, subject: str) -> bool:
    return f'violation for {kind} to "{subject.lower()}"' in "\n".join(seen)


async def test_snooping_on_inboxes_while_the_victim_works(
    platform, victim, attacker, attack, nats_as
):
    sb = await work(platform, victim)
    nc, seen = await nats_as(platform.attacker.url, platform.attacker.token)
    heard: list[str] = []

    async def hear(msg) -> None:
        heard.append(msg.subject)

    victim_inbox = bus.Login.for_token(platform.victim.token).inbox_prefix
    snoops = ("_INBOX.>", ">", "_I.>", f"{victim_inbox}.>", "_I.*.>")
    try:
        for subject in snoops:
            await nc.subscribe(subject, cb=hear)
        await nc.flush()
        secret = uuid.uuid4().hex
        await sb.write_file("/tmp/secret", secret)
        assert (await sb.exec(["cat", "/tmp/secret"])).stdout == secret.encode()
        assert await sb.read_file("/tmp/secret") == secret.encode()
        await asyncio.sleep(0.3)
        assert heard == []
        assert all(refused(seen, "subscription", s) for s in snoops), seen
        attack("snoop _INBOX.>, >, _I.> and the victim's inbox during exec and read_file", "-",
               "permissions violation; not a message heard")  # fmt: skip
    finally:
        await nc.close()
        await victim.destroy([sb])


async def test_reply_injection_into_the_victims_inbox(platform, victim, attacker, attack, nats_as):
    sb = await work(platform, victim)
    nc, seen = await nats_as(platform.attacker.url, platform.attacker.token)
    watch, _ = await nats_as(
        platform.victim.url, platform.victim.token
    )  # the victim's own view of its inbox
    victim_inbox = bus.Login.for_token(platform.victim.token).inbox_prefix
    pending = (await replies_of(victim._nc)).prefix + "."  # where the victim's replies come
    heard: list[str] = []

    async def hear(msg) -> None:
        heard.append(msg.subject)

    try:
        await watch.subscribe(f"{victim_inbox}.>", cb=hear)
        await watch.flush()
        running = asyncio.ensure_future(sb.exec(["sh", "-c", "sleep 1; echo real"]))
        await asyncio.sleep(0.3)
        targets = [f"{pending}forged", f"{victim_inbox}.forged"]
        for target in targets:  # directly: the attacker may not publish there
            await nc.publish(target, b'{"stdout": "Zm9yZ2Vk"}')
        own = {bus.TOKEN_HEADER: platform.attacker.token}
        for target in targets:  # through the apiserver: it answers only into the token's inbox
            await nc.publish(bus.api_subject("list"), b"{}", reply=target, headers=own)
        await nc.flush()
        result = await running
        assert result.stdout == b"real\n"
        await asyncio.sleep(0.3)
        assert not [s for s in heard if s.endswith("forged")], heard
        assert all(refused(seen, "publish", t) for t in targets), seen
        attack("inject replies into the victim's inbox, directly and through the apiserver", "-",
               "publish refused; the apiserver drops it; the victim got its result")  # fmt: skip
    finally:
        await nc.close()
        await watch.close()
        await victim.destroy([sb])


async def test_calling_an_edge_and_reading_or_forging_kv(
    platform, victim, attacker, attack, nats_as
):
    sb = await work(platform, victim)
    nc, seen = await nats_as(platform.attacker.url, platform.attacker.token)
    service = await bus.connect(platform.cluster.url, name="attack-check")
    state = await ClusterState.open(service, create=False)
    tenants_before = await state.tenant_logins()
    forged_key = bus.token_key("dsec_attacker-chosen")
    try:
        destroy = json.dumps({"ids": [sb.id]}).encode()
        for op in ("destroy", "exec", "file.read"):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await nc.request(bus.edge_subject(sb.node, op), destroy, timeout=1)
        with pytest.raises(nats.errors.TimeoutError):  # the JetStream API is not the tenant's
            await nc.request("$JS.API.STREAM.LIST", b"{}", timeout=1)
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request("$JS.API.STREAM.MSG.GET.KV_dsec-tenants", b'{"seq": 1}', timeout=1)
        record = {"tenant": "victim", "created_at": 0, "nats_password": "$2b$04$forged"}
        await nc.publish(f"$KV.dsec-tenants.{forged_key}", json.dumps(record).encode())
        await nc.flush()
        await asyncio.sleep(0.3)
        for subject in (
            bus.edge_subject(sb.node, "destroy"),
            "$JS.API.STREAM.LIST",
            f"$KV.dsec-tenants.{forged_key}",
        ):
            assert refused(seen, "publish", subject), seen
        assert (await sb.exec(["echo", "alive"])).stdout == b"alive\n"
        assert await state.tenant_logins() == tenants_before
        attack("call the victim's edge (destroy, exec, read), $JS.API, forge $KV.dsec-tenants",
               "-", "permissions violation; sandbox and tenants bucket untouched")  # fmt: skip
    finally:
        await nc.close()
        await bus.disconnect(service)
        await victim.destroy([sb])


async def test_guessing_other_logins(platform, attack):
    address = platform.attacker.url
    guesses = [
        bus.Login(bus.Login.for_token(platform.victim.token).user, "dsec_guessed"),
        bus.Login("dsec-service", "guessed"),
        bus.Login("dsec-client", "guessed"),  # the shared client user of old
    ]
    for guess in guesses:
        with pytest.raises(errors.Unauthenticated):
            await bus.connect(address, name="attacker", login=guess, timeout=5)
    attack("log in as the victim's NATS user, the service user, the old shared client user",
           "-", "authorization violation")  # fmt: skip


def test_the_service_password_is_in_no_process_environment(platform, attack):
    """What a sandbox's processes could inherit from the services (issue 7, item 1)."""
    cluster = platform.cluster
    password = cluster.nats.login.password.encode()
    children = [*cluster.apiservers, *cluster.edges.values()]
    for child in children:
        environ = Path(f"/proc/{child.proc.pid}/environ").read_bytes()
        assert password not in environ, child.name
        assert b"DSEC_NATS_LOGIN_FILE=" in environ  # the path only
    attack("find the service password in the edge's and apiserver's environment", "-",
           "not there: services read it from a 0600 file")  # fmt: skip


async def raw_nats(url: str, token: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A NATS connection spoken by hand, logged in as the tenant: it can send frames no
    client library would."""
    login = bus.Login.for_token(token)
    where = urlsplit(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    await reader.readline()  # INFO
    connect = {"user": login.user, "pass": login.password, "verbose": False,
               "pedantic": False, "headers": True, "protocol": 1}  # fmt: skip
    writer.write(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
    await writer.drain()
    await pong(reader)
    return reader, writer


async def pong(reader: asyncio.StreamReader) -> None:
    """Wait for the server's PONG (skipping the INFO it may send first)."""
    while not (line := await asyncio.wait_for(reader.readline(), 5)).startswith(b"PONG"):
        assert line.startswith(b"INFO"), line


async def test_an_unreadable_request_deafens_no_service(platform, victim, attacker, attack):
    """Reply subjects and headers that are not UTF-8 (nats-py raised on them in its read loop,
    which then stopped: the apiserver heard nothing for minutes): the victim is answered."""
    inbox = bus.Login.for_token(platform.attacker.token).inbox_prefix.encode()
    reader, writer = await raw_nats(platform.attacker.url, platform.attacker.token)
    try:
        header = b"NATS/1.0 \xff\xff\xff\r\n\r\n"
        frames = [
            b"PUB dsec.api.v1.list " + inbox + b".\xff 2\r\n{}\r\n",
            b"HPUB dsec.api.v1.list " + inbox + b".x %d %d\r\n" % (len(header), len(header) + 2)
            + header + b"{}\r\n",
        ]  # fmt: skip
        for frame in frames:
            writer.write(frame + b"PING\r\n")
            await writer.drain()
            await pong(reader)
        await asyncio.sleep(0.5)
        for _ in range(3):
            assert isinstance(await asyncio.wait_for(victim.list(), 10), list)
        attack("requests with a reply subject and headers that are not UTF-8", "-",
               "dropped; the apiserver answers the victim at once")  # fmt: skip
    finally:
        writer.close()
