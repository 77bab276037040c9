"""Layers belong to a tenant (issue 7, item 6): an attacker publishes layers under names its
victim runs, or names the victim's own layers, through the SDK only.

What must hold: a public name (``busybox:1``) is the operator's image for everyone; a name a
tenant publishes is that tenant's, whoever published it first; another tenant's layer is
``not_found`` to create and prestage, in words that say nothing of it; the cluster's node
listing names none of another tenant's layers.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

import dsec_kernel as dsec
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import LayerInfo

BUSYBOX = dsec.Env(base="busybox:1")
PLANTED = "/planted-by-attacker"


@pytest.fixture(autouse=True)
def _container(needs):
    needs("container")


def _fresh(prefix: str) -> str:
    """A layer name no earlier test of the session used."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def _publish(client: dsec.AsyncClient, marker: str, **layer: str) -> LayerInfo:
    """Publish a snapshot of a new busybox sandbox holding ``marker`` as ``layer``."""
    [sb] = await client.create(count=1, backend="container", env=BUSYBOX)
    try:
        await sb.write_file(marker, marker)
        return await client.publish(await sb.snapshot(), **layer)
    finally:
        await client.destroy([sb])


async def _files(client: dsec.AsyncClient, env: dsec.Env, *paths: str) -> list[str]:
    """Which of ``paths`` exist in a new sandbox of ``env``."""
    [sb] = await client.create(count=1, backend="container", env=env)
    try:
        r = await sb.exec(["ls", "-d", *paths])
        return sorted(r.stdout.decode().split())
    finally:
        await client.destroy([sb])


async def _not_found(client: dsec.AsyncClient, env: dsec.Env) -> str:
    """The message of the NotFound that creating a sandbox of ``env`` must get."""
    try:
        made = await client.create(count=1, backend="container", env=env)
    except errors.NotFound as exc:
        return exc.message
    await client.destroy(made)
    pytest.fail(f"a sandbox of {env} was created")


async def test_a_base_published_as_a_public_name_changes_no_one_else(victim, attacker, attack):
    with pytest.raises(errors.Conflict, match="public"):
        await _publish(attacker, PLANTED, kind="base", name="busybox", version="1")
    assert await _files(victim, BUSYBOX, PLANTED, "/bin/sh") == ["/bin/sh"]
    assert await _files(attacker, BUSYBOX, PLANTED, "/bin/sh") == ["/bin/sh"]
    attack("publish base busybox:1 over the public one", "container", "conflict; public kept")

    # a version the operator has not imported yet: the attacker's own, never the victim's
    version = _fresh("next")
    await _publish(attacker, PLANTED, kind="base", name="busybox", version=version)
    later = dsec.Env(base=f"busybox:{version}")
    assert await _files(attacker, later, PLANTED) == [PLANTED]
    await _not_found(victim, later)
    attack("squat a future public version busybox:<next>", "container", "victim: not_found")


async def test_a_workspace_named_like_the_victims_stays_the_attackers(victim, attacker, attack):
    name, mine = _fresh("task"), "/work/victim-solution"
    await _publish(attacker, PLANTED, kind="workspace", name=name, version="1")  # first
    layer = await _publish(victim, mine, kind="workspace", name=name, version="1")
    assert (layer.name, layer.version) == (name, "1")
    env = dsec.Env(base="busybox:1", workspace=f"{name}:1")
    assert await _files(victim, env, PLANTED, mine) == [mine]
    assert await _files(attacker, env, PLANTED, mine) == [PLANTED]
    attack("squat the victim's workspace name first", "container", "two namespaces; own kept")


async def test_another_tenants_layer_is_not_found_and_says_so_like_no_layer(
    victim, attacker, attack
):
    name, never = _fresh("private"), _fresh("never")
    await _publish(victim, "/work/secret", kind="workspace", name=name, version="1")

    theirs = await _not_found(attacker, dsec.Env(base="busybox:1", workspace=f"{name}:1"))
    nothing = await _not_found(attacker, dsec.Env(base="busybox:1", workspace=f"{never}:1"))
    assert theirs == nothing.replace(never, name), (theirs, nothing)
    assert "victim" not in theirs
    attack("create with another tenant's layer", "container", "not_found, as for no layer")

    async def prestage(layer: str) -> str:
        resp = await attacker.prestage([f"{layer}:1"])
        assert resp.nodes == [] and resp.failed, resp
        assert {f.error.code for f in resp.failed} == {"not_found"}, resp
        return resp.failed[0].error.message

    theirs, nothing = await prestage(name), await prestage(never)
    assert theirs == nothing.replace(never, name), (theirs, nothing)
    attack("prestage another tenant's layer", "container", "not_found, as for no layer")


async def test_the_node_listing_names_no_other_tenants_layers(victim, attacker, attack):
    name = _fresh("hidden")
    await _publish(victim, "/work/secret", kind="workspace", name=name, version="1")
    env = dsec.Env(base="busybox:1", workspace=f"{name}:1")
    assert await _files(victim, env, "/work/secret") == ["/work/secret"]
    used = time.time()
    deadline = time.monotonic() + 15
    nodes = await attacker.nodes()
    while min(n.heartbeat_at for n in nodes) <= used:  # a heartbeat since the victim's run
        assert time.monotonic() < deadline, "the node sent no heartbeat for 15 s"
        await asyncio.sleep(0.2)
        nodes = await attacker.nodes()
    seen = [ref for node in nodes for ref in node.layers]
    assert not [ref for ref in seen if name in ref], seen
    attack("read another tenant's layer names from nodes()", "container", "not listed")
