"""What each fncall call can and cannot do: namespaces, read-only root, uids, rlimits,
seccomp, and that nothing of one call survives into the next."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import pytest_asyncio
from dsec_backend_fncall.backend import FncallBackend, FncallConfig

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import BackendContext, ExecCall, SandboxRef
from dsec_kernel.contract.conformance import started
from dsec_kernel.contract.hookspecs import hookimpl
from dsec_kernel.contract.wire import (
    EdgeSandbox,
    FncallRequest,
    Limits,
    ReadFileRequest,
    SandboxSpec,
    WriteFileRequest,
)
from dsec_kernel.loader import load_hooks

pytestmark = pytest.mark.asyncio(loop_scope="module")
UID_BASE = 200_000


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(tmp_path_factory):
    async with started(
        FncallBackend(FncallConfig(pool_size=4)), tmp_path_factory.mktemp("fn")
    ) as b:
        yield b


async def py(backend, code: str, **kw):
    return await backend.fncall(FncallRequest(code=code, language="python", **kw))


async def sh(backend, code: str, **kw):
    return await backend.fncall(FncallRequest(code=code, language="bash", **kw))


def processes_of_call_uids() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if UID_BASE <= uid < UID_BASE + 4096:
            out.append(f"{pid} uid={uid}")
    return out


async def test_every_call_has_its_own_namespaces(backend):
    r = await py(
        backend,
        "import os\nfor n in ('pid','mnt','net','ipc','uts'):\n"
        "    print(os.readlink('/proc/self/ns/'+n))\nprint(os.getpid())",
    )
    inside = r.stdout.decode().split()
    host = [os.readlink(f"/proc/self/ns/{n}") for n in ("pid", "mnt", "net", "ipc", "uts")]
    assert inside[-1] == "1"
    assert all(a != b for a, b in zip(inside[:5], host, strict=True)), (inside, host)
    again = (
        await py(backend, "import os; print(os.readlink('/proc/self/ns/net'))")
    ).stdout.decode()
    assert again.strip() != inside[2], "two calls shared a network namespace"


async def test_no_network(backend):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        r = await py(
            backend,
            f"import socket\ns = socket.socket()\ntry:\n"
            f"    s.connect(('127.0.0.1', {port}))\n    print('connected')\n"
            f"except OSError as e:\n    print(type(e).__name__, e.errno)",
        )
        assert b"connected" not in r.stdout, r
        r = await sh(backend, "cat /proc/net/dev | tail -n +3 | cut -d: -f1")
        assert r.stdout.split() == [b"lo"]
    finally:
        server.close()


async def test_root_is_read_only_and_calls_are_unprivileged(backend, tmp_path):
    r = await sh(
        backend,
        "id -u; id -g; touch /etc/dsec-test 2>&1; touch /usr/x 2>&1; echo ok >/tmp/w; cat /tmp/w",
    )
    lines = r.stdout.decode().splitlines()
    uid, gid = int(lines[0]), int(lines[1])
    assert UID_BASE <= uid < UID_BASE + 4096 and gid == UID_BASE - 1
    assert "Read-only file system" in r.stdout.decode() or "Permission denied" in r.stdout.decode()
    assert lines[-1] == "ok"
    assert not Path("/etc/dsec-test").exists()


async def test_host_private_directories_are_hidden(backend, tmp_path):
    secret = Path.home() / ".dsec-test-secret"
    secret.write_text("secret")
    try:
        r = await sh(backend, f"cat {secret} 2>&1; ls /root | wc -l; ls /tmp")
        assert b"secret" not in r.stdout.replace(b".dsec-test-secret", b""), r
        state = backend.state_dir
        r = await sh(backend, f"ls {state} 2>&1; ls /run/dsec-files 2>&1")
        assert b"agent.sock" not in r.stdout and b"sandboxes" not in r.stdout
    finally:
        secret.unlink()


async def test_concurrent_calls_run_as_different_uids(backend):
    rs = await asyncio.gather(*(sh(backend, "id -u; sleep 0.3") for _ in range(4)))
    uids = {r.stdout.strip() for r in rs}
    assert len(uids) == 4, uids


async def test_memory_limit(backend):
    r = await py(backend, "x = bytearray(400 << 20)", limits=Limits(memory_mb=256))
    assert r.exit_code == 1 and b"MemoryError" in r.stderr


async def test_file_size_limit(backend):
    r = await sh(
        backend,
        "head -c 5000000 /dev/zero > /tmp/big; echo $?; stat -c %s /tmp/big",
        limits=Limits(file_size_mb=1),
    )
    out = r.stdout.split()
    assert out[0] != b"0" and int(out[-1]) <= 1 << 20, r


async def test_fork_bomb_is_contained(backend):
    t = time.monotonic()
    r = await sh(
        backend,
        "bomb() { bomb | bomb & }; bomb; sleep 1; echo survived",
        limits=Limits(pids=32),
        timeout_s=5,
    )
    assert time.monotonic() - t < 15
    ok = await sh(backend, "echo still serving")
    assert ok.stdout == b"still serving\n"
    for _ in range(50):
        if not processes_of_call_uids():
            break
        await asyncio.sleep(0.1)
    assert not processes_of_call_uids()
    assert r.exit_code is not None


async def test_seccomp_refuses_namespace_and_tracing_calls(backend):
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('ptrace', libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"
        "print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
        "print([l for l in open('/proc/self/status') if l.startswith('Seccomp:')][0].split()[1])"
    )
    lines = (await py(backend, code)).stdout.decode().splitlines()
    assert lines[:3] == ["unshare -1 1", "ptrace -1 1", "mount -1 1"], lines
    assert lines[3] == "2"


async def test_guard_plugins_add_refused_syscalls(tmp_path):
    class NoUname:
        @hookimpl
        def dsec_guard_syscalls(self, backend):
            return ["uname"] if backend == "fncall" else None

    b = FncallBackend(FncallConfig(pool_size=1))
    await b.start(BackendContext("n", tmp_path, load_hooks(plugins=[NoUname()])))
    try:
        r = await py(
            b, "import os\ntry:\n    os.uname()\nexcept PermissionError:\n    print('refused')"
        )
        assert r.stdout == b"refused\n", r
    finally:
        await b.close()


async def test_nothing_survives_a_call(backend):
    r = await sh(backend, "setsid sleep 1000 >/dev/null 2>&1 < /dev/null & echo started")
    assert r.stdout == b"started\n"
    for _ in range(50):
        if not processes_of_call_uids():
            break
        await asyncio.sleep(0.1)
    assert not processes_of_call_uids()


async def test_output_flood_is_capped(backend):
    r = await sh(backend, "yes", timeout_s=1.5, max_output_bytes=4096)
    assert r.timed_out and r.truncated and len(r.stdout) == 4096


async def test_stdin_and_env(backend):
    data = os.urandom(1 << 20)
    r = await sh(backend, "cat", stdin=data, max_output_bytes=2 << 20)
    assert r.stdout == data
    r = await py(backend, "import os; print(os.environ['X'], os.environ['HOME'])", env={"X": "1"})
    assert r.stdout == b"1 /tmp\n"


async def test_python_exit_codes_and_tracebacks(backend):
    assert (await py(backend, "import sys; sys.exit(7)")).exit_code == 7
    r = await py(backend, "1/0")
    assert r.exit_code == 1 and b"ZeroDivisionError" in r.stderr
    r = await py(backend, "import json, math; print(json.dumps(math.pi))")
    assert r.stdout.startswith(b"3.14")


async def test_files_are_only_under_tmp(backend, tmp_path):
    sid = "sb-00000000000000f1"
    await backend.create(
        EdgeSandbox(id=sid, tenant="t", spec=SandboxSpec(backend="fncall"), created_at=0)
    )
    try:
        for bad in ("/etc/passwd", "/tmp/../etc/x", "/tmp/a/../../b", "/tmp"):
            with pytest.raises(errors.InvalidArgument):
                await backend.write_file(WriteFileRequest(sandbox_id=sid, path=bad, data=b"x"))
        await backend.write_file(WriteFileRequest(sandbox_id=sid, path="/tmp/d/f", data=b"x"))
        with pytest.raises(errors.InvalidArgument):
            await backend.read_file(ReadFileRequest(sandbox_id=sid, path="/tmp/d"))
        r = await backend.exec(
            ExecCall(
                sandbox_id=sid,
                argv=["sh", "-c", "echo more >> /tmp/d/f; cat /tmp/d/f"],
                timeout_s=5,
                max_output_bytes=100,
            )
        )
        assert r.stdout == b"x\nmore\n" or r.stdout == b"xmore\n"
        assert (
            await backend.read_file(ReadFileRequest(sandbox_id=sid, path="/tmp/d/f"))
        ).data == b"x"
    finally:
        await backend.destroy(SandboxRef(sandbox_id=sid))


async def test_destroy_stops_running_calls(backend):
    sid = "sb-00000000000000f2"
    await backend.create(
        EdgeSandbox(id=sid, tenant="t", spec=SandboxSpec(backend="fncall"), created_at=0)
    )
    call = asyncio.ensure_future(
        backend.exec(
            ExecCall(sandbox_id=sid, argv=["sleep", "60"], timeout_s=60, max_output_bytes=10)
        )
    )
    await asyncio.sleep(0.5)
    t = time.monotonic()
    await backend.destroy(SandboxRef(sandbox_id=sid))
    r = await asyncio.wait_for(call, 10)
    assert r.exit_code == -signal.SIGKILL and time.monotonic() - t < 5


async def test_supervisor_and_zygote_crashes_are_survived(backend):
    zygotes = [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and _is_child_zygote(int(p), backend.proc.pid)
    ]
    assert zygotes, "no zygote found"
    os.kill(zygotes[0], signal.SIGKILL)
    assert await _eventually(backend, "back") == b"back\n"
    backend.proc.kill()
    assert await _eventually(backend, "back again") == b"back again\n"


async def _eventually(backend, text: str) -> bytes:
    """Calls may fail (retryably) while a crashed piece restarts; then they work again."""
    for _ in range(100):
        try:
            r = await py(backend, f"print({text!r})")
            if r.stdout == f"{text}\n".encode():
                return r.stdout
        except errors.DsecError as exc:
            assert exc.retryable, exc
        await asyncio.sleep(0.1)
    return b""


def _is_child_zygote(pid: int, parent: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"zygote" in cmd


async def test_memory_is_limited_per_call_not_per_process(backend):
    if "cgroups" not in backend.capabilities.isolation:
        pytest.skip("no cgroup v1 memory and pids hierarchies on this host")
    code = (
        "for i in 1 2 3 4; do python3 -c 'import time; x = bytearray(120 << 20); "
        'x[::4096] = b"x" * len(x[::4096]); time.sleep(3)\' & done; wait; echo finished'
    )
    r = await sh(backend, code, limits=Limits(memory_mb=256, pids=32), timeout_s=20)
    # each process stays under the 256 MiB address-space rlimit; together they do not fit
    assert b"Killed" in r.stderr or r.exit_code != 0 or b"MemoryError" in r.stderr, r
    r = await sh(backend, "cat /proc/self/cgroup")  # its own cgroup namespace: no host path
    lines = r.stdout.splitlines()
    assert lines and all(line.endswith(b":/") for line in lines), r.stdout


async def test_gigabytes_of_output_are_drained_and_capped(backend):
    t = time.monotonic()
    r = await sh(
        backend,
        "head -c 3000000000 /dev/zero; echo done >&2",
        timeout_s=60,
        max_output_bytes=1 << 20,
    )
    assert r.truncated and len(r.stdout) == 1 << 20 and r.stderr == b"done\n" and r.exit_code == 0
    assert not r.timed_out
    print(f"3 GB drained in {time.monotonic() - t:.1f}s")


async def test_a_long_state_directory_path(tmp_path):
    deep = tmp_path / ("d" * 120)  # past the 108 bytes a unix socket address holds
    async with started(FncallBackend(FncallConfig(pool_size=1)), deep) as b:
        assert (await py(b, "print('deep')")).stdout == b"deep\n"
