"""The store answers the apiserver's check of a create's layers (``dsec_layer_resolve``), as
the creating tenant sees the store, and the apiserver finds it from the same settings as the
nodes."""

from __future__ import annotations

import pytest
from dsec_storage_3fs import ThreeFsStore

from dsec_kernel.contract.errors import NotFound
from dsec_kernel.contract.wire import Env, SandboxSpec
from dsec_kernel.contract.wire.sandbox import LayerRef
from dsec_kernel.layercheck import check_layers, layer_store_plugins
from dsec_kernel.loader import PluginLoadError, load_hooks


def spec(**env: object) -> SandboxSpec:
    return SandboxSpec(backend="container", env=Env(**env))


@pytest.fixture
def tree(tmp_path):
    """``tree(text)``: a directory holding one file with ``text``."""

    def make(text: str) -> str:
        path = tmp_path / "trees" / text
        path.mkdir(parents=True)
        (path / "owner").write_text(text)
        return str(path)

    return make


async def test_the_store_answers_for_the_layers_the_tenant_may_use(store, tree):
    store.import_layer(tree("os"), "base", "os", "1")
    mine = store.import_layer(tree("alice"), "workspace", "task", "1", tenant="alice")
    hooks = load_hooks(plugins=[store], guards=[])
    task = LayerRef(name="task", version="1", kind="workspace")
    assert await hooks.layer_resolve("alice", task) == mine
    await check_layers(hooks, "alice", spec(base="os:1", workspace="task:1"))

    with pytest.raises(NotFound) as info:  # bob may not use alice's task:1
        await check_layers(hooks, "bob", spec(base="os:1", workspace="task:1"))
    assert info.value.message.startswith("layer task:1 is not in the layer store")
    assert "alice" not in info.value.message
    with pytest.raises(NotFound) as info:  # every missing layer named, not the first only
        await check_layers(hooks, "bob", spec(base="os:2", workspace="task:1", toolkits=["t:1"]))
    said = info.value.message
    assert said.startswith("3 layers of the env are missing: (1) layer t:1 ")
    assert "(2) layer task:1 " in said and "(3) layer os:2 " in said and "os has versions 1" in said
    with pytest.raises(NotFound, match="os:1 is a base layer, not a toolkit layer"):
        await check_layers(hooks, "alice", spec(base="os:1", toolkits=["os:1"]))


def test_the_apiserver_opens_the_store_its_nodes_use(store, tree, tmp_path, monkeypatch):
    layer = store.import_layer(tree("os"), "base", "os", "1")
    monkeypatch.setenv("DSEC_STORAGE_CONFIG__ROOT", str(store.root))
    monkeypatch.setenv("DSEC_STORAGE_CONFIG__CACHE_DIR", str(tmp_path / "apiserver-cache"))
    [opened] = layer_store_plugins()
    assert isinstance(opened, ThreeFsStore) and opened.root == store.root
    assert opened.resolve("os", "1", "base") == layer
    monkeypatch.setenv("DSEC_STORAGE", "no-such-store")
    with pytest.raises(PluginLoadError, match="no-such-store"):
        layer_store_plugins()
