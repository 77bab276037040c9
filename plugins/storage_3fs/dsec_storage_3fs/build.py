"""From a layer source to an EROFS image: directory / tar / OCI layout -> tree -> image.

:func:`build_image` takes

* a directory: built as it is (nothing is copied);
* a tar archive (plain, gzip, bzip2 or xz; ``.tar``, ``.tar.gz``, ``.tgz``...): extracted first;
* an OCI image layout (a directory holding ``oci-layout`` and ``index.json``): ``index.json``
  -> manifest (through a nested index or Docker manifest list: the first entry for this
  machine's linux architecture, else the first entry) -> its layers, each a tar or tar+gzip,
  extracted in order into one tree with whiteouts applied (``.wh.<name>`` deletes ``name``,
  ``.wh..wh..opq`` hides what earlier layers put in its directory).

Extraction keeps what a root filesystem needs (we run as root): numeric owners, modes with
setuid bits, ``SCHILY.xattr.*`` extended attributes, mtimes, symlinks as symlinks, hard links,
FIFOs; character and block devices where mknod is permitted (skipped otherwise). It refuses
(InvalidArgument) any entry with an absolute path, a ``..`` component, or a path through a
symlink or a file, so no archive writes outside its tree. Directories that no entry names get
mtime 0, which keeps images of the same archive identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import stat
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsec_kernel.errors import InvalidArgument, NotFound
from dsec_storage_3fs import erofs

__all__ = ["Built", "build_image", "extract_oci", "extract_tar"]

_INDEX = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
_MANIFEST = {
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
}
_DIGEST = re.compile(r"^(sha256|sha512):([0-9a-f]{64,128})$")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
_OPAQUE = ".wh..wh..opq"


@dataclass(frozen=True)
class Built:
    """An image built in a work directory, not yet in the store."""

    image: Path
    digest: str  # "sha256:<hex>" of the image's bytes
    size: int
    files: int


def build_image(
    source: Path, workdir: Path, compression: str | None, progress: Callable[[str], None]
) -> Built:
    """Build ``workdir/image.erofs`` from ``source``, extracting into ``workdir/tree`` when it
    is an archive or an OCI layout. ``workdir`` is the caller's: it removes it afterwards."""
    if source.is_dir() and (source / "oci-layout").is_file() and (source / "index.json").is_file():
        tree = workdir / "tree"
        extract_oci(source, tree, progress)
    elif source.is_dir():
        tree = source
    elif source.is_file():
        tree = workdir / "tree"
        progress(f"extracting {source.name}")
        extract_tar(source, tree)
    else:
        raise NotFound(
            f"layer source {source} does not exist; give a directory, a tar archive or an "
            "OCI image layout directory"
        )
    progress("building image")
    image = workdir / "image.erofs"
    erofs.mkfs(tree, image, compression)
    progress("hashing")
    with image.open("rb") as f:
        digest = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    return Built(image, digest, image.stat().st_size, erofs.inode_count(image))


def extract_tar(archive: Path, tree: Path) -> None:
    """Extract ``archive`` into the new directory ``tree``."""
    out = _Tree(tree)
    out.add(archive, whiteouts=False)
    out.finish()


def extract_oci(layout: Path, tree: Path, progress: Callable[[str], None]) -> None:
    """Flatten the layers of the OCI image layout ``layout`` into the new directory ``tree``."""
    layers = _oci_layers(layout)
    out = _Tree(tree)
    for i, blob in enumerate(layers, 1):
        progress(f"extracting layer {i}/{len(layers)}")
        out.add(blob, whiteouts=True)
    out.finish()


# -- OCI image layout -------------------------------------------------------------------------


def _oci_layers(layout: Path) -> list[Path]:
    doc, where = _json(layout / "index.json"), f"OCI layout {layout}"
    for _ in range(4):  # index -> (nested index / manifest list ->) manifest
        desc = _pick(doc.get("manifests") or [], where)
        path = _blob(layout, desc.get("digest", ""), where)
        doc, where = _json(path), f"{where}: {desc['digest']}"
        media = desc.get("mediaType") or doc.get("mediaType")
        if media in _MANIFEST:
            return [_blob(layout, layer.get("digest", ""), where) for layer in doc["layers"]]
        if media not in _INDEX:
            raise InvalidArgument(f"{where}: unsupported media type {media!r}")
    raise InvalidArgument(f"{where}: indexes nested too deep")


def _pick(manifests: list[dict], where: str) -> dict:
    if not manifests:
        raise InvalidArgument(f"{where} lists no manifests")
    arch = _ARCH.get(platform.machine(), platform.machine())
    for desc in manifests:
        plat = desc.get("platform") or {}
        if plat.get("os") == "linux" and plat.get("architecture") == arch:
            return desc
    return manifests[0]


def _blob(layout: Path, digest: str, where: str) -> Path:
    m = _DIGEST.match(digest)
    if m is None:
        raise InvalidArgument(f"{where}: bad digest {digest!r}")
    path = layout / "blobs" / m[1] / m[2]
    if not path.is_file():
        raise InvalidArgument(f"{where}: blob {digest} is missing from {layout}/blobs")
    return path


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{path} is not readable JSON: {e}") from None


# -- tar extraction ---------------------------------------------------------------------------


class _Tree:
    """A root filesystem tree built from tar archives applied one after another."""

    def __init__(self, root: Path) -> None:
        root.mkdir()
        os.chmod(root, 0o755)  # not left to the umask: images must not depend on it
        self.root = root
        self.dir_mtimes: dict[str, float] = {}  # relative path -> mtime of its last tar entry

    def add(self, archive: Path, whiteouts: bool) -> None:
        what = str(archive)
        try:
            with tarfile.open(archive, "r:*") as tf:
                written: set[str] = set()  # this archive's paths and their parents
                for member in tf:
                    self._entry(tf, member, what, whiteouts, written)
        except (tarfile.TarError, EOFError, zlib.error) as e:
            raise InvalidArgument(
                f"{what} is not a readable tar archive (plain, gzip, bzip2 or xz): {e}"
            ) from None

    def finish(self) -> None:
        """Set directory mtimes last: creating entries inside them changed them."""
        for dirpath, _dirs, _files in os.walk(self.root, topdown=False):
            rel = os.path.relpath(dirpath, self.root)
            mtime = self.dir_mtimes.get("" if rel == "." else rel, 0)
            os.utime(dirpath, (mtime, mtime))

    def _entry(
        self, tf: tarfile.TarFile, m: tarfile.TarInfo, what: str, whiteouts: bool, written: set
    ) -> None:
        rel = _relpath(m.name, what)
        parent_rel, _, base = rel.rpartition("/")
        if whiteouts and base == _OPAQUE:
            self._clear(parent_rel, written, what)
            return
        if whiteouts and base.startswith(".wh."):
            self._remove(self._dir(parent_rel, what, create=False), base[4:])
            return
        parts = rel.split("/")
        written.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
        if not rel:  # the tree's root itself
            if not m.isdir():
                raise InvalidArgument(f"{what}: the root entry {m.name!r} is not a directory")
            self.dir_mtimes[""] = m.mtime
            _set_meta(self.root, m)
            return
        parent = self._dir(parent_rel, what, create=True)
        assert parent is not None
        target = parent / base
        if m.isdir():
            if not (target.is_dir() and not target.is_symlink()):
                self._remove(parent, base)
                target.mkdir()
            self.dir_mtimes[rel] = m.mtime
        else:
            self._remove(parent, base)
            if not self._create(tf, m, target, what) or m.islnk():
                return  # skipped, or a hard link: the inode it shares has its metadata
        _set_meta(target, m)

    def _create(self, tf: tarfile.TarFile, m: tarfile.TarInfo, target: Path, what: str) -> bool:
        """Create the non-directory ``target``; False if it was skipped."""
        if m.isreg():
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out, tf.extractfile(m) as data:
                shutil.copyfileobj(data, out, 1 << 20)
        elif m.issym():
            os.symlink(m.linkname, target)
        elif m.islnk():
            link_dir, _, link_base = _relpath(m.linkname, what).rpartition("/")
            directory = self._dir(link_dir, what, create=False)
            try:
                if directory is None or not link_base:
                    raise FileNotFoundError
                os.link(directory / link_base, target, follow_symlinks=False)
            except (FileNotFoundError, PermissionError):  # no such file, or a directory
                raise InvalidArgument(
                    f"{what}: hard link {m.name!r} -> {m.linkname!r} names no earlier file"
                ) from None
        elif m.ischr() or m.isblk():
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            try:
                os.mknod(target, m.mode | kind, os.makedev(m.devmajor, m.devminor))
            except PermissionError:
                return False  # no CAP_MKNOD here: devices are the runtime's job anyway
        elif m.isfifo():
            os.mkfifo(target)
        else:
            return False
        return True

    def _dir(self, rel: str, what: str, create: bool) -> Path | None:
        """The directory ``rel`` ("" is the root), checked to be a real directory at every
        step (never a symlink); missing ones are created, or None returned if not ``create``."""
        cur = self.root
        for part in rel.split("/") if rel else ():
            cur = cur / part
            try:
                mode = os.lstat(cur).st_mode
            except FileNotFoundError:
                if not create:
                    return None
                cur.mkdir()
                os.chmod(cur, 0o755)
                continue
            if not stat.S_ISDIR(mode):
                raise InvalidArgument(
                    f"{what}: a path through {rel!r} crosses {part!r}, a symlink or a file; "
                    "refusing an archive that could write outside its tree"
                )
        return cur

    def _remove(self, parent: Path | None, name: str) -> None:
        if parent is None:
            return
        path = parent / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode):
            shutil.rmtree(path)
        else:
            path.unlink()

    def _clear(self, rel: str, written: set[str], what: str) -> None:
        """Opaque directory ``rel``: drop what earlier layers put in it (not this layer's)."""
        directory = self._dir(rel, what, create=True)
        assert directory is not None
        for name in os.listdir(directory):
            if (f"{rel}/{name}" if rel else name) not in written:
                self._remove(directory, name)


def _relpath(name: str, what: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts:
        raise InvalidArgument(
            f"{what}: entry {name!r} points outside the tree (absolute or '..'); "
            "refusing the archive"
        )
    return "/".join(parts)


def _set_meta(path: Path, m: tarfile.TarInfo) -> None:
    os.chown(path, m.uid, m.gid, follow_symlinks=False)
    if not m.issym():
        os.chmod(path, m.mode)  # after chown, which clears setuid bits
    for key, value in m.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            raw = value.encode("utf-8", "surrogateescape")
            os.setxattr(path, key.removeprefix("SCHILY.xattr."), raw, follow_symlinks=False)
    if not m.isdir():
        os.utime(path, (m.mtime, m.mtime), follow_symlinks=False)
