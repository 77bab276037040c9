"""DSec layer store ``3fs``: EROFS images on a shared filesystem, mounted read-only on demand.

Modules: :mod:`.store` (the ``LayerStore``: catalog, holds, node side), :mod:`.build` (directory
/ tar / OCI layout -> tree -> image), :mod:`.erofs` (mkfs.erofs, superblock), :mod:`.mounts`
(this node's mounts and refcounts), :mod:`.pagecache` (bytes read, via mincore),
:mod:`.images` (base trees for tests and examples).
"""

from dsec_storage_3fs.store import ThreeFsConfig, ThreeFsStore

__all__ = ["ThreeFsConfig", "ThreeFsStore"]
