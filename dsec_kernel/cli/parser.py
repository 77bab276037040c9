"""The ``dsec`` command line's grammar: every command and flag, with help and defaults.

Commands that run a command of their own (``up``, ``cluster-up``, ``exec``) take it after
``--``; their options may come anywhere before it (:func:`parse`), so
``dsec exec ID --timeout 1 -- sleep 3`` runs ``sleep 3``. Bad input is one line naming the
argument as it was typed (:class:`UsageError`), exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path

from dsec_kernel import __version__

__all__ = ["UsageError", "parse", "parser"]

#: commands whose own command comes after ``--``
RUNS_A_COMMAND = ("up", "cluster-up", "exec")
#: a layer's name:version, as the wire's ``LayerRef`` has it (not imported: start-up stays fast)
_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}:[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


class UsageError(Exception):
    """A command line that does not parse; ``str()`` is the one line to print."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + a traceback-like dump
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        raise UsageError(f"{message} (see `{self.prog} --help`)")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help that shows each option's default, unless it is unset or already said."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" not in text
            and default not in (None, False, [], argparse.SUPPRESS)
            and action.option_strings
        ):
            text += f" (default: {default})"
        return text


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def _ref(value: str) -> str:
    if not _REF.match(value):
        raise argparse.ArgumentTypeError("expected NAME:VERSION, e.g. debian-python:12")
    return value


def _bounded(cast: Callable[[str], float], low: float, strict: bool, what: str):
    """An argument type: ``cast`` of the text, at least ``low`` (above it if ``strict``)."""

    def parse(value: str) -> float:
        try:
            number = cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, not {value!r}") from None
        if number < low or (strict and number == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}")
        return number

    return parse


_positive = _bounded(float, 0, True, "a number of seconds")
_count = _bounded(int, 1, False, "a whole number")


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; what follows ``--`` (for the commands that run one) is ``command``."""
    head, tail = argv, []
    if "--" in argv:
        i = argv.index("--")
        head, tail = argv[:i], argv[i + 1 :]
    args = parser().parse_args(head)
    if tail and args.cmd not in RUNS_A_COMMAND:
        raise UsageError(f"dsec {args.cmd} takes no command after `--`")
    if args.cmd in RUNS_A_COMMAND:
        args.command = [*args.command, *tail]
    return args


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dsec", description="DSec: elastic sandboxes for agentic RL",
                formatter_class=_Help)  # fmt: skip
    p.add_argument("--version", action="version", version=f"dsec {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name: str, help: str, **kw: object) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_Help, **kw)

    state_help = (
        "where state, logs and the connection file go (default $DSEC_STATE_DIR, else ~/.dsec)"
    )
    rm_help = "remove every sandbox when stopping (else they stay for the next up to adopt)"
    then = "-- CMD...: run CMD against it, then stop"

    s = command("up", "run NATS + apiserver + edge on this machine")
    s.add_argument("--state-dir", type=Path, help=state_help)
    s.add_argument("--port", type=int, default=0, help="NATS client port (0: a free one)")
    s.add_argument("--node", help="this node's name (default: the host name)")
    s.add_argument("--backends", type=_csv, help="backends to run, a,b (default: all that can)")
    s.add_argument("--rm", action="store_true", help=rm_help)
    s.add_argument("command", nargs="*", help=then)

    s = command("down", "stop the dsec up of a state dir, removing every sandbox first")
    s.add_argument("--state-dir", type=Path, help=state_help)
    s.add_argument("--keep", action="store_true", help="stop it but keep the sandboxes")
    s.add_argument("--timeout", type=_positive, default=120.0,
                   help="how long to wait for it to stop, in seconds")  # fmt: skip

    s = command("cluster-up", "run a real cluster on this machine: a NATS cluster, apiservers, "
                "and edges each in its own network namespace")  # fmt: skip
    s.add_argument("--state-dir", type=Path, help=state_help)
    s.add_argument("--nats-servers", type=_count, default=3, help="NATS servers")
    s.add_argument("--apiservers", type=_count, default=2, help="apiservers")
    s.add_argument("--edges", type=_count, default=4, help="edges, nodes n1..nN")
    s.add_argument("--cloud", type=int, default=0, help="of the edges, how many in pool cloud")
    s.add_argument("--backends", type=_csv, help="backends to run, a,b (default: all that can)")
    s.add_argument("--rm", action="store_true", help=rm_help)
    s.add_argument("command", nargs="*", help=then)

    login_help = 'the NATS login, a JSON file {"user": ..., "password": ...}'
    url_help = "NATS URL (default $DSEC_NATS_URL)"
    s = command("apiserver", "run an apiserver against an existing NATS")
    s.add_argument("--nats-url", help=url_help)
    s.add_argument("--nats-login-file", type=Path, help=login_help)
    s.add_argument(
        "--placement", help="placement policy (default: the installed one its plugin prefers)"
    )
    s.add_argument(
        "--node-timeout", type=_positive, dest="node_timeout_s",
        help="seconds without a heartbeat before a node is down (default 5)",
    )  # fmt: skip

    s = command("edge", "run this node's edge against an existing NATS")
    s.add_argument("--nats-url", help=url_help)
    s.add_argument("--nats-login-file", type=Path, help=login_help)
    s.add_argument("--node", help="this node's name (default: the host name)")
    s.add_argument("--pool", help="the node pool it belongs to (default: none)")
    s.add_argument("--state-dir", type=Path, help="where its backends keep their state")
    s.add_argument("--backends", type=_csv, help="backends to run, a,b (default: all that can)")
    s.add_argument("--heartbeat", type=_positive, dest="heartbeat_s",
                   help="seconds between heartbeats (default 1)")  # fmt: skip

    s = command("plugins", "list installed plugins by group")
    s.add_argument("--json", action="store_true", help="one JSON object per plugin")

    s = command("schema", "write the wire messages' JSON Schemas")
    s.add_argument("--out", type=Path, help="directory (default: print one JSON document)")

    s = command("tenant", "manage tenants (operator; talks to NATS directly)")
    s.add_argument("action", choices=["create", "remove", "quota", "logins"],
                   help="create: print a new credential once its NATS login is live; remove: "
                   "delete every credential of the tenant; quota: set limits (omitted ones: "
                   "none); logins: print the NATS authorization block for your own NATS's "
                   "config")  # fmt: skip
    s.add_argument("name", nargs="?", help="the tenant (all but logins)")
    s.add_argument("--nats-url", help="NATS URL (default: from `dsec up`)")
    s.add_argument("--nats-login-file", type=Path, help=f"{login_help} (default: from `dsec up`)")
    s.add_argument(
        "--wait", type=float, default=10.0,
        help="create: longest wait for NATS to take its login, seconds (0: none)",
    )  # fmt: skip
    s.add_argument("--sandboxes", type=int, help="quota: most sandboxes at once")
    s.add_argument("--cpus", type=float, help="quota: most CPUs (sum of the sandboxes' limits)")
    s.add_argument("--memory-mb", type=int, help="quota: most memory (sum of their limits)")
    s.add_argument(
        "--max-priority", type=int,
        help="quota: highest priority its jobs have over other tenants' work",
    )  # fmt: skip
    s.add_argument("--json", action="store_true", help="create: the credential as JSON")

    s = command("layer", "manage layers in the layer store (DSEC_STORAGE_CONFIG__ROOT)")
    lsub = s.add_subparsers(dest="layer_cmd", required=True, metavar="ACTION",
                            parser_class=_Parser)  # fmt: skip
    lb = lsub.add_parser(
        "build", help="make a well-known layer from a recipe, if not there yet",
        description="make a well-known layer from a recipe, if the store lacks it:\n"
        "  dsec layer build debian-python [--packages a,b]\n"
        "or a toolkit of pip packages, built by pip in a sandbox of the base it is for\n"
        "(needs a running DSec: dsec up):\n"
        "  dsec layer build toolkit pytest:8.3 --pip 'pytest==8.3.*' hypothesis",
        formatter_class=_Help,
    )  # fmt: skip
    lb.add_argument(
        "recipe", nargs="?", help="the recipe, e.g. debian-python, or toolkit (none: list them)"
    )
    lb.add_argument(
        "ref",
        nargs="?",
        type=_ref,
        metavar="NAME:VERSION",
        help="toolkit: the layer to make, e.g. pytest:8.3",
    )
    lb.add_argument(
        "--packages",
        type=_csv,
        default=[],
        metavar="A,B",
        help="more packages for a recipe that takes them (debian-python: Debian "
        "packages); the layer is then VERSION-<hash of them>, e.g. "
        "debian-python:12-1a2b3c4d",
    )
    lb.add_argument(
        "--pip",
        nargs="+",
        metavar="REQ",
        help="toolkit: what pip installs (requirements, as pip takes them)",
    )
    lb.add_argument(
        "--base",
        type=_ref,
        default="debian-python:12",
        help="toolkit: the base it is built in and for",
    )
    lb.add_argument(
        "--timeout", type=_positive, default=900.0, help="toolkit: seconds pip may take"
    )
    lb.add_argument("--cert", type=Path, default=os.environ.get("PIP_CERT") or None,
                    metavar="FILE",
                    help="toolkit: a CA bundle pip in the sandbox trusts, where a proxy re-signs "
                    "TLS (default: $PIP_CERT, as pip on this host; none: the base's)")  # fmt: skip
    lb.add_argument("--json", action="store_true", help="the layer's record (the recipes) as JSON")
    li = lsub.add_parser("import", help="import a directory, tarball or OCI image layout",
                         formatter_class=_Help)  # fmt: skip
    li.add_argument("--kind", required=True, choices=["base", "workspace", "toolkit"],
                    help="what it is in an environment")  # fmt: skip
    li.add_argument("--name", required=True, help="its name")
    li.add_argument("--version", required=True, help="its version")
    li.add_argument("--tenant", help="the tenant it belongs to (default: public, for every tenant)")
    li.add_argument("--under", metavar="DIR",
                    help="a tarball's entries go under DIR, e.g. /workspace")  # fmt: skip
    li.add_argument("--strip", type=_bounded(int, 0, False, "a whole number"), default=0,
                    metavar="N",
                    help="a tarball's entries lose their first N path components, as tar's "
                    "--strip-components (an sdist's name-1.0/: 1)")  # fmt: skip
    li.add_argument("--json", action="store_true", help="the layer's record as JSON")
    li.add_argument("source", help="the directory, tarball or OCI layout")
    ll = lsub.add_parser("ls", help="list layers (every owner's)")
    ll.add_argument("--json", action="store_true", help="one JSON object per layer")
    lr = lsub.add_parser("rm", help="remove a layer (refused while in use)", formatter_class=_Help)
    lr.add_argument("ref", type=_ref, help="name:version")
    lr.add_argument("--tenant", help="remove that tenant's layer (default: the public one)")
    lr.add_argument("--force", action="store_true", help="even if held (by nodes that are gone)")
    lsub.add_parser("gc", help="delete images no layer names and nothing holds")

    s = command(
        "create", "create sandboxes (their ids on stdout, one per line; those not made on stderr)"
    )
    s.add_argument("--count", type=_count, default=1, help="how many")
    s.add_argument("--backend", help="the backend to run them on (default: the cluster's)")
    s.add_argument("--ttl", type=_positive, help="destroy after this many seconds")
    s.add_argument("--base", type=_ref, help="base layer NAME:VERSION (container backend)")
    s.add_argument("--workspace", type=_ref, help="workspace layer NAME:VERSION")
    s.add_argument("--toolkit", type=_ref, action="append", default=[],
                   help="toolkit layer NAME:VERSION (repeatable)")  # fmt: skip
    s.add_argument("--network", choices=["none", "egress"], default="none",
                   help="none: no network; egress: out to the internet only")  # fmt: skip
    s.add_argument("--idle-ttl", type=_positive,
                   help="pause after this many seconds without a command")  # fmt: skip
    s.add_argument("--wait", type=float, default=30.0, help="longest wait for room, seconds")
    s.add_argument("--json", action="store_true", help="one JSON object per sandbox")

    for verb in ("pause", "resume"):
        s = command(verb, f"{verb} sandboxes (each one's failure on stderr)")
        s.add_argument("sandboxes", nargs="+", metavar="ID", help="their ids")
        s.add_argument("--json", action="store_true", help="one JSON object per sandbox")

    s = command("ls", "list your sandboxes")
    s.add_argument("--json", action="store_true", help="one JSON object per sandbox")
    s = command("nodes", "list nodes")
    s.add_argument("--json", action="store_true", help="one JSON object per node")

    s = command("trajectory", "a sandbox's trajectory, one record per line")
    s.add_argument("sandbox", help="its id")
    s.add_argument("--json", action="store_true", help="JSON lines (output as text, or base64)")

    s = command("prestage", "stage layers on a pool's nodes before a burst")
    s.add_argument("layers", nargs="+", type=_ref, metavar="NAME:VERSION", help="the layers")
    s.add_argument("--pool", help="node pool (default: every node)")

    s = command("exec", "run a command in a sandbox: dsec exec ID [options] -- CMD...")
    s.add_argument("sandbox", help="its id")
    s.add_argument("--timeout", type=_positive, default=60.0, help="seconds before it is killed")
    s.add_argument("--json", action="store_true", help="the result as one JSON object")
    s.add_argument("command", nargs="*", help="-- CMD...: the command and its arguments")

    s = command("fncall", "run code in a throw-away sandbox")
    s.add_argument("code", help="the code")
    s.add_argument("--language", default="python", help="python or bash")
    s.add_argument("--timeout", type=_positive, default=30.0, help="seconds before it is killed")
    s.add_argument("--json", action="store_true", help="the result as one JSON object")

    s = command("destroy", "destroy sandboxes (each one's failure on stderr)")
    s.add_argument("sandboxes", nargs="*", metavar="ID", help="their ids")
    s.add_argument("--all", action="store_true", help="every sandbox of yours")
    s.add_argument("--json", action="store_true", help="one JSON object per sandbox")

    s = command("completion", "print a shell completion script: dsec completion bash > ...")
    s.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell")
    return p
