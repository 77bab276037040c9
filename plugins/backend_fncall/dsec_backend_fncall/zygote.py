"""The zygote: a minimal interpreter that forks pre-isolated workers, one per call.

Runs as ``python -S -I`` (standard library only, so forks are cheap) in a mount namespace of
its own whose root is the *sandbox view* (:func:`build_view`): only the host's programs and
libraries, a few of its ``/etc`` entries and the interpreter's own tree, read-only; a
``/dev`` of its own; the sandboxes' directory at ``/run/dsec-files`` (mode 0700: a call,
running as its own unprivileged uid, sees only its own sandbox's files, through ``/tmp``).
Nothing else of the host is in it: what is not named is not there.

Protocol with the supervisor, over a SOCK_SEQPACKET socket (one JSON message each)::

    -> the configuration                        first, once (never on the command line,
                                                which every call could read in /proc/1/cmdline)
    -> {"op": "spawn", "urgent": bool}          start one worker (urgent: a call waits for it)
    <- {"op": "ready", "wid", "uid", "urgent"}  + fds: ctrl, stdin(w), stdout(r), stderr(r), pidfd
    <- {"op": "exit", "wid", "status", "cpu_s", "max_rss"}   a worker ended (raw wait status)
    <- {"op": "error", "message", "urgent"}     a spawn failed

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
import stat
from collections import deque

from dsec_backend_fncall.worker import FILES_MOUNT, worker_main
from dsec_kernel.linuxhost import syscalls

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

#: the view's /dev: character devices (name, major, minor), mode 0666; workers mount a devpts
#: of their own on /dev/pts and a tmpfs on /dev/shm
DEVICES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9),
           ("tty", 5, 0))  # fmt: skip
_DEV_LINKS = {"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
              "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"}  # fmt: skip
#: where the view is put together, in the zygote's own mount namespace (its sources are held
#: open first, so a source below it is not hidden by it)
_STAGE = "/tmp"
_RO = syscalls.MOUNT_ATTR_RDONLY | syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV


def _bind_fd(fd: int, target: str) -> None:
    syscalls.mount(f"/proc/self/fd/{fd}", target, None, syscalls.MS_BIND | syscalls.MS_REC)


def _covered(path: str, by: list[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in by)


def build_view(
    paths: list[str],
    etc: list[str],
    keep: list[str],
    hide: list[str],
    files_root: str,
    hostname: str,
) -> None:
    """Make a new mount namespace whose root is the sandbox view, and enter it (chdir "/").

    The view holds ``paths`` (absolute; one that is a symlink, as merged-/usr's /bin, is made
    the same symlink) and ``keep`` (the interpreter's tree: where not within ``paths``), each
    bound from the host read-only, nosuid and nodev; an ``/etc`` of its own with only the
    host's entries named in ``etc`` (the host's /etc holds what no call should read: an
    index's credentials in pip.conf, say) and ``hostname`` saying ``hostname``; ``hide`` (the
    platform's own paths, where they lie within those) under empty tmpfs; ``/dev`` with
    :data:`DEVICES` only; ``files_root`` at :data:`~dsec_backend_fncall.worker.FILES_MOUNT`;
    empty ``/proc``, ``/sys``, ``/tmp`` and ``/run`` to mount on. The host's root is
    detached: nothing but these is reachable.
    """
    syscalls.unshare(syscalls.CLONE_NEWNS)
    syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)
    os.chdir("/")
    entries = [f"/etc/{name}" for name in etc]
    links = {p: os.readlink(p) for p in [*paths, *entries] if os.path.islink(p)}
    binds = [p for p in [*paths, *entries] if p not in links and os.path.exists(p)]
    binds += [k for k in keep if os.path.isdir(k) and not _covered(k, binds)]
    fds = {p: os.open(p, os.O_PATH) for p in binds}
    files_fd = os.open(files_root, os.O_PATH | os.O_DIRECTORY)
    syscalls.mount(
        "tmpfs", _STAGE, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV, "mode=0755,size=1m"
    )
    root = _STAGE
    for path, target in links.items():
        os.makedirs(root + os.path.dirname(path), mode=0o755, exist_ok=True)
        os.symlink(target, root + path)
    os.makedirs(root + "/etc", mode=0o755, exist_ok=True)
    for path, fd in fds.items():
        os.makedirs(root + os.path.dirname(path), mode=0o755, exist_ok=True)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.makedirs(root + path, mode=0o755, exist_ok=True)
        else:  # a file of /etc: bound onto a file
            os.close(os.open(root + path, os.O_CREAT | os.O_WRONLY, 0o644))
        _bind_fd(fd, root + path)
        syscalls.mount_setattr(root + path, _RO)
        os.close(fd)
    with open(root + "/etc/hostname", "w") as f:
        f.write(hostname + "\n")
    for d, mode in (("proc", 0o555), ("sys", 0o555), ("tmp", 0o1777), ("run", 0o755)):
        os.makedirs(f"{root}/{d}", exist_ok=True)
        os.chmod(f"{root}/{d}", mode)
    os.mkdir(root + FILES_MOUNT, 0o700)
    _bind_fd(files_fd, root + FILES_MOUNT)
    syscalls.mount_setattr(root + FILES_MOUNT, _RO | syscalls.MOUNT_ATTR_NOEXEC)
    os.close(files_fd)
    for h in hide:
        if os.path.isdir(root + h) and not os.path.islink(root + h):
            syscalls.mount("tmpfs", root + h, "tmpfs", syscalls.MS_RDONLY, "size=0")
    _make_dev(root + "/dev")
    syscalls.mount_setattr(
        root, syscalls.MOUNT_ATTR_RDONLY | syscalls.MOUNT_ATTR_NOSUID, recursive=False
    )
    os.chdir(root)
    syscalls.pivot_root(".", ".")
    syscalls.umount(".", syscalls.MNT_DETACH)
    os.chdir("/")


def _make_dev(dev: str) -> None:
    os.makedirs(dev, exist_ok=True)
    syscalls.mount(
        "tmpfs", dev, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NOEXEC, "mode=0755,size=64k"
    )
    for name, major, minor in DEVICES:
        os.mknod(f"{dev}/{name}", stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(f"{dev}/{name}", 0o666)  # (the umask applies to mknod)
    for d in ("pts", "shm"):
        os.mkdir(f"{dev}/{d}", 0o755)
    for name, target in _DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    syscalls.mount_setattr(
        dev, syscalls.MOUNT_ATTR_RDONLY | syscalls.MOUNT_ATTR_NOSUID, recursive=False
    )


# -- the zygote loop -------------------------------------------------------------------------


class Zygote:
    def __init__(self, cfg: dict, sock: socket.socket, pidns: int) -> None:
        self.cfg = cfg
        self.sock = sock
        # first in, first out: a uid (and its cgroup slot) is reused as late as possible
        self.free_uids = deque(range(cfg["uid_base"], cfg["uid_base"] + cfg["uid_count"]))
        self.workers: dict[int, tuple[int, int]] = {}  # pid -> (wid, uid)
        self.next_wid = 0
        self.pidns = pidns  # (the view has no /proc of its own: workers mount theirs)

    def spawn(self, urgent: bool) -> None:
        """Fork one worker. It prepares at idle priority, so refilling the pool never slows the
        calls being served, unless ``urgent`` (a call waits for it). The zygote itself runs at
        normal priority: it reports the exits of python calls."""
        if not self.free_uids:
            message = "no free sandbox uid; raise uid_count"
            _send(self.sock, {"op": "error", "message": message, "urgent": urgent})
            return
        uid = self.free_uids.popleft()
        ctrl_parent, ctrl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            syscalls.unshare(syscalls.CLONE_NEWPID)  # the next child is PID 1 of a new namespace
            pid = os.fork()
        except OSError as exc:
            syscalls.setns(self.pidns, syscalls.CLONE_NEWPID)
            self.free_uids.appendleft(uid)
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            ctrl_parent.close()
            ctrl_child.close()
            message = f"cannot start a worker: {exc}"
            _send(self.sock, {"op": "error", "message": message, "urgent": urgent})
            return
        if pid == 0:
            self.sock.close()
            ctrl_parent.close()
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            self.workers.clear()  # other workers' host pids are none of the call's business
            worker_main(self.cfg, uid, ctrl_child, (in_r, out_w, err_w), urgent)
        syscalls.setns(self.pidns, syscalls.CLONE_NEWPID)  # back to making children in our own
        ctrl_child.close()
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        wid = self.next_wid
        self.next_wid += 1
        self.workers[pid] = (wid, uid)
        fds = [ctrl_parent.fileno(), in_w, out_r, err_r, pidfd]
        _send(self.sock, {"op": "ready", "wid": wid, "uid": uid, "urgent": urgent}, fds)
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
    syscalls.set_pdeathsig(signal.SIGKILL)
    if os.getppid() != cfg.pop("supervisor_pid"):
        os._exit(1)
    cfg["bpf"] = bytes.fromhex(cfg.pop("bpf_hex"))
    cfg["cgroup_fds"] = {  # opened before the view makes /sys/fs/cgroup read-only
        c: os.open(path, os.O_RDONLY | os.O_DIRECTORY) for c, path in cfg.pop("cgroups").items()
    }
    pidns = os.open("/proc/self/ns/pid", os.O_RDONLY)
    build_view(
        cfg.pop("view_paths"), cfg.pop("view_etc"), cfg.pop("keep"), cfg.pop("hide"),
        cfg.pop("files_root"), cfg["hostname"],
    )  # fmt: skip
    try:
        Zygote(cfg, sock, pidns).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the supervisor is gone; PDEATHSIG takes the workers
