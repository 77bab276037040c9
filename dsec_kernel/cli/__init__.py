"""The ``dsec`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from dsec_kernel import __version__, errors

__all__ = ["main"]


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsec", description="DSec: elastic sandboxes for agentic RL")
    p.add_argument("--version", action="version", version=f"dsec {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("up", help="run NATS + apiserver + edge on this machine")
    s.add_argument("--state-dir", type=Path, help="where state, logs and the connection file go")
    s.add_argument("--port", type=int, default=0, help="NATS client port (default: a free one)")
    s.add_argument("--node", help="this node's name (default: the host name)")
    s.add_argument("--backends", type=_csv, help="backends to run (default: all that can)")
    s.add_argument(
        "--rm",
        action="store_true",
        help="remove every sandbox when stopping (default: they stay, and the next up adopts them)",
    )
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...: run CMD, then stop")

    s = sub.add_parser("down", help="stop the dsec up of a state dir, removing every sandbox first")
    s.add_argument("--state-dir", type=Path, help="the dsec up's (default ~/.dsec)")
    s.add_argument("--keep", action="store_true", help="stop it but keep the sandboxes")
    s.add_argument("--timeout", type=float, default=120.0,
                   help="how long to wait for it to stop, in seconds (default 120)")  # fmt: skip

    s = sub.add_parser(
        "cluster-up",
        help="run a real cluster on this machine: a NATS cluster, apiservers, and edges each in "
        "its own network namespace",
    )
    s.add_argument("--state-dir", type=Path, help="where state, logs and the connection file go")
    s.add_argument("--nats-servers", type=int, default=3, help="NATS servers (default 3)")
    s.add_argument("--apiservers", type=int, default=2, help="apiservers (default 2)")
    s.add_argument("--edges", type=int, default=4, help="edges, nodes n1..nN (default 4)")
    s.add_argument("--cloud", type=int, default=0, help="of them, how many in pool cloud")
    s.add_argument("--backends", type=_csv, help="backends to run (default: all that can)")
    s.add_argument(
        "--rm",
        action="store_true",
        help="remove every sandbox when stopping (default: they stay, and the next up adopts them)",
    )
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...: run CMD, then stop")

    login_help = 'the NATS login, a JSON file {"user": ..., "password": ...}'
    s = sub.add_parser("apiserver", help="run an apiserver against an existing NATS")
    s.add_argument("--nats-url")
    s.add_argument("--nats-login-file", type=Path, help=login_help)
    s.add_argument("--placement", help="placement policy (default least-loaded)")
    s.add_argument("--node-timeout", type=float, dest="node_timeout_s")

    s = sub.add_parser("edge", help="run this node's edge against an existing NATS")
    s.add_argument("--nats-url")
    s.add_argument("--nats-login-file", type=Path, help=login_help)
    s.add_argument("--node")
    s.add_argument("--pool")
    s.add_argument("--state-dir", type=Path)
    s.add_argument("--backends", type=_csv)
    s.add_argument("--heartbeat", type=float, dest="heartbeat_s")

    sub.add_parser("plugins", help="list installed plugins by group")

    s = sub.add_parser("schema", help="write the wire messages' JSON Schemas")
    s.add_argument("--out", type=Path, help="directory (default: print one JSON document)")

    s = sub.add_parser("tenant", help="manage tenants (operator; talks to NATS directly)")
    s.add_argument("action", choices=["create", "remove", "quota", "logins"],
                   help="create: print a new credential once its NATS login is live; remove: "
                   "delete every credential of the tenant; quota: set limits (omitted ones: "
                   "none); logins: print the NATS authorization block for your own NATS's "
                   "config")  # fmt: skip
    s.add_argument("name", nargs="?")
    s.add_argument("--nats-url", default=None, help="NATS URL (default: from `dsec up`)")
    s.add_argument("--nats-login-file", type=Path, help=f"{login_help} (default: from `dsec up`)")
    s.add_argument("--wait", type=float, default=10.0,
                   help="create: longest wait for NATS to take its login (0: none)")  # fmt: skip
    s.add_argument("--sandboxes", type=int, help="quota: most sandboxes at once")
    s.add_argument("--cpus", type=float, help="quota: most CPUs (sum of the sandboxes' limits)")
    s.add_argument("--memory-mb", type=int, help="quota: most memory (sum of their limits)")
    s.add_argument(
        "--max-priority",
        type=int,
        help="quota: highest priority its jobs have over other tenants' work",
    )

    s = sub.add_parser("layer", help="manage layers in the layer store (DSEC_STORAGE_CONFIG__ROOT)")
    lsub = s.add_subparsers(dest="layer_cmd", required=True, metavar="ACTION")
    li = lsub.add_parser("import", help="import a directory, tarball or OCI image layout")
    li.add_argument("--kind", required=True, choices=["base", "workspace", "toolkit"])
    li.add_argument("--name", required=True)
    li.add_argument("--version", required=True)
    li.add_argument("--tenant", help="the tenant it belongs to (default: public, for every tenant)")
    li.add_argument("source")
    lsub.add_parser("ls", help="list layers (every owner's)")
    lr = lsub.add_parser("rm", help="remove a layer (refused while in use)")
    lr.add_argument("ref", help="name:version")
    lr.add_argument("--tenant", help="remove that tenant's layer (default: the public one)")
    lr.add_argument("--force", action="store_true", help="even if held (by nodes that are gone)")
    lsub.add_parser("gc", help="delete images no layer names and nothing holds")

    s = sub.add_parser("create", help="create sandboxes")
    s.add_argument("--count", type=int, default=1)
    s.add_argument("--backend", default="fncall")
    s.add_argument("--ttl", type=float)
    s.add_argument("--base", help="base layer name:version (container backend)")
    s.add_argument("--workspace", help="workspace layer name:version")
    s.add_argument("--toolkit", action="append", default=[], help="toolkit layer (repeatable)")
    s.add_argument("--network", choices=["none", "egress"], default="none")
    s.add_argument("--idle-ttl", type=float, help="pause after this many seconds without a command")
    s.add_argument("--wait", type=float, default=30.0, help="longest wait for room (seconds)")

    for verb in ("pause", "resume"):
        s = sub.add_parser(verb, help=f"{verb} sandboxes")
        s.add_argument("sandboxes", nargs="+", metavar="ID")

    sub.add_parser("ls", help="list your sandboxes")
    sub.add_parser("nodes", help="list nodes")

    s = sub.add_parser("trajectory", help="a sandbox's trajectory as JSON lines")
    s.add_argument("sandbox")

    s = sub.add_parser("prestage", help="stage layers on a pool's nodes before a burst")
    s.add_argument("layers", nargs="+", metavar="NAME:VERSION")
    s.add_argument("--pool", help="node pool (default: every node)")

    s = sub.add_parser("exec", help="run a command in a sandbox")
    s.add_argument("sandbox")
    s.add_argument("--timeout", type=float, default=60.0)
    s.add_argument("command", nargs=argparse.REMAINDER)

    s = sub.add_parser("fncall", help="run code in a throw-away sandbox")
    s.add_argument("code")
    s.add_argument("--language", default="python")
    s.add_argument("--timeout", type=float, default=30.0)

    s = sub.add_parser("destroy", help="destroy sandboxes")
    s.add_argument("sandboxes", nargs="*")
    s.add_argument("--all", action="store_true", help="every sandbox of yours")
    return p


def _cmd_plugins() -> int:
    from rich.console import Console
    from rich.table import Table

    from dsec_kernel.plugins import GROUPS, discover

    table = Table("group", "name", "distribution", "version", "status / capabilities")
    for group in GROUPS:
        for info in discover(group):
            if info.error:
                status = f"[red]broken: {info.error}[/red]"
            elif group == "dsec.backends":
                reason = info.obj.unavailable_reason()
                caps = info.obj.capabilities.model_dump(exclude_defaults=True)
                status = (
                    f"[yellow]cannot run here: {reason}[/yellow]" if reason else json.dumps(caps)
                )
            else:
                status = "ok"
            table.add_row(group, info.name, info.distribution, info.version, status)
    Console().print(table)
    return 0


def _cmd_schema(out: Path | None) -> int:
    from dsec_kernel.wire import json_schemas

    schemas = json_schemas()
    if out is None:
        print(json.dumps(schemas, indent=2, sort_keys=True))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in schemas.items():
        (out / f"{name}.json").write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(schemas)} schemas to {out}")
    return 0


def _service_login(args: argparse.Namespace) -> tuple[str, Any]:
    """The NATS URL and service login of an operator command: its flags, else the service
    file that `dsec up` wrote (a login given in the URL itself is used as it is)."""
    from dsec_kernel import bus
    from dsec_kernel.connection import read_service, service_file

    url, login_file = args.nats_url, args.nats_login_file
    if url is None:
        url, default_login = read_service(service_file())
        login_file = login_file or default_login
    return url, bus.Login.read(login_file) if login_file else bus.login_in_url(url)


async def _cmd_tenant(args: argparse.Namespace) -> int:
    from dsec_kernel import bus
    from dsec_kernel.state import ClusterState, password_hash
    from dsec_kernel.wire import NAME_PATTERN, Quota

    name = args.name
    if args.action != "logins" and not name:
        raise errors.InvalidArgument(f"give the tenant: dsec tenant {args.action} NAME")
    quota = Quota(sandboxes=args.sandboxes, cpus=args.cpus, memory_mb=args.memory_mb,
                  max_priority=args.max_priority)  # fmt: skip
    url, login = _service_login(args)
    nc = await bus.connect(url, name="dsec-cli", login=login)
    try:
        state = await ClusterState.open(nc, create=False)
        if args.action == "quota":
            if not re.match(NAME_PATTERN, name):
                raise errors.InvalidArgument(f"{name!r} is not a tenant name")
            await state.quotas.put(name, quota.model_dump_json().encode())
            print(f"tenant {name}: quota {quota.model_dump_json()}")
            return 0
        if args.action == "remove":
            print(f"tenant {name}: removed {await state.remove_tenant(name)} credential(s)")
            return 0
        if args.action == "logins":
            from dsec_kernel.natsserver import authorization_block

            service = login and {"user": login.user, "password": password_hash(login.password)}
            print(authorization_block(service, await state.tenant_logins()), end="")
            return 0
        token = await state.create_tenant(name)
        if args.wait > 0:
            try:
                clients = ",".join(bus.server_urls(url))
                await bus.wait_accepted(clients, bus.Login.for_token(token), args.wait)
            except errors.DsecError:
                await state.tenants.delete(bus.token_key(token))
                raise errors.Unavailable(
                    f"NATS did not take tenant {name}'s login within {args.wait:g}s, so the "
                    "credential was withdrawn: nothing loads logins from the tenants bucket into "
                    "this NATS (`dsec up` and `dsec cluster-up` do). With your own NATS: `dsec "
                    f"tenant create {name} --wait 0`, then put the output of `dsec tenant logins` "
                    "into its config and reload it"
                ) from None
    finally:
        await nc.drain()
    print(token)
    return 0


async def _client_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from dsec_kernel.sdk import AsyncClient
    from dsec_kernel.wire import Env

    console = Console()
    async with AsyncClient() as c:
        if args.cmd == "create":
            with Progress(console=Console(stderr=True), transient=False) as bar:
                task = bar.add_task(f"creating {args.count} {args.backend}", total=args.count)
                sbs = await c.create(
                    args.count,
                    backend=args.backend,
                    ttl=args.ttl,
                    env=Env(base=args.base, workspace=args.workspace, toolkits=args.toolkit)
                    if args.base
                    else None,
                    network=args.network,
                    idle_ttl=args.idle_ttl,
                    wait=args.wait,
                    progress=lambda done, total: bar.update(task, completed=done),
                )
            print("\n".join(sb.id for sb in sbs))
        elif args.cmd in ("pause", "resume"):
            reports = await getattr(c, args.cmd)(args.sandboxes)
            for r in reports:
                freed = (r.memory_before_bytes - r.memory_after_bytes) >> 20
                extra = f", {freed} MiB out of RAM" if args.cmd == "pause" else ""
                print(f"{r.sandbox_id} {r.state} in {r.seconds * 1e3:.1f} ms{extra}")
        elif args.cmd == "ls":
            table = Table("id", "backend", "node", "state", "job", "pool", "expires")
            for sb in await c.list():
                i = sb.info
                state = f"{i.state} ({i.paused_reason})" if i.paused_reason else i.state
                pool = f"{i.pool}{' (idle)' if i.in_pool else ''}" if i.pool else ""
                table.add_row(
                    sb.id, sb.backend, sb.node, state, i.job or "", pool, _when(i.expires_at)
                )
            console.print(table)
        elif args.cmd == "nodes":
            table = Table("node", "state", "pool", "backends", "sandboxes", "paused", "cpu load")
            for n in await c.nodes():
                table.add_row(
                    n.node,
                    n.state if n.serving or n.state == "down" else "stopping",
                    n.pool,
                    ",".join(b.name for b in n.backends),
                    str(n.load.sandboxes),
                    str(n.load.paused),
                    f"{n.load.cpu_load:.2f}",
                )
            console.print(table)
        elif args.cmd == "trajectory":
            for rec in await c.trajectory(args.sandbox):
                print(rec.model_dump_json())
        elif args.cmd == "prestage":
            resp = await c.prestage(args.layers, pool=args.pool)
            print(f"staged on {len(resp.nodes)} node(s): {', '.join(sorted(resp.nodes)) or '-'}")
            for f in resp.failed:
                print(f"  {f.id}: {f.error.message}", file=sys.stderr)
            return 1 if resp.failed else 0
        elif args.cmd == "exec":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise errors.InvalidArgument(
                    "give the command after the sandbox id: dsec exec ID -- CMD"
                )
            r = await (await c.get(args.sandbox)).exec(command, timeout=args.timeout)
            return _print_result(r)
        elif args.cmd == "fncall":
            return _print_result(
                await c.fncall(args.code, language=args.language, timeout=args.timeout)
            )
        elif args.cmd == "destroy":
            targets: list[Any] = await c.list() if args.all else args.sandboxes
            done = await c.destroy(targets) if targets else []
            print(f"destroyed {len(done)}")
    return 0


def _cmd_layer(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from dsec_kernel.storage import open_store

    store = open_store()
    console = Console(stderr=True)
    if args.layer_cmd == "import":
        with console.status("importing") as status:
            layer = store.import_layer(
                args.source, args.kind, args.name, args.version,
                progress=lambda step: status.update(f"{args.name}:{args.version}: {step}"),
                tenant=args.tenant,
            )  # fmt: skip
        print(f"{layer.ref} {layer.kind} {layer.digest} {layer.size} bytes {layer.files} files")
    elif args.layer_cmd == "ls":
        table = Table("name:version", "owner", "kind", "digest", "size", "files")
        for layer in sorted(store.list_layers(), key=lambda x: (x.tenant or "", x.kind, x.ref)):
            table.add_row(
                layer.ref, layer.tenant or "public", layer.kind, layer.digest[:19],
                _size(layer.size), str(layer.files),
            )  # fmt: skip
        Console().print(table)
    elif args.layer_cmd == "rm":
        name, _, version = args.ref.partition(":")
        if not version:
            raise errors.InvalidArgument(f"give name:version, not {args.ref!r}")
        print(f"removed {store.remove(name, version, force=args.force, tenant=args.tenant).ref}")
    else:
        report = store.gc()
        print(f"removed {len(report.removed)} image(s), freed {_size(report.bytes_freed)}")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(t: float | None) -> str:
    import time

    return "-" if t is None else f"in {max(0, t - time.time()):.0f}s"


def _print_result(r: Any) -> int:
    sys.stdout.buffer.write(r.stdout)
    sys.stderr.buffer.write(r.stderr)
    if r.timed_out:
        print(f"dsec: timed out after {r.duration_s:.1f}s", file=sys.stderr)
    if r.truncated:
        print("dsec: output truncated", file=sys.stderr)
    return r.exit_code if 0 <= r.exit_code < 256 else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from dsec_kernel.plugins import PluginLoadError

    try:
        if args.cmd == "up":
            from dsec_kernel.cli.up import up

            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            return up(args.state_dir, args.port, args.node, args.backends, command, args.rm)
        if args.cmd == "down":
            from dsec_kernel.cli.up import down

            return down(args.state_dir, args.keep, args.timeout)
        if args.cmd == "cluster-up":
            from dsec_kernel.cli.up import cluster_up

            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            return cluster_up(
                args.state_dir, args.nats_servers, args.apiservers, args.edges, args.cloud,
                args.backends, command, args.rm,
            )  # fmt: skip
        if args.cmd == "apiserver":
            from dsec_kernel.cli.services import run_apiserver

            run_apiserver(
                nats_url=args.nats_url,
                nats_login_file=args.nats_login_file,
                placement=args.placement,
                node_timeout_s=args.node_timeout_s,
            )
            return 0
        if args.cmd == "edge":
            from dsec_kernel.cli.services import run_edge

            run_edge(
                nats_url=args.nats_url,
                nats_login_file=args.nats_login_file,
                node=args.node,
                pool=args.pool,
                state_dir=args.state_dir,
                backends=args.backends,
                heartbeat_s=args.heartbeat_s,
            )
            return 0
        if args.cmd == "plugins":
            return _cmd_plugins()
        if args.cmd == "schema":
            return _cmd_schema(args.out)
        if args.cmd == "layer":
            return _cmd_layer(args)
        if args.cmd == "tenant":
            return asyncio.run(_cmd_tenant(args))
        return asyncio.run(_client_cmd(args))
    except errors.DsecError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return 2
    except PluginLoadError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return 3
