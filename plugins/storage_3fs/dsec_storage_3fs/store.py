"""The ``3fs`` layer store: EROFS images in a directory every node reaches, mounted on demand.

Store layout, under ``root`` (3FS, CephFS, NFS... or a local disk for one machine)::

    blobs/sha256/<hex>.erofs       images, named by the sha256 of their bytes
    layers/<name>/<version>.json   public catalog records (the Layer model as JSON)
    layers/@<tenant>/<name>/<version>.json
                                   a tenant's records ('@' starts no layer name, so the
                                   namespaces never meet; records written before owners
                                   existed are where public ones are)
    holds/<hex>/<holder>           one file per holder of an image; the holder URL-quoted
                                   ("node-1/sb-7" -> "node-1%2Fsb-7")
    snapshots/                     backends' snapshots (snapshots_root())
    locks/@<tenant>                one empty file per tenant, flock()ed while an import of
                                   its checks the tenant's bounds and adds its layer
    tmp/                           imports in progress (same filesystem: the final rename is
                                   atomic); removed on failure, leftovers of killed imports by
                                   gc() after a day

Every file is written under a temporary name in its own directory and renamed, so no node
ever reads a partial file. Node-local, under ``cache_dir``::

    catalog/[@<tenant>/]<name>/<version>.json
                                   copies of records, used while the store file's mtime and
                                   size are unchanged (records never change in place)
    mounts/<hex>                   the one read-only mount of each image in use on this node

Concurrency: imports of the same content from several nodes are safe (same digest, same
record). Two imports of one ``name:version`` with *different* content at the same instant
both rename their record; the read-back after the rename makes the loser a Conflict unless it
read back before the winner's rename (a narrow window): import each name:version from one place.
An image whose record never got written (a failed import) is collected by :meth:`gc` after
``gc_grace_s``. A tenant's import checks that its name:version is not public; an operator
import of the same name:version at that instant makes the tenant's layer shadowed (resolve
finds public layers first), never the other way round.

Bounds on a tenant's layers (public ones, the operator's, are not counted): at most
``tenant_max_layers`` records in its namespace, and its images at most ``tenant_max_bytes``,
each distinct image its records name counted in full, by the blocks it takes in the store,
however many of its records name it and whoever else (the public catalog, other tenants)
names it too: what a tenant is charged never depends on what others did, so it tells
nothing of them, and no tenant holds an image on another's account. A tenant at either bound
is refused (QuotaExceeded) before its tree is built; one whose new image would take it past
``tenant_max_bytes`` after the build, and the built image is dropped. The last checks and the
adding of the layer run under the tenant's lock file, so concurrent imports of one tenant on
several nodes do not both pass (on a store filesystem without locks they may: each can pass
by one image). Re-importing a layer it has is never refused.

Registered with an apiserver's hooks (:func:`dsec_kernel.layercheck.layer_store_plugins`),
the store answers ``dsec_layer_resolve`` from its catalog, so a create's layers are checked
before the create is placed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import re
import tempfile
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec_kernel.config import default_state_dir
from dsec_kernel.contract.errors import (
    Conflict,
    DsecError,
    Internal,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
)
from dsec_kernel.contract.hookspecs import hookimpl
from dsec_kernel.contract.store import GcReport, Layer, LayerStore, LayerUsage, Progress
from dsec_kernel.contract.wire.base import NAME_PATTERN
from dsec_kernel.contract.wire.sandbox import (
    LAYER_KINDS,
    LAYER_NAME_PATTERN,
    LAYER_VERSION_PATTERN,
    LayerKind,
    LayerRef,
)
from dsec_kernel.linuxhost.fileio import remove_tree
from dsec_storage_3fs import erofs
from dsec_storage_3fs.build import Built, build_image, size_text
from dsec_storage_3fs.mounts import NodeMounts
from dsec_storage_3fs.pagecache import resident_bytes, tree_resident_bytes

__all__ = ["ThreeFsConfig", "ThreeFsStore"]

_NAME = re.compile(LAYER_NAME_PATTERN)
_VERSION = re.compile(LAYER_VERSION_PATTERN)
_TENANT = re.compile(NAME_PATTERN)
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
_TMP_MAX_AGE_S = 86400.0
_GIB = 1 << 30


class ThreeFsConfig(BaseModel):
    """Settings (``extra="forbid"``)."""

    model_config = ConfigDict(extra="forbid")

    root: Path = Field(
        default_factory=lambda: default_state_dir() / "layers",
        description="the store directory, shared by every node",
    )
    cache_dir: Path | None = Field(
        None, description="node-local record cache and mount points; <state dir>/layer-cache"
    )
    compression: str | None = Field(
        None, description="mkfs.erofs -z (lz4, lz4hc); None: uncompressed, fastest to build"
    )
    gc_grace_s: float = Field(
        600.0, ge=0, description="gc keeps unnamed images younger than this (imports in flight)"
    )
    direct_io: bool = Field(
        True, description="read image data with direct I/O: cached once, no readahead waste"
    )
    build_max_bytes: int = Field(
        64 * _GIB,
        ge=0,
        description="most bytes of file data one import may build from, by apparent size "
        "(holes count: mkfs.erofs reads them); more is refused before the build",
    )
    build_timeout_s: float = Field(
        900.0, gt=0, description="longest mkfs.erofs may run; then it is killed, the import fails"
    )
    tenant_max_layers: int = Field(
        256, ge=0, description="most layer versions (records) one tenant may keep in the store"
    )
    tenant_max_bytes: int = Field(
        64 * _GIB,
        ge=0,
        description="most bytes (allocated blocks) the images of one tenant's layers may take",
    )


class ThreeFsStore(LayerStore):
    """Layers as EROFS images in a shared directory; see the module docstring for the layout."""

    name = "3fs"
    Config = ThreeFsConfig

    @classmethod
    def node_defaults(cls, state_dir: Path) -> dict[str, Any]:
        """An edge's mounts are its node's: kept with the edge's own state."""
        return {"cache_dir": str(state_dir / "layer-cache")}

    def __init__(self, config: ThreeFsConfig | None = None) -> None:
        super().__init__(config)
        self.root: Path = self.config.root
        if not self.root.exists():  # a store this makes is root's alone: tenants' layers are
            self.root.mkdir(mode=0o700, parents=True)  # in it (an operator's keeps its modes)
        self.cache_dir: Path = self.config.cache_dir or default_state_dir() / "layer-cache"
        self._mounts = NodeMounts(self.cache_dir / "mounts", self.config.direct_io)
        self._sizes: dict[str, int] = {}  # digest -> image size, from records read

    # -- catalog -----------------------------------------------------------------------------

    def import_layer(
        self,
        source: str,
        kind: LayerKind,
        name: str,
        version: str,
        progress: Progress | None = None,
        *,
        tenant: str | None = None,
        under: str = "",
        strip: int = 0,
    ) -> Layer:
        if kind not in LAYER_KINDS:
            raise InvalidArgument(f"layer kind {kind!r} is not one of {', '.join(LAYER_KINDS)}")
        _check_ref(name, version)
        _scope(tenant)  # InvalidArgument for a bad tenant name
        if tenant is not None and self._record(name, version, None).exists():
            raise Conflict(
                f"layer {name}:{version} is a public layer, and public names mean the same "
                "layer for every tenant; publish yours under another name or version",
                retryable=False,
            )
        say = progress or (lambda _msg: None)
        work = None
        try:
            if tenant is not None:  # at a bound already: refused before any work
                self._charge(tenant, name, version, None)
            (self.root / "tmp").mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix="import-", dir=self.root / "tmp"))
            built = build_image(
                Path(source),
                work,
                self.config.compression,
                say,
                max_bytes=self.config.build_max_bytes,
                timeout_s=self.config.build_timeout_s,
                under=under,
                strip=strip,
            )
            with self._tenant_lock(tenant):
                return self._add(built, kind, name, version, source, tenant, say)
        except DsecError:
            raise
        except OSError as e:
            where = f" for tenant {tenant}" if tenant else ""
            raise Internal(f"importing {source} as {name}:{version}{where} failed: {e}") from e
        finally:
            if work is not None:
                remove_tree(work)

    def _add(
        self,
        built: Built,
        kind: LayerKind,
        name: str,
        version: str,
        source: str,
        tenant: str | None,
        say: Progress,
    ) -> Layer:
        """Put the built image in the store and name it ``name:version`` (the same content
        again: the existing record), once the tenant's bounds allow it."""
        existing = self._read_record(name, version, tenant)
        if existing is not None:
            _same(existing, built.digest, kind)
        elif tenant is not None:
            self._charge(tenant, name, version, built)
        say("publishing")
        self._publish(built)  # also repairs a blob of the wrong size
        if existing is not None:
            return existing
        layer = Layer(
            digest=built.digest,
            kind=kind,
            name=name,
            version=version,
            size=built.size,
            files=built.files,
            created_at=time.time(),
            source=os.path.abspath(source),
            tenant=tenant,
        )
        record = layer.model_dump_json(indent=2).encode()
        _atomic_write(self._record(name, version, tenant), record)
        final = self._read_record(name, version, tenant)  # a concurrent import may have won
        return _same(final or layer, built.digest, kind)

    def list_layers(self, tenant: str | None = None) -> list[Layer]:
        """Public layers first, then each owner's (sorted by owner, name, version)."""
        owners = [tenant] if tenant is not None else self._tenants()
        return [layer for owner in [None, *owners] for layer in self._records(owner)]

    def resolve(
        self, name: str, version: str, kind: LayerKind | None = None, *, tenant: str | None = None
    ) -> Layer:
        """The public record, else the tenant's own; each read from the node cache while the
        store's record is unchanged. Other tenants' records are never looked at."""
        _check_ref(name, version)
        _scope(tenant)  # InvalidArgument for a bad tenant name
        layer = self._lookup(name, version, None)
        if layer is None and tenant is not None:
            layer = self._lookup(name, version, tenant)
        if layer is None:
            raise NotFound(self._missing(name, version, tenant))
        if kind is not None and layer.kind != kind:
            raise NotFound(f"layer {layer.ref} is a {layer.kind} layer, not a {kind} layer")
        return layer

    def remove(
        self, name: str, version: str, force: bool = False, *, tenant: str | None = None
    ) -> Layer:
        _check_ref(name, version)
        layer = self._read_record(name, version, tenant)
        if layer is None:
            owner = "the public catalog" if tenant is None else f"tenant {tenant}"
            raise NotFound(f"{owner} has no layer {name}:{version}")
        held = self.holders(layer.digest)
        shared = any(
            o.digest == layer.digest and (o.tenant, o.ref) != (tenant, layer.ref)
            for o in self.list_layers()
        )
        if held and not shared and not force:
            raise Conflict(
                f"layer {layer.ref} is in use by {', '.join(held)}; remove it once they release "
                "it, or with force if their nodes are gone (the image stays until its holds go)"
            )
        record = self._record(name, version, tenant)
        record.unlink(missing_ok=True)
        self._cached(name, version, tenant).unlink(missing_ok=True)
        for empty in (record.parent, record.parent.parent) if tenant else (record.parent,):
            try:
                empty.rmdir()
            except OSError:  # other versions (or names) remain
                break
        return layer

    def gc(self) -> GcReport:
        """Delete images no record names and nobody holds (older than ``gc_grace_s``), empty
        hold directories, and temporary files of imports killed over a day ago."""
        named = {layer.digest for layer in self.list_layers()}
        now = time.time()
        report = GcReport()
        for blob in sorted(self.root.glob("blobs/sha256/*.erofs")):
            digest = f"sha256:{blob.stem}"
            if not _DIGEST.match(digest) or digest in named or self.holders(digest):
                continue
            try:
                st = blob.stat()
                if now - st.st_mtime < self.config.gc_grace_s:
                    continue
                blob.unlink()
            except FileNotFoundError:
                continue
            report.removed.append(digest)
            report.bytes_freed += st.st_size
        for holds in self.root.glob("holds/*"):
            try:
                holds.rmdir()  # only if empty
            except OSError:
                pass
        for leftover in self.root.glob("tmp/*"):
            with contextlib.suppress(FileNotFoundError):
                if now - leftover.lstat().st_mtime > _TMP_MAX_AGE_S:
                    remove_tree(leftover)
        return report

    def image_path(self, digest: str) -> Path:
        path = self._blob(digest)
        if not path.is_file():
            raise NotFound(
                f"the image of {digest} is missing from the store; import the layer again"
            )
        return path

    def snapshots_root(self) -> Path:
        path = self.root / "snapshots"
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)  # sandboxes' files (setuid ones too): root's eyes only
        return path

    # -- node side ---------------------------------------------------------------------------

    def mount(self, digest: str, holder: str) -> Path:
        """Mount read-only at ``cache_dir/mounts/<hex>`` (shared by this node's holders) after
        checking the image: its size against the catalog and the EROFS magic (InvalidArgument
        if damaged; nothing mounted, no hold left)."""
        image = self.image_path(digest)
        hold = self._hold(digest, holder)
        _atomic_write(hold, json.dumps({"holder": holder, "since": time.time()}).encode())
        try:
            return self._mounts.acquire(digest, holder, image, lambda: self._check(digest, image))
        except BaseException:
            hold.unlink(missing_ok=True)
            raise

    def release(self, digest: str, holder: str) -> None:
        self._hold(digest, holder).unlink(missing_ok=True)
        self._mounts.release(digest, holder)

    def pin(self, digest: str, holder: str) -> None:
        if not holder.startswith("@"):
            raise InvalidArgument(f"pin holder {holder!r} must start with '@'")
        self.image_path(digest)  # NotFound if gone
        _atomic_write(self._hold(digest, holder), json.dumps({"holder": holder}).encode())

    def unpin(self, digest: str, holder: str) -> None:
        self._hold(digest, holder).unlink(missing_ok=True)

    def holders(self, digest: str) -> list[str]:
        try:
            names = os.listdir(self.root / "holds" / _hex(digest))
        except FileNotFoundError:
            return []
        return sorted(unquote(n) for n in names if not n.startswith("."))

    def usage(self, digest: str) -> LayerUsage:
        """Bytes of the image in this node's page cache: its own pages (all it read, with
        buffered mounts; its metadata, with direct I/O) plus, while it is mounted, the pages
        of the files in the mount (what direct I/O read)."""
        resident, size = resident_bytes(self.image_path(digest))
        mountpoint = self.mounted().get(digest)
        if mountpoint is not None:
            resident += tree_resident_bytes(mountpoint)
        return LayerUsage(digest=digest, size=size, bytes_read=min(resident, size))

    def mounted(self) -> dict[str, Path]:
        """digest -> mount point of every image of this store mounted on this node."""
        return self._mounts.mounted()

    def adopt(self, node: str) -> dict[str, list[str]]:
        """Take over this node's state after its process restarted; call once, before any
        :meth:`mount`. Holds of ``node`` (holders ``"<node>/..."``) on a mounted image become
        its refcount here; a mounted image no holder of ``node`` holds is unmounted; holds of
        ``node`` on an image that is not mounted are stale (the node rebooted) and removed.
        Returns digest -> holders of ``node`` now counted, so the caller can release those
        whose sandboxes are gone."""
        prefix = f"{node}/"
        mounted = self.mounted()
        kept: dict[str, list[str]] = {}
        for holds in self.root.glob("holds/*"):
            digest = f"sha256:{holds.name}"
            if not _DIGEST.match(digest):
                continue
            mine = [h for h in self.holders(digest) if h.startswith(prefix)]
            if mine and digest in mounted:
                kept[digest] = mine
            for holder in mine if digest not in mounted else ():
                self._hold(digest, holder).unlink(missing_ok=True)
        for digest in mounted:
            if digest in kept:
                self._mounts.adopt(digest, kept[digest])
            else:
                self._mounts.unmount(digest)
        return kept

    # -- hooks (an apiserver registers its layer store) --------------------------------------

    @hookimpl
    def dsec_layer_resolve(self, tenant: str, ref: LayerRef) -> Awaitable[Layer]:
        """A create's layer, checked on the apiserver before it is placed: :meth:`resolve`,
        in a thread (it reads the catalog's files)."""
        return asyncio.to_thread(self.resolve, ref.name, ref.version, ref.kind, tenant=tenant)

    # -- internals ---------------------------------------------------------------------------

    def _blob(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / f"{_hex(digest)}.erofs"

    def _record(self, name: str, version: str, tenant: str | None) -> Path:
        return self.root / "layers" / _scope(tenant) / name / f"{version}.json"

    def _cached(self, name: str, version: str, tenant: str | None) -> Path:
        return self.cache_dir / "catalog" / _scope(tenant) / name / f"{version}.json"

    def _tenants(self) -> list[str]:
        """Owners with a namespace in the store."""
        return sorted(
            p.name[1:] for p in (self.root / "layers").glob("@*") if _TENANT.fullmatch(p.name[1:])
        )

    def _records(self, owner: str | None) -> list[Layer]:
        """The layers in ``owner``'s namespace (None: the public ones), by name and version."""
        layers = []
        for path in sorted((self.root / "layers" / _scope(owner)).glob("*/*.json")):
            if not path.name.startswith("."):
                try:
                    layers.append(self._parse(path.read_bytes(), path, owner))
                except FileNotFoundError:  # removed meanwhile
                    continue
        return layers

    def _charge(self, tenant: str, name: str, version: str, built: Built | None) -> None:
        """QuotaExceeded if ``tenant`` may not add ``name:version`` with the image ``built``
        (None, before the build: if it is at a bound already). A re-import passes."""
        owned = self._records(tenant)
        if any((x.name, x.version) == (name, version) for x in owned):
            return
        remove = f"ask the operator to remove some (dsec layer rm --tenant {tenant} NAME:VERSION)"
        if len(owned) >= self.config.tenant_max_layers:
            raise QuotaExceeded(
                f"tenant {tenant} has {len(owned)} layers, the most one tenant may keep "
                f"(tenant_max_layers); {remove} before publishing {name}:{version}"
            )
        digests = {x.digest for x in owned}
        used = sum(self._blob_bytes(digest) for digest in digests)
        cap = self.config.tenant_max_bytes
        if built is None:
            if used >= cap:
                raise QuotaExceeded(
                    f"the images of tenant {tenant}'s layers take {size_text(used)} of the "
                    f"{size_text(cap)} one tenant may (tenant_max_bytes); {remove} before "
                    f"publishing {name}:{version}"
                )
            return
        cost = 0 if built.digest in digests else _allocated(built.image.stat())
        if used + cost > cap:
            raise QuotaExceeded(
                f"layer {name}:{version} would add {size_text(cost)} to the {size_text(used)} "
                f"tenant {tenant}'s layers take, more than the {size_text(cap)} one tenant may "
                f"(tenant_max_bytes); publish less, or {remove}"
            )

    def _blob_bytes(self, digest: str) -> int:
        """What the image of ``digest`` takes in the store (0 if it is missing)."""
        try:
            return _allocated(self._blob(digest).stat())
        except FileNotFoundError:
            return 0

    @contextlib.contextmanager
    def _tenant_lock(self, tenant: str | None) -> Iterator[None]:
        """Hold ``locks/@<tenant>`` (nothing for public imports) while checking its bounds
        and adding a layer; unlocked where the store's filesystem has no locks."""
        if tenant is None:
            yield
            return
        path = self.root / "locks" / _scope(tenant)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
            yield
        finally:
            os.close(fd)  # (which unlocks)

    def _lookup(self, name: str, version: str, tenant: str | None) -> Layer | None:
        """The record of ``name:version`` in ``tenant``'s namespace (None: public), through
        the node cache; None if there is none."""
        path = self._record(name, version, tenant)
        try:
            st = path.stat()
            cached = self._cached(name, version, tenant)
            try:
                cst = cached.stat()
                fresh = (cst.st_mtime_ns, cst.st_size) == (st.st_mtime_ns, st.st_size)
                raw = cached.read_bytes() if fresh else None
            except FileNotFoundError:
                raw = None
            if raw is None:
                raw = path.read_bytes()
                _atomic_write(cached, raw, mtime_ns=st.st_mtime_ns)
        except FileNotFoundError:  # none, or removed meanwhile
            return None
        return self._parse(raw, path, tenant)

    def _hold(self, digest: str, holder: str) -> Path:
        if not holder or holder.startswith(".") or len(holder) > 200:
            raise InvalidArgument(
                f"holder {holder!r} must be 1-200 characters not starting with '.', "
                "e.g. '<node>/<sandbox id>'"
            )
        return self.root / "holds" / _hex(digest) / quote(holder, safe="")

    def _publish(self, built: Built) -> None:
        blob = self._blob(built.digest)
        with contextlib.suppress(FileNotFoundError):
            if blob.stat().st_size == built.size:  # already there: refresh its age for gc
                os.utime(blob)
                return
        blob.parent.mkdir(parents=True, exist_ok=True)  # absent, or damaged: (re)place it
        with built.image.open("rb") as f:
            os.fsync(f.fileno())
        os.rename(built.image, blob)

    def _read_record(self, name: str, version: str, tenant: str | None) -> Layer | None:
        path = self._record(name, version, tenant)
        try:
            return self._parse(path.read_bytes(), path, tenant)
        except FileNotFoundError:
            return None

    def _parse(self, raw: bytes, path: Path, tenant: str | None) -> Layer:
        """The record at ``path``, owned by ``tenant``: where a record lies decides whose it
        is, whatever it says (records older than owners say nothing, and are public)."""
        try:
            layer = Layer.model_validate_json(raw)
        except ValidationError as e:
            where = path.relative_to(self.root)
            raise Internal(
                f"catalog record {where} of the store is unreadable ({e}); remove it"
            ) from None
        self._sizes[layer.digest] = layer.size
        return layer if layer.tenant == tenant else layer.model_copy(update={"tenant": tenant})

    def _check(self, digest: str, image: Path) -> None:
        """Cheap corruption checks before a mount: size as recorded, EROFS magic."""
        size = self._sizes.get(digest)
        if size is None:
            size = next((x.size for x in self.list_layers() if x.digest == digest), None)
        if size is None:
            raise NotFound(f"no layer in the catalog names {digest}; resolve a layer first")
        actual = image.stat().st_size
        if actual != size:
            raise InvalidArgument(
                f"the image of {digest} has {actual} bytes where the catalog says {size}: it is "
                "damaged; remove the layer and import it again"
            )
        erofs.check_magic(image)

    def _missing(self, name: str, version: str, tenant: str | None) -> str:
        """Why ``name:version`` is not found, from what ``tenant`` may see only (the same
        words whether or not another tenant has such a layer; no store path)."""
        versions = sorted(
            {
                p.stem
                for owner in {None, tenant}
                for p in (self.root / "layers" / _scope(owner) / name).glob("*.json")
                if p.name[0] != "."
            }
        )
        have = f"{name} has versions {', '.join(versions)}" if versions else f"none is named {name}"
        return (
            f"layer {name}:{version} is not in the layer store ({have}); publish a snapshot "
            "under that name, or have the operator import it (`dsec layer import`)"
        )


def _check_ref(name: str, version: str) -> None:
    if not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"layer name {name!r} must be 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if not _VERSION.fullmatch(version):
        raise InvalidArgument(
            f"layer version {version!r} must be 1-128 letters, digits, '.', '_', '+' or '-', "
            "starting with a letter or digit"
        )


def _scope(tenant: str | None) -> Path:
    """The part of a record's path that names its owner: none for public layers."""
    if tenant is None:
        return Path()
    if not _TENANT.fullmatch(tenant):
        raise InvalidArgument(
            f"tenant {tenant!r} must be 1-63 letters, digits, '_' or '-', starting with a "
            "letter or digit"
        )
    return Path(f"@{tenant}")


def _hex(digest: str) -> str:
    m = _DIGEST.match(digest)
    if m is None:
        raise InvalidArgument(f"digest {digest!r} is not 'sha256:' and 64 lowercase hex digits")
    return m[1]


def _same(existing: Layer, digest: str, kind: str) -> Layer:
    """``existing`` if it is this content of this kind, else the Conflict of two contents."""
    if (existing.digest, existing.kind) != (digest, kind):
        raise Conflict(
            f"layer {existing.ref} already exists as {existing.kind} {existing.digest}; this "
            f"source is {kind} {digest}. Import it under a new version, or remove "
            f"{existing.ref} first",
            retryable=False,
        )
    return existing


def _allocated(st: os.stat_result) -> int:
    """Bytes of the blocks a file takes (its size where the filesystem reports no blocks)."""
    return st.st_blocks * 512 if st.st_blocks or not st.st_size else st.st_size


def _atomic_write(path: Path, data: bytes, mtime_ns: int | None = None) -> None:
    """Write ``path`` whole or not at all: a temporary name in its directory, then rename."""
    for attempt in range(3):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        except FileNotFoundError:  # gc or remove() took the empty directory meanwhile
            if attempt == 2:
                raise
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            if mtime_ns is not None:
                os.utime(tmp, ns=(mtime_ns, mtime_ns))
            os.rename(tmp, path)
            return
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
