"""Reading and writing files inside a running sandbox from the host, safely: every path is
resolved with the sandbox's root as ``/`` (openat2 RESOLVE_IN_ROOT through /proc/PID/root),
so a symlink the sandbox planted cannot point the edge at a host file."""

from __future__ import annotations

import os
from contextlib import contextmanager

from dsec_kernel import errors, linux
from dsec_kernel.fileio import read_whole

__all__ = ["read_file", "write_file"]


@contextmanager
def _root(init_pid: int):
    try:
        fd = os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        raise errors.SandboxLost("the sandbox's init is gone") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _check(path: str) -> str:
    if not path.startswith("/") or "\0" in path:
        raise errors.InvalidArgument(f"{path!r}: give an absolute path")
    return path


def read_file(init_pid: int, path: str, max_bytes: int) -> bytes:
    """The whole file; NotFound, or InvalidArgument for a directory or one over max_bytes."""
    with _root(init_pid) as root:
        try:
            fd = linux.open_in_root(root, _check(path), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO
        except FileNotFoundError:
            raise errors.NotFound(f"{path}: no such file") from None
        except OSError as exc:
            raise errors.InvalidArgument(f"{path}: {exc.strerror}") from None
        return read_whole(fd, path, max_bytes)


def write_file(init_pid: int, path: str, data: bytes, mode: int) -> int:
    """Create or replace ``path`` atomically, making missing parent directories (0755)."""
    parent, _, name = _check(path).rstrip("/").rpartition("/")
    if not name or name in (".", ".."):
        raise errors.InvalidArgument(f"{path!r}: not a file path")
    with _root(init_pid) as root:
        dfd = _mkdirs(root, parent or "/")
        tmp = f".{name}.dsec-tmp"
        try:
            try:  # whatever is there (a FIFO the sandbox planted, say) goes; ours is new
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), mode & 0o777)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except IsADirectoryError:
            raise errors.InvalidArgument(f"{path}: is a directory") from None
        except OSError as exc:
            raise errors.InvalidArgument(f"{path}: {exc.strerror}") from None
        finally:
            os.close(dfd)
    return len(data)


def _mkdirs(root: int, path: str) -> int:
    """An fd of directory ``path`` in the sandbox, made (component by component) if missing."""
    try:
        return linux.open_in_root(root, path, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        raise errors.InvalidArgument(f"{path}: a parent is not a directory") from None
    fd = linux.open_in_root(root, "/", os.O_PATH | os.O_DIRECTORY)
    for part in [p for p in path.split("/") if p]:
        try:
            nxt = linux.open_in_root(fd, part, os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            nxt = linux.open_in_root(fd, part, os.O_PATH | os.O_DIRECTORY)
        except NotADirectoryError:
            os.close(fd)
            raise errors.InvalidArgument(f"{path}: a parent is not a directory") from None
        os.close(fd)
        fd = nxt
    return fd
