"""The zygote: a minimal interpreter that forks pre-isolated workers, one per call.

Runs as ``python -S -I`` (standard library only, so forks are cheap) in a mount namespace of
its own that holds the *sandbox view*: the host root read-only and nosuid, with private
directories (``/root``, ``/home``, ``/run``...) hidden under empty tmpfs, the interpreter's own
tree bound back, and the sandboxes' directory bound at ``/run/dsec-files`` (mode 0700: a call,
running as its own unprivileged uid, sees only its own sandbox's files, through ``/tmp``).

Protocol with the supervisor, over a SOCK_SEQPACKET socket (one JSON message each)::

    -> {"op": "spawn", "urgent": bool}          start one worker (urgent: a call waits for it)
    <- {"op": "ready", "wid", "pid", "uid"}     + fds: ctrl, stdin(w), stdout(r), stderr(r), pidfd
    <- {"op": "exit", "wid", "status", "cpu_s", "max_rss"}   a worker ended (raw wait status)
    <- {"op": "error", "message"}               a spawn failed

A worker is PID 1 of new PID, mount, network, IPC and UTS namespaces, with a fresh tmpfs on
``/tmp`` and ``/dev/shm`` and its own ``/proc``; its network namespace has no interface up
(``lo`` only when configured). It waits on its ctrl socket for one call (see :func:`_worker`),
runs it as an unprivileged uid of its own (group ``uid_base - 1``, which owns sandboxes'
files) under rlimits, a memory and pids cgroup (when the host has cgroup v1 ones) and
seccomp, and exits. Killing it
kills everything the call started (the PID namespace dies with its PID 1).
"""

from __future__ import annotations

import array
import builtins
import errno
import gc
import json
import os
import resource
import selectors
import signal
import socket
import sys
import traceback

from dsec_kernel import linux

FILES_MOUNT = "/run/dsec-files"

#: run with ``python -S -I -c BOOT CONFIG_JSON``: puts the plugin on sys.path, remembers the
#: standard library path for calls, and starts :func:`main`.
BOOT = (
    "import faulthandler, json, sys; faulthandler.enable(); cfg = json.loads(sys.argv[1]); "
    "cfg['stdlib_path'] = list(sys.path); "
    "sys.path[:0] = cfg['sys_path']; from dsec_backend_fncall.zygote import main; main(cfg)"
)
_MAX_MSG = 1 << 20


def _send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:  # type: ignore[assignment]
    data = json.dumps(msg).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


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


# -- the sandbox view ------------------------------------------------------------------------


def _bind_fd(fd: int, target: str) -> None:
    linux.mount(f"/proc/self/fd/{fd}", target, None, linux.MS_BIND | linux.MS_REC)


def build_view(masks: list[str], keep: list[str], files_root: str) -> None:
    """Turn this process's (new) mount namespace into the sandbox view. ``/run`` is always
    masked: the files mount point is made inside that tmpfs, never on the host."""
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    masks = [m for m in dict.fromkeys(os.path.realpath(m) for m in [*masks, "/run"]) if m != "/"]
    keep_fds = {p: os.open(p, os.O_PATH) for p in keep if os.path.exists(p)}
    files_fd = os.open(files_root, os.O_PATH | os.O_DIRECTORY)
    # every worker copies this mount table and tears its copy down: drop what calls never
    # see (mounts below masked directories, the host's cgroup hierarchies)
    _detach_below([*masks, "/sys/fs/cgroup"], keep=[*keep_fds, files_root])
    for mask in masks:
        if not os.path.isdir(mask):
            continue
        linux.mount("tmpfs", mask, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "mode=0755,size=1m")
        for path, fd in keep_fds.items():
            if path.startswith(mask.rstrip("/") + "/"):
                os.makedirs(path, mode=0o755, exist_ok=True)
                _bind_fd(fd, path)
    os.makedirs(FILES_MOUNT, mode=0o700, exist_ok=True)
    _bind_fd(files_fd, FILES_MOUNT)
    for fd in [*keep_fds.values(), files_fd]:
        os.close(fd)
    linux.mount_setattr("/", linux.MOUNT_ATTR_RDONLY | linux.MOUNT_ATTR_NOSUID)


def _detach_below(tops: list[str], keep: list[str]) -> None:
    """Detach every mount at or below ``tops`` (the tops themselves only if they are not
    masked again right after), deepest first, except those holding a ``keep`` path."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    keep_real = [os.path.realpath(k) for k in keep]

    def below(point: str, top: str) -> bool:
        return point == top or point.startswith(top.rstrip("/") + "/")

    for point in sorted(set(points), key=len, reverse=True):
        if any(below(point, t) for t in tops) and not any(below(k, point) for k in keep_real):
            try:
                linux.umount(point, linux.MNT_DETACH)
            except OSError:
                pass


# -- one worker ------------------------------------------------------------------------------


def _prepare_worker(cfg: dict) -> None:
    """Enter new namespaces and, still root, mount a private /tmp, /dev/shm and /proc."""
    linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWNET | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS)
    fl = linux.MS_NOSUID | linux.MS_NODEV
    linux.mount("tmpfs", "/tmp", "tmpfs", fl, f"mode=1777,size={cfg['tmp_size_mb']}m")
    linux.mount("tmpfs", "/dev/shm", "tmpfs", fl, "mode=1777,size=16m")
    linux.mount("proc", "/proc", "proc", fl | linux.MS_NOEXEC)
    linux.sethostname(cfg["hostname"])
    if cfg["loopback"]:
        linux.loopback_up()


def _files_overlay(sandbox: str) -> None:
    """Show the sandbox's files in /tmp, copy-on-write onto the call's own tmpfs."""
    lower = os.path.join(FILES_MOUNT, sandbox, "files")
    if not sandbox or not os.path.isdir(lower) or not os.listdir(lower):
        return
    os.mkdir("/tmp/.dsec-upper", 0o755)
    os.mkdir("/tmp/.dsec-work", 0o700)
    linux.mount(
        "overlay",
        "/tmp",
        "overlay",
        linux.MS_NOSUID | linux.MS_NODEV,
        f"lowerdir={lower},upperdir=/tmp/.dsec-upper,workdir=/tmp/.dsec-work",
    )


def _join_cgroup(cfg: dict, uid: int) -> dict[str, int]:
    """Move this worker into its slot's cgroup (one per uid, reused) in each hierarchy the
    supervisor prepared; return open fds of the limit files to write when the call comes.

    Works through directory fds opened before the view was made read-only."""
    limits = {"memory": "memory.limit_in_bytes", "pids": "pids.max"}
    out = {}
    for controller, base_fd in cfg["cgroup_fds"].items():
        try:
            os.mkdir(str(uid), dir_fd=base_fd)
        except FileExistsError:
            pass
        slot = os.open(str(uid), os.O_RDONLY | os.O_DIRECTORY, dir_fd=base_fd)
        try:
            procs = os.open("cgroup.procs", os.O_WRONLY, dir_fd=slot)
            os.write(procs, str(os.getpid()).encode())
            os.close(procs)
            out[controller] = os.open(limits[controller], os.O_WRONLY, dir_fd=slot)
        finally:
            os.close(slot)
    return out


def _set_cgroup_limits(fds: dict[str, int], lim: dict) -> None:
    """Limit the call as a whole: memory across all its processes, and their number."""
    values = {"memory": lim["memory_bytes"], "pids": lim["processes"]}
    for controller, fd in fds.items():
        os.write(fd, str(values[controller]).encode())
        os.close(fd)


def _close_fds_except(keep: set[int]) -> None:
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def _drop_privileges(cfg: dict, spec: dict, uid: int) -> None:
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
    os.setgroups([])
    gid = cfg["uid_base"] - 1  # every call shares the sandbox group, which owns its files
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    linux.set_no_new_privs()
    linux.load_seccomp(cfg["bpf"])


def _run_python(code: str, env: dict, stdlib_path: list[str]) -> int:
    """Run ``code`` as ``__main__`` in this (single-use) interpreter; returns the exit code.

    ``sys.stdin/stdout/stderr`` are the zygote's own (UTF-8, empty buffers), created once: in
    the worker they read and write fds 0-2, which are the call's pipes.
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
    except BaseException:
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return status


def _run_argv(argv: list[str], env: dict) -> int:
    """Start the program as PID 2 (posix_spawn: no page-table copy); as PID 1, forward
    signals and reap. Returns its wait status."""
    try:
        pid = os.posix_spawnp(
            argv[0],
            argv,
            env,
            setsid=True,
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM),
        )
    except OSError as exc:
        os.write(2, f"dsec: cannot run {argv[0]!r}: {exc.strerror}\n".encode())
        return (127 if exc.errno == errno.ENOENT else 126) << 8
    linux.set_dumpable(False)  # the program (same uid) cannot reach this process's fds
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
    ):
        signal.signal(sig, forward)
    while True:
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        if reaped == pid:
            return status


def _worker(cfg: dict, uid: int, ctrl: socket.socket, fds: tuple[int, int, int]) -> None:
    """The body of a worker process. Never returns.

    Ends by closing the call's stdout/stderr and sending ``{"status", "cpu_s", "max_rss"}``
    (a wait status) on ``ctrl``, so the supervisor can answer before the namespaces are torn
    down; the zygote's own exit report covers a worker that dies without sending it.
    """
    status = 125 << 8
    try:
        linux.set_pdeathsig(signal.SIGKILL)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)  # from here on, errors reach the caller's stderr
        limit_fds = _join_cgroup(cfg, uid)
        _close_fds_except({ctrl.fileno(), *limit_fds.values()})
        _prepare_worker(cfg)
        spec = recv_frame(ctrl)
        if spec is None:  # the pool is shrinking
            os._exit(0)
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # spawned idle; runs normal
        _files_overlay(spec.get("sandbox", ""))
        _set_cgroup_limits(limit_fds, spec["limits"])
        _drop_privileges(cfg, spec, uid)
        os.chdir(spec.get("cwd") or "/tmp")  # as the call's uid: its permissions apply
        if spec["mode"] == "python":
            status = _run_python(spec["code"], spec["env"], cfg["stdlib_path"]) << 8
        else:
            status = _run_argv(spec["argv"], spec["env"])
    except BaseException as exc:  # report, never fall back into the zygote's loop
        try:
            os.write(2, f"dsec: cannot start the call: {exc}\n".encode())
        except OSError:
            pass
    try:
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        me, kids = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
        send_frame(
            ctrl,
            {"status": status, "cpu_s": cpu, "max_rss": max(me.ru_maxrss, kids.ru_maxrss) * 1024},
        )
        # the call is answered: tearing this process and its namespaces down can wait for
        # idle CPU instead of slowing the next call
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except BaseException:
        pass
    os._exit(0)


# -- the zygote loop -------------------------------------------------------------------------


class Zygote:
    def __init__(self, cfg: dict, sock: socket.socket) -> None:
        self.cfg = cfg
        self.sock = sock
        self.free_uids = list(
            range(cfg["uid_base"] + cfg["uid_count"] - 1, cfg["uid_base"] - 1, -1)
        )
        self.workers: dict[int, tuple[int, int]] = {}  # pid -> (wid, uid)
        self.next_wid = 0
        self.pidns = os.open("/proc/self/ns/pid", os.O_RDONLY)

    def spawn(self, urgent: bool) -> None:
        """Fork one worker. The zygote runs SCHED_IDLE, so refilling the pool never slows the
        calls being served; a worker a call already waits for is made at normal priority."""
        if urgent:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        try:
            self._spawn()
        finally:
            if urgent:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    def _spawn(self) -> None:
        if not self.free_uids:
            _send(self.sock, {"op": "error", "message": "no free sandbox uid; raise uid_count"})
            return
        uid = self.free_uids.pop()
        ctrl_parent, ctrl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            linux.unshare(linux.CLONE_NEWPID)  # the next child is PID 1 of a new namespace
            pid = os.fork()
        except OSError as exc:
            linux.setns(self.pidns, linux.CLONE_NEWPID)
            self.free_uids.append(uid)
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            ctrl_parent.close()
            ctrl_child.close()
            _send(self.sock, {"op": "error", "message": f"cannot start a worker: {exc}"})
            return
        if pid == 0:
            self.sock.close()
            ctrl_parent.close()
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            _worker(self.cfg, uid, ctrl_child, (in_r, out_w, err_w))
        linux.setns(self.pidns, linux.CLONE_NEWPID)  # back to making children in our own
        ctrl_child.close()
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        wid = self.next_wid
        self.next_wid += 1
        self.workers[pid] = (wid, uid)
        fds = [ctrl_parent.fileno(), in_w, out_r, err_r, pidfd]
        _send(self.sock, {"op": "ready", "wid": wid, "pid": pid, "uid": uid}, fds)
        ctrl_parent.close()
        for fd in (in_w, out_r, err_r, pidfd):
            os.close(fd)

    def reap(self) -> None:
        while True:
            try:
                pid, status, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            wid, uid = self.workers.pop(pid, (None, None))
            if wid is None:
                continue
            self.free_uids.append(uid)
            _send(
                self.sock,
                {
                    "op": "exit",
                    "wid": wid,
                    "status": status,
                    "cpu_s": ru.ru_utime + ru.ru_stime,
                    "max_rss": ru.ru_maxrss * 1024,
                },
            )

    def serve(self) -> None:
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        sel.register(rfd, selectors.EVENT_READ)
        gc.freeze()
        while True:
            for key, _ in sel.select():
                if key.fileobj == rfd:
                    while True:
                        try:
                            if not os.read(rfd, 512):
                                break
                        except BlockingIOError:
                            break
                    self.reap()
                    continue
                data = self.sock.recv(_MAX_MSG)
                if not data:
                    return  # the supervisor is gone; PDEATHSIG takes the workers
                msg = json.loads(data)
                if msg["op"] == "spawn":
                    self.spawn(msg.get("urgent", False))


def main(cfg: dict) -> None:
    """Entry (see :data:`BOOT`): serve the supervisor on fd ``cfg["sock_fd"]``."""
    sock = socket.socket(fileno=cfg["sock_fd"])
    cfg["bpf"] = bytes.fromhex(cfg.pop("bpf_hex"))
    cfg["cgroup_fds"] = {  # opened before the view makes /sys/fs/cgroup read-only
        c: os.open(path, os.O_RDONLY | os.O_DIRECTORY) for c, path in cfg["cgroups"].items()
    }
    linux.set_pdeathsig(signal.SIGKILL)
    if os.getppid() != cfg["supervisor_pid"]:
        os._exit(1)
    build_view(cfg["masks"], cfg["keep"], cfg["files_root"])
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # refills yield to calls
    try:
        Zygote(cfg, sock).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the supervisor is gone; PDEATHSIG takes the workers
