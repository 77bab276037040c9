"""The filesystem of sandboxes' writable layers: btrfs, one subvolume per sandbox, each with a
quota (a btrfs qgroup limit on the bytes it references, metadata included).

A sandbox that fills its quota gets ``EDQUOT`` ("Disk quota exceeded") inside, and nothing
else is touched: the node's other sandboxes keep their room, and the host's own filesystem
only ever sees one image file of bounded size. Quotas are thin (their sum may pass the
filesystem's size), so each tenant's subvolumes are also grouped in a qgroup of their own
(level 1, its id a hash of the tenant's name) whose limit is ``group_bytes``: however many
sandboxes a tenant fills, its neighbours keep the rest of the filesystem. A subvolume leaves
its group before it is deleted, which gives its bytes back to the group at once (the kernel
keeps a deleted subvolume's bytes in its groups). A group stays once made (a few hundred
bytes of the quota tree), with its limit set again at each start.

Every inode a sandbox makes costs it metadata bytes (about 350 measured); btrfs has no inode
quota, so :mod:`.inodes` counts them (:meth:`UpperFs.highest_inode`,
:meth:`UpperFs.count_inodes`) and closes the quota (:meth:`UpperFs.set_limit`) of a sandbox
past its inode limit.

Where ``root`` is already on btrfs (an operator's disk), it is used as it is. Otherwise the
filesystem is a sparse image file, made once (``mkfs.btrfs``) and mounted through a loop
device on ``root``; it stays mounted while sandboxes live (an edge restart adopts it) and is
unmounted when the backend closes with none left. Deleted subvolumes give their blocks back
to the host (``discard``).

Why btrfs: this kernel has neither ext4 nor XFS quotas (no CONFIG_QFMT_V2, no
CONFIG_XFS_QUOTA), and a loop-mounted filesystem per sandbox costs ~7 ms and ~140 KiB of
kernel memory each (measured), against 0.1 ms and 3 KiB for a subvolume with a limit.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import struct
import subprocess
from pathlib import Path

from dsec_kernel.contract import errors
from dsec_kernel.linuxhost import syscalls

__all__ = ["UpperFs"]

log = logging.getLogger(__name__)

_BTRFS_MAGIC = 0x9123683E
# ioctls of <linux/btrfs.h> (magic 0x94)
_SUBVOL_CREATE = 0x5000940E  # _IOW(14, struct btrfs_ioctl_vol_args): 4096 bytes
_SNAP_DESTROY = 0x5000940F  # _IOW(15, struct btrfs_ioctl_vol_args)
_INO_LOOKUP = 0xD0009412  # _IOWR(18, struct btrfs_ioctl_ino_lookup_args): 4096 bytes
_QUOTA_CTL = 0xC0109428  # _IOWR(40, struct btrfs_ioctl_quota_ctl_args): cmd, status
_QGROUP_LIMIT = 0x8030942B  # _IOR(43, struct btrfs_ioctl_qgroup_limit_args): 48 bytes
_TREE_SEARCH_V2 = 0xC0709411  # _IOWR(17, struct btrfs_ioctl_search_args_v2): 112 bytes + buf
_QGROUP_ASSIGN = 0x40189429  # _IOW(41, struct btrfs_ioctl_qgroup_assign_args): 24 bytes
_QGROUP_CREATE = 0x4010942A  # _IOW(42, struct btrfs_ioctl_qgroup_create_args): 16 bytes
_GROUP_LEVEL = 1 << 48  # a qgroup id is level << 48 | id; subvolumes' own are level 0
_QUOTA_ENABLE = 1
_LIMIT_MAX_RFER = 1
_FIRST_FREE_OBJECTID = 256  # the inode number of every subvolume's root directory
_LAST_FREE_OBJECTID = (1 << 64) - 256  # above: orphan items and other special objects
_INODE_ITEM_KEY = 1
_QUOTA_TREE = 8  # BTRFS_QUOTA_TREE_OBJECTID
_QGROUP_RELATION_KEY = 246
#: struct btrfs_ioctl_search_key (tree 0: the subvolume of the fd), then buf_size
_SEARCH_KEY = struct.Struct("7Q4I4QQ")
_SEARCH_NR_ITEMS = 64  # offset of nr_items, which the kernel sets to the items it returned
_SEARCH_HEADER = struct.Struct("3Q2I")  # transid, objectid, offset, type, len (then the item)
_COUNT_BUF = 1 << 20


def _vol_args(name: str) -> bytearray:
    raw = name.encode()
    if not raw or b"/" in raw or len(raw) > 255:
        raise ValueError(f"bad subvolume name {name!r}")
    return bytearray(struct.pack("q4088s", 0, raw))


def _statfs_type(path: Path) -> int:
    import ctypes

    buf = ctypes.create_string_buffer(120)  # struct statfs; f_type is its first field
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(str(path).encode(), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return struct.unpack_from("q", buf.raw)[0] & 0xFFFFFFFF


def _mount_point(path: Path) -> bool:
    """Whether ``path`` is itself a mount point in this mount namespace."""
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4].replace("\\040", " ") == target for line in f)


class UpperFs:
    """Sandboxes' writable layers below ``root``; see the module docstring."""

    def __init__(
        self, root: Path, image: Path, size_bytes: int = 0, group_bytes: int | None = None
    ) -> None:
        """``image``: the image file made when ``root`` is not on btrfs; ``size_bytes`` its
        size (0: nine tenths of the free space where it is made; it is sparse).
        ``group_bytes``: what one group's subvolumes may reference together (None: half the
        filesystem)."""
        self.root = root
        self.image = image
        self.size_bytes = size_bytes
        self.group_bytes = group_bytes or 0  # set by open() if None
        self.owned = False  # mounted from our image (so ours to unmount)
        self._groups: set[int] = set()  # qgroups made or limited since open()

    def open(self) -> UpperFs:
        """Make ``root`` a btrfs with quotas on. Unavailable, with the reason, if it cannot."""
        self.root.mkdir(parents=True, exist_ok=True)
        if _mount_point(self.root) and _statfs_type(self.root) == _BTRFS_MAGIC:
            self.owned = self.image.exists()  # ours from an earlier start, or the operator's
        elif _statfs_type(self.root) != _BTRFS_MAGIC:
            self._mount_image()
            self.owned = True
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, _QUOTA_CTL, bytearray(struct.pack("QQ", _QUOTA_ENABLE, 0)))
        except OSError as exc:
            raise errors.Unavailable(f"cannot turn on btrfs quotas on {self.root}: {exc}") from None
        finally:
            os.close(fd)
        if not self.group_bytes:
            self.group_bytes = self.total_bytes() // 2
        return self

    def total_bytes(self) -> int:
        """The filesystem's size."""
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize

    def _mount_image(self) -> None:
        if shutil.which("mkfs.btrfs") is None:
            raise errors.Unavailable(
                "sandboxes' disk quotas need btrfs: apt-get install btrfs-progs"
            )
        if not self.image.exists():
            size = self.size_bytes or shutil.disk_usage(self.image.parent).free * 9 // 10
            tmp = self.image.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.truncate(size)
            run = subprocess.run(["mkfs.btrfs", "-q", "-f", str(tmp)], capture_output=True)
            if run.returncode != 0:
                tmp.unlink()
                raise errors.Unavailable(
                    f"mkfs.btrfs failed: {run.stderr.decode(errors='replace').strip()}"
                )
            tmp.replace(self.image)
        run = subprocess.run(
            ["mount", "-o", "loop,discard=async", str(self.image), str(self.root)],
            capture_output=True,
        )
        if run.returncode != 0:
            raise errors.Unavailable(
                f"cannot mount {self.image}: {run.stderr.decode(errors='replace').strip()}"
            )

    def close(self) -> None:
        """Unmount our image if no sandbox is left on it (only a trash directory may be)."""
        if not self.owned or any(p.name != ".trash" for p in self.root.iterdir()):
            return
        trash = self.root / ".trash"
        if trash.exists() and any(trash.iterdir()):
            return
        try:
            syscalls.umount(str(self.root))
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # not mounted any more
                raise

    # -- subvolumes --------------------------------------------------------------------------

    def create(self, path: Path, limit_bytes: int, group: str | None = None) -> None:
        """A subvolume at ``path`` (its parent must exist on this filesystem) whose files may
        reference at most ``limit_bytes``, and with those of ``group``'s other subvolumes at
        most ``group_bytes``."""
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(parent, _SUBVOL_CREATE, _vol_args(path.name))
        finally:
            os.close(parent)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            subvolume = self.subvolume(fd)
            self.set_limit(subvolume, limit_bytes)
            if group is not None:
                self._join(subvolume, group)
        except BaseException:
            os.close(fd)
            fd = -1
            self.delete(path)
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    @staticmethod
    def subvolume(fd: int) -> int:
        """The id of the subvolume open as ``fd``."""
        lookup = bytearray(struct.pack("QQ4080s", 0, _FIRST_FREE_OBJECTID, b""))
        fcntl.ioctl(fd, _INO_LOOKUP, lookup)
        return struct.unpack_from("Q", lookup)[0]

    def set_limit(self, subvolume: int, limit_bytes: int) -> None:
        """Let ``subvolume`` reference at most ``limit_bytes``. Asked through the filesystem's
        root, whose transaction this is: one through a subvolume past its limit would fail
        for want of room in it (EDQUOT)."""
        limit = struct.pack("QQQQQQ", subvolume, _LIMIT_MAX_RFER, limit_bytes, 0, 0, 0)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, _QGROUP_LIMIT, bytearray(limit))
        finally:
            os.close(fd)

    @staticmethod
    def group_qgroup(group: str) -> int:
        """The id of ``group``'s qgroup."""
        return _GROUP_LEVEL | int.from_bytes(hashlib.sha256(group.encode()).digest()[:6], "big")

    def _join(self, subvolume: int, group: str) -> None:
        """Put the (empty) ``subvolume`` in ``group``'s qgroup, made and limited at first."""
        qgroup = self.group_qgroup(group)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if qgroup not in self._groups:
                try:
                    fcntl.ioctl(fd, _QGROUP_CREATE, bytearray(struct.pack("QQ", 1, qgroup)))
                except OSError as exc:
                    if exc.errno != errno.EEXIST:
                        raise
                self.set_limit(qgroup, self.group_bytes)
                self._groups.add(qgroup)
            assign = bytearray(struct.pack("QQQ", 1, subvolume, qgroup))
            if fcntl.ioctl(fd, _QGROUP_ASSIGN, assign) > 0:  # (an empty one never needs it)
                log.warning("btrfs wants its quotas rescanned after %d joined a group", subvolume)
        finally:
            os.close(fd)

    def _leave_groups(self, subvolume: int) -> None:
        """Take ``subvolume`` out of every group qgroup it is in (the kernel subtracts what it
        references from each: exact, as sandboxes' subvolumes share no extents)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for group in _parent_qgroups(fd, subvolume):
                leave = bytearray(struct.pack("QQQ", 0, subvolume, group))
                if fcntl.ioctl(fd, _QGROUP_ASSIGN, leave) > 0:
                    log.warning("btrfs wants its quotas rescanned after %d left a group", subvolume)
        finally:
            os.close(fd)

    @staticmethod
    def highest_inode(fd: int, known: int = _FIRST_FREE_OBJECTID) -> int:
        """The highest inode number in use in the subvolume open as ``fd``, searched upwards
        from ``known`` (one in use, or the root's): a few tree searches, each O(log n).

        btrfs gives a subvolume's inodes increasing numbers and never reuses one while it is
        mounted, so no more than ``highest - known`` inodes were made since ``known`` was the
        highest."""
        if not _any_from(fd, known + 1):
            return known
        low, step = known + 1, 1  # low is in use; find a number above it that is not
        while _any_from(fd, low + step):
            low, step = low + step, step * 2
        high = low + step  # not in use, nor anything above it
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if _any_from(fd, mid) else (low, mid)
        return low

    @staticmethod
    def count_inodes(fd: int) -> int:
        """How many inodes the subvolume open as ``fd`` holds (its tree searched: ~1 µs
        each)."""
        total, start = 0, _FIRST_FREE_OBJECTID
        while True:
            n, buf = _search(fd, start, _INODE_ITEM_KEY, _COUNT_BUF >> 5, _COUNT_BUF)
            if not n:
                return total
            offset, last = _SEARCH_KEY.size, start
            for _ in range(n):
                _, last, _, kind, length = _SEARCH_HEADER.unpack_from(buf, offset)
                offset += _SEARCH_HEADER.size + length
                total += kind == _INODE_ITEM_KEY
            start = last + 1

    def delete(self, path: Path) -> None:
        """Delete the subvolume at ``path`` with all it holds (the kernel frees its blocks in
        the background). It leaves its groups first, which gives its bytes back to them at
        once: deleting it alone left them counted in its tenant's group for good (a tenant
        that had made and destroyed half the disk's worth could write nothing). A missing
        one is nothing to do."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        try:
            self._leave_groups(self.subvolume(fd))
        finally:
            os.close(fd)
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(parent, _SNAP_DESTROY, _vol_args(path.name))
        except FileNotFoundError:
            pass
        finally:
            os.close(parent)

    @staticmethod
    def is_subvolume(path: Path) -> bool:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        return st.st_ino == _FIRST_FREE_OBJECTID and os.path.isdir(path)


def _search(fd: int, start: int, kind: int | None, items: int, size: int) -> tuple[int, bytearray]:
    """Search the subvolume's tree from object ``start`` (items of ``kind`` only, or of any
    kind): (items returned, the buffer holding them after the search key)."""
    low, high = (kind, kind) if kind is not None else (0, 255)
    key = _SEARCH_KEY.pack(0, start, _LAST_FREE_OBJECTID, 0, (1 << 64) - 1, 0, (1 << 64) - 1,
                           low, high, items, 0, 0, 0, 0, 0, size)  # fmt: skip
    buf = bytearray(key) + bytes(size)
    fcntl.ioctl(fd, _TREE_SEARCH_V2, buf)
    return struct.unpack_from("I", buf, _SEARCH_NR_ITEMS)[0], buf


def _parent_qgroups(fd: int, qgroup: int) -> list[int]:
    """The qgroups that ``qgroup`` is a member of (its relation items in the quota tree)."""
    key = _SEARCH_KEY.pack(_QUOTA_TREE, qgroup, qgroup, 0, (1 << 64) - 1, 0, (1 << 64) - 1,
                           _QGROUP_RELATION_KEY, _QGROUP_RELATION_KEY, 256, 0, 0, 0, 0, 0,
                           1 << 16)  # fmt: skip
    buf = bytearray(key) + bytes(1 << 16)
    fcntl.ioctl(fd, _TREE_SEARCH_V2, buf)
    parents, offset = [], _SEARCH_KEY.size
    for _ in range(struct.unpack_from("I", buf, _SEARCH_NR_ITEMS)[0]):
        _, _, other, _, length = _SEARCH_HEADER.unpack_from(buf, offset)
        offset += _SEARCH_HEADER.size + length
        if other >> 48 > qgroup >> 48:  # (both directions are stored: a child's too)
            parents.append(other)
    return parents


def _any_from(fd: int, objectid: int) -> bool:
    """Whether any item of object ``objectid`` or a higher ordinary one exists."""
    return _search(fd, objectid, None, 1, 4096)[0] > 0
