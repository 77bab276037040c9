"""File reading shared by backends that serve read_file from the host side."""

from __future__ import annotations

import os
import stat

from dsec_kernel import errors

__all__ = ["read_whole"]


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
