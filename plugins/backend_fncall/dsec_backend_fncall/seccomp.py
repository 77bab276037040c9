"""The fncall seccomp profile, compiled once to BPF with libseccomp (``pyseccomp``).

Default allow; the calls below fail with EPERM. Calls already run as an unprivileged uid with
no capabilities and ``no_new_privs``, so this is the second wall: it removes kernel attack
surface (namespaces, BPF, perf, keyrings, io_uring, userfaultfd) and the ways to reach other
processes (ptrace, process_vm_*, pidfd_getfd).
"""

from __future__ import annotations

import errno
import os

import pyseccomp as sc

__all__ = ["DENIED", "compile_profile"]

DENIED = (
    # mounts and namespaces
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # kernel surface
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "open_by_handle_at",
    "name_to_handle_at", "lookup_dcookie", "personality", "uselib", "vhangup", "acct",
    "quotactl", "syslog", "iopl", "ioperm",
    # the machine
    "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "swapon", "swapoff", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex",
)  # fmt: skip

#: ioctls refused: TIOCSTI (typing into a terminal) and TIOCLINUX (the console's)
_IOCTLS = (0x5412, 0x541C)
#: CLONE_NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWCGROUP
_NAMESPACE_FLAGS = (0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                    0x02000000)  # fmt: skip


def compile_profile(extra: list[str]) -> bytes:
    """The BPF program: ``DENIED`` plus ``extra`` (from guard plugins) refused with EPERM,
    ``clone`` with any namespace flag refused, ``clone3`` answered ENOSYS (callers fall back
    to ``clone``, whose flags can be checked). Raises ValueError for an unknown call name."""
    f = sc.SyscallFilter(sc.ALLOW)
    for name in dict.fromkeys((*DENIED, *extra)):
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except OSError:
            raise ValueError(
                f"unknown system call {name!r} in the fncall seccomp profile"
            ) from None
    for flag in _NAMESPACE_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for cmd in _IOCTLS:  # the kernel reads the command as 32 bits: compare only those
        f.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, cmd))
    fd = os.memfd_create("dsec-seccomp")
    try:
        with os.fdopen(fd, "w+b", closefd=False) as out:
            f.export_bpf(out)
            out.seek(0)
            return out.read()
    finally:
        os.close(fd)
