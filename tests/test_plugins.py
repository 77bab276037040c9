"""Plugin discovery: installed plugins are listed; missing or broken ones stop start-up."""

import pytest
from stevedore import ExtensionManager

from dsec_kernel.cli import main
from dsec_kernel.config import EdgeSettings
from dsec_kernel.edge import load_backends
from dsec_kernel.loader import GROUPS, PluginLoadError, discover, load_drivers, load_hooks


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
