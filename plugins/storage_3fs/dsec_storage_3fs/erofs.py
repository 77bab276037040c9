"""EROFS images: building one from a directory with ``mkfs.erofs`` and reading its superblock.

Images are reproducible: the same tree always gives the same bytes, so importing the same
content twice gives the same digest. ``mkfs.erofs`` (erofs-utils 1.5) would otherwise stamp a
random UUID and the build time; we pass a fixed UUID and a fixed build time
(``SOURCE_DATE_EPOCH`` = 2100-01-01, which keeps every file's own mtime; only mtimes later than
that are clamped to it).

Extended attributes, ``trusted.overlay.*`` included, are kept: ``-x`` (the xattr tolerance)
stays at its default, 2; only a negative value would drop them.

Holes: erofs-utils 1.5 keeps none. It reads every byte of a sparse file and, uncompressed,
writes it out (``truncate -s 3G`` made a 3 GiB image, fully allocated). ``--chunksize``
only deduplicates identical chunks by sha256 (holes then cost 4 bytes of index per 4 KiB, but
the build is five times slower on real data, and 1.5 marks the feature experimental); chunks
that are holes came in 1.6. lz4 is what 1.5 has: zeros compress to about 0.45 % of their
size (4 KiB physical clusters), read back as zeros, and are built about as fast as zeros are
read. :mod:`.build` picks it for trees with holes.

A build is bounded: ``timeout_s`` kills mkfs.erofs (it runs alone, no children) and the
partial image is removed, as it is after any failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from dsec_kernel.contract.errors import DeadlineExceeded, Internal, InvalidArgument, Unavailable

__all__ = ["MAGIC", "check_magic", "inode_count", "mkfs"]

MAGIC = 0xE0F5E1E2
_SUPERBLOCK = 1024  # byte offset of the superblock; the magic is its first little-endian u32
_INODES = slice(16, 24)  # u64 inode count within the superblock
_UUID = "6f1d2c2e-3f5a-4d5e-9b1a-0d5ec0e7a1e5"
_BUILD_TIME = "4102444800"  # 2100-01-01T00:00:00Z


def mkfs(
    tree: Path, image: Path, compression: str | None = None, timeout_s: float | None = None
) -> None:
    """Write the EROFS image of directory ``tree`` to ``image`` (``-z compression`` if given).
    DeadlineExceeded if mkfs.erofs runs longer than ``timeout_s``: it is killed. On any
    failure no ``image`` is left."""
    exe = shutil.which("mkfs.erofs")
    if exe is None:
        raise Unavailable(
            "mkfs.erofs is not installed on this node; install erofs-utils "
            "(apt-get install erofs-utils)",
            retryable=False,
        )
    cmd = [exe, "--quiet", f"-U{_UUID}"]
    if compression:
        cmd.append(f"-z{compression}")
    cmd += [str(image), str(tree)]
    try:
        done = subprocess.run(  # on a timeout: killed, then waited for
            cmd,
            env={**os.environ, "SOURCE_DATE_EPOCH": _BUILD_TIME},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        image.unlink(missing_ok=True)
        raise DeadlineExceeded(
            f"building the layer's image took longer than {timeout_s:g} s (build_timeout_s) "
            "and was stopped; make the tree smaller (fewer files, fewer bytes)",
            retryable=False,
        ) from None
    except BaseException:
        image.unlink(missing_ok=True)
        raise
    if done.returncode:
        image.unlink(missing_ok=True)
        tail = done.stdout.strip()[-2000:]
        raise Internal(f"mkfs.erofs failed (exit {done.returncode}) building {tree}: {tail}")


def _superblock(image: Path) -> bytes:
    with image.open("rb") as f:
        f.seek(_SUPERBLOCK)
        raw = f.read(128)
    if len(raw) < 128 or int.from_bytes(raw[:4], "little") != MAGIC:
        raise InvalidArgument(
            f"{image.name} is not an EROFS image (no superblock magic at byte {_SUPERBLOCK}): "
            "it is damaged; remove the layer and import it again"
        )
    return raw


def check_magic(image: Path) -> None:
    """InvalidArgument unless ``image`` starts with an EROFS superblock."""
    _superblock(image)


def inode_count(image: Path) -> int:
    """The number of inodes (files, directories, links...) in ``image``."""
    return int.from_bytes(_superblock(image)[_INODES], "little")
