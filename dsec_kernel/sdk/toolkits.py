"""Toolkit layers of pip packages, built in a sandbox of the base they are for.

:func:`build_toolkit` makes the toolkit ``NAME:VERSION`` of the caller's tenant. It holds

* ``/opt/dsec/toolkits/NAME-VERSION/``: what ``pip install --target`` put there, the
  requirements and all their dependencies (their scripts in ``bin/``);
* ``dsec-toolkit-NAME-VERSION.pth`` in the base's site directory (``sysconfig``'s purelib of
  its ``python3``: ``/usr/local/lib/python3.11/dist-packages`` on Debian 12), naming that
  directory, so that the base's ``python3`` imports from it (``python3 -m pytest``) with no
  ``PYTHONPATH``;
* a link in ``/usr/local/bin`` (on every command's ``PATH``) to each script, unless the base
  has a file of that name there.

A sandbox made with ``toolkits=["NAME:VERSION"]`` on that base can use it at once. pip runs
inside a container sandbox of the base (with ``network="egress"``), never on the caller's
host: a package's build backend is code the tenant chose, and it runs as the sandbox's root.
The sandbox's files are then published as the toolkit (everything above the base), and the
sandbox is destroyed whatever happens. Files are dated :data:`EPOCH`, and bytecode is
compiled where it stays, checked by hash (pip's own names the temporary directory it
installed into), so the same files from pip (pinned requirements) give the same image:
building a toolkit again is then a no-op, and other files under its name a Conflict.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError

from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import Env
from dsec_kernel.contract.wire.sandbox import LayerRef
from dsec_kernel.contract.wire.snapshot import LayerInfo

if TYPE_CHECKING:
    from dsec_kernel.sdk.client import AsyncClient
    from dsec_kernel.sdk.sandbox import Sandbox

__all__ = ["EPOCH", "TOOLKITS", "build_toolkit", "check_requirements"]

#: where each toolkit's packages go, in a directory NAME-VERSION of its own
TOOLKITS = "/opt/dsec/toolkits"
#: the date of every file a toolkit build makes (1980-01-01, the earliest a wheel can hold)
EPOCH = 315_532_800
#: pip's output and the CA bundle it is given, in the sandbox's /dev/shm (a tmpfs: not
#: among the files published)
_LOG = "/dev/shm/dsec-toolkit.log"
_CERT = "/dev/shm/dsec-toolkit-ca.pem"
_POLL_S = 1.0

# Run by the base's python3 in the build sandbox, with one JSON argument: dir, name, reqs,
# log, cert (None: the base's CAs), epoch. Exit status 3 and a line on stderr: the base
# cannot build toolkits.
_BUILD = r"""
import compileall, importlib.util, json, os, py_compile, subprocess, sys, sysconfig
a = json.loads(sys.argv[1])

def refuse(why):
    print(why, file=sys.stderr)
    sys.exit(3)

if importlib.util.find_spec("pip") is None:
    refuse("its python3 has no pip (Debian: the python3-pip package)")
site, target, bindir, epoch = sysconfig.get_path("purelib"), a["dir"], "/usr/local/bin", a["epoch"]
if site not in sys.path:
    refuse(f"its python3's site directory {site} is not on its sys.path")

def up(path):  # path and its parents, but / (the upper directory's own: dated EPOCH)
    while path != "/":
        yield path
        path = os.path.dirname(path)

kept = {}
for d in {"/tmp", "/root", *up(site), *up(target), *up(bindir)}:
    try:
        st = os.stat(d)
    except FileNotFoundError:
        continue
    kept[d] = (st.st_atime_ns, st.st_mtime_ns)
env = dict(os.environ, SOURCE_DATE_EPOCH=str(epoch))
with open(a["log"], "w") as log:
    rc = subprocess.call(
        [sys.executable, "-m", "pip", "install", "--target", target, "--no-cache-dir",
         "--disable-pip-version-check", "--no-warn-script-location", "--progress-bar", "off",
         "--no-compile",
         "--root-user-action", "ignore", "--no-input",
         *(["--cert", a["cert"]] if a["cert"] else []), *a["reqs"]],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
    )
if rc:
    sys.exit(rc)
# compiled here, not by pip: its bytecode names the temporary directory it installed into
hashed = py_compile.PycInvalidationMode.CHECKED_HASH  # valid whatever the files' dates
compileall.compile_dir(target, quiet=2, invalidation_mode=hashed)
os.makedirs(site, exist_ok=True)
pth = os.path.join(site, f"dsec-toolkit-{a['name']}.pth")
with open(pth, "w") as f:
    f.write(target + "\n")
made, linked, skipped = [pth], [], []
scripts = os.path.join(target, "bin")
for name in sorted(os.listdir(scripts)) if os.path.isdir(scripts) else []:
    link = os.path.join(bindir, name)
    if os.path.lexists(link):
        skipped.append(name)
        continue
    os.makedirs(bindir, exist_ok=True)
    os.symlink(os.path.join(scripts, name), link)
    made.append(link)
    linked.append(name)
for root, dirs, files in os.walk(target):
    made += [os.path.join(root, n) for n in dirs + files]
made += ["/", *(d for d in {*up(site), *up(target), *up(bindir)} if d not in kept)]
for path in made:
    os.utime(path, ns=(epoch * 10**9,) * 2, follow_symlinks=False)
for path, times in kept.items():
    os.utime(path, ns=times)
print(json.dumps({"site": site, "linked": linked, "skipped": skipped}))
"""


def check_requirements(requirements: Sequence[str]) -> list[str]:
    """``requirements`` as a list, if they are some and none is empty or an option (``-e``,
    ``--index-url``: pip's options are the builder's); else InvalidArgument."""
    bad = [r for r in requirements if not r.strip() or r.lstrip().startswith("-")]
    if bad:
        raise errors.InvalidArgument(
            f"--pip: expected requirements such as pytest==8.3.* (not {bad[0]!r})"
        )
    if not requirements:
        raise errors.InvalidArgument("--pip: name at least one requirement, e.g. --pip pytest")
    return list(requirements)


async def _layered_backend(client: AsyncClient) -> str:
    """A backend of the cluster whose sandboxes are made of layers and can be snapshotted
    (what publishing a toolkit takes); Unsupported if it has none."""
    able = sorted(
        {
            b.name
            for n in await client.nodes()
            for b in n.backends
            if b.capabilities.snapshot and b.capabilities.exec and b.capabilities.files
        }
    )
    if not able:
        raise errors.Unsupported(
            "no backend of this cluster can build a toolkit: it takes one whose sandboxes are "
            "made of layers and can be snapshotted (such as container)"
        )
    return able[0]


async def build_toolkit(
    client: AsyncClient,
    ref: str,
    requirements: Sequence[str],
    *,
    base: str = "debian-python:12",
    timeout: float = 900.0,
    cert: bytes | None = None,
    progress: Callable[[str], None] | None = None,
    backend: str | None = None,
) -> LayerInfo:
    """Make the toolkit ``ref`` (``NAME:VERSION``) of ``requirements`` (as ``pip install``
    takes them: ``pytest==8.3.*``, ``hypothesis``...) for ``base``, as the module says.
    ``cert``: a CA bundle (PEM) for pip to trust instead of the base's, where a proxy
    re-signs TLS (pip's ``--cert``; it stays out of the toolkit). ``progress`` hears each
    line of pip's output as it comes, and the build's other steps. ``backend``: where the
    build runs (None: the first, by name, of the cluster's backends that take layers and
    snapshots).

    InvalidArgument for a ``ref`` that is not NAME:VERSION, requirements
    :func:`check_requirements` refuses and a base with no ``python3`` with pip;
    Unavailable if pip fails (its last lines say why) or runs past ``timeout``
    seconds; a publish's Conflict if the tenant's ``ref`` exists with other files."""
    say = progress or (lambda _line: None)
    try:
        toolkit = LayerRef.model_validate(ref)
    except ValidationError:
        raise errors.InvalidArgument(
            f"toolkit {ref!r} is not NAME:VERSION, such as pytest:8.3"
        ) from None
    name, version = toolkit.name, toolkit.version
    reqs = check_requirements(requirements)
    backend = backend or await _layered_backend(client)
    say(f"creating a {backend} sandbox of {base} (egress network)")
    [sb] = await client.create(count=1, backend=backend, env=Env(base=base), network="egress")
    try:
        if cert is not None:
            await sb.write_file(_CERT, cert)
        done = await _install(sb, base, name, version, reqs, cert is not None, timeout, say)
        if done["skipped"]:
            say(f"not linked into /usr/local/bin (the base has them): {', '.join(done['skipped'])}")
        say("taking a snapshot of the sandbox's files")
        snap = await sb.snapshot()
        say(f"publishing {ref}")
        return await client.publish(snap, kind="toolkit", name=name, version=version)
    finally:
        with contextlib.suppress(errors.DsecError):
            await client.destroy([sb])


async def _install(
    sb: Sandbox,
    base: str,
    name: str,
    version: str,
    reqs: list[str],
    cert: bool,
    timeout: float,
    say: Callable[[str], None],
) -> dict:
    """Run :data:`_BUILD` in ``sb``, passing on pip's lines while it runs; its report."""
    args = {"dir": f"{TOOLKITS}/{name}-{version}", "name": f"{name}-{version}", "reqs": reqs,
            "log": _LOG, "cert": _CERT if cert else None, "epoch": EPOCH}  # fmt: skip
    say(f"pip install --target {args['dir']} {' '.join(reqs)}")
    run = asyncio.ensure_future(
        sb.exec(["python3", "-c", _BUILD, json.dumps(args)], timeout=timeout, cwd="/")
    )
    seen = 0
    lines: list[str] = []

    async def follow() -> None:
        nonlocal seen
        with contextlib.suppress(errors.NotFound):  # pip has not started yet
            text = (await sb.read_file(_LOG)).decode(errors="replace")
            end = text.rfind("\n") + 1 if not run.done() else len(text)
            for line in text[seen:end].splitlines():
                lines.append(line)
                say(line)
            seen = max(seen, end)

    try:
        while not run.done():
            await asyncio.wait({run}, timeout=_POLL_S)
            await follow()
    finally:
        run.cancel()
    r = run.result()
    if r.exit_code in (3, 127):  # the script's refusal; no python3 at all
        why = r.stderr.decode(errors="replace").strip().splitlines() or ["it has no python3"]
        raise errors.InvalidArgument(
            f"base {base} cannot build toolkits: {why[-1]}; use one with python3 and pip, "
            "such as debian-python:12 (dsec layer build debian-python)"
        )
    if r.timed_out:
        raise errors.Unavailable(
            f"pip did not finish in {timeout:.0f} s; stopped it", retryable=False
        )
    if r.exit_code:
        said = [line for line in lines if line.startswith("ERROR")] or lines or ["no output"]
        raise errors.Unavailable(
            f"pip install failed (exit {r.exit_code}): {said[-1].strip()}", retryable=False
        )
    return json.loads(r.stdout)
