"""One NATS identity per tenant, on a real nats-server whose logins follow the tenants bucket
(an apiserver in this process, no edge).

A tenant's login may publish only to the API subjects and subscribe only to its own inbox;
the apiserver answers only into the inbox of the token a request carries; ``dsec tenant
create`` returns once the new login works and ``dsec tenant remove`` ends it; the services
are handed no NATS password.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import sys
import time

import nats
import pytest
from dsec_placement_basic import LeastLoaded

import dsec_kernel as dsec
from dsec_kernel import bus
from dsec_kernel.apiserver import ApiServer
from dsec_kernel.cluster import LocalCluster, ensure_tenant
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract import errors
from dsec_kernel.loader import load_hooks
from dsec_kernel.natsserver import NatsServer
from dsec_kernel.state.facade import ClusterState

API_LIST = bus.api_subject("list")


@pytest.fixture
async def server(tmp_path):
    """A nats-server following the tenants bucket, with an apiserver."""
    with NatsServer(tmp_path / "nats") as server:
        nc = await bus.connect(server.service_url, name="apiserver")
        hooks = load_hooks(guards=[])
        api = ApiServer(
            nc,
            ApiSettings(nats_url=server.client_url),
            hooks,
            LeastLoaded(LeastLoaded.Config(), hooks),
        )
        await api.start()
        try:
            yield server
        finally:
            await api.stop()
            await nc.close()


async def tenant(server: NatsServer, name: str) -> str:
    return (await ensure_tenant(server.service_url, name, client_url=server.client_url)).token


async def dsec_cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec_kernel.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


def operator(server: NatsServer) -> list[str]:
    return ["--nats-url", server.client_url, "--nats-login-file", str(server.login_file)]


async def test_a_tenant_login_reaches_only_the_api_and_its_own_inbox(server, nats_as):
    a, b = await tenant(server, "alice"), await tenant(server, "bob")
    b_inbox = bus.Login.for_token(b).inbox_prefix
    nc, seen = await nats_as(server.client_url, a)
    bob_nc, _ = await nats_as(server.client_url, b)
    bob_heard: list[str] = []

    async def hear(msg) -> None:
        bob_heard.append(msg.subject)

    await bob_nc.subscribe(f"{b_inbox}.>", cb=hear)
    subs = {}
    for subject in ("_INBOX.>", ">", "_I.>", f"{b_inbox}.>", "$JS.>", "$KV.>", "dsec.>"):
        subs[subject] = await nc.subscribe(subject)
    forbidden = (
        bus.edge_subject("n1", "exec"),
        "$JS.API.INFO",
        "$JS.API.STREAM.LIST",
        "$KV.dsec-tenants.x",
        "_INBOX.x",
        f"{b_inbox}.x",
    )
    for subject in forbidden:
        await nc.publish(subject, b"{}", headers={bus.TOKEN_HEADER: a})
    await nc.flush()
    async with dsec.AsyncClient(url=server.client_url, token=b) as bob:  # bob's traffic flows
        assert await bob.list() == []
    await asyncio.sleep(0.3)
    for subject in subs:
        assert f'violation for subscription to "{subject.lower()}"' in "\n".join(seen)
    for subject in forbidden:
        assert f'violation for publish to "{subject.lower()}"' in "\n".join(seen)
    assert all(sub.pending_msgs == 0 and sub.delivered == 0 for sub in subs.values())
    assert f"{b_inbox}.x" not in bob_heard  # it heard its own replies only
    assert (await nc.request(API_LIST, b"{}", timeout=5, headers={bus.TOKEN_HEADER: a})).data
    await nc.close()
    await bob_nc.close()


async def test_the_apiserver_answers_only_into_the_inbox_of_the_token(server, nats_as):
    a, b = await tenant(server, "alice"), await tenant(server, "bob")
    nc, _ = await nats_as(server.client_url, a)
    bob_nc, _ = await nats_as(server.client_url, b)
    b_inbox = bus.Login.for_token(b).inbox_prefix
    bob_heard = await bob_nc.subscribe(f"{b_inbox}.>")
    service = await bus.connect(server.service_url, name="watcher")
    # (not all of _INBOX.>: the services' own JetStream calls are answered there)
    service_heard = [await service.subscribe(s) for s in ("_INBOX.stolen", "dsec.edge.>")]
    await bob_nc.flush()
    await service.flush()
    for reply in (f"{b_inbox}.injected", "_INBOX.stolen", bus.edge_subject("n1", "destroy"), ""):
        await nc.publish(API_LIST, b"{}", reply=reply, headers={bus.TOKEN_HEADER: a})
    await nc.flush()
    # the same request into its own inbox is answered: the others were dropped, not slow
    mine = await nc.request(API_LIST, b"{}", timeout=5, headers={bus.TOKEN_HEADER: a})
    assert json.loads(mine.data)["sandboxes"] == []
    with pytest.raises(nats.errors.TimeoutError):  # nor with no token: no inbox to answer in
        await nc.request(API_LIST, b"{}", timeout=1)
    await asyncio.sleep(0.3)
    assert bob_heard.delivered == 0 and bob_heard.pending_msgs == 0
    assert all(s.delivered == 0 and s.pending_msgs == 0 for s in service_heard)
    for conn in (nc, bob_nc, service):
        await conn.close()


async def test_a_new_tenant_connects_as_soon_as_tenant_create_returns(server):
    for i in range(3):
        rc, out, err = await dsec_cli("tenant", "create", f"new{i}", *operator(server))
        assert rc == 0, err
        async with dsec.AsyncClient(url=server.client_url, token=out.strip()) as c:
            assert await c.list() == []


async def test_a_removed_tenant_loses_its_login(server):
    token = await tenant(server, "dave")
    other = await tenant(server, "erin")
    old = await dsec.AsyncClient(url=server.client_url, token=token, timeout=2).connect()
    assert await old.list() == []
    rc, out, err = await dsec_cli("tenant", "remove", "dave", *operator(server))
    assert (rc, out.strip()) == (0, "tenant dave: removed 1 credential(s)"), err
    deadline = time.monotonic() + 10
    while True:
        try:
            await (await dsec.AsyncClient(url=server.client_url, token=token).connect()).close()
        except errors.Unauthenticated:
            break
        assert time.monotonic() < deadline, "the removed login still works"
        await asyncio.sleep(0.1)
    with pytest.raises(errors.DsecError):  # its connection was closed by the reload
        await old.list()
    await old.close()
    async with dsec.AsyncClient(url=server.client_url, token=other) as c:  # others unaffected
        assert await c.list() == []
    rc, _, err = await dsec_cli("tenant", "remove", "nobody", *operator(server))
    assert rc == errors.NotFound.exit_status and "no tenant 'nobody'" in err


async def test_an_unknown_token_is_refused_at_once(server):
    started = time.monotonic()
    with pytest.raises(errors.Unauthenticated, match="refused the login"):
        await dsec.AsyncClient(url=server.client_url, token="dsec_guessed").connect()
    assert time.monotonic() - started < 3
    with pytest.raises(errors.Unauthenticated):  # nor does the service login take a guess
        await bus.connect(f"nats://dsec-service:guess@{server.client_url[7:]}", name="x")


async def test_a_credential_from_before_per_tenant_logins_gets_one_when_reused(server):
    nc = await bus.connect(server.service_url, name="admin")
    state = await ClusterState.open(nc)
    token = "dsec_" + "x" * 43
    record = {"tenant": "old", "created_at": 0.0}  # no nats_password: no login
    await state.tenants.create(bus.token_key(token), json.dumps(record).encode())
    await asyncio.sleep(0.3)
    with pytest.raises(errors.Unauthenticated):
        await dsec.AsyncClient(url=server.client_url, token=token).connect()
    conn = await ensure_tenant(server.service_url, "old", token, server.client_url)
    assert (conn.token, conn.tenant) == (token, "old")
    async with dsec.AsyncClient(url=conn.url, token=token) as c:
        assert await c.list() == []
    await nc.close()


async def test_with_nothing_loading_logins_create_fails_with_the_way_to_load_them(tmp_path):
    """An operator's own NATS: create withdraws the credential and names `dsec tenant
    logins`; its block, put into the config, makes the login work."""
    with NatsServer(tmp_path / "nats", follow_tenants=False) as own:
        nc = await bus.connect(own.service_url, name="admin")
        state = await ClusterState.open(nc)
        rc, out, err = await dsec_cli("tenant", "create", "ops", "--wait", "1", *operator(own))
        assert rc == errors.Unavailable.exit_status and out == ""
        assert "dsec tenant logins" in err and len(err.strip().splitlines()) == 1, err
        assert await state.tenant_logins() == {}
        rc, out, err = await dsec_cli("tenant", "create", "ops", "--wait", "0", *operator(own))
        assert rc == 0, err
        token = out.strip()
        rc, block, err = await dsec_cli("tenant", "logins", *operator(own))
        assert rc == 0 and bus.Login.for_token(token).user in block, err
        (own.store_dir / "auth.conf").write_text(block)
        own.proc.send_signal(signal.SIGHUP)  # what an operator's reload does
        await bus.wait_accepted(own.client_url, bus.Login.for_token(token), 5)
        await nc.close()
        nc = await bus.connect(own.service_url, name="still-the-service")  # its user is kept
        await nc.close()


def test_services_are_handed_no_nats_password(tmp_path):
    with LocalCluster(tmp_path / "c") as cluster:
        cluster.start_nats()
        password = cluster.nats.login.password
        assert not [k for k, v in cluster.env.items() if password in v]
        assert "@" not in cluster.env["DSEC_NATS_URL"]
        login_file = cluster.env["DSEC_NATS_LOGIN_FILE"]
        assert bus.Login.read(login_file) == cluster.nats.login
        assert stat.S_IMODE(os.stat(login_file).st_mode) == 0o600
        conf = (cluster.nats.store_dir / "auth.conf").read_text()
        assert password not in conf and "$2b$" in conf
