"""The container seccomp profile, compiled once per backend start to a BPF file.

Commands in a container run as root of their namespaces, with a container capability set
and no_new_privs; this filter additionally refuses (EPERM) what a software-engineering task
never needs and what widens the kernel's attack surface: mounts and new namespaces, kernel
modules, BPF, perf, keyrings, userfaultfd, io_uring, handle-based opens, clock and swap
changes. ptrace stays allowed (debuggers, strace) within the sandbox's own PID namespace.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyseccomp as sc

__all__ = ["DENIED", "write_profile"]

DENIED = (
    "mount", "umount2", "pivot_root", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "open_by_handle_at",
    "name_to_handle_at", "lookup_dcookie", "uselib", "vhangup", "acct", "quotactl", "syslog",
    "iopl", "ioperm", "reboot", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "swapon", "swapoff", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "process_vm_writev",
)  # fmt: skip

#: ioctls refused: TIOCSTI (typing into a terminal) and TIOCLINUX (the console's)
_IOCTLS = (0x5412, 0x541C)
#: CLONE_NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWCGROUP
_NAMESPACE_FLAGS = (0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                    0x02000000)  # fmt: skip


def write_profile(path: Path, extra: list[str]) -> Path:
    """Compile the profile (plus ``extra`` calls from guard plugins) into ``path``."""
    f = sc.SyscallFilter(sc.ALLOW)
    for name in dict.fromkeys((*DENIED, *extra)):
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except OSError:
            raise ValueError(f"unknown system call {name!r} in the container profile") from None
    for flag in _NAMESPACE_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for cmd in _IOCTLS:  # the kernel reads the command as 32 bits: compare only those
        f.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, cmd))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        f.export_bpf(out)
    os.replace(tmp, path)
    return path
