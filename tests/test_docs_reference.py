"""The docs' reference parts, held to the code they describe.

docs/plugins.md's field reference is written by hand, not generated: a field's meaning and who
sets it are prose no script can make, while a generated table beside a hand-written one would
still need a test that the two agree. So this test reads the tables and checks them: every
model a backend sees (found by walking the ``Backend`` ABC's signatures, its ``capabilities``
and ``BackendContext``, then the models their fields hold) has a table under a ``#### `Name```
heading; each table lists exactly the model's fields, each with its type as the source
annotates it and a meaning and a setter. A field added, removed, renamed or retyped fails here,
naming the row to write.

Likewise: the page's account of the conformance suite names every test of
``BackendConformance`` and no other; the layer-store table names every abstract method of
``LayerStore``; docs/configuration.md lists every setting of the kernel's (and of the shipped
placement policies'); and every kernel path, dotted name and relative link in the README, docs/ and
the plugins' READMEs exists inside this repository.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import itertools
import pkgutil
import re
import typing
from pathlib import Path

from dsec_backend_container.backend import ContainerBackend
from dsec_backend_fncall.backend import FncallBackend
from dsec_placement_basic import ScoredConfig
from dsec_storage_3fs import ThreeFsStore
from pydantic import BaseModel

from dsec_kernel.config import ApiSettings, EdgeSettings, StorageSettings
from dsec_kernel.contract import wire
from dsec_kernel.contract.backend import Backend, BackendContext
from dsec_kernel.contract.conformance import BackendConformance
from dsec_kernel.contract.store import LayerStore

ROOT = Path(__file__).resolve().parents[1]
PLUGINS_MD = ROOT / "docs" / "plugins.md"
PAGES = [
    ROOT / "README.md",
    *sorted(ROOT.glob("docs/*.md")),
    *sorted(ROOT.glob("plugins/*/README.md")),
]


# -- the models a backend sees -----------------------------------------------------------------


def _leaves(tp: object) -> list[object]:
    """The classes inside a type: ``list[X] | None`` -> [X, NoneType]."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Annotated:
        return _leaves(args[0])
    return [leaf for a in args for leaf in _leaves(a)] if args else [tp]


def _is_model(tp: object) -> bool:
    return (
        isinstance(tp, type)
        and (issubclass(tp, BaseModel) or dataclasses.is_dataclass(tp))
        and tp.__module__.startswith("dsec_kernel.")
    )


def backend_models() -> dict[str, type]:
    """Name -> class of every model a backend is handed or returns, and the models inside
    them."""
    roots: list[object] = [BackendContext, Backend.__annotations__["capabilities"]]
    names = {  # what the contract imports only for type checkers
        k: v
        for info in pkgutil.iter_modules(wire.__path__, f"{wire.__name__}.")
        for k, v in vars(importlib.import_module(info.name)).items()
    }
    for _, fn in inspect.getmembers(Backend, inspect.isfunction):
        roots += typing.get_type_hints(fn, localns=names).values()
    found: dict[str, type] = {}
    todo = [leaf for r in roots for leaf in _leaves(eval_hint(r))]
    while todo:
        tp = todo.pop()
        if not _is_model(tp) or tp.__name__ in found:
            continue
        assert isinstance(tp, type)
        found[tp.__name__] = tp
        if issubclass(tp, BaseModel):
            todo += [leaf for f in tp.model_fields.values() for leaf in _leaves(f.annotation)]
    return found


def eval_hint(hint: object) -> object:
    """``ClassVar[X]`` as written in a class body (a string there) -> X."""
    if isinstance(hint, str):
        hint = re.fullmatch(r"ClassVar\[(\w+)\]", hint).group(1)  # type: ignore[union-attr]
        return getattr(importlib.import_module(Backend.__module__), hint)
    return hint


def field_types(model: type) -> dict[str, str]:
    """Field -> its annotation as the source writes it (inherited fields too; a message's
    constant ``type`` left out)."""
    if issubclass(model, BaseModel):
        names = [n for n in model.model_fields if n != "type"]
    else:
        names = [f.name for f in dataclasses.fields(model)]
    out = {}
    for name in names:
        hint = next(
            k.__annotations__[name]
            for k in model.__mro__
            if name in vars(k).get("__annotations__", {})
        )
        out[name] = _bare(hint if isinstance(hint, str) else inspect.formatannotation(hint))
    return out


def _bare(hint: str) -> str:
    """A source annotation without ``Annotated``'s metadata: ``Annotated[X, meta]`` -> X."""
    while (start := hint.find("Annotated[")) >= 0:
        depth, i, comma = 0, start + len("Annotated"), None
        for i in range(start + len("Annotated"), len(hint)):
            depth += {"[": 1, "]": -1}.get(hint[i], 0)
            if hint[i] == "," and depth == 1 and comma is None:
                comma = i
            if depth == 0:
                break
        inner = hint[start + len("Annotated[") : comma if comma else i]
        hint = hint[:start] + inner.strip() + hint[i + 1 :]
    return hint.replace("'", '"')


# -- the page's tables -------------------------------------------------------------------------


def _cells(row: str) -> list[str]:
    """A markdown table row's cells; ``\\|`` is a pipe inside a cell."""
    inner = row.strip().removeprefix("|").removesuffix("|")
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def reference_tables(text: str) -> dict[str, list[list[str]]]:
    """``#### `Name``` heading -> the rows of the first table after it (header dropped)."""
    tables: dict[str, list[list[str]]] = {}
    current = None
    for line in text.splitlines():
        if re.match(r"^#{1,4} ", line):
            head = re.fullmatch(r"#### `(\w+)`.*", line)
            current = head.group(1) if head else None
            if current:
                assert current not in tables, f"two tables for {current}"
                tables[current] = []
        elif current and line.startswith("|"):
            cells = _cells(line)
            if cells[0] != "field" and not set("".join(cells)) <= set("-: "):
                tables[current].append(cells)
    return tables


def test_every_model_a_backend_sees_has_a_table_of_exactly_its_fields():
    tables = reference_tables(PLUGINS_MD.read_text())
    models = backend_models()
    assert models.keys() >= {"EdgeSandbox", "ExecCall", "ExecResult", "BackendContext"}
    problems = [f"no table for {name}" for name in sorted(models.keys() - tables.keys())]
    problems += [f"a table for {n}, which no backend sees" for n in tables.keys() - models.keys()]
    for name in sorted(models.keys() & tables.keys()):
        want = field_types(models[name])
        rows = tables[name]
        got = {}
        for cells in rows:
            if len(cells) != 4 or not all(cells):
                problems.append(f"{name}: a row not | field | type | meaning | set by |: {cells}")
                continue
            got[cells[0].strip("`")] = cells[1].strip("`").replace("'", '"')
        for field in want.keys() - got.keys():
            problems.append(f"{name}: no row for {field!r} (type `{want[field]}`)")
        for field in got.keys() - want.keys():
            problems.append(f"{name}: a row for {field!r}, which it does not have")
        for field in want.keys() & got.keys():
            if got[field] != want[field]:
                problems.append(f"{name}.{field}: typed `{got[field]}`, the code `{want[field]}`")
    assert not problems, "docs/plugins.md's field reference:\n" + "\n".join(problems)


def _section(text: str, title: str) -> str:
    """The text of the ``## title`` section."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/plugins.md has no section {title!r}"
    return m.group(1)


def test_the_implicit_contract_names_every_conformance_test():
    text = _section(PLUGINS_MD.read_text(), "The conformance suite")
    named = set(re.findall(r"`(test_\w+)`", text))
    tests = {n for n in dir(BackendConformance) if n.startswith("test_")}
    assert not tests - named, f"conformance tests the page does not describe: {tests - named}"
    assert not named - tests, f"the page names tests the suite lacks: {named - tests}"


def test_the_layer_store_table_names_every_method():
    text = _section(PLUGINS_MD.read_text(), "A layer store")
    first_cells = " ".join(re.findall(r"^\| (.*?) \|", text, re.M))
    named = set(re.findall(r"`(\w+)\(", first_cells))
    abstract = set(LayerStore.__abstractmethods__)
    assert not abstract - named, f"LayerStore methods the table leaves out: {abstract - named}"
    assert not named - set(dir(LayerStore)), (
        f"not LayerStore methods: {named - set(dir(LayerStore))}"
    )


def test_every_setting_is_in_configuration_md():
    """Each field of the kernel's settings as its variable (``DSEC_<FIELD>``, a nested one's
    prefix ``DSEC_<FIELD>__``), and each of the shipped placement policies' settings."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    fields = {
        name: info
        for cls in (ApiSettings, EdgeSettings, StorageSettings)
        for name, info in cls.model_fields.items()
    }
    wanted = [
        f"DSEC_{name.upper()}" + ("__" if typing.get_origin(info.annotation) is dict else "")
        for name, info in fields.items()
    ]
    wanted += [f"DSEC_PLACEMENT_CONFIG__{name.upper()}" for name in ScoredConfig.model_fields]
    missing = [v for v in wanted if not re.search(rf"`{v}(?![A-Z_])", text)]
    assert not missing, f"settings docs/configuration.md does not list: {missing}"


def _first_cells(text: str, title: str) -> list[str]:
    """The first cells of the first table after ``title`` (its header and rule left out)."""
    lines = iter(text[text.index(title) :].splitlines())
    for line in lines:
        if line.startswith("|"):
            break
    next(lines)  # the rule under the header
    return [_cells(line)[0] for line in itertools.takewhile(lambda x: x.startswith("|"), lines)]


def test_the_plugins_settings_tables_list_exactly_their_configs_fields():
    """docs/configuration.md's tables of this repository's backends' and store's settings."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    tables = {
        "## fncall backend": FncallBackend.Config,
        "## container backend": ContainerBackend.Config,
        "`3fs` fields": ThreeFsStore.Config,
    }
    problems = []
    for title, config in tables.items():
        cells = " ".join(_first_cells(text, title))
        listed = {n.lower() for n in re.findall(r"`([A-Z_]+?)(?:__<FIELD>)?`", cells)}
        fields = set(config.model_fields)
        problems += [f"{title}: no row for {f.upper()}" for f in sorted(fields - listed)]
        problems += [f"{title}: {f.upper()} is no setting" for f in sorted(listed - fields)]
    assert not problems, "\n".join(problems)


# -- names and links ---------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w/.-])((?:dsec_kernel|plugins|tests|benchmarks|docs)/[\w./-]*\w)")
DOTTED = re.compile(r"(?<![\w/.])(dsec_[a-z0-9_]+(?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _resolves(dotted: str) -> bool:
    """A module, or an attribute of one, of an installed package (True for the names of a
    package that is not installed: the docs' example plugins)."""
    parts = dotted.split(".")
    if importlib.util.find_spec(parts[0]) is None:
        return True
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _prose(page: Path) -> str:
    """The page without its fenced blocks (run by tests/test_docs.py) and HTML comments."""
    text = re.sub(r"^\s*```.*?^\s*```$", "", page.read_text(), flags=re.M | re.S)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def test_every_path_name_and_link_the_docs_give_exists():
    problems = []
    for page in PAGES:
        text = _prose(page)
        where = page.relative_to(ROOT)
        for path in {m.split("::")[0] for m in PATH.findall(text)}:
            if not (ROOT / path).exists() and not (page.parent / path).exists():
                problems.append(f"{where}: {path} does not exist")
        for dotted in set(DOTTED.findall(text)):
            if not _resolves(dotted.removesuffix(".py")):
                problems.append(f"{where}: {dotted} does not resolve")
        for target in set(LINK.findall(text)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file = (page.parent / target.split("#")[0]).resolve()
            if not file.is_relative_to(ROOT) or not file.exists():
                problems.append(f"{where}: the link {target} leads nowhere in this repository")
    assert not problems, "\n".join(sorted(problems))
