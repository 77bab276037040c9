"""The apiserver's check of a create's layers (dsec_kernel.layercheck): every missing layer
named in one NotFound, a layer no plugin answers for not checked, a plugin's other errors
raised as they are."""

from __future__ import annotations

import asyncio

import pytest

from dsec_kernel.contract import errors
from dsec_kernel.contract.hookspecs import hookimpl
from dsec_kernel.contract.wire import Env, SandboxSpec
from dsec_kernel.layercheck import check_layers
from dsec_kernel.loader import load_hooks

SPEC = SandboxSpec(
    backend="container",
    env=Env(base="os:1", workspace="task:1", toolkits=["tools:1", "more:1", "tools:1"]),
)


def _spec(base: str) -> SandboxSpec:
    return SandboxSpec(backend="container", env=Env(base=base))


class Catalog:
    """Knows ``have`` (name:version), as an async store would: awaitables."""

    def __init__(self, *have: str) -> None:
        self.have, self.asked = set(have), []

    @hookimpl
    def dsec_layer_resolve(self, tenant, ref):
        self.asked.append((tenant, ref.kind, str(ref)))

        async def answer():
            await asyncio.sleep(0)
            if str(ref) not in self.have:
                raise errors.NotFound(f"no layer {ref}")
            return str(ref)

        return answer()


class NotMine:
    @hookimpl
    def dsec_layer_resolve(self, tenant, ref):
        return None


async def test_every_missing_layer_is_named_in_one_not_found():
    catalog = Catalog("os:1", "tools:1")
    with pytest.raises(errors.NotFound) as info:
        await check_layers(load_hooks(plugins=[catalog], guards=[]), "alice", SPEC)
    assert (
        info.value.message
        == "2 layers of the env are missing: (1) no layer more:1 (2) no layer task:1"
    )
    assert sorted(catalog.asked) == [  # each once (tools:1 is named twice), with its kind
        ("alice", "base", "os:1"), ("alice", "toolkit", "more:1"),
        ("alice", "toolkit", "tools:1"), ("alice", "workspace", "task:1"),
    ]  # fmt: skip
    with pytest.raises(errors.NotFound) as info:  # one: the store's own words
        await check_layers(load_hooks(plugins=[Catalog("os:1")], guards=[]), "a", _spec("x:1"))
    assert info.value.message == "no layer x:1"


async def test_all_found_or_nothing_to_check_passes():
    await check_layers(load_hooks(plugins=[Catalog("os:1", "task:1", "tools:1", "more:1")],
                                  guards=[]), "alice", SPEC)  # fmt: skip
    await check_layers(load_hooks(guards=[]), "alice", SPEC)  # no plugin answers: not checked
    await check_layers(load_hooks(plugins=[NotMine()], guards=[]), "alice", SPEC)
    nothing = load_hooks(plugins=[Catalog()], guards=[])
    await check_layers(nothing, "alice", SandboxSpec(backend="fncall"))  # no layers
    fork = SPEC.model_copy(update={"snapshot": "snap-1"})  # made of the snapshot's layers
    await check_layers(nothing, "alice", fork)


async def test_other_errors_of_a_plugin_are_raised_as_they_are():
    class Down:
        @hookimpl
        def dsec_layer_resolve(self, tenant, ref):
            raise errors.Unavailable("the store is not mounted")

    with pytest.raises(errors.Unavailable, match="not mounted"):
        await check_layers(load_hooks(plugins=[Down()], guards=[]), "alice", SPEC)
