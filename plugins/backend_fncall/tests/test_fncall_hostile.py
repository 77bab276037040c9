"""A hostile call against the fncall backend: it cannot speak for the platform (forge its exit
report, outlive its timeout), read what the edge holds, starve other tenants, or learn host
paths and pids from errors; a batch larger than every queue limit completes."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import pytest_asyncio
from dsec_backend_fncall.backend import FncallBackend, FncallConfig

from dsec_kernel.agent import AgentClient
from dsec_kernel.contract import errors
from dsec_kernel.contract.agent import agent_pb2 as pb
from dsec_kernel.contract.backend import ExecCall, SandboxRef
from dsec_kernel.contract.conformance import started
from dsec_kernel.contract.wire import EdgeSandbox, FncallRequest, SandboxSpec

pytestmark = pytest.mark.asyncio(loop_scope="module")
SECRET = "nats://dsec-service:s3cr3t-service-password@127.0.0.1:4222"

#: Python run inside a call: every way to reach the worker's control socket, each tried by
#: sending a forged "exited 0" report; prints what was reached, then outlives its timeout.
FORGE = r"""
import gc, inspect, json, os, socket, sys, time
frame = json.dumps({"status": 0, "cpu_s": 0.0, "max_rss": 0}).encode()
frame = len(frame).to_bytes(8, "little") + frame
reached = []

def send(how, sock):
    try:
        sock.setblocking(True)
        sock.sendall(frame)
        reached.append(how)
    except (OSError, ValueError):
        pass

for o in gc.get_objects():
    if isinstance(o, socket.socket):
        send("gc", o)
frames = [f.frame for f in inspect.stack()]
f = sys._getframe()
while f:
    frames.append(f)
    f = f.f_back
for f in frames:
    for v in list(f.f_locals.values()) + list(f.f_globals.values()):
        if isinstance(v, socket.socket):
            send("frame", v)
for fd in range(1025):
    try:
        send(f"fd {fd}", socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_STREAM))
    except OSError:
        pass
for d in ("/proc/self/fd", "/proc/1/fd"):
    try:
        for name in os.listdir(d):
            target = os.readlink(f"{d}/{name}")
            if target.startswith("socket:"):
                reached.append(f"{d}/{name} is {target}")
    except OSError:
        pass
print(json.dumps({"reached": reached, "pidns": os.readlink("/proc/self/ns/pid")}), flush=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
time.sleep(600)
"""


#: a program (PID 2 of an argv call) against the worker (PID 1) that reports its status
PROBE_WORKER = r"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
reached = []
for d in ("/proc/1/fd", "/proc/1/map_files"):
    try:
        os.listdir(d)
        reached.append(d)
    except OSError:
        pass
for path in ("/proc/1/environ", "/proc/1/mem", "/proc/1/maps"):
    try:
        open(path, "rb").read(1)
        reached.append(path)
    except OSError:
        pass
if libc.ptrace(16, 1, 0, 0) == 0:
    reached.append("ptrace(ATTACH, 1)")
pidfd = libc.syscall(434, 1, 0)
if pidfd >= 0 and any(libc.syscall(438, pidfd, fd, 0) >= 0 for fd in range(64)):
    reached.append("pidfd_getfd")
for sig in (9, 19):
    try:
        os.kill(1, sig)
    except OSError:
        pass
time.sleep(0.2)
state = open("/proc/1/status").read().split("State:")[1].split()[0]
if state not in ("S", "R"):
    reached.append(f"worker is {state}")
print(reached)
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(tmp_path_factory):
    """A backend started while the edge's environment holds a service credential."""
    saved = os.environ.get("DSEC_NATS_URL")
    os.environ["DSEC_NATS_URL"] = SECRET
    try:
        config = FncallConfig(pool_size=4, max_running=4)  # one tenant runs 3 at most
        async with started(FncallBackend(config), tmp_path_factory.mktemp("fn")) as b:
            yield b
    finally:
        if saved is None:
            os.environ.pop("DSEC_NATS_URL")
        else:
            os.environ["DSEC_NATS_URL"] = saved


async def py(backend, code: str, **kw):
    return await backend.fncall(FncallRequest(code=code, language="python", **kw))


def pid_namespace_members(ns: str) -> list[int]:
    """Host pids of the processes in the PID namespace ``ns`` (``pid:[inode]``)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.readlink(f"/proc/{pid}/ns/pid") == ns:
                found.append(int(pid))
        except OSError:
            pass
    return found


async def test_a_call_cannot_forge_its_report_and_dies_at_its_timeout(backend):
    t = time.monotonic()
    r = await py(backend, FORGE, timeout_s=3)
    took = time.monotonic() - t
    seen = json.loads(r.stdout.splitlines()[0])
    assert seen["reached"] == [], seen
    assert r.timed_out and r.exit_code == -9, r
    assert took < 3 + 2, f"answered after {took:.1f}s"
    gone_in = None
    for i in range(100):
        if not pid_namespace_members(seen["pidns"]):
            gone_in = time.monotonic() - t - took
            break
        await asyncio.sleep(0.02 * min(i + 1, 10))
    assert gone_in is not None, "the call's processes outlived its answer"
    print(f"killed at {took:.2f}s (timeout 3s); every process gone {gone_in * 1e3:.0f} ms later")


async def test_the_worker_is_out_of_a_programs_reach(backend):
    """A program (PID 2) cannot kill, stop, trace or read the worker that reports its status,
    and what it can read of it (its command line) names nothing of the host."""
    code = f"python3 - <<'PY'\n{PROBE_WORKER}\nPY\ntr '\\0' ' ' < /proc/1/cmdline"
    r = await backend.fncall(FncallRequest(language="bash", code=code))
    reached, cmdline = r.stdout.decode().splitlines()
    assert r.exit_code == 0 and reached == "[]", r
    for host_fact in (str(backend.proc.pid), str(backend.state_dir), "supervisor_pid"):
        assert host_fact not in cmdline, cmdline


#: Python run inside a call: every NATS URL in its environment, its PID 1's, and anywhere in
#: its own memory (which it shares with the worker and the zygote it was forked from)
FIND_NATS_URLS = r"""
import ctypes, os, re
pat = re.compile(rb"nats://[!-~]{4,200}")
hits = set()
for path in ("/proc/self/environ", "/proc/1/environ", "/proc/1/cmdline"):
    try:
        hits.update(m.group() for m in pat.finditer(open(path, "rb").read()))
    except OSError:
        pass
for line in open("/proc/self/maps"):  # anonymous memory: heap, stack, arenas
    addr, perms, *rest = line.split()
    if perms.startswith("r") and (len(rest) < 4 or rest[3] in ("[heap]", "[stack]")):
        lo, hi = (int(x, 16) for x in addr.split("-"))
        hits.update(m.group() for m in pat.finditer(ctypes.string_at(lo, hi - lo)))
print(sorted(os.environ))
print(b"\n".join(sorted(hits)).decode(errors="replace"))
"""


async def test_nothing_of_the_edges_environment_reaches_a_call(backend):
    supervisor = backend.proc.pid
    for pid in [supervisor, *_children(supervisor)]:  # the supervisor and its zygote
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert b"s3cr3t" not in environ and b"DSEC_" not in environ, (pid, environ)
    r = await py(backend, FIND_NATS_URLS, timeout_s=30)
    names, *urls = r.stdout.decode().splitlines()
    assert names == "['HOME', 'LANG', 'PATH', 'TMPDIR']", r
    assert not any("s3cr3t" in u for u in urls), urls


def _children(parent: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            continue
        if pid.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            out.append(int(pid))
    return out


async def test_a_tenant_cannot_starve_another(backend):
    """The attacker fills every slot it may with long calls and queues more; the victim's
    call still starts at once."""
    sid = "sb-00000000000000a7"
    await backend.create(
        EdgeSandbox(id=sid, tenant="attacker", spec=SandboxSpec(backend="fncall"), created_at=0)
    )
    hog = ExecCall(
        sandbox_id=sid, argv=["sleep", "60"], timeout_s=60, max_output_bytes=10, tenant="attacker"
    )
    hogs = [asyncio.ensure_future(backend.exec(hog)) for _ in range(8)]
    try:
        await asyncio.sleep(1.0)
        t = time.monotonic()
        r = await py(backend, "print(1)", tenant="victim")
        took = time.monotonic() - t
        assert r.stdout == b"1\n" and took < 1.0, (r, took)
        print(f"victim's print(1) answered in {took * 1e3:.0f} ms next to 8 long calls")
    finally:
        await backend.destroy(SandboxRef(sandbox_id=sid))
    results = await asyncio.gather(*hogs, return_exceptions=True)
    killed = sum(1 for x in results if not isinstance(x, BaseException) and x.exit_code == -9)
    gone = sum(1 for x in results if isinstance(x, errors.NotFound))
    assert (killed, gone) == (3, 5), results  # 3 ran (the tenant's share), 5 queued


async def test_a_tenants_queue_is_bounded(tmp_path):
    """Past ``tenant_max_waiting`` calls waiting, a tenant's next is refused at once (its
    queue, not the node's); another tenant's call still runs."""
    config = FncallConfig(pool_size=2, max_running=2, tenant_max_running=1, tenant_max_waiting=2)
    async with started(FncallBackend(config), tmp_path) as b:
        sid = "sb-00000000000000a8"
        await b.create(
            EdgeSandbox(id=sid, tenant="attacker", spec=SandboxSpec(backend="fncall"), created_at=0)
        )
        hog = ExecCall(
            sandbox_id=sid, argv=["sleep", "60"], timeout_s=60, max_output_bytes=10,
            tenant="attacker",
        )  # fmt: skip
        hogs = [asyncio.ensure_future(b.exec(hog)) for _ in range(3)]  # 1 runs, 2 wait
        try:
            await asyncio.sleep(1.0)
            with pytest.raises(errors.QueueFull, match="2 of this tenant's calls are waiting"):
                await b.exec(hog)
            r = await b.fncall(FncallRequest(code="echo 1", language="bash", tenant="victim"))
            assert r.stdout == b"1\n", r
        finally:
            await b.destroy(SandboxRef(sandbox_id=sid))
            await asyncio.gather(*hogs, return_exceptions=True)


async def test_a_batch_past_every_queue_limit_completes(backend):
    """More calls at once than gRPC's pending-request limit (1,000): all queue, all run."""
    n = 1500
    t = time.monotonic()
    results = await asyncio.gather(
        *(backend.fncall(FncallRequest(language="bash", code="echo hi")) for _ in range(n)),
        return_exceptions=True,
    )
    ok = sum(1 for r in results if not isinstance(r, BaseException) and r.stdout == b"hi\n")
    failed = [r for r in results if isinstance(r, BaseException)][:3]
    assert ok == n, (ok, failed)
    print(f"{n} calls at once: all done in {time.monotonic() - t:.1f}s")


async def test_errors_name_no_host_path(tmp_path):
    sock = tmp_path / "gone" / "agent.sock"
    client = AgentClient(f"unix://{sock}")
    try:
        with pytest.raises(errors.Unavailable) as caught:
            await client.exec(pb.ExecRequest(argv=["true"], timeout_s=1))
    finally:
        await client.close()
    assert str(tmp_path) not in caught.value.message, caught.value.message


async def test_bad_input_is_refused_before_anything_runs(backend):
    for bad in ({"env": {"A": "x\0y"}}, {"env": {"A=B": "x"}}, {"cwd": "/tmp\0"}):
        req = pb.ExecRequest(argv=["true"], timeout_s=5, **bad)
        with pytest.raises(errors.InvalidArgument):
            await backend.agent.exec(req)
