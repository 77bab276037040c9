"""Plugin discovery: installed plugins are listed; missing or broken ones stop start-up."""

import pytest
from stevedore import ExtensionManager

from dsec_kernel.cli import main
from dsec_kernel.config import EdgeSettings
from dsec_kernel.edge import load_backends
from dsec_kernel.loader import (
    GROUPS,
    PluginLoadError,
    default_backend,
    discover,
    load_driver,
    load_drivers,
    load_hooks,
    open_store,
    preferred,
)


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """Install a distribution with a broken backend and a broken guard (on sys.path only)."""
    info = tmp_path / "dsec_fake_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsec-fake-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[dsec.backends]\nbroken = dsec_no_such_module:Backend\n\n"
        "[dsec.guards]\nbroken-guard = dsec_no_such_module:Guard\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})  # stevedore's per-process cache
    return tmp_path


def test_discover_lists_installed_plugins():
    found = {(p.group, p.name): p for g in GROUPS for p in discover(g)}
    assert ("dsec.placement", "least-loaded") in found
    assert ("dsec.backends", "noop") in found and ("dsec.backends", "fncall") in found
    noop = found[("dsec.backends", "noop")]
    assert noop.distribution == "dsec-backend-noop" and noop.version and noop.error is None


def test_a_missing_driver_names_itself_and_the_alternatives():
    with pytest.raises(PluginLoadError) as exc:
        load_drivers("dsec.placement", ["no-such-policy"])
    assert "no-such-policy" in str(exc.value) and "least-loaded" in str(exc.value)


def test_a_broken_driver_gives_the_reason(fake_dist):
    with pytest.raises(PluginLoadError) as exc:
        load_drivers("dsec.backends", ["broken"])
    assert "broken" in str(exc.value) and "dsec_no_such_module" in str(exc.value)
    assert any(p.name == "broken" and p.error for p in discover("dsec.backends"))


def test_named_broken_guard_stops_start_up_unnamed_is_skipped(fake_dist, caplog):
    with pytest.raises(PluginLoadError):
        load_hooks(guards=["broken-guard"])
    load_hooks()  # all installed: the broken one is logged and skipped
    assert "broken-guard" in caplog.text


def test_edge_backend_selection(fake_dist):
    backends, skipped = load_backends(EdgeSettings(node="n"))
    assert "noop" in skipped and "broken" in skipped  # opt-in, and does not load
    with pytest.raises(PluginLoadError, match="broken"):
        load_backends(EdgeSettings(node="n", backends=["broken"]))
    with pytest.raises(PluginLoadError, match="configuration is invalid"):
        load_backends(
            EdgeSettings(
                node="n", backends=["noop"], backend_config={"noop": {"max_sandboxes": "lots"}}
            )
        )
    with pytest.raises(PluginLoadError, match="no installed plugin has"):
        load_backends(EdgeSettings(node="n", backends=["noop"], backend_config={"nope": {}}))
    # settings for an installed backend this edge does not run are fine (a log line at most)
    only_noop = EdgeSettings(node="n", backends=["noop"], backend_config={"fncall": {}})
    assert list(load_backends(only_noop)[0]) == ["noop"]
    backends, _ = load_backends(
        EdgeSettings(node="n", backends=["noop"], backend_config={"noop": {"max_sandboxes": 7}})
    )
    assert backends["noop"].capabilities.max_sandboxes == 7


def test_dsec_plugins_lists_groups(capsys, fake_dist):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "least-loaded" in out and "fncall" in out and "broken" in out


def test_every_driver_kind_is_made_with_its_validated_config():
    policy = load_driver("dsec.placement", "bin-pack", {"locality_weight": 0.5}, None)
    assert policy.config.locality_weight == 0.5
    with pytest.raises(PluginLoadError, match="placement 'bin-pack' configuration is invalid"):
        load_driver("dsec.placement", "bin-pack", {"locality_wieght": 0.5}, None)
    with pytest.raises(PluginLoadError, match="storage '3fs' configuration is invalid"):
        load_driver("dsec.storage", "3fs", {"no_such_setting": 1})


def test_unnamed_drivers_are_the_ones_their_plugins_prefer(monkeypatch):
    """The kernel names no plugin: what runs when the operator names none is the installed
    plugin whose class declares the lowest ``preference``."""
    assert preferred("dsec.placement") == "least-loaded"
    assert preferred("dsec.storage") == "3fs"
    assert preferred("dsec.backends", among=["container", "fncall"]) == "fncall"
    assert preferred("dsec.backends", among=["container", "noop"]) == "container"
    monkeypatch.delenv("DSEC_DEFAULT_BACKEND", raising=False)
    assert default_backend(["noop"]) == "noop"
    monkeypatch.setenv("DSEC_DEFAULT_BACKEND", "container")
    assert default_backend(["noop"]) == "container"  # the operator's choice wins
    with pytest.raises(PluginLoadError, match=r"no dsec\.backends plugin"):
        preferred("dsec.backends", among=["no-such-backend"])


def test_equally_preferred_plugins_must_be_named(tmp_path, monkeypatch):
    (tmp_path / "dsec_twin_policies.py").write_text(
        "from dsec_placement_basic import LeastLoaded\n"
        "class A(LeastLoaded):\n    preference = 1\n"
        "class B(LeastLoaded):\n    preference = 1\n"
    )
    info = tmp_path / "dsec_twins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsec-twins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[dsec.placement]\ntwin-a = dsec_twin_policies:A\ntwin-b = dsec_twin_policies:B\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
    with pytest.raises(PluginLoadError, match=r"equally preferred.*DSEC_PLACEMENT"):
        preferred("dsec.placement")


def test_a_guard_class_gets_its_validated_config(tmp_path, monkeypatch):
    (tmp_path / "dsec_cfg_guard.py").write_text(
        "from pydantic import BaseModel, ConfigDict\n"
        "class Guard:\n"
        "    class Config(BaseModel):\n"
        "        model_config = ConfigDict(extra='forbid')\n"
        "        limit: int = 1\n"
        "    def __init__(self, config):\n"
        "        self.config = config\n"
    )
    info = tmp_path / "dsec_cfg_guard-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsec-cfg-guard\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dsec.guards]\ncfg = dsec_cfg_guard:Guard\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})
    hooks = load_hooks(guards=["cfg"], guard_config={"cfg": {"limit": 5}})
    [guard] = [p for p in hooks.pm.get_plugins() if type(p).__name__ == "Guard"]
    assert guard.config.limit == 5
    with pytest.raises(PluginLoadError, match="guard 'cfg' configuration is invalid"):
        load_hooks(guards=["cfg"], guard_config={"cfg": {"limit": "many"}})
    with pytest.raises(PluginLoadError, match="not loaded"):
        load_hooks(guards=["cfg"], guard_config={"other": {}})


def test_a_nodes_store_takes_its_node_defaults_under_the_operators(tmp_path):
    root = {"root": str(tmp_path / "layers")}
    store = open_store(None, root, state_dir=tmp_path / "edge")
    assert store.cache_dir == tmp_path / "edge" / "layer-cache"  # the store's node default
    given = {**root, "cache_dir": str(tmp_path / "mine")}
    assert open_store(None, given, state_dir=tmp_path / "edge").cache_dir == tmp_path / "mine"
