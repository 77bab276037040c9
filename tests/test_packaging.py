"""Every distribution of the repository says its licence and ships its text, declares exactly
what it imports, and installs on its own: the kernel without its ``server`` extra gives a
trainer the SDK and the command line, and each plugin needs nothing but the kernel and names
an index has.

Two kinds of check. The static one walks the modules' syntax trees (every import, in
functions too, but not those for type checkers only) and maps each third-party top-level
module to the installed distribution that provides it: a plugin must declare exactly the
distributions its own modules import plus those the kernel modules it imports need beyond
the kernel's own dependencies (``dsec_kernel.agent`` needs grpc and protobuf, which a plain
kernel lacks), and every name it declares but the kernel's must be one pip found on an index
here (installed without a ``direct_url.json``: an in-repo plugin by its name is not).

The real one installs into a fresh venv (``python -m venv --without-pip``) wheels built from
a copy of the checkout (``pip wheel --no-build-isolation``, with this interpreter's
setuptools) of the kernel and one plugin, with ``--no-deps --no-index``, and makes visible
beside them exactly the distributions their requirements name, followed through their own
requirements: each is linked in file by file from this interpreter's site-packages, as its
RECORD lists them. So the venv holds what pip would install from PyPI and nothing else,
without the network (installing them from PyPI takes minutes and needs the index up) and
without ``--system-site-packages`` (it sees everything installed here). ``pip check``'s rule
must hold in it (every requirement of every distribution there met), the plugin's entry
points must import, and with the kernel alone the trainer's
commands must run while ``dsec up`` and the other server commands say in one line to install
``dsec-kernel[server]``.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from dsec_kernel.cli import exitcodes

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))
DISTRIBUTIONS = [ROOT, *PLUGINS]
KERNEL = "dsec-kernel"
#: the kernel's extras that its own modules' imports may come from (``test`` serves tests/)
KERNEL_EXTRAS = ("server", "fast")
#: how the server extra's commands end their one line when it is missing
SERVER_HINT = "pip install 'dsec-kernel[server]'"
SERVER_COMMANDS = [
    ["up"],
    ["down"],
    ["cluster-up"],
    ["apiserver"],
    ["edge"],
    ["tenant", "create", "t"],
]


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda p: p.name)
def test_a_distribution_declares_the_licence_and_carries_its_text(dist):
    project = _project(dist)
    assert project.get("license") == {"text": "Apache-2.0"}, project["name"]
    text = (dist / "LICENSE").read_text()  # (a plugin's is a link to the repository's)
    assert text == (ROOT / "LICENSE").read_text() and "Apache License" in text


def test_the_changelog_names_the_current_version():
    version = _project(ROOT)["version"]
    assert f"## {version}" in (ROOT / "CHANGELOG.md").read_text()


# -- what a distribution imports ---------------------------------------------------------------


def _project(dist: Path) -> dict:
    return tomllib.loads((dist / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _packages(dist: Path) -> list[Path]:
    """The top-level package directories the distribution ships."""
    config = tomllib.loads((dist / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return [
        p
        for pattern in patterns
        for p in sorted(dist.glob(pattern))
        if (p / "__init__.py").is_file()
    ]


def _modules(dist: Path) -> dict[str, Path]:
    """``{module name: file}`` of every module the distribution ships."""
    out = {}
    for package in _packages(dist):
        for path in package.rglob("*.py"):
            parts = path.relative_to(package.parent).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _catches_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(k, ast.Name) and k.id in names for k in kinds):
            return True
    return False


def _imports(name: str, path: Path) -> tuple[set[str], set[str]]:
    """The absolute names ``name`` imports when it runs (``from a import b``: ``a`` and
    ``a.b``, which may be a module), leaving out imports for type checkers only: those it
    needs, and those it does without (in a ``try`` that catches ImportError)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[bool, set[str]] = {False: set(), True: set()}

    def visit(node: ast.AST, optional: bool) -> None:
        children: list[ast.AST] = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _type_checking(node):
            children = list(node.orelse)
        elif isinstance(node, ast.Try) and _catches_import_error(node):
            for child in node.body:
                visit(child, True)
            children = [*node.handlers, *node.orelse, *node.finalbody]
        elif isinstance(node, ast.Import):
            found[optional].update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found[optional].add(base)
            found[optional].update(f"{base}.{a.name}" for a in node.names)
        for child in children:
            visit(child, optional)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found[False], found[True] - found[False]


def _within(names: set[str], modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``names`` load, with the packages above them."""
    out = set()
    for n in names:
        parts = n.split(".")
        out.update(p for i in range(1, len(parts) + 1) if (p := ".".join(parts[:i])) in modules)
    return out


@cache
def _kernel_graph() -> dict[str, tuple[set[str], set[str]]]:
    return {m: _imports(m, p) for m, p in _modules(ROOT).items()}


def _third_party(names: set[str]) -> set[str]:
    """The top-level names of ``names`` that are neither the standard library nor DSec's."""
    tops = {n.split(".")[0] for n in names}
    return {t for t in tops if t not in sys.stdlib_module_names and not t.startswith("dsec_")}


def _kernel_needs(entry: set[str]) -> tuple[set[str], set[str]]:
    """The third-party top-level names that the kernel modules ``entry`` loads need, and
    those they do without, followed through the kernel."""
    graph = _kernel_graph()
    todo, seen = list(_within(entry, graph)), set()
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += _within(graph[m][0] | graph[m][1], graph) - seen
    required = _third_party(set().union(*(graph[m][0] for m in seen)))
    return required, _third_party(set().union(*(graph[m][1] for m in seen))) - required


@cache
def _providers() -> dict[str, set[str]]:
    """``{top-level module: distributions installed here that provide it}``."""
    return {
        top: {canonicalize_name(d) for d in dists}
        for top, dists in metadata.packages_distributions().items()
    }


def _distributions_of(tops: set[str]) -> set[str]:
    providers = _providers()
    unknown = sorted(t for t in tops if t not in providers)
    assert not unknown, f"no distribution installed here provides {unknown}"
    return set().union(*(providers[t] for t in tops))


def _plugin_packages() -> dict[str, str]:
    """``{top-level package: distribution}`` of the repository's plugins."""
    return {
        p.name: canonicalize_name(_project(dist)["name"])
        for dist in PLUGINS
        for p in _packages(dist)
    }


def _from_an_index(name: str) -> bool:
    """Whether pip installed ``name`` here from a package index (PEP 610: only a direct
    install, of a directory, an archive or a VCS URL, records ``direct_url.json``)."""
    return metadata.distribution(name).read_text("direct_url.json") is None


def test_the_kernel_declares_what_it_imports():
    """Every third-party module the kernel imports comes from its dependencies or an extra
    (the conformance suites' pytest from ``test``), and each distribution of its
    dependencies and of the extras its modules use is imported (or is a program: the
    nats-server binary ships no module)."""
    project = _project(ROOT)
    extras = project["optional-dependencies"]
    core = _names(project["dependencies"])
    required, optional = _kernel_needs(set(_kernel_graph()))
    imported = _distributions_of(required | optional)
    declared = core.union(*map(_names, extras.values()))
    assert imported <= declared, f"the kernel imports undeclared {sorted(imported - declared)}"
    used = core.union(*(_names(extras[e]) for e in KERNEL_EXTRAS))
    modules_of = set().union(*_providers().values())
    unused = {d for d in used - imported if d in modules_of}
    assert not unused, f"the kernel declares {sorted(unused)} but imports none of it"


def test_the_faces_need_no_extra():
    """What a trainer imports (the SDK, the contract, the loader), and all they load, in
    functions too, comes from the kernel's plain dependencies."""
    core = _names(_project(ROOT)["dependencies"])
    faces = {"dsec_kernel", "dsec_kernel.sdk", "dsec_kernel.contract", "dsec_kernel.loader"}
    needs = _distributions_of(_kernel_needs(faces)[0])
    assert needs <= core, f"the SDK needs {sorted(needs - core)}, in an extra"


@pytest.mark.parametrize("dist", PLUGINS, ids=lambda p: p.name)
def test_a_plugin_declares_exactly_what_it_imports(dist):
    """Its dependencies: the kernel, the other plugins it imports, the third-party
    distributions it imports and those the kernel modules it imports need beyond the
    kernel's own dependencies. Its extras: what it imports only if it can."""
    project = _project(dist)
    modules = _modules(dist)
    required, optional = set(), set()
    for m, p in modules.items():
        needed, spared = _imports(m, p)
        required |= needed
        optional |= spared
    optional -= required
    own = {m.split(".")[0] for m in modules}
    plugins = _plugin_packages()
    others = {n.split(".")[0] for n in required if n.startswith("dsec_")} - own - {"dsec_kernel"}
    assert others <= plugins.keys(), f"imports {sorted(others - plugins.keys())}: whose?"
    core = _names(_project(ROOT)["dependencies"])
    needs = _distributions_of(_third_party(required) - own)
    needs |= _distributions_of(_kernel_needs(required)[0]) - core
    wanted = {KERNEL, *(plugins[t] for t in others), *needs}
    declared = _names(project.get("dependencies", []))
    assert declared == wanted, (
        f"{project['name']} declares {sorted(declared - wanted)} it does not import"
        f" and lacks {sorted(wanted - declared)}"
    )
    extras = project.get("optional-dependencies", {})
    offered = set().union(*map(_names, extras.values()))
    spare = _distributions_of(_third_party(optional) - own) - needs
    assert offered == spare, f"{project['name']}'s extras: {sorted(offered)}, not {sorted(spare)}"
    not_indexed = sorted(d for d in (declared | offered) - {KERNEL} if not _from_an_index(d))
    assert not not_indexed, f"{project['name']} requires {not_indexed}, on no package index"


# -- a venv of the kernel and one plugin -------------------------------------------------------


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """``{distribution: wheel}`` built from a copy of the checkout (so no build files land in
    it), the kernel's and every plugin's."""
    if _pip("--version").returncode:
        pytest.skip("pip is not available to this interpreter")
    base = tmp_path_factory.mktemp("wheels")
    sources = []
    for dist in DISTRIBUTIONS:
        src = base / "src" / dist.name
        src.mkdir(parents=True)
        for f in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy(dist / f, src / f)
        for package in _packages(dist):
            shutil.copytree(
                package, src / package.name, ignore=shutil.ignore_patterns("__pycache__")
            )
        sources.append(str(src))
    built = _pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                 "-w", str(base / "wheels"), *sources)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    return {canonicalize_name(w.name.split("-")[0]): w for w in (base / "wheels").glob("*.whl")}


def _closure(requirements: list[str]) -> set[str]:
    """The distributions installed here that ``requirements`` need, followed through their
    own requirements (markers evaluated for this interpreter, with the extras asked for)."""
    out: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name.startswith("dsec-") or (name in out and not req.extras):
            continue
        out.add(name)
        for sub in metadata.requires(name) or []:
            todo += [(Requirement(sub), e) for e in ("", *req.extras)]
    return out


def _venv(base: Path, wheels: list[Path], requirements: list[str]) -> tuple[Path, Path]:
    """A venv holding ``wheels`` and exactly what ``requirements`` need: its python and its
    site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", base], check=True)
    python = base / "bin" / "python"
    installed = _pip("--python", str(python), "install", "--quiet", "--no-deps", "--no-index",
                     *map(str, wheels))  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    [site] = base.glob("lib/python*/site-packages")
    for name in _closure(requirements):
        dist = metadata.distribution(name)
        home = Path(dist.locate_file("")).resolve()
        assert dist.files, f"{name} lists no files (no RECORD)"
        for f in dist.files:
            source = Path(dist.locate_file(f)).resolve()
            if not source.is_relative_to(home) or "__pycache__" in f.parts:
                continue  # a script in bin/ (the nats-server binary), or a cache
            target = site / f
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.exists() and not target.exists():
                target.symlink_to(source)
    return python, site


def _unmet(site: Path) -> list[str]:
    """What ``pip check`` would report of ``site``: each requirement of a distribution there
    that no distribution there meets."""
    dists = {
        canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])
    }
    unmet = []
    for name, dist in dists.items():
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = dists.get(canonicalize_name(req.name))
            if have is None or not req.specifier.contains(have.version, prereleases=True):
                unmet.append(f"{name} requires {req}")
    return unmet


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSEC_", "PYTHON"))}
    return env | {"HOME": str(home), "DSEC_STATE_DIR": str(home / "state")}


def _run(argv: list, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, cwd=home, env=_clean_env(home)
    )


def test_the_kernel_alone_gives_a_trainer_the_sdk_and_the_cli(wheels, tmp_path):
    python, site = _venv(tmp_path / "venv", [wheels[KERNEL]], _project(ROOT)["dependencies"])
    dsec = str(python.parent / "dsec")
    assert not _unmet(site)
    sdk = _run([python, "-I", "-c", "import dsec_kernel as d; d.AsyncClient, d.Client, d.Env"],
               tmp_path)  # fmt: skip
    assert sdk.returncode == 0, sdk.stderr
    shown = _run([dsec, "--help"], tmp_path)
    assert shown.returncode == 0 and "usage: dsec" in shown.stdout, shown.stderr
    for argv in (["ls"], ["exec", "sb-1", "--", "true"]):  # no platform here: one line
        ran = _run([dsec, *argv], tmp_path)
        assert ran.returncode != 0 and "no DSec connection" in ran.stderr, (argv, ran.stderr)
        assert len(ran.stderr.splitlines()) == 1, ran.stderr
    for argv in SERVER_COMMANDS:
        ran = _run([dsec, *argv], tmp_path)
        assert ran.returncode == exitcodes.PLUGIN and ran.stdout == "", (argv, ran.stderr)
        [line] = ran.stderr.splitlines()
        assert line.endswith(SERVER_HINT) and "grpcio" in line, line


@pytest.mark.parametrize("dist", PLUGINS, ids=lambda p: p.name)
def test_a_plugin_installs_into_a_venv_with_only_the_kernel(wheels, tmp_path, dist):
    project = _project(dist)
    requirements = [*_project(ROOT)["dependencies"], *project["dependencies"]]
    name = canonicalize_name(project["name"])
    python, site = _venv(tmp_path / "venv", [wheels[KERNEL], wheels[name]], requirements)
    assert not _unmet(site)
    points = [ep for group in project["entry-points"].values() for ep in group.values()]
    code = "import importlib\n" + "".join(
        f"getattr(importlib.import_module({m!r}), {a!r})\n"
        for m, _, a in (p.partition(":") for p in points)
    )
    loaded = _run([python, "-I", "-c", code], tmp_path)
    assert loaded.returncode == 0, f"{project['name']}'s entry points: {loaded.stderr}"
