"""How much of a file sits in this node's page cache: mincore(2) over a shared read-only map.

An EROFS image mounted straight from its file with buffered reads is read through that
file's page cache; with direct I/O, its file data lands only in the pages of the files in the
mount. Either way, resident pages are bytes this node has read of the layer. Mapping a file
reads nothing. ``mmap.mmap`` can't hand a read-only map to ctypes, hence libc's mmap.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

__all__ = ["resident_bytes", "tree_resident_bytes"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path: Path) -> tuple[int, int]:
    """(bytes of ``path`` in the page cache, the file's size). OSError if unreadable."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}", str(path))
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = ctypes.create_string_buffer(pages)
            if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore: {os.strerror(err)}", str(path))
            resident = pages - vec.raw.count(0)  # one byte per page, bit 0 set if resident
        finally:
            _libc.munmap(ctypes.c_void_p(addr), size)
        return min(resident * mmap.PAGESIZE, size), size
    finally:
        os.close(fd)


def tree_resident_bytes(root: Path) -> int:
    """Resident bytes of every regular file under ``root`` (symlinks not followed)."""
    total = 0
    for top, _dirs, files in os.walk(root):
        for name in files:
            path = Path(top, name)
            if not path.is_symlink() and path.is_file():
                try:
                    total += resident_bytes(path)[0]
                except OSError:
                    pass
    return total
