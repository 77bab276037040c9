"""``dsec layer`` as a new user meets it: a store with nothing in it, the layers the recipes
make, imports under any name the store takes, and the records as JSON."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from dsec_storage_3fs.images import Busybox

from dsec_kernel.cli import exitcodes
from dsec_kernel.cli.parser import _REF
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire.sandbox import LAYER_REF_PATTERN

NEEDS = (
    "needs root (file owners, mounts)" if os.geteuid() != 0
    else "needs mkfs.erofs: apt-get install erofs-utils" if shutil.which("mkfs.erofs") is None
    else Busybox.unavailable_reason()
)  # fmt: skip
pytestmark = pytest.mark.skipif(bool(NEEDS), reason=f"cannot build layers here: {NEEDS}")


@pytest.fixture
def layer_cli(tmp_path):
    """``layer_cli(ARGS...)``: ``dsec layer ARGS`` on a store of its own in ``tmp_path``."""
    env = {**os.environ, "COLUMNS": "200", "DSEC_STATE_DIR": str(tmp_path),
           "DSEC_STORAGE_CONFIG__ROOT": str(tmp_path / "layers")}  # fmt: skip

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dsec_kernel.cli", "layer", *args],
                              env=env, capture_output=True, text=True, timeout=120)  # fmt: skip

    return run


def _json_lines(done: subprocess.CompletedProcess[str]) -> list[dict]:
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_an_empty_store_says_how_to_make_a_layer(layer_cli):
    empty = layer_cli("ls")
    assert empty.returncode == 0 and empty.stdout == ""
    assert "`dsec layer build`" in empty.stderr and "`dsec layer import`" in empty.stderr
    assert layer_cli("ls", "--json").stdout == ""
    recipes = {r["recipe"]: r for r in _json_lines(layer_cli("build", "--json"))}
    assert recipes["busybox"] | {"summary": ""} == {
        "recipe": "busybox", "distribution": "dsec-storage-3fs", "layer": "busybox:1",
        "kind": "base", "status": "ok", "summary": "",
    }  # fmt: skip
    assert recipes["debian-python"]["layer"] == "debian-python:12"
    assert recipes["debian-python"]["status"] in ("ok", "unavailable")
    shown = layer_cli("build").stdout
    assert "busybox:1" in shown and "debian-python:12" in shown


def test_build_makes_a_recipes_layer_once(layer_cli):
    made = layer_cli("build", "busybox")
    assert made.returncode == 0, made.stderr
    ref, kind, digest, size, _, files, _ = made.stdout.split()
    assert (ref, kind) == ("busybox:1", "base") and int(size) > 0 and int(files) > 50
    again = layer_cli("build", "busybox", "--json")
    assert "busybox:1 is in the store already; nothing built" in again.stderr
    record = json.loads(again.stdout)
    assert (record["digest"], record["tenant"]) == (digest, None)
    assert [x["digest"] for x in _json_lines(layer_cli("ls", "--json"))] == [digest]


def test_an_unknown_recipe_names_the_installed_ones(layer_cli):
    r = layer_cli("build", "no-such-recipe")
    assert r.returncode == exitcodes.PLUGIN and r.stdout == ""
    assert "no-such-recipe" in r.stderr and "busybox" in r.stderr and "debian-python" in r.stderr


def test_a_layer_imported_under_any_name_the_store_takes_can_be_removed(layer_cli, tmp_path):
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "motd").write_text("hi\n")
    made = layer_cli("import", "--kind", "toolkit", "--name", "MyTools", "--version", "1.0+local",
                     "--json", str(tree))  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["version"] == "1.0+local"
    removed = layer_cli("rm", "MyTools:1.0+local")
    assert (removed.returncode, removed.stdout) == (0, "removed MyTools:1.0+local\n"), (
        removed.stderr
    )


def test_the_command_line_takes_the_layer_references_the_wire_does():
    assert _REF.pattern == LAYER_REF_PATTERN
    assert re.fullmatch(_REF, "debian-python:12") and not re.fullmatch(_REF, "-x:1")


def test_packages_and_toolkit_arguments_go_only_where_they_belong(layer_cli):
    for args, said in [
        (["busybox", "--packages", "ripgrep"], "recipe busybox takes no packages"),
        (["debian-python", "--packages", "ripgrep,Bad"], "--packages: 'Bad' is not a Debian"),
        (["busybox", "pytest:8.3"], "NAME:VERSION and --pip are for toolkits"),
        (["toolkit", "--pip", "pytest"], "a toolkit takes NAME:VERSION and --pip REQ..."),
        (["toolkit", "pytest:8.3"], "--pip: name at least one requirement"),
    ]:
        r = layer_cli("build", *args)
        assert r.returncode == errors.InvalidArgument.exit_status, (args, r.stderr)
        assert said in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert layer_cli("ls", "--json").stdout == ""  # nothing built
    assert "dsec layer build toolkit NAME:VERSION --pip REQ..." in layer_cli("build").stdout
