"""``dsec layer``: the layer store, worked on directly (no apiserver, no NATS).

``build`` makes a well-known layer from a recipe (entry-point group ``dsec.recipes``) if the
store lacks it; ``import`` makes one from a directory, a tar archive or an OCI image layout;
``ls``, ``rm`` and ``gc`` keep the catalog. A layer is printed as one line, ``name:version kind
digest size files``, or with ``--json`` as its record.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from dsec_kernel import errors

if TYPE_CHECKING:
    from rich.console import Console

    from dsec_kernel.storage import Layer, LayerStore

__all__ = ["run_layer"]


def run_layer(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dsec_kernel.storage import open_store

    console = Console(stderr=True)
    if args.layer_cmd == "build" and args.recipe is None:
        return _recipes(args.json)
    store = open_store()
    if args.layer_cmd == "build":
        _print(_build(store, args.recipe, console), args.json)
    elif args.layer_cmd == "import":
        with console.status("importing") as status:
            layer = store.import_layer(
                args.source, args.kind, args.name, args.version,
                progress=lambda step: status.update(f"{args.name}:{args.version}: {step}"),
                tenant=args.tenant, under=args.under or "", strip=args.strip,
            )  # fmt: skip
        _print(layer, args.json)
    elif args.layer_cmd == "ls":
        _ls(store.list_layers(), args.json)
    elif args.layer_cmd == "rm":
        name, _, version = args.ref.partition(":")
        print(f"removed {store.remove(name, version, force=args.force, tenant=args.tenant).ref}")
    else:
        report = store.gc()
        print(f"removed {len(report.removed)} image(s), freed {_size(report.bytes_freed)}")
    return 0


def _build(store: LayerStore, name: str, console: Console) -> Layer:
    """The recipe's layer: from the store, else built and imported."""
    from dsec_kernel.plugins import load_drivers
    from dsec_kernel.storage import ensure_layer

    recipe = load_drivers("dsec.recipes", [name])[name].obj  # PluginLoadError lists the others
    ref = f"{recipe.name}:{recipe.version}"
    try:
        layer = store.resolve(recipe.name, recipe.version, recipe.kind)
    except errors.NotFound:
        pass
    else:
        print(f"dsec: {ref} is in the store already; nothing built", file=sys.stderr)
        return layer
    if reason := recipe.unavailable_reason():
        raise errors.Unavailable(f"recipe {name} cannot build here: {reason}", retryable=False)
    with console.status(f"{ref}: building") as status:

        def say(step: str) -> None:
            status.update(f"{ref}: {step}")

        return ensure_layer(
            store, recipe.kind, recipe.name, recipe.version,
            lambda tree: recipe().build(tree, say), say,
        )  # fmt: skip


def _recipes(as_json: bool) -> int:
    """``dsec layer build`` without a recipe: what it can build."""
    from rich.console import Console
    from rich.table import Table

    from dsec_kernel.cli import _json_line
    from dsec_kernel.plugins import discover

    table = Table("recipe", "layer", "kind", "status", "what")
    for info in discover("dsec.recipes"):
        row: dict[str, Any] = {"recipe": info.name, "distribution": info.distribution}
        if info.error:
            row.update(status="broken", error=info.error)
            table.add_row(info.name, "", "", f"[red]broken: {info.error}[/red]", "")
        else:
            r = info.obj
            reason = r.unavailable_reason()
            row.update(layer=f"{r.name}:{r.version}", kind=r.kind, summary=r.summary)
            row.update(status="unavailable", reason=reason) if reason else row.update(status="ok")
            status = f"[yellow]cannot build here: {reason}[/yellow]" if reason else "ok"
            table.add_row(info.name, row["layer"], r.kind, status, r.summary)
        if as_json:
            _json_line(row)
    if not as_json:
        Console().print(table)
    return 0


def _ls(layers: list[Layer], as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from dsec_kernel.cli import _json_line

    layers = sorted(layers, key=lambda x: (x.tenant or "", x.kind, x.ref))
    if as_json:
        for layer in layers:
            _json_line(layer)
        return
    if not layers:
        print(
            "dsec: no layers yet; `dsec layer build` lists those it can make, `dsec layer "
            "import` makes one of a directory, a tar archive or an OCI image layout",
            file=sys.stderr,
        )
        return
    table = Table("name:version", "owner", "kind", "digest", "size", "files")
    for layer in layers:
        table.add_row(
            layer.ref, layer.tenant or "public", layer.kind, layer.digest[:19],
            _size(layer.size), str(layer.files),
        )  # fmt: skip
    Console().print(table)


def _print(layer: Layer, as_json: bool) -> None:
    if as_json:
        from dsec_kernel.cli import _json_line

        _json_line(layer)
    else:
        print(f"{layer.ref} {layer.kind} {layer.digest} {layer.size} bytes {layer.files} files")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
