"""The kernel's shape: the contract stands alone, no import circles, small modules."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dsec_kernel

KERNEL = Path(dsec_kernel.__file__).parent
CONTRACT = [
    "dsec_kernel.contract",
    "dsec_kernel.contract.agent",
    "dsec_kernel.contract.agent.agent_pb2",
    "dsec_kernel.contract.backend",
    "dsec_kernel.contract.errors",
    "dsec_kernel.contract.hooks",
    "dsec_kernel.contract.hookspecs",
    "dsec_kernel.contract.placement",
    "dsec_kernel.contract.store",
    "dsec_kernel.contract.wire",
]
# what the contract may not load: the NATS client, the grpc runtime, the control plane (any
# kernel module outside the contract), the Linux host helpers
FORBIDDEN = ("nats", "grpc", "dsec_kernel.")


def test_importing_the_contract_loads_no_runtime():
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in CONTRACT)
        + "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded = json.loads(out)
    bad = [
        m
        for m in loaded
        if m.startswith(FORBIDDEN)
        and not m.startswith("dsec_kernel.contract")
        and m.split(".")[0] in ("nats", "grpc", "dsec_kernel")
    ]
    assert not bad, f"importing the contract loaded {bad}"
    assert "dsec_kernel.contract.conformance" not in loaded  # (pytest, on its own import)


def test_the_sdk_loads_no_linux_helper_and_no_service():
    code = "import json, sys, dsec_kernel.sdk\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded = json.loads(out)
    services = ("apiserver", "edge", "state", "admission", "pools", "leases", "loader")
    bad = [
        m
        for m in loaded
        if m.startswith(("dsec_kernel.linuxhost", "grpc"))
        or m.split(".")[:2] in [["dsec_kernel", s] for s in services]
    ]
    assert not bad, f"importing the SDK loaded {bad}"


def _modules() -> dict[str, Path]:
    out = {}
    for p in KERNEL.rglob("*.py"):
        if p.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = ("dsec_kernel", *p.relative_to(KERNEL).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every kernel module ``name`` imports, wherever the import is (a function, a
    TYPE_CHECKING block): ``from pkg import sub`` is an import of ``pkg.sub`` only (a
    package's own ``__init__`` running first is not a dependency of the importer's)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            subs = [f"{base}.{a.name}" for a in node.names]
            hits = [s for s in subs if s in modules]
            out.update(hits)
            if len(hits) < len(subs) and base in modules:
                out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_in_the_kernel():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert not _cycles(graph)


def test_the_walk_finds_a_circle(tmp_path):
    """(The walker itself: a circle through a TYPE_CHECKING import is found.)"""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from pkg import a\n"
    )
    mods = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


@pytest.mark.parametrize("limit", [420])
def test_no_kernel_module_outside_the_sdk_and_cli_is_large(limit):
    big = {
        str(p.relative_to(KERNEL)): n
        for p in KERNEL.rglob("*.py")
        if p.relative_to(KERNEL).parts[0] not in ("sdk", "cli")
        and not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        and (n := len(p.read_text().splitlines())) > limit
    }
    assert not big, f"modules over {limit} lines: {big}"
