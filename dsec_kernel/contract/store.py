"""The layer-store contract: what a ``dsec.storage`` plugin implements.

A layer is a read-only filesystem image (EROFS for the ``3fs`` store), content addressed by
the digest of the image, with a kind (``base``: OS and runtimes; ``workspace``: a task's or
repository's files; ``toolkit``: harness and tools), a name and a version. An environment is
``base + workspace + toolkits``, composed when a sandbox starts.

Layers belong to someone. A *public* layer (``tenant`` None) is imported by the operator
(``dsec layer import``) and every tenant may run it; a tenant's layer (a snapshot it published,
or one imported on its behalf) lives in that tenant's own namespace, so tenants' names never
collide and no tenant can see, run, shadow or squat another's. Resolving as a tenant finds a
public layer first, then the tenant's own: a ``name:version`` that is public means the same
image for everyone, so a trainer naming ``debian:12`` always gets the operator's ``debian:12``
whatever its own jobs published (a tenant cannot import a public name; a tenant's layer that a
later operator import makes public is shadowed, never the other way round). A layer that is
not visible is NotFound with the same message as one that does not exist. Images are shared
by content whoever owns the records; holds, pins and snapshots are per digest.

A *recipe* (entry-point group ``dsec.recipes``, :class:`LayerRecipe`) builds the tree of one
well-known layer, such as a base image, so that ``dsec layer build NAME`` can make it without
a root filesystem at hand (with more packages, ``--packages``, as a version of its own);
:func:`ensure_layer` imports a tree only if the store lacks its layer.

The store has a *catalog* (layers, their images, snapshots) on a filesystem every node can
reach (3FS, CephFS, NFS... or a local directory on one machine) and a *node side*: each node
mounts the images it needs directly from the store path, once per node, and caches metadata
on local disk. Sandbox writes never go to the store. Methods are synchronous (file work);
callers run them in a thread. Failures raise :class:`~dsec_kernel.contract.errors.DsecError`.
"""

from __future__ import annotations

import abc
import hashlib
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from dsec_kernel.contract.config import NoConfig
from dsec_kernel.contract.errors import InvalidArgument, NotFound
from dsec_kernel.contract.wire.base import NAME_PATTERN
from dsec_kernel.contract.wire.sandbox import (
    LAYER_NAME_PATTERN,
    LAYER_VERSION_PATTERN,
    LayerKind,
    LayerRef,
)

__all__ = [
    "GcReport",
    "Layer",
    "LayerRecipe",
    "LayerStore",
    "LayerUsage",
    "Progress",
    "ensure_layer",
]

Progress = Callable[[str], None]


class Layer(BaseModel):
    """A layer's catalog record."""

    model_config = ConfigDict(extra="ignore")

    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$", description="digest of the image")
    kind: LayerKind
    name: str = Field(pattern=LAYER_NAME_PATTERN)
    version: str = Field(pattern=LAYER_VERSION_PATTERN)
    size: int = Field(ge=0, description="image bytes")
    files: int = Field(0, ge=0, description="entries in the filesystem")
    created_at: float = 0.0
    source: str = Field("", description="where it was imported from")
    tenant: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="the owner; None: public (imported by the operator, and records older "
        "than owners)",
    )

    @property
    def ref(self) -> str:
        """``name:version``, as people write it."""
        return f"{self.name}:{self.version}"

    @property
    def listed(self) -> str:
        """The layer as nodes list it (:meth:`LayerRef.listed_as` its owner)."""
        return LayerRef(name=self.name, version=self.version, kind=self.kind).listed_as(self.tenant)


class LayerUsage(BaseModel):
    """How much of a layer's image this node has read (the on-demand claim, measured)."""

    digest: str
    size: int
    bytes_read: int

    @property
    def fraction(self) -> float:
        return self.bytes_read / self.size if self.size else 0.0


class GcReport(BaseModel):
    removed: list[str] = Field(default_factory=list, description="digests or snapshot ids")
    bytes_freed: int = 0


class LayerStore(abc.ABC):
    """A layer store driver (entry-point group ``dsec.storage``)."""

    name: ClassVar[str]
    Config: ClassVar[type[BaseModel]] = NoConfig
    preference: ClassVar[int] = 100  # the lowest installed runs when none is named

    def __init__(self, config: BaseModel | None = None) -> None:
        self.config = config if config is not None else self.Config()

    @classmethod
    def node_defaults(cls, state_dir: Path) -> dict[str, Any]:
        """Configuration a node's edge gives the store where the operator gave none
        (e.g. where this node's mounts live, under the edge's ``state_dir``)."""
        return {}

    # -- catalog -----------------------------------------------------------------------------

    @abc.abstractmethod
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
        """Build a layer from a directory, a tar / tar.gz, or an OCI image layout (its layers
        flattened in order, whiteouts applied) and add it to the catalog: public when
        ``tenant`` is None, else in that tenant's namespace. An archive's entries may be
        placed: each without the first ``strip`` components of its path, under the directory
        ``under`` (``name-1.0/setup.py`` with ``strip=1, under="workspace"`` is
        ``/workspace/setup.py``); other sources take neither (InvalidArgument). The same
        source always gives the same image. Importing the same name:version
        (in the same namespace) again with different content is a Conflict; with the same
        content, a no-op returning the existing record. A tenant's import of a name:version
        that is public is a Conflict. Nothing is left behind on failure."""

    @abc.abstractmethod
    def list_layers(self, tenant: str | None = None) -> list[Layer]:
        """What ``tenant`` may use (the public layers and its own); None: every layer of
        every owner (the operator's view)."""

    @abc.abstractmethod
    def resolve(
        self, name: str, version: str, kind: LayerKind | None = None, *, tenant: str | None = None
    ) -> Layer:
        """The layer ``name:version`` (of ``kind`` when given) as ``tenant`` sees it: the
        public one, else the tenant's own (None: public only). NotFound otherwise, with a
        message that says nothing of other tenants' layers."""

    @abc.abstractmethod
    def remove(
        self, name: str, version: str, force: bool = False, *, tenant: str | None = None
    ) -> Layer:
        """Remove ``name:version`` of ``tenant`` (None: the public one; never falls back from
        one namespace to the other) from the catalog; Conflict (naming the holders) while any
        sandbox holds its image and no other record names it, unless ``force`` (for holders
        on nodes that are gone). The image itself goes at the next :meth:`gc` if nothing
        else names it."""

    @abc.abstractmethod
    def gc(self) -> GcReport:
        """Delete images no layer of any owner names and nothing holds."""

    @abc.abstractmethod
    def image_path(self, digest: str) -> Path:
        """Where the image of ``digest`` lives in the store (NotFound if it does not)."""

    @abc.abstractmethod
    def snapshots_root(self) -> Path:
        """A directory in the store where backends keep snapshots (shared by all nodes)."""

    # -- node side ---------------------------------------------------------------------------

    @abc.abstractmethod
    def mount(self, digest: str, holder: str) -> Path:
        """Mount the image read-only on this node (once; later calls share the mount) and
        record that ``holder`` (e.g. ``node/sandbox-id``) uses it. Returns the mount point.
        A missing or corrupt image raises NotFound / InvalidArgument and mounts nothing."""

    @abc.abstractmethod
    def release(self, digest: str, holder: str) -> None:
        """``holder`` no longer uses the layer; the last release unmounts it. Idempotent."""

    @abc.abstractmethod
    def pin(self, digest: str, holder: str) -> None:
        """Hold the layer without mounting it, for something built on it (a snapshot):
        ``remove`` refuses and ``gc`` keeps it while pinned. NotFound if the image is gone.
        Holders of pins start with ``@`` (e.g. ``@snapshot/<id>``), never a node name."""

    @abc.abstractmethod
    def unpin(self, digest: str, holder: str) -> None:
        """Drop a pin. Idempotent."""

    @abc.abstractmethod
    def holders(self, digest: str) -> list[str]:
        """Who holds the layer, on any node."""

    @abc.abstractmethod
    def usage(self, digest: str) -> LayerUsage:
        """Bytes of the image this node has read (page cache residency), and its size."""

    @abc.abstractmethod
    def mounted(self) -> dict[str, Path]:
        """digest -> mount point of every image mounted on this node."""

    @abc.abstractmethod
    def adopt(self, node: str) -> dict[str, list[str]]:
        """After a restart on ``node``: take over the mounts still there (with the holds of
        this node's holders), unmount those nobody holds, forget holds whose image is no
        longer mounted. Returns digest -> holders adopted."""


class LayerRecipe(abc.ABC):
    """How to build the tree of one layer, ``name:version`` of ``kind`` (entry-point group
    ``dsec.recipes``; the entry point's name is what ``dsec layer build`` takes).

    A recipe may take more packages to install (``dsec layer build NAME --packages a,b``):
    ``packages_from`` says from where (None: it takes none). Built with packages beyond its
    own, a recipe makes another version of its layer, named after them
    (:meth:`version_for`), so that it can never be taken for the default.

    A recipe must be reproducible: built again, later or on another machine, from the same
    inputs (the same packages, the same binary), its tree gives the same image, so that every
    store and every node agrees on what ``name:version`` holds."""

    kind: ClassVar[LayerKind]
    name: ClassVar[str]
    version: str  # the default's; an instance with more packages has its own
    summary: ClassVar[str]  # one line: what the tree holds, and what building it takes
    packages_from: ClassVar[str | None] = None  # e.g. "Debian 12"; None: takes no packages

    def __init__(self, packages: Sequence[str] = ()) -> None:
        """The recipe with ``packages`` added to its own. InvalidArgument for a recipe that
        takes none, or for a name that is not a package name of ``packages_from``."""
        if packages and self.packages_from is None:
            raise InvalidArgument(f"recipe {self.name} takes no packages")
        self.extra = self.extra_packages(packages)
        self.version = self.version_for(self.extra)

    @classmethod
    def extra_packages(cls, packages: Sequence[str]) -> tuple[str, ...]:
        """``packages`` beyond the recipe's own, checked, without repeats, in one order."""
        return tuple(sorted(set(packages)))

    @classmethod
    def version_for(cls, extra: Sequence[str]) -> str:
        """The version of the layer built with ``extra`` packages: the default's if none,
        else ``<default>-<8 hex digits of sha256 of the names, comma-separated>``."""
        if not extra:
            return cls.version
        return f"{cls.version}-{hashlib.sha256(','.join(extra).encode()).hexdigest()[:8]}"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why it cannot be built on this machine (a missing tool; None: it can). Cheap."""
        return None

    @abc.abstractmethod
    def build(self, tree: Path, progress: Progress) -> None:
        """Fill ``tree``, a directory that does not exist yet (the caller removes it
        afterwards). Failures raise DsecError (Unavailable: a tool, a mirror)."""


def ensure_layer(
    store: LayerStore,
    kind: LayerKind,
    name: str,
    version: str,
    builder: Callable[[Path], object],
    progress: Progress | None = None,
) -> Layer:
    """The public layer ``name:version`` of ``kind``; if the store lacks it, ``builder(tree)``
    fills a new temporary directory ``tree`` (under $TMPDIR), which is imported, then removed
    (so a layer of that name and another kind is the import's Conflict)."""
    try:
        return store.resolve(name, version, kind)
    except NotFound:
        pass
    with tempfile.TemporaryDirectory(prefix=f"dsec-{name}-") as tmp:
        tree = Path(tmp) / "rootfs"
        builder(tree)
        return store.import_layer(str(tree), kind, name, version, progress)
