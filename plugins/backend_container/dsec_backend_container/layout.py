"""Where a container sandbox keeps its state on the node, and what it records about itself.

``<upper_root>/<id>/`` (0700), on the sandboxes' btrfs (:mod:`.upperfs`):

    meta.json    :class:`Meta`
    rw/          a subvolume with the sandbox's quota: ``upper/`` and ``work/`` of its overlay,
                 files owned by the uids the sandbox sees (its root is 0 here)
    m/           mount points used only inside the sandbox's own mount namespace: ``m/0``...
                 for its lower layers, ``m/rw`` for ``rw/``, both idmapped into its user
                 namespace
    rootfs/      the overlay's mount point, likewise
    netns        egress sandboxes: their network namespace (a bind mount)

Nothing is mounted in the host's namespace per sandbox but an egress sandbox's network
namespace. ``<upper_root>/.trash/``: what is being deleted (:class:`Trash`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dsec_backend_container.upperfs import UpperFs
from dsec_kernel.contract.wire import Limits
from dsec_kernel.linuxhost.fileio import remove_tree

log = logging.getLogger(__name__)

__all__ = ["Meta", "SandboxDir", "Trash", "delete_tree"]


class Meta(BaseModel):
    """A sandbox's own record, enough to adopt it after an edge restart."""

    model_config = ConfigDict(extra="ignore")

    id: str
    tenant: str
    created_at: float
    layers: list[str] = Field(description="digests of its environment's layers, top first")
    chain: list[str] = Field(
        default_factory=list, description="snapshots its files start from, newest first"
    )
    origin: list[str] = Field(default_factory=list, description="the chain it was created on")
    last_snapshot: str | None = Field(None, description="the next snapshot's parent")
    upper_since: str | None = Field(
        None, description="the snapshot whose manifest describes the upper (None: it started empty)"
    )
    held: list[str] = Field(default_factory=list, description="its own snapshots, which it holds")
    address: str | None = Field(None, description="its egress address")
    limits: Limits = Field(default_factory=Limits)
    network: str = "none"
    uid_base: int = Field(0, description="the host uid of its root (its user namespace's range)")
    disk_bytes: int = Field(0, description="its quota on the node's disk")
    inodes: int = Field(0, description="its inode limit (0: the backend's default)")
    init_pid: int = 0
    init_start: int = Field(0, description="the init's start time (clock ticks), against pid reuse")


class SandboxDir:
    """The files of one sandbox on this node."""

    def __init__(self, root: Path, sandbox_id: str) -> None:
        self.id = sandbox_id
        self.path = root / sandbox_id
        self.meta_file = self.path / "meta.json"
        self.rw = self.path / "rw"
        self.upper = self.rw / "upper"
        self.rootfs = self.path / "rootfs"

    def exists(self) -> bool:
        return self.meta_file.exists()

    def create(self, fs: UpperFs, disk_bytes: int, tenant: str, lowers: int) -> None:
        """The directory, its quota'd writable layer (in ``tenant``'s group) and mount points
        for ``lowers`` layers."""
        self.path.mkdir(mode=0o700)
        for d in (self.rootfs, self.path / "m", self.path / "m" / "rw"):
            d.mkdir()
        self.mount_points(lowers)
        self._rw(fs, disk_bytes, tenant)

    def mount_points(self, lowers: int) -> None:
        for i in range(lowers):
            (self.path / "m" / str(i)).mkdir(exist_ok=True)

    def _rw(self, fs: UpperFs, disk_bytes: int, tenant: str) -> None:
        fs.create(self.rw, disk_bytes, group=tenant)
        for d in ("upper", "work"):
            (self.rw / d).mkdir()

    def read(self) -> Meta:
        return Meta.model_validate_json(self.meta_file.read_text())

    def write(self, meta: Meta) -> None:
        tmp = self.meta_file.with_suffix(".tmp")
        tmp.write_text(meta.model_dump_json())
        tmp.replace(self.meta_file)

    def fresh_upper(self, trash: Trash, fs: UpperFs, disk_bytes: int, tenant: str) -> None:
        """Replace the writable layer with an empty one (the old one goes to ``trash``)."""
        trash.discard(self.rw)
        self._rw(fs, disk_bytes, tenant)

    def remove(self, trash: Trash) -> None:
        trash.discard(self.path)


class Trash:
    """Directories on their way out: moved aside at once (a rename on the same filesystem)
    and deleted by one background thread, so restore and destroy do not wait on the disk.
    ``delete(path)`` deletes one (subvolumes in one call). What a crash left here is deleted
    after the next start."""

    def __init__(self, root: Path, delete: Callable[[Path], None]) -> None:
        self.root = root
        self._delete = delete
        root.mkdir(parents=True, exist_ok=True)
        self._queue: queue.SimpleQueue[Path | None] = queue.SimpleQueue()
        for left in root.iterdir():
            self._queue.put(left)
        self._thread = threading.Thread(target=self._run, name="dsec-trash", daemon=True)
        self._thread.start()

    def discard(self, path: Path) -> None:
        """Move ``path`` here to be deleted; a missing ``path`` is nothing to do."""
        moved = self.root / secrets.token_hex(8)
        try:
            path.rename(moved)
        except FileNotFoundError:
            return
        self._queue.put(moved)

    def close(self) -> None:
        """Delete everything discarded so far, then stop the thread (and leave no directory)."""
        self._queue.put(None)
        self._thread.join()
        with contextlib.suppress(OSError):  # not empty: deleted after the next start
            self.root.rmdir()

    def _run(self) -> None:
        while (path := self._queue.get()) is not None:
            try:
                self._delete(path)
            except OSError as exc:  # (what stays is tried again after the next start)
                log.warning("could not delete %s from the trash: %s", path.name, exc)


def delete_tree(fs: UpperFs) -> Callable[[Path], None]:
    """How the trash deletes a sandbox's directory or a writable layer on ``fs``: its
    subvolume at once, then the rest (a few small files)."""

    def delete(path: Path) -> None:
        for rw in (path, path / "rw"):
            if UpperFs.is_subvolume(rw):
                fs.delete(rw)
        remove_tree(path)

    return delete
