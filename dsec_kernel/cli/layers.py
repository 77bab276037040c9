"""``dsec layer``: the layer store, worked on directly (no apiserver, no NATS).

``build`` makes a well-known layer from a recipe (entry-point group ``dsec.recipes``) if the
store lacks it, or a toolkit of pip packages through a running DSec (``build toolkit``: in a
sandbox of its base, :mod:`dsec_kernel.sdk.toolkits`); ``import`` makes one from a directory,
a tar archive or an OCI image layout; ``ls``, ``rm`` and ``gc`` keep the catalog. A layer is
printed as one line, ``name:version kind digest size files``, or with ``--json`` as its
record. A build's steps go to stderr as they come (:class:`_Steps`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from dsec_kernel.cli.output import json_line
from dsec_kernel.contract import errors

if TYPE_CHECKING:
    from rich.console import Console

    from dsec_kernel.contract.store import Layer, LayerStore

__all__ = ["run_layer"]


def run_layer(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dsec_kernel.loader import open_store

    console = Console(stderr=True)
    if args.layer_cmd == "build" and args.recipe is None:
        return _recipes(args.json)
    if args.layer_cmd == "build" and args.recipe == "toolkit":
        return _toolkit(args, console)
    store = open_store()
    if args.layer_cmd == "build":
        if args.ref or args.pip:
            raise errors.InvalidArgument(
                f"NAME:VERSION and --pip are for toolkits (dsec layer build toolkit "
                f"NAME:VERSION --pip REQ...), not for recipe {args.recipe}"
            )
        _print(_build(store, args.recipe, args.packages, console), args.json)
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


def _build(store: LayerStore, name: str, packages: list[str], console: Console) -> Layer:
    """The recipe's layer (with ``packages`` added): from the store, else built and
    imported."""
    from dsec_kernel.contract.store import ensure_layer
    from dsec_kernel.loader import load_drivers

    cls = load_drivers("dsec.recipes", [name])[name].obj  # PluginLoadError lists the others
    recipe = cls(packages)
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
    if recipe.extra:
        print(f"dsec: {ref} is {recipe.name}:{cls.version} with {','.join(recipe.extra)}",
              file=sys.stderr)  # fmt: skip
    with _Steps(console, ref) as say:
        return ensure_layer(
            store, recipe.kind, recipe.name, recipe.version,
            lambda tree: recipe.build(tree, say), say,
        )  # fmt: skip


def _toolkit(args: argparse.Namespace, console: Console) -> int:
    """``dsec layer build toolkit NAME:VERSION --pip REQ...``, through the running DSec."""
    import asyncio

    from dsec_kernel.sdk import AsyncClient
    from dsec_kernel.sdk.toolkits import build_toolkit, check_requirements

    if args.ref is None or args.packages:
        not_packages = " (not --packages)" if args.packages else ""
        raise errors.InvalidArgument(
            f"a toolkit takes NAME:VERSION and --pip REQ...{not_packages}, e.g. dsec layer "
            "build toolkit pytest:8.3 --pip 'pytest==8.3.*'"
        )

    check_requirements(args.pip or [])
    try:
        cert = args.cert.read_bytes() if args.cert else None
    except OSError as e:
        raise errors.InvalidArgument(f"--cert: cannot read {args.cert}: {e.strerror}") from None

    async def build() -> Any:
        async with AsyncClient() as c:
            with _Steps(console, args.ref, every_line=True) as say:
                return await build_toolkit(
                    c, args.ref, args.pip or [], base=args.base, timeout=args.timeout,
                    cert=cert, progress=say,
                )  # fmt: skip

    layer = asyncio.run(build())
    if args.json:
        json_line(layer)
    else:
        print(f"{layer.name}:{layer.version} {layer.kind} {layer.digest} {layer.size} bytes")
    return 0


class _Steps:
    """A build's progress on stderr, as a callable taking each step (``"phase: detail"``).
    On a terminal, a live line shows the latest step and the time since the start.
    Everywhere, a line is kept for each phase when the next begins (its last detail and its
    seconds), and off a terminal every 10 s of a long phase; with ``every_line`` (pip's
    output), each step is kept as it comes."""

    def __init__(self, console: Console, ref: str, every_line: bool = False) -> None:
        self.console, self.ref, self.every_line = console, ref, every_line
        self.start = self.since = self.said = time.monotonic()
        self.phase, self.last = "", ""

    def __enter__(self) -> _Steps:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.table import Column

        line = Column(no_wrap=True, overflow="ellipsis", ratio=1)
        self.live = Progress(
            SpinnerColumn(), TextColumn("{task.description}", markup=False, table_column=line),
            TimeElapsedColumn(), console=self.console, transient=True, expand=True,
        )  # fmt: skip
        self.task = self.live.add_task(f"{self.ref}: starting")
        if self.console.is_terminal:  # (elsewhere it would print empty lines)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.console.is_terminal:
            self.live.__exit__(*exc)
        if exc[0] is None:
            if not self.every_line:
                self._keep()
            self.console.print(f"{self.ref}: done in {time.monotonic() - self.start:.0f} s",
                               highlight=False)  # fmt: skip

    def __call__(self, step: str) -> None:
        phase = step.partition(":")[0] if ": " in step else step
        now = time.monotonic()
        if self.every_line:
            self.console.print(f"{self.ref}: {step}", highlight=False, markup=False)
        elif phase != self.phase:
            self._keep()
            self.phase, self.since = phase, now
        elif not self.console.is_terminal and now - self.said >= 10:
            self.console.print(f"{self.ref}: {step}", highlight=False, markup=False)
            self.said = now
        self.last = step
        self.live.update(self.task, description=f"{self.ref}: {step}")

    def _keep(self) -> None:
        """The line kept for the phase that ends."""
        if self.last:
            took = time.monotonic() - self.since
            self.console.print(f"{self.ref}: {self.last} ({took:.1f} s)", highlight=False,
                               markup=False)  # fmt: skip
            self.said = time.monotonic()
        self.last = ""


def _recipes(as_json: bool) -> int:
    """``dsec layer build`` without a recipe: what it can build."""
    from rich.console import Console
    from rich.table import Table

    from dsec_kernel.loader import discover

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
            json_line(row)
    if not as_json:
        Console().print(table)
        print(
            "and toolkit: dsec layer build toolkit NAME:VERSION --pip REQ... [--base "
            "debian-python:12] makes a toolkit of pip packages in a sandbox of its base (needs "
            "a running DSec: dsec up)"
        )
    return 0


def _ls(layers: list[Layer], as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    layers = sorted(layers, key=lambda x: (x.tenant or "", x.kind, x.ref))
    if as_json:
        for layer in layers:
            json_line(layer)
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
        json_line(layer)
    else:
        print(f"{layer.ref} {layer.kind} {layer.digest} {layer.size} bytes {layer.files} files")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
