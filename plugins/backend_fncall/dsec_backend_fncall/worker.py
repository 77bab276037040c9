"""One call's process: the worker, PID 1 of the call's namespaces, forked by the zygote.

It prepares the call's namespaces ahead of demand, then waits on its control socket for the
call's spec, prepares what needs root (the files overlay, the cgroup limits), closes every
fd but the call's stdio, limits itself, loads seccomp, becomes the call's uid and runs:

* ``python``: the code, in this warm interpreter. The control socket is closed first, so the
  code can send the platform nothing; its result is its wait status, which the zygote reads
  from the kernel (``wait4``) and reports.
* an argv: the program, ``posix_spawn``ed as PID 2; the worker (non-dumpable: the program,
  though of the same uid, cannot ptrace it, read its fds or memory) forwards signals, reaps,
  and reports the program's wait status on its control socket.

Either way the supervisor kills the call at its timeout unless the worker has really exited:
no word of the call's is taken for its end. Running the code in the worker itself, rather
than in a child of it, keeps the call one process: a second Python process per call faulted
~370 more pages copy-on-write here (~980 faults per call instead of ~590, +40 % of the
workers' CPU) and answered later, for no gain in what the code can reach.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import resource
import signal
import socket
import sys
import traceback
from typing import NoReturn

from dsec_kernel.linuxhost import syscalls

FILES_MOUNT = "/run/dsec-files"
#: signals the worker passes on to the call's process group
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip
#: exit status of a call that could not be started
CANNOT_START = 125
#: pseudo-terminals one call may open (in a devpts of its own)
PTYS = 64


def send_frame(sock: socket.socket, msg: dict) -> None:
    """Write one length-prefixed JSON frame on a (blocking) stream socket."""
    data = json.dumps(msg).encode()
    sock.sendall(len(data).to_bytes(8, "little") + data)


def recv_frame(sock: socket.socket) -> dict | None:
    """Read one frame; None at end of stream."""
    buf = bytearray()
    need = 8
    size = None
    while len(buf) < need:
        chunk = sock.recv(min(need - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
        if size is None and len(buf) >= 8:
            size = int.from_bytes(buf[:8], "little")
            need = 8 + size
    return json.loads(buf[8:])


# -- the worker ------------------------------------------------------------------------------


def worker_main(
    cfg: dict, uid: int, ctrl: socket.socket, fds: tuple[int, int, int], urgent: bool
) -> NoReturn:
    """The body of a worker (PID 1 of a new PID namespace, forked by the zygote). Never returns.

    ``urgent``: a call waits for it; otherwise it prepares at idle priority. An argv call
    ends with its report (``{"status", "cpu_s", "max_rss"}``) on ``ctrl``; a python call,
    and a worker that dies, with the zygote's report of the worker's own wait status.
    """
    status = CANNOT_START << 8
    try:
        os.setsid()  # no controlling terminal, whatever the zygote's ancestry had
        if not urgent:  # refilling the pool never competes with the calls being served
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        syscalls.set_pdeathsig(signal.SIGKILL)
        syscalls.set_dumpable(False)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)  # from here on, errors reach the caller's stderr
        limit_fds = _join_cgroups(cfg, uid)
        _close_fds_except({ctrl.fileno(), *limit_fds.values()})
        _prepare_namespaces(cfg)
        spec = recv_frame(ctrl)
        if spec is None:  # the pool is shrinking
            os._exit(0)
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        _files_overlay(spec.get("sandbox", ""))
        _set_cgroup_limits(limit_fds, spec["limits"], spec["tenant_group"])
        if spec["mode"] == "python":
            ctrl.close()  # nothing of the platform's is left within the code's reach
            _close_fds_except(set())
            _confine(cfg, spec, uid)
            os._exit(_run_python(spec["code"], spec["env"], cfg["stdlib_path"]))
        _confine(cfg, spec, uid)
        status = _run_argv(spec["argv"], spec["env"])
    except BaseException as exc:  # report, never fall back into the zygote's loop
        _say(f"dsec: cannot start the call: {exc}")
    try:
        _detach_stdio()
        me, kids = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        rss = max(me.ru_maxrss, kids.ru_maxrss) * 1024
        send_frame(ctrl, {"status": status, "cpu_s": cpu, "max_rss": rss})
        # the call is answered: tearing this process and its namespaces down can wait for
        # idle CPU instead of slowing the next call
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except BaseException:  # (no control socket: the zygote's report stands)
        os._exit(CANNOT_START)
    os._exit(0)


def _say(message: str) -> None:
    try:
        os.write(2, f"{message}\n".encode())
    except OSError:
        pass


def _detach_stdio() -> None:
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _join_cgroups(cfg: dict, uid: int) -> dict[str, int]:
    """Move this worker into its slot (one per uid, reused) in every hierarchy the supervisor
    prepared; return open fds of the v1 limit files to write when the call comes.

    Works through directory fds opened before the view was made read-only. The cgroup2 slot
    has no limits: it is how the supervisor kills the call (``cgroup.kill``)."""
    limits = {"memory": "memory.limit_in_bytes", "pids": "pids.max"}
    out = {}
    for controller, base_fd in cfg["cgroup_fds"].items():
        if controller == "cpu":  # joined per tenant when the call comes (_join_tenant)
            out[controller] = os.dup(base_fd)
            continue
        try:
            os.mkdir(str(uid), dir_fd=base_fd)
        except FileExistsError:
            pass
        slot = os.open(str(uid), os.O_RDONLY | os.O_DIRECTORY, dir_fd=base_fd)
        try:
            procs = os.open("cgroup.procs", os.O_WRONLY, dir_fd=slot)
            os.write(procs, str(os.getpid()).encode())
            os.close(procs)
            if controller in limits:
                out[controller] = os.open(limits[controller], os.O_WRONLY, dir_fd=slot)
        finally:
            os.close(slot)
    return out


def _set_cgroup_limits(fds: dict[str, int], lim: dict, tenant_group: str) -> None:
    """Limit the call as a whole: memory across all its processes, and their number; and
    share the CPU by tenant: the call joins its tenant's group in the cpu hierarchy (equal
    weights), so one tenant's busy calls together get one tenant's share, however many."""
    values = {"memory": lim["memory_bytes"], "pids": lim["processes"]}
    for controller, fd in fds.items():
        if controller == "cpu":
            _join_tenant(fd, tenant_group)
        else:
            os.write(fd, str(values[controller]).encode())
        os.close(fd)


def _join_tenant(cpu_fd: int, group: str) -> None:
    try:
        os.mkdir(group, dir_fd=cpu_fd)
    except FileExistsError:
        pass
    tenant = os.open(group, os.O_RDONLY | os.O_DIRECTORY, dir_fd=cpu_fd)
    try:
        procs = os.open("cgroup.procs", os.O_WRONLY, dir_fd=tenant)
        try:
            os.write(procs, str(os.getpid()).encode())
        finally:
            os.close(procs)
    finally:
        os.close(tenant)


def _close_fds_except(keep: set[int]) -> None:
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def _prepare_namespaces(cfg: dict) -> None:
    """Enter new namespaces and, still root, mount a private /tmp, /dev/shm, /dev/pts and
    /proc."""
    syscalls.unshare(
        syscalls.CLONE_NEWNS | syscalls.CLONE_NEWNET | syscalls.CLONE_NEWIPC | syscalls.CLONE_NEWUTS
    )
    fl = syscalls.MS_NOSUID | syscalls.MS_NODEV
    syscalls.mount("tmpfs", "/tmp", "tmpfs", fl, f"mode=1777,size={cfg['tmp_size_mb']}m")
    syscalls.mount("tmpfs", "/dev/shm", "tmpfs", fl, "mode=1777,size=16m")
    syscalls.mount("devpts", "/dev/pts", "devpts", syscalls.MS_NOSUID | syscalls.MS_NOEXEC,
                f"newinstance,ptmxmode=0666,mode=0620,max={PTYS}")  # fmt: skip
    syscalls.mount("proc", "/proc", "proc", fl | syscalls.MS_NOEXEC)
    syscalls.sethostname(cfg["hostname"])
    if cfg["loopback"]:
        syscalls.loopback_up()


def _files_overlay(sandbox: str) -> None:
    """Show the sandbox's files in /tmp, copy-on-write onto the call's own tmpfs."""
    lower = os.path.join(FILES_MOUNT, sandbox, "files")
    if not sandbox or not os.path.isdir(lower) or not os.listdir(lower):
        return
    os.mkdir("/tmp/.dsec-upper", 0o755)
    os.mkdir("/tmp/.dsec-work", 0o700)
    syscalls.mount(
        "overlay",
        "/tmp",
        "overlay",
        syscalls.MS_NOSUID | syscalls.MS_NODEV,
        f"lowerdir={lower},upperdir=/tmp/.dsec-upper,workdir=/tmp/.dsec-work",
    )


# -- the call ---------------------------------------------------------------------------------


def _confine(cfg: dict, spec: dict, uid: int) -> None:
    """rlimits, seccomp, then the call's uid, and its working directory entered as that uid:
    never an unprivileged moment without the filter (a process that could be ptraced
    meanwhile), never root with untrusted code."""
    lim = spec["limits"]
    for res, value in (
        (resource.RLIMIT_AS, lim["memory_bytes"]),
        (resource.RLIMIT_NPROC, lim["processes"]),
        (resource.RLIMIT_FSIZE, lim["file_size_bytes"]),
        (resource.RLIMIT_NOFILE, lim["open_files"]),
        (resource.RLIMIT_CPU, lim["cpu_seconds"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))
    syscalls.unshare(syscalls.CLONE_NEWCGROUP)  # its cgroup is its /: no host cgroup path shows
    syscalls.set_no_new_privs()
    syscalls.load_seccomp(cfg["bpf"])
    os.setgroups([])
    gid = cfg["uid_base"] - 1  # every call shares the sandbox group, which owns its files
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    syscalls.set_dumpable(False)  # a uid change may leave it dumpable (fs.suid_dumpable)
    os.chdir(spec.get("cwd") or "/tmp")  # as the call's uid: its permissions apply


def _run_python(code: str, env: dict, stdlib_path: list[str]) -> int:
    """Run ``code`` as ``__main__`` in this (single-use) interpreter; returns the exit code.

    ``sys.stdin/stdout/stderr`` are the zygote's own (UTF-8, empty buffers), created once: in
    the call they read and write fds 0-2, which are the call's pipes. Tracebacks start in
    the call's code (no frame of the platform's, nor its paths).
    """
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = stdlib_path
    sys.argv[:] = ["-c"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(128 + signal.SIGHUP))
    status = 0
    try:
        exec(compile(code, "<fncall>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as exc:
        if exc.code is None:
            status = 0
        elif isinstance(exc.code, int):
            status = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return status


def _run_argv(argv: list[str], env: dict) -> int:
    """Start the program as PID 2 (posix_spawn: no page-table copy); as PID 1, forward
    signals and reap. Returns its wait status; a missing program exits 127."""
    try:
        pid = os.posix_spawnp(
            argv[0],
            argv,
            env,
            setsid=True,
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM),
        )
    except OSError as exc:
        _say(f"dsec: cannot run {argv[0]!r}: {exc.strerror}")
        return (127 if exc.errno == errno.ENOENT else 126) << 8
    _detach_stdio()  # the call's output ends when the program's processes end

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return CANNOT_START << 8
        if reaped == pid:
            return status
