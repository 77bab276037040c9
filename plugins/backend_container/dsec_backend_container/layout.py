"""Where a container sandbox keeps its state on the node, and what it records about itself.

``<state>/sandboxes/<id>/``: ``meta.json`` (:class:`Meta`), ``upper/`` and ``work/`` (the
overlay's writable layer, on local disk) and ``rootfs/`` (the mount point, used only inside
the sandbox's own mount namespace). Nothing is mounted in the host's namespace per sandbox.
``<state>/sandboxes/.trash/``: what is being deleted (:class:`Trash`).
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import shutil
import threading
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dsec_kernel.wire import Limits

__all__ = ["Meta", "SandboxDir", "Trash", "process_start"]


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
    init_pid: int = 0
    init_start: int = Field(0, description="the init's start time (clock ticks), against pid reuse")

    def alive(self) -> bool:
        """Its init still runs (the same process, not a reuse of its pid)."""
        return bool(self.init_pid) and process_start(self.init_pid) == self.init_start


class SandboxDir:
    """The files of one sandbox on this node."""

    def __init__(self, root: Path, sandbox_id: str) -> None:
        self.id = sandbox_id
        self.path = root / sandbox_id
        self.meta_file = self.path / "meta.json"
        self.upper = self.path / "upper"
        self.work = self.path / "work"
        self.rootfs = self.path / "rootfs"

    def exists(self) -> bool:
        return self.meta_file.exists()

    def create(self) -> None:
        self.path.mkdir(mode=0o700)
        for d in (self.upper, self.work, self.rootfs):
            d.mkdir()

    def read(self) -> Meta:
        return Meta.model_validate_json(self.meta_file.read_text())

    def write(self, meta: Meta) -> None:
        tmp = self.meta_file.with_suffix(".tmp")
        tmp.write_text(meta.model_dump_json())
        tmp.replace(self.meta_file)

    def fresh_upper(self, trash: Trash) -> None:
        """Replace the writable layer with an empty one (the old one goes to ``trash``)."""
        for d in (self.upper, self.work):
            trash.discard(d)
            d.mkdir()

    def remove(self, trash: Trash) -> None:
        trash.discard(self.path)


class Trash:
    """Directories on their way out: moved aside at once (a rename on the same filesystem)
    and deleted by one background thread, so restore and destroy do not wait on the disk.
    What a crash left here is deleted after the next start."""

    def __init__(self, root: Path) -> None:
        self.root = root
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
            shutil.rmtree(path, ignore_errors=True)


def process_start(pid: int) -> int | None:
    """A live process's start time (clock ticks since boot); None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])
