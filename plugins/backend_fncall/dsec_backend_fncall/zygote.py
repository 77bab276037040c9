"""The zygote: a minimal interpreter that forks pre-isolated workers, one per call.

Runs as ``python -S -I`` (standard library only, so forks are cheap) in a mount namespace of
its own that holds the *sandbox view*: the host root read-only and nosuid, with private
directories (``/root``, ``/home``, ``/run``...) hidden under empty tmpfs, the interpreter's own
tree bound back, and the sandboxes' directory bound at ``/run/dsec-files`` (mode 0700: a call,
running as its own unprivileged uid, sees only its own sandbox's files, through ``/tmp``).

Protocol with the supervisor, over a SOCK_SEQPACKET socket (one JSON message each)::

    -> the configuration                        first, once (never on the command line,
                                                which every call could read in /proc/1/cmdline)
    -> {"op": "spawn", "urgent": bool}          start one worker (urgent: a call waits for it)
    <- {"op": "ready", "wid", "uid"}            + fds: ctrl, stdin(w), stdout(r), stderr(r), pidfd
    <- {"op": "exit", "wid", "status", "cpu_s", "max_rss"}   a worker ended (raw wait status)
    <- {"op": "error", "message"}               a spawn failed

A worker (:mod:`dsec_backend_fncall.worker`) is PID 1 of new PID, mount, network, IPC and UTS
namespaces; it runs one call and exits. Its ``exit`` message carries the wait status the
kernel gives the zygote: for a python call, that is the call's result. Killing a worker
kills everything the call started (the PID namespace dies with its PID 1).
"""

from __future__ import annotations

import array
import gc
import json
import os
import selectors
import signal
import socket
from collections import deque

from dsec_backend_fncall.worker import FILES_MOUNT, worker_main
from dsec_kernel import linux

#: run with ``python -S -I -c BOOT SOCKET_FD``: reads the configuration from the socket, puts
#: the plugin on sys.path, remembers the standard library path for calls, starts :func:`main`.
BOOT = (
    "import faulthandler, json, socket, sys; faulthandler.enable(); "
    "sock = socket.socket(fileno=int(sys.argv[1])); cfg = json.loads(sock.recv(1 << 20)); "
    "cfg['stdlib_path'] = list(sys.path); sys.path[:0] = cfg['sys_path']; "
    "from dsec_backend_fncall.zygote import main; main(sock, cfg)"
)
_MAX_MSG = 1 << 20


def _send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:  # type: ignore[assignment]
    data = json.dumps(msg).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


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


# -- the zygote loop -------------------------------------------------------------------------


class Zygote:
    def __init__(self, cfg: dict, sock: socket.socket) -> None:
        self.cfg = cfg
        self.sock = sock
        # first in, first out: a uid (and its cgroup slot) is reused as late as possible
        self.free_uids = deque(range(cfg["uid_base"], cfg["uid_base"] + cfg["uid_count"]))
        self.workers: dict[int, tuple[int, int]] = {}  # pid -> (wid, uid)
        self.next_wid = 0
        self.pidns = os.open("/proc/self/ns/pid", os.O_RDONLY)

    def spawn(self, urgent: bool) -> None:
        """Fork one worker. It prepares at idle priority, so refilling the pool never slows the
        calls being served, unless ``urgent`` (a call waits for it). The zygote itself runs at
        normal priority: it reports the exits of python calls."""
        if not self.free_uids:
            _send(self.sock, {"op": "error", "message": "no free sandbox uid; raise uid_count"})
            return
        uid = self.free_uids.popleft()
        ctrl_parent, ctrl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            linux.unshare(linux.CLONE_NEWPID)  # the next child is PID 1 of a new namespace
            pid = os.fork()
        except OSError as exc:
            linux.setns(self.pidns, linux.CLONE_NEWPID)
            self.free_uids.appendleft(uid)
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
            self.workers.clear()  # other workers' host pids are none of the call's business
            worker_main(self.cfg, uid, ctrl_child, (in_r, out_w, err_w), urgent)
        linux.setns(self.pidns, linux.CLONE_NEWPID)  # back to making children in our own
        ctrl_child.close()
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        wid = self.next_wid
        self.next_wid += 1
        self.workers[pid] = (wid, uid)
        fds = [ctrl_parent.fileno(), in_w, out_r, err_r, pidfd]
        _send(self.sock, {"op": "ready", "wid": wid, "uid": uid}, fds)
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


def main(sock: socket.socket, cfg: dict) -> None:
    """Entry (see :data:`BOOT`): build the view and serve the supervisor on ``sock``.

    What only the zygote needs (host paths, the supervisor's pid) is dropped from ``cfg``
    before any worker is forked: workers and calls inherit this process's memory."""
    linux.set_pdeathsig(signal.SIGKILL)
    if os.getppid() != cfg.pop("supervisor_pid"):
        os._exit(1)
    cfg["bpf"] = bytes.fromhex(cfg.pop("bpf_hex"))
    cfg["cgroup_fds"] = {  # opened before the view makes /sys/fs/cgroup read-only
        c: os.open(path, os.O_RDONLY | os.O_DIRECTORY) for c, path in cfg.pop("cgroups").items()
    }
    build_view(cfg.pop("masks"), cfg.pop("keep"), cfg.pop("files_root"))
    try:
        Zygote(cfg, sock).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the supervisor is gone; PDEATHSIG takes the workers
