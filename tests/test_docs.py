"""Every fenced code block of README.md, docs/*.md and plugins/*/README.md, run for real, so a
snippet that stops working fails here instead of for a reader (the convention, for writers:
docs/plugins.md, *Documenting a plugin*).

* ``python`` blocks are programs and ``sh`` blocks commands (bash, ``-euo pipefail``), run in
  each page's order against one platform as ``dsec up`` starts it: an apiserver and an edge
  with fncall and, where it can run here, container. They get its ``DSEC_URL`` and
  ``DSEC_TOKEN`` and its ``DSEC_STATE_DIR`` (so ``dsec layer`` fills the store its edge
  reads), and the blocks of one page share a working directory, as a reader's shell would. A
  block passes when it exits 0 and, for a program, prints in order a line matching each
  ``print(...)  # -> TEXT`` (``...`` matches anything).
* The README's set-up block (``<!-- setup -->``) is what ``.ci/run`` runs; it is checked to
  run exactly that block, not run again here.
* ``toml`` blocks are parsed; the entry-point groups they fill must be the kernel's.
* ``<!-- file: NAME -->`` blocks make docs/plugins.md's example plugin: the backend package
  is pip-installed and listed by ``dsec plugins``, its skeleton checked against the Backend
  contract, its conformance test file run by pytest (against the fncall backend, in the
  skeleton's place), its placement policy asked to place. ``<!-- excerpt: PATH -->`` blocks
  must be in PATH.
* ``text`` blocks (diagrams, layouts, sample output) are not code; a block with any other
  language, or none, fails.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import typing
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from dsec_backend_container.backend import ContainerBackend
from dsec_backend_fncall.backend import FncallBackend

from dsec_kernel.cluster import LocalCluster
from dsec_kernel.contract.backend import Backend
from dsec_kernel.contract.placement import NodeView, PlacementRequest
from dsec_kernel.contract.wire import BackendInfo, Capabilities, NodeInfo, NodeLoad, SandboxSpec
from dsec_kernel.loader import GROUPS, load_hooks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted(ROOT.glob("docs/*.md")),
    *sorted(ROOT.glob("plugins/*/README.md")),
]
LANGUAGES = {"python", "sh", "toml", "text"}
MARKS = {"setup": {"sh"}, "file": {"python", "toml"}, "excerpt": {"python"}}  # -> languages
PLUGIN_FILES = {
    "pyproject.toml",
    "dsec_backend_mine.py",
    "tests/test_conformance.py",
    "dsec_placement_coolest.py",
}
CONTAINER = ContainerBackend.unavailable_reason()
FNCALL = FncallBackend.unavailable_reason()
FENCE = re.compile(r"^(\s*)```(.*)$")
MARK = re.compile(r"^<!-- (\S+?)(?:: (\S+))? -->$")
EXPECT = re.compile(r"[#:] -> (.+)$")
#: what pip and debootstrap say when the package index or the Debian mirror is out of reach
OFFLINE = re.compile(
    r"NewConnectionError|Network is unreachable|Temporary failure in name res|Couldn't download"
)


@dataclass(frozen=True)
class Block:
    """A fenced block: its page, the line of its opening fence, its language and text, and
    the mark (and its argument) of an HTML comment just before it."""

    page: Path
    line: int
    lang: str
    text: str
    mark: str = ""
    arg: str = ""

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order, their indentation removed."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if not (fence := FENCE.match(lines[i])):
            i += 1
            continue
        indent, lang = fence.group(1), fence.group(2).strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a fence that is never closed"
        text = "".join(line.removeprefix(indent) + "\n" for line in lines[i + 1 : end])
        before = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        mark = MARK.match(before)
        found.append(Block(page, i + 1, lang, text, *(mark.groups("") if mark else ())))
        i = end + 1
    return found


BLOCKS = [block for page in PAGES for block in parse(page)]
RUN = [b for b in BLOCKS if b.lang in ("python", "sh") and not b.mark]


def plugin_file(name: str) -> str:
    """The text of the example plugin's file ``name`` (docs/plugins.md)."""
    [block] = [b for b in BLOCKS if b.mark == "file" and b.arg == name]
    return block.text


def test_every_block_says_what_it_is():
    problems = []
    for b in BLOCKS:
        if b.lang not in LANGUAGES:
            problems.append(f"{b}: language {b.lang!r}; say one of {sorted(LANGUAGES)}")
        elif b.mark and b.lang not in MARKS.get(b.mark, ()):
            problems.append(f"{b}: a {b.lang} block marked {b.mark!r}")
    assert not problems, "\n".join(problems)
    files = {b.arg for b in BLOCKS if b.mark == "file"}
    assert files == PLUGIN_FILES, "a file of the example plugin that no test here checks"
    assert {b.page.name for b in BLOCKS} >= {"README.md", "plugins.md", "architecture.md"}


def test_ci_runs_exactly_the_readme_setup_block(tmp_path):
    """.ci/run, given the README, runs each line of its set-up block, comments dropped, and
    nothing else (a fake bash on PATH writes down what it is asked to run)."""
    [setup] = [b for b in BLOCKS if b.mark == "setup"]
    assert setup.page.name == "README.md" and setup.lang == "sh"
    commands = [re.sub(r"\s*#.*$", "", line) for line in setup.text.splitlines()]
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    shutil.copy(setup.page, tmp_path / "README.md")
    fake = tmp_path / "bin" / "bash"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$2" >> "$RAN"\n')
    fake.chmod(0o755)
    ran = tmp_path / "ran"
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "RAN": str(ran)}
    proc = subprocess.run(
        ["/bin/bash", str(tmp_path / ".ci" / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ran.read_text().splitlines() == commands
    install, tests = commands
    assert install.startswith("./install.sh ") and os.access(ROOT / "install.sh", os.X_OK)
    assert (ROOT / install.split()[-1]).is_file() and tests == "python3 -m pytest"


# -- python and sh blocks, against a platform ------------------------------------------------


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    """A platform as ``dsec up`` starts it, as the environment of a program run under it;
    what the blocks leave behind is destroyed at the end."""
    if FNCALL:
        pytest.skip(f"the fncall backend cannot run here: {FNCALL}")
    state = tmp_path_factory.mktemp("up")
    with LocalCluster(state, {"DSEC_STATE_DIR": str(state)}) as cluster:
        cluster.start_nats()
        cluster.start_apiserver()
        cluster.start_edge("node", ["fncall", *([] if CONTAINER else ["container"])])
        asyncio.run(cluster.ready())
        assert cluster.conn is not None
        yield {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # its dsec, python3
            "DSEC_STATE_DIR": str(state),
            "DSEC_URL": cluster.conn.url,
            "DSEC_TOKEN": cluster.conn.token,
        }
        asyncio.run(destroy_all(cluster))


async def destroy_all(cluster: LocalCluster) -> None:
    async with cluster.client() as c:
        await c.destroy(await c.list())


@dataclass
class Reader:
    """Someone following one page: the working directory its blocks share, and why they
    stopped (a block that could not run here: the ones after it may need what it makes)."""

    dir: Path
    stopped: str = ""


@pytest.fixture(scope="module")
def readers(tmp_path_factory):
    """``readers(page)``: the page's Reader."""
    made: dict[Path, Reader] = {}

    def get(page: Path) -> Reader:
        if page not in made:
            made[page] = Reader(tmp_path_factory.mktemp(page.parent.name + "-" + page.stem))
        return made[page]

    return get


def check_prints(block: Block, stdout: str) -> None:
    """``stdout`` has, in order, a line matching each ``# -> TEXT`` of ``block``."""
    lines = iter(stdout.splitlines())
    for line in block.text.splitlines():
        if want := EXPECT.search(line):
            text = want.group(1).strip()
            pattern = re.compile(".*".join(map(re.escape, text.split("..."))))
            assert any(pattern.fullmatch(x.strip()) for x in lines), (
                f"{block}: no line {text!r} (after the ones before it) in:\n{stdout}"
            )


@pytest.mark.parametrize("block", RUN, ids=str)
def test_block_runs(block, platform, readers, tmp_path):
    if CONTAINER and re.search(r"container|dsec layer", block.text):
        pytest.skip(f"{block} needs the container backend, which cannot run here: {CONTAINER}")
    reader = readers(block.page)
    if reader.stopped:
        pytest.skip(f"{block} comes after {reader.stopped}")
    if block.lang == "python":
        program = tmp_path / "block.py"
        argv = [sys.executable, str(program)]
    else:
        program = tmp_path / "block.sh"
        argv = ["bash", "-euo", "pipefail", str(program)]
    program.write_text(block.text)
    proc = subprocess.run(
        argv, cwd=reader.dir, env=platform, capture_output=True, text=True, timeout=300
    )
    out = f"{proc.stdout}\n{proc.stderr}"
    downloads = re.search(r"pip download|dsec layer build", block.text)
    if proc.returncode and downloads and (offline := OFFLINE.search(out)):
        reader.stopped = f"{block}, which downloads packages, and the network said {offline[0]!r}"
        pytest.skip(reader.stopped)
    where = f"{block} exited with {proc.returncode} (its line 1 is the page's {block.line + 1})"
    assert proc.returncode == 0, f"{where}:\n{out[-5000:]}"
    if block.lang == "python":
        check_prints(block, proc.stdout)


# -- toml and excerpts -----------------------------------------------------------------------


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "toml"], ids=str)
def test_toml_block_fills_the_kernels_entry_point_groups(block):
    project = tomllib.loads(block.text)["project"]
    groups = project["entry-points"]
    assert set(groups) <= set(GROUPS), f"{block}: groups the kernel does not load"
    for group, entries in groups.items():
        for name, value in entries.items():
            ep = metadata.EntryPoint(name, value, group)
            assert re.fullmatch(r"[a-z][a-z0-9-]*", name) and ep.module and ep.attr, ep
    if "name" in project:  # a whole pyproject.toml: what a build needs
        assert "version" in project or "version" in project.get("dynamic", []), block


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark == "excerpt"], ids=str)
def test_excerpt_is_in_its_file(block):
    assert block.text in (ROOT / block.arg).read_text(), f"{block} is not in {block.arg}"


# -- docs/plugins.md's example plugin --------------------------------------------------------


@pytest.fixture(scope="module")
def installed_backend(tmp_path_factory) -> Path:
    """The example backend package, made of its blocks and pip-installed into a directory of
    its own (returned: a PYTHONPATH entry)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed: pip cannot build the example package offline")
    tmp = tmp_path_factory.mktemp("mine")
    pkg, site = tmp / "pkg", tmp / "site"
    pkg.mkdir()
    for name in ("pyproject.toml", "dsec_backend_mine.py"):
        (pkg / name).write_text(plugin_file(name))
    argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    argv += ["--no-build-isolation", "--root-user-action=ignore", "--target", str(site), str(pkg)]
    pip = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return site


def test_the_example_backend_is_installed_and_listed(installed_backend):
    env = {**os.environ, "PYTHONPATH": str(installed_backend)}
    proc = subprocess.run(
        [sys.executable, "-m", "dsec_kernel.cli", "plugins", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    listed = [json.loads(line) for line in proc.stdout.splitlines()]
    [mine] = [p for p in listed if (p["group"], p["name"]) == ("dsec.backends", "mine")]
    assert (mine["distribution"], mine["version"], mine["status"]) == (
        "dsec-backend-mine",
        "0.1.0",
        "ok",
    ), mine
    assert mine["capabilities"]["max_sandboxes"] == 500


def test_the_example_backend_keeps_to_the_backend_contract(installed_backend):
    """Its class is a Backend that can be made, and each method it writes is one of the
    contract's, with the contract's parameters and types."""
    path = installed_backend / "dsec_backend_mine.py"
    spec = importlib.util.spec_from_file_location("dsec_backend_mine", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = module.MineBackend
    assert issubclass(cls, Backend) and not inspect.isabstract(cls)
    assert cls().capabilities.exec and cls.name == "mine"
    methods = {n: f for n, f in vars(cls).items() if inspect.iscoroutinefunction(f)}
    assert len(methods) == 11
    for name, method in methods.items():
        contract = getattr(Backend, name, None)
        assert contract is not None, f"{name} is not a Backend method"
        assert list(inspect.signature(method).parameters) == list(
            inspect.signature(contract).parameters
        ), name
        assert typing.get_type_hints(method) == typing.get_type_hints(contract), name


def test_the_example_conformance_tests_pass_against_a_real_backend(tmp_path):
    """The page's test file, in a package with the conftest.py it asks for, run by pytest
    with the fncall backend as ``MineBackend`` (the skeleton does nothing)."""
    if FNCALL:
        pytest.skip(f"the fncall backend cannot run here: {FNCALL}")
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(plugin_file("pyproject.toml"))
    (pkg / "tests" / "test_conformance.py").write_text(plugin_file("tests/test_conformance.py"))
    (pkg / "conftest.py").write_text(
        'import pytest\n\npytest.register_assert_rewrite("dsec_kernel.contract.conformance")\n'
    )
    (pkg / "dsec_backend_mine.py").write_text(
        "from dsec_backend_fncall.backend import FncallBackend as MineBackend  # noqa: F401\n"
    )
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(pkg)]
    argv += ["-c", str(pkg / "pyproject.toml"), "--basetemp", str(tmp_path / "t"), "tests"]
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    proc = subprocess.run(argv, cwd=pkg, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert re.search(r"\b(1\d|[2-9]\d) passed", proc.stdout), proc.stdout


def test_the_example_placement_policy_places_on_the_coolest_node(tmp_path):
    path = tmp_path / "dsec_placement_coolest.py"
    path.write_text(plugin_file("dsec_placement_coolest.py"))
    spec = importlib.util.spec_from_file_location("dsec_placement_coolest", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    policy = module.CoolestFirst(module.CoolestFirst.Config(), load_hooks(guards=[]))

    def node(name: str, cpu_load: float, used: int) -> NodeView:
        backends = [BackendInfo(name="noop", capabilities=Capabilities(max_sandboxes=10))]
        load = NodeLoad(sandboxes=used, by_backend={"noop": used}, cpu_load=cpu_load)
        return NodeView(NodeInfo(node=name, edge_id=name, backends=backends, load=load))

    request = PlacementRequest("t", SandboxSpec(backend="noop"), 1, {})
    assert policy.place(request, [node("hot", 0.9, 0), node("cool", 0.1, 0)]) == ["cool"]
    assert policy.place(request, [node("full", 0.5, 8), node("empty", 0.5, 1)]) == ["empty"]
