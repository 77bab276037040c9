"""A hostile tenant against container sandboxes: issue 7's items 1, 2, 3, 6 (the fs_diff
oracle), 7, 9, 10 and 11, and the classic escapes. Every attack goes through the SDK or runs
inside the attacker's own sandbox; the host side only looks (and, for item 2, plays the
machine that reuses a PID)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

import dsec_kernel as dsec
from dsec_kernel.contract import errors

BUSYBOX = dsec.Env(base="busybox:1")


@pytest.fixture(autouse=True)
def container(needs):
    needs("container")


def sandbox_dir(platform, sandbox_id: str) -> Path:
    node = platform.cluster.state_dir / "nodes" / "node-a"
    return node / "backends" / "container" / "sandboxes" / sandbox_id


def init_pid(platform, sandbox_id: str) -> int:
    return json.loads((sandbox_dir(platform, sandbox_id) / "meta.json").read_text())["init_pid"]


async def one(client, **kw) -> dsec.Sandbox:
    [sb] = await client.create(count=1, backend="container", env=BUSYBOX, **kw)
    return sb


async def wait_lost(client, sb, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.1)):
        if (await sb.status()).state == "lost":
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{sb.id} was not reported lost")


# -- item 1: nothing a sandbox reaches holds a platform secret or the host's state --------


async def test_no_secret_or_host_state_through_files_or_procfs(platform, victim, attacker, attack):
    sb = await one(attacker)
    try:
        for path in ("/proc/1/environ", "/proc/1/stack", "/proc/kmsg", "/proc/kallsyms"):
            try:
                data = await sb.read_file(path)
            except errors.DsecError as exc:
                assert str(init_pid(platform, sb.id)) not in exc.message
                continue
            assert b"DSEC" not in data and b"nats://" not in data, path
            assert not any(w.strip(b"0 ") for w in data.split(b"\n")[:5] if path.endswith("syms"))
        loadavg = (await sb.read_file("/proc/loadavg")).split()[3]
        assert int(loadavg.split(b"/")[0]) < 1000  # the sandbox's own PID namespace counts
        r = await sb.exec("cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; env")
        assert (
            b"DSEC" not in r.stdout and b"nats://" not in r.stdout and b"PASSWORD" not in r.stdout
        )
        r = await sb.exec(
            "cat /proc/1/environ /proc/1/stack /proc/kmsg 2>&1; head -3 /proc/kallsyms"
        )
        assert b"Permission denied" in r.stdout or r.exit_code != 0
        assert b" T " not in r.stdout  # no kernel symbol with its address
        attack("read init's environ, kernel stack, kmsg, kallsyms, loadavg", "container",
               "refused, or the sandbox's own view")  # fmt: skip
    finally:
        await attacker.destroy([sb])


async def test_file_operations_see_the_sandboxs_proc_as_its_commands_do(platform, attacker, attack):
    """A read_file aimed at /proc/self/... tells what a command in the sandbox sees: its own
    network, hostname and IPC, and no host path (of its cgroups, of the helper that reads)."""
    sb = await one(attacker)
    state = str(platform.cluster.state_dir).encode()
    try:
        await sb.exec("ln -s /proc/self/maps /maps")  # the helper's own, through a symlink
        for path in ("/proc/self/net/dev", "/proc/self/net/tcp", "/proc/sys/kernel/hostname",
                     "/proc/sysvipc/shm", "/proc/self/net/unix"):  # fmt: skip
            seen = await sb.read_file(path)
            assert seen == (await sb.exec(f"cat {path}")).stdout, path
        for path in ("/maps", "/proc/self/cgroup", "/proc/self/mountinfo", "/proc/self/comm"):
            seen = await sb.read_file(path)
            assert state not in seen and b"dsec-container" not in seen, (path, seen[:300])
        assert b"eth0" not in await sb.read_file("/proc/self/net/dev")  # (no network asked)
        attack("read_file /proc/self/{net/*,cgroup,maps}, hostname, sysvipc", "container",
               "the sandbox's own, as its commands see; no host path")  # fmt: skip
    finally:
        await attacker.destroy([sb])


# -- root in a sandbox is not root on the host ---------------------------------------------


async def test_root_in_a_sandbox_is_an_unprivileged_host_uid_of_its_own(platform, attacker, attack):
    a, b = await one(attacker), await one(attacker)
    try:
        uids = []
        for sb in (a, b):
            r = await sb.exec("id -u; sleep 30 >/dev/null 2>&1 & echo $!")
            assert r.stdout.split()[0] == b"0"
            pid = init_pid(platform, sb.id)
            status = Path(f"/proc/{pid}/status").read_text()
            uid = int(status.split("Uid:")[1].split()[0])
            assert uid >= 1 << 28, "init runs as the sandbox's root: an unprivileged host uid"
            caps = int(status.split("CapEff:")[1].split()[0], 16)
            assert caps == 0
            uids.append(uid)
        assert uids[0] != uids[1], "no two sandboxes share a uid range"
        attack("root in a sandbox vs the host", "container", f"host uids {uids[0]}, {uids[1]}")
    finally:
        await attacker.destroy([a, b])


# -- item 2: a dead init is never mistaken for a live one ----------------------------------


async def test_killing_init_from_inside_fails(attacker, attack):
    sb = await one(attacker)
    try:
        r = await sb.exec("kill -TERM 1; kill -KILL 1; kill -STOP 1; sleep 0.3; ps -o pid,args")
        assert b"init" in r.stdout
        assert (await sb.exec("echo alive")).stdout == b"alive\n"
        attack("kill -TERM/-KILL/-STOP 1 from inside", "container", "ignored: init lives")
    finally:
        await attacker.destroy([sb])


def _take_pid(pid: int, start: int) -> subprocess.Popen | None:
    """A host process with exactly ``pid`` (the host's ns_last_pid set just below it) once
    the old init is reaped; None if another process holds the pid already."""
    for _ in range(100):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            stat = None
        if stat is not None and int(stat[19]) == start:
            assert stat[0] == "Z", "the old init still runs"
            time.sleep(0.1)  # dead, not reaped yet: its pid is not free
            continue
        if stat is not None:
            return None
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(["sleep", "60"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError(f"could not reuse pid {pid}")


async def test_a_reused_init_pid_is_never_entered(platform, attacker, attack):
    sb = await one(attacker)
    pid = init_pid(platform, sb.id)
    start = json.loads((sandbox_dir(platform, sb.id) / "meta.json").read_text())["init_start"]
    host = None
    try:
        os.kill(pid, signal.SIGKILL)  # the machine kills it (only the host can)
        await asyncio.sleep(0.2)
        host = _take_pid(pid, start)  # and a host process gets its number
        for attempt in (
            sb.exec("hostname > /proof; cat /etc/hostname"),
            sb.write_file("/tmp/proof", b"x"),
            sb.read_file("/etc/hostname"),
        ):
            with pytest.raises(errors.SandboxLost) as info:
                await attempt
            assert str(pid) not in info.value.message
        assert not Path("/proof").exists() and not Path("/tmp/proof").exists()
        await wait_lost(attacker, sb)
        attack("act on a dead init whose pid a host process took", "container",
               "sandbox_lost, the host process untouched")  # fmt: skip
    finally:
        if host is not None:
            host.kill()
            host.wait()
        await attacker.destroy([sb])


# -- item 3: no ptrace window before seccomp ------------------------------------------------

_TRACER = r"""
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
/* attach to every process that appears, for `secs` seconds; print how many were caught,
 * how many of those had no seccomp filter, and how many showed the platform's helper's
 * command line (host paths) */
int main(int argc, char **argv) {
    int secs = atoi(argv[1]), caught = 0, unfiltered = 0, helpers = 0;
    char seen[65536] = {0};
    time_t end = time(NULL) + secs;
    while (time(NULL) < end) {
        DIR *d = opendir("/proc");
        struct dirent *e;
        while ((e = readdir(d))) {
            int pid = atoi(e->d_name);
            if (pid <= 1 || pid == getpid() || pid >= 65536 || seen[pid]) continue;
            seen[pid] = 1;
            char cpath[64], cmd[4096] = {0};
            snprintf(cpath, sizeof cpath, "/proc/%d/cmdline", pid);
            FILE *c = fopen(cpath, "r");
            size_t got = c ? fread(cmd, 1, sizeof cmd - 1, c) : 0;
            if (c) fclose(c);
            for (size_t i = 0; i < got; i++) if (!cmd[i]) cmd[i] = ' ';
            if (strstr(cmd, "--pidfd") || strstr(cmd, "cgroup")) helpers++;
            if (ptrace(PTRACE_SEIZE, pid, 0, 0) == 0) {
                caught++;
                char path[64], buf[4096];
                snprintf(path, sizeof path, "/proc/%d/status", pid);
                FILE *f = fopen(path, "r");
                size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
                buf[n] = 0;
                if (f) fclose(f);
                char *s = strstr(buf, "Seccomp:");
                if (s && atoi(s + 8) == 0) unfiltered++;
                ptrace(PTRACE_DETACH, pid, 0, 0);
            }
        }
        closedir(d);
    }
    printf("%d %d %d\n", caught, unfiltered, helpers);
    return 0;
}
"""


async def test_no_process_is_traceable_before_its_seccomp_filter(attacker, tmp_path, attack):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the tracer")
    (tmp_path / "t.c").write_text(_TRACER)
    subprocess.run([cc, "-O2", "-static", "-o", str(tmp_path / "t"), str(tmp_path / "t.c")],
                   check=True)  # fmt: skip
    sb = await one(attacker)
    try:
        await sb.write_file("/tracer", (tmp_path / "t").read_bytes(), mode=0o755)
        tracer = asyncio.ensure_future(sb.exec("/tracer 8", timeout=30))
        await asyncio.sleep(0.5)
        for _ in range(30):  # each lives a moment: the tracer gets to it, after its exec
            r = await sb.exec("sleep 0.2; grep -E 'Seccomp|NoNewPrivs' /proc/self/status")
            assert b"Seccomp:\t2" in r.stdout and b"NoNewPrivs:\t1" in r.stdout
        caught, unfiltered, helpers = map(int, (await tracer).stdout.split())
        assert caught > 0, "the tracer attached nothing at all: it proves nothing"
        assert unfiltered == 0, f"{unfiltered} of {caught} traced before their filter"
        assert helpers == 0, "a helper's command line (host paths) was in sight"
        attack("ptrace a command before its seccomp filter", "container",
               f"never (attached {caught} after exec, all filtered)")  # fmt: skip
    finally:
        await attacker.destroy([sb])


# -- item 6 (second half): fs_diff is no oracle of the host's paths -------------------------


async def test_fs_diff_through_a_planted_symlink_tells_nothing_of_the_host(attacker, attack):
    sb = await one(attacker)
    try:
        await sb.exec("ln -s / /hostroot")
        snap = await sb.snapshot()
        layer = await attacker.publish(snap, kind="base", name="rooted", version="1")
        rooted = dsec.Env(base=f"{layer.name}:{layer.version}")
        [sb2] = await attacker.create(count=1, backend="container", env=rooted)
        try:
            await sb2.exec(
                "rm /hostroot && mkdir -p /hostroot/etc && "
                "touch /hostroot/etc/passwd /hostroot/etc/no-such-file-on-any-host"
            )
            diff = await sb2.fs_diff()
            assert {"/hostroot/etc/passwd", "/hostroot/etc/no-such-file-on-any-host"} <= set(
                diff.added
            ), diff  # the same answer whether or not the host has the path
            assert "/hostroot/etc/passwd" not in diff.modified
            attack("fs_diff through a layer's symlink to /", "container", "no host lookups")
        finally:
            await attacker.destroy([sb2])
    finally:
        await attacker.destroy([sb])


# -- item 7: an edit that puts size and times back still shows -----------------------------


async def test_a_stealthy_edit_shows_in_fs_diff(attacker, attack):
    sb = await one(attacker)
    try:
        await sb.write_file("/work/test_answer.py", b"assert solve() == 42\n")
        snap = await sb.snapshot()
        await sb.exec(
            "cd /work && cp -p test_answer.py /tmp/ref && sed -i 's/42/41/' test_answer.py && "
            "touch -r /tmp/ref test_answer.py && rm /tmp/ref"
        )
        assert "/work/test_answer.py" in (await sb.fs_diff(since=snap)).modified
        assert "/work/test_answer.py" in (await sb.fs_diff()).added
        attack("edit a file, put size and mtime back", "container", "reported modified")
    finally:
        await attacker.destroy([sb])


# -- item 9: a sandbox fills its quota, not the host's disk ---------------------------------


async def test_filling_the_disk_stops_at_the_quota(platform, attacker, victim, attack):
    sb = await one(attacker, limits=dsec.Limits(disk_mb=64))
    neighbour = await one(victim)
    try:
        r = await sb.exec("dd if=/dev/zero of=/fill bs=1M count=512", timeout=120)
        assert b"quota exceeded" in r.stderr.lower(), r.stderr
        r = await sb.exec(  # most of the quota taken: a flood of empty files ends soon
            "rm /fill; sync; dd if=/dev/zero of=/fill bs=1M count=63 2>/dev/null; mkdir /i &&"
            " cd /i && seq 1 100000 | xargs touch; ls | wc -l",
            timeout=300,
        )
        assert b"quota exceeded" in r.stderr.lower(), r.stderr
        assert int(r.stdout) < 100_000, "an inode flood ends at the same quota"
        rw = sandbox_dir(platform, sb.id) / "rw"
        show = subprocess.run(["btrfs", "qgroup", "show", "-rf", "--raw", str(rw)],
                              capture_output=True, text=True, check=True)  # fmt: skip
        referenced = int(show.stdout.splitlines()[-1].split()[1])
        assert referenced <= 64 << 20, f"{referenced} bytes on the node's disk"
        assert (await neighbour.exec("echo x > /f && cat /f")).stdout == b"x\n"
        attack("fill the disk with bytes and with inodes", "container",
               f"quota exceeded at 64 MiB (the last {int(r.stdout)} files)")  # fmt: skip
    finally:
        await attacker.destroy([sb])
        await victim.destroy([neighbour])


async def test_a_tenants_sandboxes_fill_its_share_of_the_node_disk_only(
    platform, attacker, victim, attack
):
    """Quotas are thin; each tenant's sandboxes together fill at most its share of the node's
    sandbox disk (half of it: 1 GiB here), so the victim still writes."""
    sbs = [await one(attacker, limits=dsec.Limits(disk_mb=1024)) for _ in range(3)]
    neighbour = await one(victim)
    try:
        fill = "dd if=/dev/zero of=/fill bs=1M count=400 2>&1; sync; wc -c < /fill"
        wrote = [int((await sb.exec(fill, timeout=120)).stdout.split()[-1]) >> 20 for sb in sbs]
        assert sum(wrote) < 1024 and wrote[-1] < 400, wrote
        r = await neighbour.exec(fill, timeout=120)
        assert int(r.stdout.split()[-1]) >> 20 == 400, r
        attack("3 sandboxes of 1 GiB quota each fill 400 MiB", "container",
               f"quota exceeded at the tenant's 1 GiB ({'+'.join(map(str, wrote))} MiB); "
               "the victim wrote 400 MiB")  # fmt: skip
    finally:
        await attacker.destroy(sbs)
        await victim.destroy([neighbour])


async def test_an_inode_flood_stops_at_the_inode_limit(platform, attacker, victim, attack):
    sb = await one(attacker, limits=dsec.Limits(inodes=5000))
    neighbour = await one(victim, limits=dsec.Limits(inodes=5000))
    try:
        r = await sb.exec(  # (true: a failed redirection of ':' would end the shell)
            "mkdir /i; n=0; while [ $n -lt 500000 ] && true > /i/$n; do n=$((n+1)); done; echo $n",
            timeout=300,
        )
        made = int(r.stdout)
        assert b"quota exceeded" in r.stderr.lower() and made < 500_000, (made, r.stderr[-200:])
        assert (await sb.exec("touch /one-more")).exit_code != 0, "still closed"
        with pytest.raises(errors.QuotaExceeded):
            await sb.write_file("/one-more", b"x")
        r = await neighbour.exec("mkdir /i && cd /i && seq 1 4000 | xargs touch && ls | wc -l")
        assert r.stdout == b"4000\n", r
        attack("flood the writable layer with empty files", "container",
               f"EDQUOT after {made} of a 5,000-inode limit (one look's overshoot)")  # fmt: skip
    finally:
        await attacker.destroy([sb])
        await victim.destroy([neighbour])


async def test_long_walks_of_one_tenant_hold_up_no_one_else(platform, attacker, victim, attack):
    """A tenant asking for fs_diffs of big trees in many sandboxes at once gets one walk at a
    time on the node's lanes; the victim's command waits for none of them."""
    sbs = await attacker.create(count=8, backend="container", env=BUSYBOX)
    neighbour = await one(victim)
    try:
        made = await attacker.exec_many(
            sbs, "mkdir /m && cd /m && seq 1 40000 | xargs touch && ls | wc -l", timeout=300
        )
        assert all(r.exit_code == 0 and r.stdout == b"40000\n" for r in made), made
        diffs = [asyncio.ensure_future(sb.fs_diff()) for sb in sbs]
        await asyncio.sleep(0.3)  # every diff asked for
        r = await neighbour.exec("echo hi")
        done = sum(d.done() for d in diffs)
        assert r.stdout == b"hi\n" and done <= 1, done  # 4 of 8 on the default executor
        sizes = {len((await d).added) for d in diffs}
        assert sizes == {40_001}, sizes
        attack("fs_diffs of 40,000 files in 8 sandboxes at once, then the victim's exec",
               "container", f"answered after {done} of 8: one walk per tenant")  # fmt: skip
    finally:
        await attacker.destroy(sbs)
        await victim.destroy([neighbour])


async def test_limits_past_the_nodes_are_refused(attacker, attack):
    for limits in (
        dsec.Limits(memory_mb=1 << 20), dsec.Limits(pids=1 << 16), dsec.Limits(disk_mb=1 << 24),
        dsec.Limits(inodes=1 << 30),
    ):  # fmt: skip
        with pytest.raises(errors.InvalidArgument, match="over the"):
            await one(attacker, limits=limits)
    assert not [s for s in await attacker.list() if s.backend == "container"]
    attack("ask for 1 TiB of memory, 65,536 processes, 16 TiB of disk or 2^30 inodes",
           "container", "invalid_argument")  # fmt: skip


def file_helpers() -> list[int]:
    """Host pids of file-operation helpers (each shows only its name)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"dsec-file"):
                found.append(int(pid))
        except OSError:
            pass
    return found


async def test_a_flood_of_file_operations_leaves_the_node_up(platform, attacker, victim, attack):
    """300 read_files at once: the node keeps its heartbeat (its helpers run in the sandbox's
    cgroups, a few at a time), the victim's sandbox stays ready and answers meanwhile."""
    sb = await one(attacker)
    mine = await one(victim)
    try:
        await mine.write_file("/data", b"victim's")
        t = time.monotonic()
        flood = asyncio.gather(*(sb.read_file("/etc/passwd") for _ in range(300)))
        answered = []
        while not flood.done():
            r = await mine.exec("cat /data")
            answered.append(r.stdout == b"victim's")
            await asyncio.sleep(0.2)
        await flood
        took = time.monotonic() - t
        assert all(answered) and (await mine.status()).state == "ready"
        [node] = await victim.nodes()
        assert node.state == "up", node
        attack("300 read_files at once against the node's heartbeat", "container",
               f"done in {took:.1f}s; node up, victim answered {len(answered)} times")  # fmt: skip
    finally:
        await attacker.destroy([sb])
        await victim.destroy([mine])


async def test_stopped_file_helpers_do_not_pile_up(platform, attacker, attack):
    """The sandbox stops every process of its uid, the file helpers' children included: each
    operation ends at the file timeout (3 s here) with everything it started, and no more of
    them exist at once than the sandbox's process limit allows."""
    sb = await one(attacker, limits=dsec.Limits(pids=32))
    try:
        await sb.exec("(while :; do kill -STOP -1; done) >/dev/null 2>&1 &")
        t = time.monotonic()
        results = await asyncio.gather(
            *(sb.read_file("/etc/passwd") for _ in range(40)), return_exceptions=True
        )
        took = time.monotonic() - t
        kinds = {type(r).__name__ for r in results}
        assert kinds <= {"bytes", "DeadlineExceeded", "Unavailable"}, kinds
        for _ in range(50):
            if not file_helpers():
                break
            await asyncio.sleep(0.1)
        assert not file_helpers(), "file helpers outlived their operations"
        attack("stop the file helpers (kill -STOP -1), then 40 read_files", "container",
               f"40 answered in {took:.1f}s ({','.join(sorted(kinds))}); none left")  # fmt: skip
    finally:
        await attacker.destroy([sb])


async def test_file_operations_whose_callers_gave_up_do_not_pile_up(platform, attacker, attack):
    """Waves of read_files against a sandbox that stops every helper: those that wait for a
    turn stop when their callers do (2 s here), so once the waves end nothing of them is left
    running on the edge (they had filled its 20,000-request cap)."""
    sb = await one(attacker, limits=dsec.Limits(pids=64))
    try:
        await sb.exec("(while :; do kill -STOP -1; done) >/dev/null 2>&1 &")
        who = platform.attacker
        async with dsec.AsyncClient(url=who.url, token=who.token, timeout=2) as quick:
            mine = await quick.get(sb.id)
            kinds: Counter[str] = Counter()
            for _ in range(3):
                got = await asyncio.gather(
                    *(mine.read_file("/etc/passwd") for _ in range(150)), return_exceptions=True
                )
                kinds.update(type(r).__name__ for r in got)
        assert set(kinds) <= {"bytes", "DeadlineExceeded"} and kinds["DeadlineExceeded"], kinds
        for _ in range(60):  # what got a turn ends at the file timeout (3 s here)
            if not file_helpers():
                break
            await asyncio.sleep(0.1)
        assert not file_helpers(), "file operations went on after their callers gave up"
        attack("3 waves of 150 read_files (callers wait 2 s) at a sandbox stopping helpers",
               "container", f"{dict(kinds)}; none left running")  # fmt: skip
    finally:
        await attacker.destroy([sb])


def edge_fds(platform) -> int:
    return len(os.listdir(f"/proc/{platform.cluster.edges['node-a'].proc.pid}/fd"))


def tree_bytes(root: Path) -> int:
    """Bytes a tree takes on disk (blocks allocated, each inode once)."""
    seen, total = set(), 0
    for d, _, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(d, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


async def test_snapshots_of_planted_trees_stay_bounded(platform, attacker, attack):
    """10,000 sibling directories (each held a descriptor: the edge ran out of them), a
    2 GiB sparse file and 60 links to one 8 MiB file (written out whole to the store) make a
    snapshot of what the sandbox really holds, with the edge's descriptors bounded."""
    sb = await one(attacker, limits=dsec.Limits(disk_mb=256))
    try:
        await sb.exec(
            "mkdir /w && cd /w && seq 1 10000 | xargs mkdir && for d in 1 2 3; do : > $d/f; done;"
            " dd if=/dev/zero of=/sparse bs=1 count=1 seek=2G 2>/dev/null;"
            " dd if=/dev/urandom of=/big bs=1M count=8 2>/dev/null &&"
            " for i in $(seq 1 60); do ln /big /l$i; done",
            timeout=300,
        )
        before = edge_fds(platform)
        snap = await sb.snapshot()
        after = edge_fds(platform)
        stored = tree_bytes(platform.store / "snapshots" / snap.id / "delta")
        assert stored < 64 << 20, f"{stored} bytes stored for 8 MiB of data"
        assert after < before + 64, (before, after)
        fork = (await attacker.create(count=1, from_snapshot=snap))[0]
        try:
            r = await fork.exec("ls /w | wc -l; stat -c %s /sparse; md5sum /big /l60 | cut -c1-32")
        finally:
            await attacker.destroy([fork])
        lines = r.stdout.split()
        assert len(lines) == 4 and lines[:2] == [b"10000", b"2147483649"], r
        assert lines[2] == lines[3], r
        attack("snapshot 10,000 directories, a 2 GiB hole, 60 links to 8 MiB", "container",
               f"{stored >> 20} MiB stored; edge descriptors {before} -> {after}")  # fmt: skip
    finally:
        await attacker.destroy([sb])


async def test_a_tree_deeper_than_any_walk_is_refused_and_leaves_nothing(
    platform, attacker, attack
):
    """2,000 nested directories (a walk of them once recursed past Python's limit, and its
    half-done work stayed in the store for ever): snapshot and fs_diff are refused with a
    typed error; nothing is left in the store; the sandbox goes on and is removed whole."""
    sb = await one(attacker)
    try:
        await sb.exec(
            "i=0; while [ $i -lt 2000 ]; do mkdir d && cd d; i=$((i+1)); done", timeout=120
        )
        for op in (sb.snapshot, sb.fs_diff):
            with pytest.raises(errors.InvalidArgument, match="deeper than"):
                await op()
        leftovers = [p.name for p in (platform.store / "snapshots").iterdir()
                     if p.name.startswith(".")]  # fmt: skip
        assert leftovers == [], leftovers
        assert (await sb.exec("echo still")).stdout == b"still\n"
        attack("snapshot and fs_diff of 2,000 nested directories", "container",
               "invalid_argument (deeper than 512); nothing left behind")  # fmt: skip
    finally:
        await attacker.destroy([sb])
    assert not sandbox_dir(platform, sb.id).exists()


async def test_concurrent_publishes_name_no_host_path(platform, attacker, attack):
    sb = await one(attacker)
    try:
        await sb.exec("echo x > /x")
        snap = await sb.snapshot()
        results = await asyncio.gather(
            *(attacker.publish(snap, kind="workspace", name=f"pub{i}", version="1")
              for i in range(3)),
            return_exceptions=True,
        )  # fmt: skip
        text = " ".join(str(r) for r in results)
        assert "/tmp" not in text and str(platform.cluster.state_dir) not in text, text
        assert all(not isinstance(r, Exception) for r in results), results
        attack("three publishes of one snapshot at once", "container",
               "all published; no host path or pid in any answer")  # fmt: skip
    finally:
        await attacker.destroy([sb])


# -- item 10: a lost sandbox releases what it held ------------------------------------------


async def test_a_lost_sandbox_releases_everything_at_once(platform, attacker, attack):
    sb = await one(attacker)
    d = sandbox_dir(platform, sb.id)
    pid = init_pid(platform, sb.id)
    await sb.exec("dd if=/dev/zero of=/big bs=1M count=50")
    os.kill(pid, signal.SIGKILL)
    await wait_lost(attacker, sb)
    for _ in range(100):
        cgroups = list(Path("/sys/fs/cgroup/memory").rglob(sb.id))
        if not d.exists() and not cgroups:
            break
        await asyncio.sleep(0.1)
    assert not d.exists() and not cgroups, "its files and cgroups are released"
    claims = [os.readlink(p) for p in Path("/run/dsec/userns").iterdir()]
    assert not any(c.endswith(sb.id) for c in claims), "its uid range is released"
    with pytest.raises(errors.SandboxLost):
        await sb.exec("true")
    await attacker.destroy([sb])  # still accepted
    attack("a lost sandbox keeps its files, cgroups, holds", "container", "released at once")


# -- item 11: the caller's environment never reaches the host side --------------------------


async def test_the_callers_env_reaches_only_the_command(platform, attacker, attack):
    sb = await one(attacker)
    try:
        env = {"LD_PRELOAD": "/tmp/evil.so", "LD_LIBRARY_PATH": "/tmp", "PATH": "/bin"}
        running = asyncio.ensure_future(sb.exec("echo $LD_PRELOAD; sleep 2", env=env))
        await asyncio.sleep(1)
        helpers = []
        for p in Path("/proc").iterdir():
            try:
                if p.name.isdigit() and "dsec-sandbox" in os.readlink(p / "exe"):
                    helpers.append((p / "environ").read_bytes())
            except OSError:
                continue
        r = await running
        assert r.stdout.startswith(b"/tmp/evil.so")
        assert helpers and all(e == b"" for e in helpers), "host-side helpers see no env"
        attack("LD_PRELOAD in a command's env", "container", "applied inside only")
    finally:
        await attacker.destroy([sb])


# -- the classic escapes --------------------------------------------------------------------

_CLASSICS = {
    "mount a tmpfs": "mkdir -p /m && mount -t tmpfs x /m",
    "unshare a user namespace": "unshare -U -r id",
    "unshare a mount namespace": "unshare -m true",
    "enter init's mount namespace": "nsenter -t 1 -m true",
    "write a host sysctl": "echo 1 > /proc/sys/kernel/sysrq",
    "sysrq": "echo b > /proc/sysrq-trigger",
    "make a block device": "mknod /dev/sdx b 8 0",
    "read the host's disk": "head -c 1 /dev/vda >/dev/null",
    "set the hostname": "hostname evil",
    "change an address": "ip addr add 10.9.9.9/32 dev lo",
    "load a module": "insmod /bin/busybox",
    "read /proc/1/root": "ls /proc/1/root/",
    "write uid_map": "echo '0 0 1' > /proc/self/uid_map",
    "pivot the root": "mkdir -p /j && pivot_root / /j",
    "list the kernel's keys": "test -s /proc/keys",
    "swap off": "swapoff /dev/zram0",
    "reboot": "reboot -f",
}


async def test_classic_escapes_fail(platform, attacker, victim, attack):
    sb = await one(attacker)
    other = await one(victim)
    await other.write_file("/secret", b"victim")
    try:
        for name, script in _CLASSICS.items():
            r = await sb.exec(script + " 2>&1; echo rc=$?")
            assert not r.stdout.rstrip().endswith(b"rc=0"), (name, r.stdout)
            attack(name, "container", r.stdout.decode(errors="replace").split("\n")[0][:60])
        r = await sb.exec("cat /proc/*/root/secret 2>/dev/null; find / -name secret 2>/dev/null")
        assert b"victim" not in r.stdout and b"/secret" not in r.stdout
        r = await sb.exec("kill -9 -1; echo after")  # kills the attacker's own processes only
        assert (await other.exec("cat /secret")).stdout == b"victim"
        r = await sb.exec(":(){ :|:& };: 2>/dev/null; sleep 3; echo contained", timeout=30)
        assert (await other.exec("echo ok")).stdout == b"ok\n"
        attack("fork bomb, kill -9 -1, the victim's files", "container", "contained")
    finally:
        await attacker.destroy([sb])
        await victim.destroy([other])
