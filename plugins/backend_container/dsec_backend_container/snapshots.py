"""Incremental snapshots of sandboxes' writable layers, kept in the layer store (so any node
can restore or fork from them).

``<store>/snapshots/<id>/``::

    meta.json      SnapshotMeta
    delta/         what changed since the parent snapshot, in overlay upper format
    manifest.json  the sandbox's upper as it was when taken: the base of its next increment
    holds/         one empty file per holder: a sandbox whose files build on it
                   (``sb.<node>.<id>``) or its child snapshot (``snap.<id>``)

Holds are transitive: every snapshot holds its parent, so holding a chain's newest snapshot
holds the whole chain, and taking or restoring costs one hold however deep the chain. The
root of a chain (depth 1) pins its environment's layers in the layer store
(``@snapshot/<id>``), so a layer cannot be removed from under a snapshot built on it.

A chain deeper than ``max_depth`` is compacted: the new snapshot's delta then holds the whole
chain merged (depth 1). A snapshot nothing holds, not kept, and unused for ``grace_s`` is
collected; restoring or forking first takes a hold, then checks the snapshot is still there,
and collection re-checks holds after moving a snapshot aside, so the two cannot race.

Taking one is bounded as walks are (:mod:`.overlay`): the manifest is a scan's listing, so it
is at most ``max_listing`` bytes (names written as they are on disk, not escaped), and one
far past that (written before there was a limit) is not read. Every entry is a
:func:`~.lanes.checkpoint`; a snapshot cancelled, or failing, removes its ``.tmp-*``
directory.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dsec_backend_container.lanes import checkpoint
from dsec_backend_container.overlay import (
    MAX_LISTING,
    Budget,
    Entry,
    Links,
    Tree,
    apply,
    copy_entry,
    date_dirs,
    kind_at,
    remove,
    scan,
    whiteout,
)
from dsec_kernel.contract import errors
from dsec_kernel.contract.store import LayerStore
from dsec_kernel.linuxhost.fileio import remove_tree

__all__ = ["SnapshotMeta", "Snapshots"]


class SnapshotMeta(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    tenant: str
    sandbox_id: str
    backend: str
    parent: str | None
    depth: int
    created_at: float
    bytes: int = 0
    keep: bool = False
    layers: list[str] = Field(description="digests of the environment it applies to, top first")


#: age past which an unfinished snapshot (``.tmp-*``) is taken for a leftover
LEFTOVER_S = 3600.0
_ID = re.compile(r"snap-[0-9a-f]{16}")  # the ids this backend mints


class Snapshots:
    def __init__(
        self,
        store: LayerStore,
        max_depth: int = 16,
        grace_s: float = 60.0,
        max_listing: int = MAX_LISTING,
    ) -> None:
        self.store = store
        self.root = store.snapshots_root()
        self.max_depth = max_depth
        self.grace_s = grace_s
        self.max_listing = max_listing

    def _dir(self, snap_id: str) -> Path:
        """Where ``snap_id`` lives; NotFound for an id this backend never mints (the kernel
        takes any opaque id)."""
        if not _ID.fullmatch(snap_id):
            raise errors.NotFound(f"no snapshot {snap_id} (deleted, or not yours)")
        return self.root / snap_id

    def get(self, snap_id: str, tenant: str | None = None) -> SnapshotMeta:
        """The snapshot's record; NotFound if missing or another tenant's."""
        try:
            meta = SnapshotMeta.model_validate_json((self._dir(snap_id) / "meta.json").read_text())
        except (FileNotFoundError, NotADirectoryError):
            meta = None
        if meta is None or (tenant is not None and meta.tenant != tenant):
            raise errors.NotFound(f"no snapshot {snap_id} (deleted, or not yours)")
        return meta

    def chain(self, snap_id: str, tenant: str | None = None) -> list[SnapshotMeta]:
        """The snapshot and its ancestors, newest first."""
        out = [self.get(snap_id, tenant)]
        while out[-1].parent:
            out.append(self.get(out[-1].parent))
        return out

    def deltas(self, chain: list[str]) -> list[Path]:
        return [self._dir(s) / "delta" for s in chain]

    def manifest(self, snap_id: str | None) -> dict[str, Entry]:
        """The listing of the upper ``snap_id`` was taken of (None: nothing). A manifest is
        at most ``max_listing`` bytes; one of more than twice that (from before there was a
        limit, or escaped as they were) is InvalidArgument, not read."""
        if snap_id is None:
            return {}
        with open(self._dir(snap_id) / "manifest.json", "rb") as f:
            raw = f.read(2 * self.max_listing + 1)
        if len(raw) > 2 * self.max_listing:
            raise errors.InvalidArgument(
                f"snapshot {snap_id} lists more than {2 * self.max_listing >> 20} MiB of paths "
                "(it was taken before there was a limit): restore the sandbox to it, or fork "
                "it, rather than add snapshots to it"
            )
        data = json.loads(raw.decode("utf-8", "surrogateescape"))
        return {k: Entry.from_list(v) for k, v in data.items()}

    # -- holds ---------------------------------------------------------------------------------

    def hold(self, snap_id: str, holder: str) -> None:
        """Hold ``snap_id``, and so its whole chain; NotFound (holding nothing) if it is gone."""
        d = self._dir(snap_id)
        try:
            (d / "holds" / holder).touch()
            os.utime(d)  # "used now": collection waits grace_s after this
            if (d / "meta.json").exists():
                return
        except FileNotFoundError:
            pass
        self.release([snap_id], holder)
        raise errors.NotFound(f"snapshot {snap_id} is gone")

    def release(self, chain: list[str], holder: str) -> None:
        for snap in chain:
            try:
                os.unlink(self._dir(snap) / "holds" / holder)
            except FileNotFoundError:
                pass

    def drop_holders(self, prefix: str, keep: set[str]) -> None:
        """Remove holds named ``prefix...`` except ``keep`` (a node's sandboxes that are gone)."""
        for hold in self.root.glob(f"snap-*/holds/{prefix}*"):
            if hold.name not in keep:
                hold.unlink(missing_ok=True)

    # -- taking ----------------------------------------------------------------------------------

    def take(
        self,
        upper: Path,
        *,
        tenant: str,
        sandbox_id: str,
        backend: str,
        layers: list[str],
        parent: str | None,
        baseline: str | None,
        keep: bool,
    ) -> SnapshotMeta:
        """Snapshot ``upper``: what changed since ``baseline``'s manifest (None: all of it),
        on top of ``parent``'s chain. The caller keeps the upper still meanwhile."""
        snap_id = "snap-" + secrets.token_hex(8)  # (_ID)
        tmp = self.root / f".tmp-{snap_id}"
        (tmp / "holds").mkdir(parents=True)
        try:
            now = scan(upper, Budget(self.max_listing))
            before = self.manifest(baseline)
            depth = self.get(parent).depth + 1 if parent else 1
            (tmp / "delta").mkdir()
            if parent and depth > self.max_depth:  # compact: the whole chain, merged
                for delta in reversed(self.deltas([c.id for c in self.chain(parent)])):
                    apply(delta, tmp / "delta")
                _copy_changes(upper, now, before, tmp / "delta", merge=True)
                parent, depth = None, 1
                size = _tree_bytes(tmp / "delta")
            else:
                size = _copy_changes(upper, now, before, tmp / "delta")
            (tmp / "manifest.json").write_bytes(_manifest_json(now))
            meta = SnapshotMeta(
                id=snap_id, tenant=tenant, sandbox_id=sandbox_id, backend=backend, parent=parent,
                depth=depth, created_at=time.time(), bytes=size, keep=keep, layers=layers,
            )  # fmt: skip
            (tmp / "meta.json").write_text(meta.model_dump_json())
            if parent:
                self.hold(parent, f"snap.{snap_id}")
            else:
                self._pin(meta)
            tmp.rename(self._dir(snap_id))
        except BaseException:
            remove_tree(tmp)
            if parent is None:
                self._unpin(snap_id, layers)
            raise
        return meta

    def _pin(self, meta: SnapshotMeta) -> None:
        for digest in meta.layers:
            self.store.pin(digest, f"@snapshot/{meta.id}")

    def _unpin(self, snap_id: str, layers: list[str]) -> None:
        for digest in layers:
            self.store.unpin(digest, f"@snapshot/{snap_id}")

    # -- collecting ------------------------------------------------------------------------------

    def gc(self) -> list[str]:
        """Delete snapshots nothing holds, not kept, unused for ``grace_s``; returns their ids.
        What a failed deletion or an interrupted snapshot left (``.trash-*`` and ``.tmp-*``
        untouched for an hour: not another node's work in progress) goes too."""
        for left in [*self.root.glob(".trash-*"), *self.root.glob(".tmp-*")]:
            try:
                if time.time() - left.lstat().st_ctime > LEFTOVER_S:
                    remove_tree(left)
            except OSError:  # another node's collection took it meanwhile
                pass
        removed: list[str] = []
        progress = True
        while progress:  # deleting a snapshot releases its parents
            progress = False
            for d in self.root.glob("snap-*"):
                try:
                    meta = SnapshotMeta.model_validate_json((d / "meta.json").read_text())
                    idle = time.time() - d.stat().st_mtime
                    held = any((d / "holds").iterdir())
                except (FileNotFoundError, NotADirectoryError):
                    continue
                if meta.keep or held or idle < self.grace_s:
                    continue
                trash = self.root / f".trash-{d.name}"
                try:
                    d.rename(trash)
                except FileNotFoundError:
                    continue  # another node took it
                if any((trash / "holds").iterdir()):  # a hold arrived meanwhile: put it back
                    trash.rename(d)
                    continue
                if meta.parent:
                    self.release([meta.parent], f"snap.{meta.id}")
                else:
                    self._unpin(meta.id, meta.layers)
                remove_tree(trash)
                removed.append(meta.id)
                progress = True
        return removed


def _manifest_json(listing: dict[str, Entry]) -> bytes:
    """``listing`` as JSON, names as their bytes on disk (what scan counted them as): not
    ASCII-escaped, which made non-UTF-8 names six times as long. (Manifests written escaped
    read the same.)"""
    text = json.dumps({k: v.as_list() for k, v in listing.items()}, ensure_ascii=False)
    return text.encode("utf-8", "surrogateescape")


def _copy_changes(
    upper: Path, now: dict[str, Entry], before: dict[str, Entry], delta: Path, merge: bool = False
) -> int:
    """Write into ``delta`` what ``upper`` changed since ``before``; returns bytes copied.

    With ``merge``, ``delta`` already holds older changes and is overwritten where needed.
    """
    size = 0
    fresh: set[str] = set()  # directories that became opaque, and those below: all is new
    made: set[str] = {""}  # directories known to be in ``delta`` (so not checked again)
    links: Links = {}
    with Tree(upper) as src, Tree(delta) as dst:
        for rel, e in now.items():  # (parents first: a scan's order)
            checkpoint()
            old = before.get(rel)
            if rel.rpartition("/")[0] in fresh:
                if e.kind == "d":
                    fresh.add(rel)
            elif old == e:
                continue
            try:
                _parents(src, dst, rel, made)
                if e.kind == "d":
                    have = kind_at(dst, rel)
                    made.add(rel)
                    if have == "d" and not e.opaque:
                        continue  # already there (merge), or made as a parent
                    remove(dst, rel)
                    copy_entry(src, dst, rel)
                    if e.opaque and (old is None or not old.opaque or merge):
                        fresh.add(rel)
                    continue
                remove(dst, rel)
                size += copy_entry(src, dst, rel, links=links)
            except (FileNotFoundError, NotADirectoryError):
                made.discard(rel)
                continue  # changed while read (only a paused or idle sandbox is still)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
        gone = {rel for rel in before if rel not in now}
        for rel in sorted(gone):
            checkpoint()
            if rel.rpartition("/")[0] in gone:
                continue  # a deleted directory's whiteout covers its contents (listings hold
                # every entry's parent: one gone above means its parent is gone too)
            try:
                _parents(src, dst, rel, made)
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
            remove(dst, rel)
            whiteout(dst, rel)
        date_dirs(dst, now, made, src)
    return size


def _parents(src: Tree, dst: Tree, rel: str, made: set[str]) -> None:
    """Make ``rel``'s missing parent directories in ``dst``, as they are in ``src``; those
    in ``made`` are known to be there already (so are their ancestors: only the missing are
    climbed to, not every ancestor's path built for each entry)."""
    missing = [rel.rpartition("/")[0]]
    while missing[-1] not in made:
        missing.append(missing[-1].rpartition("/")[0])
    for cur in reversed(missing[:-1]):
        if kind_at(dst, cur) != "d":
            remove(dst, cur)
            try:
                if kind_at(src, cur) == "d":
                    copy_entry(src, dst, cur, opaque=False)
                    made.add(cur)
                    continue
            except (FileNotFoundError, NotADirectoryError):
                pass
            d, name = dst.parent(cur)
            os.mkdir(name, 0o755, dir_fd=d)
        made.add(cur)


def _tree_bytes(root: Path) -> int:
    return sum(e.size for e in scan(root).values() if e.kind == "f")
