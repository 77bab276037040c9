"""File work shared by backends and stores on the host side: reading a sandbox's file whole,
and deleting trees of any depth."""

from __future__ import annotations

import errno
import os
import stat

from dsec_kernel.contract import errors

__all__ = ["read_whole", "remove_tree"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def read_whole(fd: int, path: str, max_bytes: int) -> bytes:
    """Read the regular file open on ``fd`` (always closed). InvalidArgument for anything
    else (a directory, a device) or a file over ``max_bytes``."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise errors.InvalidArgument(f"{path}: not a regular file")
        if max_bytes and st.st_size > max_bytes:
            raise errors.InvalidArgument(
                f"{path} is {st.st_size} bytes; at most {max_bytes} are read at once"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def remove_tree(path: os.PathLike[str] | str, dir_fd: int | None = None) -> None:
    """Delete the directory ``path`` (relative to ``dir_fd`` if given) with all it holds, or
    the file or symlink it is; nothing if it is missing. Never follows a symlink, and never
    recurses: a sandbox can nest directories deeper than Python's recursion limit, where
    ``shutil.rmtree`` fails half-way (and its ``ignore_errors`` does not cover that). Holds
    one descriptor per level of the current path."""
    parent, name = os.path.split(os.fspath(path)) if dir_fd is None else (None, path)
    pfd = os.open(parent or ".", _DIR) if dir_fd is None else dir_fd
    try:
        try:
            top = os.open(name, _DIR, dir_fd=pfd)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            os.unlink(name, dir_fd=pfd)
            return
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # a symlink: removed, not followed
                raise
            os.unlink(name, dir_fd=pfd)
            return
        stack = [(top, name, _clear_files(top))]  # (fd, its name, subdirectories left)
        try:
            while stack:
                fd, _, subdirs = stack[-1]
                if subdirs:
                    sub = subdirs.pop()
                    try:
                        child = os.open(sub, _DIR, dir_fd=fd)
                    except FileNotFoundError:
                        continue
                    stack.append((child, sub, _clear_files(child)))
                    continue
                _, done, _ = stack.pop()
                os.close(fd)
                os.rmdir(done, dir_fd=stack[-1][0] if stack else pfd)
        finally:
            for fd, _, _ in stack:
                os.close(fd)
    finally:
        if dir_fd is None:
            os.close(pfd)


def _clear_files(fd: int) -> list[str]:
    """Unlink everything in the directory ``fd`` but its subdirectories; return those."""
    subdirs = []
    with os.scandir(fd) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
            else:
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
    return subdirs
