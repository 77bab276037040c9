"""Container sandboxes: isolation, limits, files, users, and what an idle one costs."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from dsec_backend_container.backend import ContainerBackend
from dsec_backend_container.lanes import checkpoint
from pyroute2 import IPRoute

from dsec_kernel.contract import errors
from dsec_kernel.contract.backend import ExecCall, SandboxRef
from dsec_kernel.contract.conformance import started
from dsec_kernel.contract.wire import (
    EdgeSandbox,
    Env,
    Limits,
    ReadFileRequest,
    SandboxSpec,
    WriteFileRequest,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
BUSYBOX = Env(base="busybox:1")


def new(sandbox_id: str, **spec) -> EdgeSandbox:
    spec.setdefault("env", BUSYBOX)
    return EdgeSandbox(
        id=sandbox_id,
        tenant="t",
        spec=SandboxSpec(backend="container", **spec),
        created_at=time.time(),
    )


async def sh(backend, sid: str, script: str, **kw):
    return await backend.exec(
        ExecCall(
            sandbox_id=sid,
            argv=["/bin/sh", "-c", script],
            timeout_s=kw.pop("timeout_s", 20),
            max_output_bytes=1 << 20,
            **kw,
        )
    )


@pytest.fixture
async def box(backend):
    sb = new("sb-" + os.urandom(8).hex())
    await backend.create(sb)
    yield sb.id
    await backend.destroy(SandboxRef(sandbox_id=sb.id))


async def test_own_namespaces_and_only_an_init_per_sandbox(backend, box):
    r = await sh(
        backend,
        box,
        "echo $$; hostname; ps -o pid,args; cat /proc/net/dev | tail -n +3 | cut -d: -f1",
    )
    lines = r.stdout.decode().split()
    assert "sandbox" in lines and "init" in r.stdout.decode() and "eth0" not in lines
    meta = backend.metas[box]
    kinds = ("pid", "mnt", "net", "uts", "ipc", "cgroup", "user")
    ns = {n: os.readlink(f"/proc/{meta.init_pid}/ns/{n}") for n in kinds}
    mine = {n: os.readlink(f"/proc/self/ns/{n}") for n in ns}
    assert all(ns[n] != mine[n] for n in ns), (ns, mine)
    cgroups = (await sh(backend, box, "cat /proc/self/cgroup")).stdout.decode().splitlines()
    assert cgroups and all(c.endswith(":/") or ":/exec-" in c for c in cgroups), cgroups
    children = [p for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == meta.init_pid]
    assert children == [], "an idle sandbox runs nothing but its init"


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


async def test_writes_go_to_the_sandbox_only(backend, box):
    assert (
        await sh(backend, box, "echo changed > /etc/hostname; rm /bin/ls; echo ok")
    ).stdout == b"ok\n"
    other = new("sb-" + os.urandom(8).hex())
    await backend.create(other)
    try:
        r = await sh(backend, other.id, "cat /etc/hostname; test -e /bin/ls && echo has-ls")
        assert r.stdout == b"has-ls\n", r  # its /etc/hostname is the image's (empty)
    finally:
        await backend.destroy(SandboxRef(sandbox_id=other.id))


async def test_privileged_operations_are_refused(backend, box):
    r = await sh(
        backend,
        box,
        "mount -t tmpfs none /mnt 2>&1; echo rc=$?; "
        "grep CapEff /proc/self/status; unshare -n true 2>&1; echo u=$?",
    )
    out = r.stdout.decode()
    assert "rc=0" not in out and "u=0" not in out, out
    eff = int(next(line for line in out.splitlines() if line.startswith("CapEff")).split()[1], 16)
    assert not eff & (1 << 21), "CAP_SYS_ADMIN must be dropped"


async def test_host_knobs_and_devices_are_out_of_reach(backend, box):
    """Root in a sandbox is uid 0 on the host: /proc's host-wide files must be read-only or
    hidden, and no device node can be made (or used from the writable layer)."""
    r = await sh(
        backend,
        box,
        "for f in /proc/sys/kernel/core_pattern /proc/sysrq-trigger; do"
        "  (echo x > $f) 2>/dev/null && echo wrote $f; done;"
        " mknod /tmp/disk b 8 0 2>/dev/null && echo made-device;"
        " for f in /proc/kcore /proc/keys /proc/timer_list; do"
        '  [ -n "$(head -c 1 $f 2>/dev/null)" ] && echo shows $f; done;'
        " cat /proc/sys/kernel/ostype",
    )
    assert r.stdout == b"Linux\n", r


async def test_file_operations_do_not_hang_on_a_fifo(backend, box):
    assert (await sh(backend, box, "mkfifo /tmp/pipe /tmp/.f.dsec-tmp")).exit_code == 0
    with pytest.raises(errors.InvalidArgument, match="not a regular file"):
        await backend.read_file(ReadFileRequest(sandbox_id=box, path="/tmp/pipe"))
    await backend.write_file(WriteFileRequest(sandbox_id=box, path="/tmp/f", data=b"ok"))
    assert (await backend.read_file(ReadFileRequest(sandbox_id=box, path="/tmp/f"))).data == b"ok"


async def test_memory_and_process_limits(backend):
    sid = "sb-" + os.urandom(8).hex()
    await backend.create(new(sid, limits=Limits(memory_mb=64, pids=32)))
    try:
        # the shell holds 150 MB in a variable: more than the sandbox may have
        r = await sh(
            backend, sid, "x=$(head -c 150000000 /dev/zero | tr '\\0' a); echo ${#x}", timeout_s=30
        )
        cg = backend._group(sid).dirs
        assert int((cg["memory"] / "memory.limit_in_bytes").read_text()) == 64 << 20
        oom = dict(
            line.split() for line in (cg["memory"] / "memory.oom_control").read_text().splitlines()
        )
        assert r.stdout != b"150000000\n" and int(oom["oom_kill"]) > 0, r  # swap or not
        await sh(backend, sid, "for i in $(seq 100); do sleep 1 & done 2>/dev/null; true")
        assert int((cg["pids"] / "pids.current").read_text()) <= 32
        assert int((cg["pids"] / "pids.events").read_text().split()[1]) > 0  # forks refused
        await asyncio.sleep(1.5)
        assert (await sh(backend, sid, "echo alive")).stdout == b"alive\n"
    finally:
        await backend.destroy(SandboxRef(sandbox_id=sid))


async def test_users_env_cwd_and_file_size(backend, box):
    r = await backend.exec(
        ExecCall(
            sandbox_id=box, argv=["id", "-u"], user="nobody", timeout_s=5, max_output_bytes=100
        )
    )
    assert r.stdout == b"65534\n"
    r = await backend.exec(
        ExecCall(sandbox_id=box, argv=["id", "-u"], user="1234", timeout_s=5, max_output_bytes=100)
    )
    assert r.stdout == b"1234\n"
    with pytest.raises(errors.InvalidArgument):
        await backend.exec(
            ExecCall(
                sandbox_id=box, argv=["true"], user="nosuchuser", timeout_s=5, max_output_bytes=100
            )
        )
    r = await sh(
        backend,
        box,
        "head -c 3000000 /dev/zero > /tmp/big; echo $?; wc -c < /tmp/big",
        limits=Limits(file_size_mb=1),
    )
    assert int(r.stdout.split()[-1]) <= 1 << 20


async def test_files_cannot_escape_through_symlinks(backend, box):
    await sh(backend, box, "ln -s /etc/shadow /tmp/link; ln -s ../../../../../../etc /tmp/up")
    with pytest.raises(errors.NotFound):  # resolved inside the sandbox, where there is none
        await backend.read_file(ReadFileRequest(sandbox_id=box, path="/tmp/link"))
    await backend.write_file(WriteFileRequest(sandbox_id=box, path="/tmp/up/written", data=b"x"))
    assert not Path("/etc/written").exists()
    assert (await sh(backend, box, "cat /etc/written")).stdout == b"x"
    with pytest.raises(errors.InvalidArgument):
        await backend.read_file(ReadFileRequest(sandbox_id=box, path="/etc"))


async def test_timeout_kills_the_process_group_and_background_output_does_not_block(backend, box):
    t = time.monotonic()
    r = await sh(backend, box, "sleep 30 & sleep 30 & wait", timeout_s=1)
    assert r.timed_out and time.monotonic() - t < 5
    assert (await sh(backend, box, "ps -o args | grep -c '^sleep 30' || true")).stdout == b"0\n"
    t = time.monotonic()
    r = await sh(backend, box, "(setsid sleep 30 &); echo started")  # keeps stdout open
    assert r.stdout == b"started\n" and time.monotonic() - t < 5


async def test_commands_left_running_leave_few_exec_groups_behind(backend, box):
    """Each command's freezer group stays while what it left runs, and goes once emptied:
    200 `sleep 0.05 &` leave a bounded few, not 200, until the sandbox goes."""
    freezer = backend._group(box).dirs["freezer"]
    for _ in range(200):
        await sh(backend, box, "sleep 0.05 >/dev/null 2>&1 &")
    left = [p for p in freezer.iterdir() if p.name.startswith("exec-")]
    assert 0 < len(left) <= 64, len(left)


async def test_destroying_a_sandbox_stops_its_long_work(backend):
    """A walk on the sandbox's lane (a snapshot, an fs_diff) stops at its next step when the
    sandbox is destroyed, and the destroy waits for it to let go."""
    sid = "sb-" + os.urandom(8).hex()
    await backend.create(new(sid))
    started_walk = threading.Event()

    def walk() -> None:  # what a walk does between its steps
        started_walk.set()
        while True:
            checkpoint()
            time.sleep(0.001)

    work = asyncio.ensure_future(backend.lanes.run("t", walk, key=sid))
    await asyncio.to_thread(started_walk.wait, 10)
    await backend.destroy(SandboxRef(sandbox_id=sid))
    assert work.done()
    with pytest.raises(errors.Unavailable, match="destroyed while this ran"):
        await work


async def test_a_timeout_kills_through_the_helper_when_the_cgroup_kill_fails(backend, box):
    """The fallback kill goes through the helper (our own child), which kills the command's
    group while the command is still unreaped: the host never signals a group by number."""

    def broken() -> None:
        raise OSError("the freezer failed")

    pidfd = os.dup(backend.inits.pidfd(box))
    try:
        t = time.monotonic()
        with pytest.raises(OSError, match="freezer failed"):
            await backend.helper.exec(
                pidfd, ["/bin/sh", "-c", "sleep 31 & sleep 31; wait"], cgroups=[],
                kill_all=broken, env={"PATH": "/bin"}, cwd="/", stdin=b"", timeout=0.5,
                max_output=1024, seccomp=None,
            )  # fmt: skip
        assert time.monotonic() - t < 5
    finally:
        os.close(pidfd)
    r = await sh(backend, box, "ps -o args | grep -c '^sleep 31' || true")
    assert r.stdout == b"0\n", r


async def test_idle_sandboxes_cost_little_host_memory(backend):
    ids = ["sb-" + os.urandom(8).hex() for _ in range(20)]
    for sid in ids:
        await backend.create(new(sid))
    try:
        pss = [_pss_kib(backend.metas[s].init_pid) for s in ids]
        assert max(pss) < 512, pss  # each init's own share; kernel objects come on top
    finally:
        await asyncio.gather(*(backend.destroy(SandboxRef(sandbox_id=s)) for s in ids))


def _pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


async def test_a_restarted_backend_adopts_live_sandboxes_and_removes_dead_ones(
    make_config, tmp_path
):
    state = tmp_path / "state"
    async with started(ContainerBackend(make_config()), state) as b:
        await b.create(new("sb-00000000000000a1"))
        await b.create(new("sb-00000000000000a2"))
        await sh(b, "sb-00000000000000a1", "echo kept > /tmp/k")
        dead = b.metas["sb-00000000000000a2"]
    os.kill(dead.init_pid, 9)  # dies while no edge watches
    await asyncio.sleep(0.2)
    async with started(ContainerBackend(make_config()), state) as b:
        assert await b.list_sandboxes() == ["sb-00000000000000a1"]
        assert (await sh(b, "sb-00000000000000a1", "cat /tmp/k")).stdout == b"kept\n"
        assert not (b.root / "sb-00000000000000a2").exists()
        assert not b._group("sb-00000000000000a2").dirs["memory"].exists()
        await b.destroy(SandboxRef(sandbox_id="sb-00000000000000a1"))


async def test_egress_is_a_link_of_its_own_and_goes_with_the_sandbox(
    make_config, tmp_path, monkeypatch
):
    """network="egress": eth0 with an address and a default route through the gateway on
    the host end of its own link; the host itself is not reachable (a server the test runs
    on the gateway address is refused, and the refusal is a guard event); network="none":
    only lo. Link and namespace are gone afterwards. The edge process is never forked on
    the way (a forked copy of a threaded edge shares its signal wakeup fd: pyroute2's
    ``netns=`` did that, and the SIGTERM it sent its child stopped the edge).
    test_container_egress.py tests the rules themselves."""

    def no_fork() -> int:
        raise AssertionError("the backend forked the edge process")

    monkeypatch.setattr(os, "fork", no_fork)
    name, subnet = f"dsect{os.urandom(3).hex()}", f"10.214.{os.urandom(1)[0]}.0/24"
    config = make_config(egress_name=name, egress_subnet=subnet, egress_check_s=0.2)
    async with started(ContainerBackend(config), tmp_path) as b:
        events: list[tuple[str, str, dict]] = []

        async def guard_event(sandbox_id: str, kind: str, detail: dict) -> None:
            events.append((sandbox_id, kind, detail))

        monkeypatch.setattr(b.hooks, "guard_event", guard_event)
        out, closed = (
            new("sb-" + os.urandom(8).hex(), network="egress"),
            new("sb-" + os.urandom(8).hex()),
        )
        await b.create(out)
        await b.create(closed)
        gateway = str(b.egress.gateway)
        server = ThreadingHTTPServer((gateway, 0), _Hello)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        get = f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {gateway} {port}"
        try:
            r = await sh(b, out.id, f"ip -o -4 addr show eth0; ip route; {get}")
            assert b.metas[out.id].address in r.stdout.decode()
            assert f"default via {gateway}".encode() in r.stdout, r
            assert b"hello" not in r.stdout and r.exit_code != 0, r  # the host is refused
            for _ in range(50):
                if any(i == out.id and k == "egress_denied" for i, k, _ in events):
                    break
                await asyncio.sleep(0.1)
            assert any(i == out.id and k == "egress_denied" for i, k, _ in events), events
            r = await sh(b, closed.id, f"ip -o link | cut -d: -f2; {get}")
            assert r.stdout.split() == [b"lo"] and r.exit_code != 0, r
        finally:
            server.shutdown()
            server.server_close()
            for sb in (out, closed):
                await b.destroy(SandboxRef(sandbox_id=sb.id))
        assert not (b.root / out.id).exists()
    assert await asyncio.to_thread(_links, ("dsv",)) == []  # no link left


def _links(prefixes: tuple[str, ...]) -> list[str]:
    with IPRoute() as ip:  # pyroute2's synchronous API: not on the event loop's thread
        names = [link.get_attr("IFLA_IFNAME") for link in ip.get_links()]
    return [n for n in names if n.startswith(prefixes)]


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"hello\n")

    def log_message(self, *args) -> None:
        pass


async def test_pause_reclaims_memory_into_compressed_swap(backend, box):
    """A paused sandbox's memory leaves RAM (into the zram swap the backend makes at the
    first pause when the node has none), and is all there after resume."""
    from dsec_backend_container.reclaim import ZramSwap

    hold = b"x=$(head -c 41943040 /dev/zero | tr '\\000' a); touch /tmp/held\n"
    hold += b"while :; do sleep 1; done\n"
    await backend.write_file(WriteFileRequest(sandbox_id=box, path="/tmp/hold.sh", data=hold))
    r = await sh(backend, box, "(setsid sh /tmp/hold.sh > /dev/null 2>&1 &); "
                 "while [ ! -e /tmp/held ]; do sleep 0.1; done")  # fmt: skip
    assert r.exit_code == 0, r
    ref = SandboxRef(sandbox_id=box)
    report = await backend.pause(ref)
    if not ZramSwap.active():
        await backend.resume(ref)
        pytest.skip("no swap and no zram on this node: a pause reclaims page cache only")
    assert report.memory_before_bytes > 40 << 20, report
    assert report.memory_after_bytes < report.memory_before_bytes / 4, report
    assert report.swapped_bytes > 30 << 20, report
    back = await backend.resume(ref)
    assert back.memory_before_bytes > 40 << 20, back
    r = await sh(backend, box, "ps -o args | grep -c '^sh /tmp/hold.sh'")
    assert r.stdout == b"1\n", r
