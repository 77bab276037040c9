"""The ``dsec`` command line: what each command does (the grammar is in :mod:`.parser`, the
exit statuses in :mod:`.exitcodes`).

Listings and reports print a table for people, or with ``--json`` one JSON object per line
(bytes as text when they are UTF-8, else ``{"base64": ...}``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec_kernel.cli import exitcodes
from dsec_kernel.cli.extras import server_extra_hint
from dsec_kernel.cli.output import json_line, plain
from dsec_kernel.cli.parser import UsageError, parse, parser
from dsec_kernel.contract import errors

__all__ = ["main"]


async def _stateless_note(c: Any, backend: str) -> str | None:
    """What ``dsec create`` says on stderr of the sandboxes of a backend that declares
    itself stateless (fncall), naming the stateful backends the cluster runs; None for
    other backends."""
    backends = [b for n in await c.nodes() for b in n.backends]
    if not any(b.name == backend and not b.capabilities.stateful for b in backends):
        return None
    stateful = sorted({b.name for b in backends if b.capabilities.stateful})
    hint = f"; use --backend {' or '.join(stateful)} for state" if stateful else ""
    return f"note: {backend} sandboxes are stateless: files do not survive between commands{hint}"


def _report(
    entries: list[Any],
    as_json: bool,
    ok_line: Callable[[Any], str] | None,
    name: Callable[[Any], str],
) -> int:
    """Print a batch's entries in order: each done one as ``ok_line(entry)`` (if given), each
    failed one as a line on stderr naming it (``name(entry)``) and its error; with
    ``as_json``, each as a JSON object (a failed one's ``error`` set). The exit status: 0,
    or the first failure's kind."""
    status = 0
    for entry in entries:
        if as_json:
            json_line(entry)
        elif entry.error is None:
            if ok_line is not None:
                print(ok_line(entry))
        else:
            print(f"dsec: {name(entry)}: {entry.error}", file=sys.stderr)
        if entry.error is not None and not status:
            status = exitcodes.for_error(entry.error)
    return status


def _cmd_plugins(as_json: bool) -> int:
    from rich.console import Console
    from rich.table import Table

    from dsec_kernel.loader import GROUPS, discover

    table = Table("group", "name", "version", "status")
    for group in GROUPS:
        for info in discover(group):
            row: dict[str, Any] = {
                "group": group, "name": info.name, "distribution": info.distribution,
                "version": info.version,
            }  # fmt: skip
            if info.error:
                row["status"], text = "broken", f"[red]broken: {info.error}[/red]"
                row["error"] = str(info.error)
            elif group == "dsec.backends" and (reason := info.obj.unavailable_reason()):
                row["status"], text = "unavailable", f"[yellow]cannot run here: {reason}[/yellow]"
                row["reason"] = reason
            elif group == "dsec.backends":
                caps = info.obj.capabilities.model_dump(exclude_defaults=True)
                row["status"], row["capabilities"] = "ok", caps
                text = ", ".join(["ok", *(k for k, v in caps.items() if v is True)])
            else:
                row["status"], text = "ok", "ok"
            if as_json:
                json_line(row)
            table.add_row(group.removeprefix("dsec."), info.name, info.version, text)
    if not as_json:
        Console().print(table)
    return 0


def _cmd_schema(out: Path | None) -> int:
    from dsec_kernel.contract.wire import json_schemas

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
    from dsec_kernel.contract.wire import NAME_PATTERN, Quota
    from dsec_kernel.state.facade import ClusterState
    from dsec_kernel.state.tenants import password_hash

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
            await state.put_quota(name, quota)
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
                await state.withdraw_credential(token)
                raise errors.Unavailable(
                    f"NATS did not take tenant {name}'s login within {args.wait:g}s, so the "
                    "credential was withdrawn: nothing loads logins from the tenants bucket into "
                    "this NATS (`dsec up` and `dsec cluster-up` do). With your own NATS: `dsec "
                    f"tenant create {name} --wait 0`, then put the output of `dsec tenant logins` "
                    "into its config and reload it"
                ) from None
    finally:
        await nc.drain()
    json_line({"tenant": name, "token": token}) if args.json else print(token)
    return 0


async def _client_cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from dsec_kernel.contract.wire import Env
    from dsec_kernel.sdk import AsyncClient

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
            if not args.json and (note := await _stateless_note(c, args.backend)):
                print(note, file=sys.stderr)
            for sb in sbs:  # the made ones come first
                if sb.error is None:
                    json_line(sb.info) if args.json else print(sb.id)
            unmade = [sb for sb in sbs if sb.error is not None]
            return _report(unmade, args.json, None, lambda _: "not created")
        elif args.cmd in ("pause", "resume"):

            def done(r: Any) -> str:
                freed = (r.memory_before_bytes - r.memory_after_bytes) >> 20
                extra = f", {freed} MiB out of RAM" if args.cmd == "pause" else ""
                return f"{r.sandbox_id} {r.state} in {r.seconds * 1e3:.1f} ms{extra}"

            reports = await getattr(c, args.cmd)(args.sandboxes)
            return _report(reports, args.json, done, lambda r: r.sandbox_id)
        elif args.cmd == "ls":
            table = Table("id", "backend", "node", "state", "job", "pool", "expires")
            for sb in await c.list():
                i = sb.info
                if args.json:
                    json_line(i)
                    continue
                state = f"{i.state} ({i.paused_reason})" if i.paused_reason else i.state
                pool = f"{i.pool}{' (idle)' if i.in_pool else ''}" if i.pool else ""
                table.add_row(
                    sb.id, sb.backend, sb.node, state, i.job or "", pool, _when(i.expires_at)
                )
            if not args.json:
                console.print(table)
        elif args.cmd == "nodes":
            table = Table("node", "state", "pool", "backends", "sandboxes", "paused", "cpu load")
            for n in await c.nodes():
                if args.json:
                    json_line(n)
                    continue
                table.add_row(
                    n.node,
                    n.state if n.serving or n.state == "down" else "stopping",
                    n.pool,
                    ",".join(b.name for b in n.backends),
                    str(n.load.sandboxes),
                    str(n.load.paused),
                    f"{n.load.cpu_load:.2f}",
                )
            if not args.json:
                console.print(table)
        elif args.cmd == "trajectory":
            for rec in await c.trajectory(args.sandbox):
                if args.json:
                    json_line(rec)
                else:
                    print(_record_line(rec))
        elif args.cmd == "prestage":
            resp = await c.prestage(args.layers, pool=args.pool)
            print(f"staged on {len(resp.nodes)} node(s): {', '.join(sorted(resp.nodes)) or '-'}")
            for f in resp.failed:
                print(f"  {f.id}: {f.error.message}", file=sys.stderr)
            return 1 if resp.failed else 0
        elif args.cmd == "exec":
            if not args.command:
                raise UsageError("give the command after the sandbox id: dsec exec ID -- CMD")
            (r,) = await c.exec_many([args.sandbox], args.command, timeout=args.timeout)
            if r.error is not None:
                return _report([r], args.json, None, lambda r: r.sandbox_id)
            return _print_result(r, args.json)
        elif args.cmd == "fncall":
            r = await c.fncall(args.code, language=args.language, timeout=args.timeout)
            return _print_result(r, args.json)
        elif args.cmd == "destroy":
            targets: list[Any] = await c.list() if args.all else args.sandboxes
            reports = await c.destroy(targets) if targets else []
            status = _report(reports, args.json, None, lambda r: r.sandbox_id)
            if not args.json:
                print(f"destroyed {sum(1 for r in reports if r.error is None and r.found)}")
            return status
    return 0


def _when(t: float | None) -> str:
    import time

    return "-" if t is None else f"in {max(0, t - time.time()):.0f}s"


def _print_result(r: Any, as_json: bool) -> int:
    if as_json:
        json_line(r)
    else:
        sys.stdout.buffer.write(r.stdout)
        sys.stderr.buffer.write(r.stderr)
        if r.timed_out:
            print(f"dsec: timed out after {r.duration_s:.1f}s", file=sys.stderr)
        if r.truncated:
            print("dsec: output truncated", file=sys.stderr)
    return exitcodes.for_result(r.exit_code, r.timed_out)


#: what a terminal would act on beyond JSON's own escapes: C1 controls (0x9b is CSI to some
#: terminals) and bidirectional overrides (text that reads other than it is)
_TERMINAL_ACTIVE = re.compile("[\u0080-\u009f\u202a-\u202e\u2066-\u2069]")


def _record_line(rec: Any) -> str:
    """One trajectory record for people: when, what, and its output as text. A sandbox wrote
    that output: JSON escapes its C0 controls, and the C1 ones and bidi overrides are escaped
    too, so nothing in it acts on the reader's terminal."""
    data = plain(rec.model_dump(mode="python", exclude_defaults=True))
    text = json.dumps(data, default=str, ensure_ascii=False)
    return _TERMINAL_ACTIVE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:  # `dsec schema | head`: the reader had enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv: list[str]) -> int:
    try:
        args = parse(argv)
    except UsageError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    hint = server_extra_hint(args.cmd)
    if hint is not None:
        print(f"dsec: {hint}", file=sys.stderr)
        return exitcodes.PLUGIN
    service = args.cmd in ("up", "cluster-up", "apiserver", "edge")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO if service else logging.WARNING,
        # a service's log has times; a command's warnings read as its other lines do
        format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        if service
        else "dsec: %(message)s",
    )
    from dsec_kernel.loader import PluginLoadError

    try:
        return _run(args)
    except UsageError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    except errors.DsecError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return exitcodes.for_error(exc)
    except PluginLoadError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return exitcodes.PLUGIN


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "up":
        from dsec_kernel.cli.up import up

        return up(args.state_dir, args.port, args.node, args.backends, args.command, args.rm)
    if args.cmd == "down":
        from dsec_kernel.cli.up import down

        return down(args.state_dir, args.keep, args.timeout)
    if args.cmd == "cluster-up":
        from dsec_kernel.cli.up import cluster_up

        return cluster_up(
            args.state_dir, args.nats_servers, args.apiservers, args.edges, args.cloud,
            args.backends, args.command, args.rm,
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
        return _cmd_plugins(args.json)
    if args.cmd == "schema":
        return _cmd_schema(args.out)
    if args.cmd == "completion":
        import shtab

        print(shtab.complete(parser(), shell=args.shell))
        return 0
    if args.cmd == "layer":
        from dsec_kernel.cli.layers import run_layer

        return run_layer(args)
    if args.cmd == "tenant":
        return asyncio.run(_cmd_tenant(args))
    return asyncio.run(_client_cmd(args))
