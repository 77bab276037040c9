"""Thin ctypes wrappers over the Linux calls that sandbox backends need.

Standard library only, so a minimal interpreter (``python -S``) can import it. Every function
raises :class:`OSError` with the failing call and path on error.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

__all__ = [
    "CLONE_NEWCGROUP",
    "CLONE_NEWIPC",
    "CLONE_NEWNET",
    "CLONE_NEWNS",
    "CLONE_NEWPID",
    "CLONE_NEWUTS",
    "MNT_DETACH",
    "MOUNT_ATTR_NODEV",
    "MOUNT_ATTR_NOEXEC",
    "MOUNT_ATTR_NOSUID",
    "MOUNT_ATTR_RDONLY",
    "MS_BIND",
    "MS_NODEV",
    "MS_NOEXEC",
    "MS_NOSUID",
    "MS_PRIVATE",
    "MS_RDONLY",
    "MS_REC",
    "load_seccomp",
    "loopback_up",
    "mount",
    "mount_setattr",
    "pivot_root",
    "set_dumpable",
    "set_no_new_privs",
    "set_pdeathsig",
    "sethostname",
    "setns",
    "umount",
    "unshare",
]

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
_AT_FDCWD = -100
_AT_RECURSIVE = 0x8000
_SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 share the new-syscall numbers

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str, path: str | None = None) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)


def _b(s: str | None) -> bytes | None:
    return s.encode() if s is not None else None


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None
) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), "mount", target)


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), flags), "umount", target)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def mount_setattr(path: str, attr_set: int, attr_clr: int = 0, recursive: bool = True) -> None:
    """Change mount attributes (e.g. read-only) of ``path``, and every mount below it."""
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    flags = _AT_RECURSIVE if recursive else 0
    _check(
        _libc.syscall(
            _SYS_MOUNT_SETATTR, _AT_FDCWD, _b(path), flags, ctypes.byref(attr), ctypes.sizeof(attr)
        ),
        "mount_setattr",
        path,
    )


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(155, _b(new_root), _b(put_old)), "pivot_root", new_root)


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, len(raw)), "sethostname")


def set_pdeathsig(sig: int) -> None:
    _check(_libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PDEATHSIG)")


def set_dumpable(dumpable: bool) -> None:
    """A non-dumpable process cannot be inspected through /proc or ptrace by its own uid."""
    _check(_libc.prctl(_PR_SET_DUMPABLE, int(dumpable), 0, 0, 0), "prctl(DUMPABLE)")


def set_no_new_privs() -> None:
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(bpf: bytes) -> None:
    """Install a compiled seccomp BPF program (8-byte instructions) on this thread.

    Needs no_new_privs (or CAP_SYS_ADMIN); inherited by children and across exec.
    """
    if len(bpf) % 8:
        raise ValueError("seccomp program length is not a multiple of 8")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(
        _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0),
        "prctl(SECCOMP)",
    )


def loopback_up() -> None:
    """Bring ``lo`` up in the current network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
