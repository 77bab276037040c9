"""From a layer source to an EROFS image: directory / tar / OCI layout -> tree -> image.

:func:`build_image` takes

* a directory: built as it is (nothing is copied);
* a tar archive (plain, gzip, bzip2 or xz; ``.tar``, ``.tar.gz``, ``.tgz``...): extracted first,
  each entry's path without its first ``strip`` components and under ``under`` (an sdist or a
  repository's tarball, ``name-1.0/...``, as ``/workspace/...``: ``strip=1, under="workspace"``);
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

Bytes: a tree may hold at most ``max_bytes`` of file data, counted by apparent size (each
inode once), holes included, since mkfs.erofs reads every one of them; more is QuotaExceeded
before mkfs.erofs runs, naming the largest file (an archive is refused while it is extracted,
before it writes more). A tree whose files have at least :data:`HOLES` bytes of holes is
built with lz4 (unless a compression is configured), which is what keeps its holes small in
the image (see :mod:`.erofs`); other trees are built as configured, byte for byte as before.
Holes are counted from allocated blocks (``st_blocks``), so the same content written densely
builds the uncompressed image, another digest.
"""

from __future__ import annotations

import contextlib
import decimal
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

from dsec_kernel.contract.errors import InvalidArgument, NotFound, QuotaExceeded
from dsec_storage_3fs import erofs

__all__ = [
    "HOLES",
    "Built",
    "TreeBytes",
    "build_image",
    "extract_oci",
    "extract_tar",
    "size_text",
    "tree_bytes",
]

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
HOLES = 8 << 20  # bytes of holes from which a tree is built with lz4: fewer are written out


@dataclass(frozen=True)
class Built:
    """An image built in a work directory, not yet in the store."""

    image: Path
    digest: str  # "sha256:<hex>" of the image's bytes
    size: int
    files: int


@dataclass(frozen=True)
class TreeBytes:
    """The file data of a tree, each inode counted once."""

    data: int  # apparent bytes: what mkfs.erofs reads
    holes: int  # of those, the ones no block holds
    largest: tuple[int, str]  # (size, "/path") of its largest file


def build_image(
    source: Path,
    workdir: Path,
    compression: str | None,
    progress: Callable[[str], None],
    *,
    max_bytes: int | None = None,
    timeout_s: float | None = None,
    under: str = "",
    strip: int = 0,
) -> Built:
    """Build ``workdir/image.erofs`` from ``source``, extracting into ``workdir/tree`` when it
    is an archive (its entries placed by ``under`` and ``strip``, which only archives take) or
    an OCI layout. ``workdir`` is the caller's: it removes it afterwards. QuotaExceeded if the
    tree's files hold more than ``max_bytes``; DeadlineExceeded if mkfs.erofs runs longer than
    ``timeout_s``."""
    if (under or strip) and source.is_dir():
        raise InvalidArgument(
            f"{source} is not a tar archive: only an archive's entries are placed (under, "
            "strip); a directory or an OCI layout is imported as it is"
        )
    if source.is_dir() and (source / "oci-layout").is_file() and (source / "index.json").is_file():
        tree = workdir / "tree"
        extract_oci(source, tree, progress, max_bytes)
    elif source.is_dir():
        tree = source
    elif source.is_file():
        tree = workdir / "tree"
        progress(f"extracting {source.name}")
        extract_tar(source, tree, max_bytes, under, strip)
    else:
        raise NotFound(
            f"layer source {source} does not exist; give a directory, a tar archive or an "
            "OCI image layout directory"
        )
    measured = tree_bytes(tree)
    if max_bytes is not None and measured.data > max_bytes:
        size, path = measured.largest
        raise QuotaExceeded(
            f"the layer's files hold {size_text(measured.data)} (holes of sparse files count: "
            f"they are read), more than the {size_text(max_bytes)} a layer may "
            f"(build_max_bytes); remove or shrink large files, such as {path} "
            f"({size_text(size)})"
        )
    if compression is None and measured.holes >= HOLES:
        compression = "lz4"  # holes as zeros compress to ~0.45 %; uncompressed, written out
    progress("building image")
    image = workdir / "image.erofs"
    erofs.mkfs(tree, image, compression, timeout_s)
    progress("hashing")
    with image.open("rb") as f:
        digest = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    return Built(image, digest, image.stat().st_size, erofs.inode_count(image))


def tree_bytes(tree: Path) -> TreeBytes:
    """Measure the regular files under ``tree`` (a walk without recursion; symlinks are not
    followed, hard-linked files count once)."""
    data = holes = 0
    largest = (0, "")
    seen: set[tuple[int, int]] = set()
    todo = [(str(tree), "")]
    while todo:
        path, rel = todo.pop()
        with os.scandir(path) as entries:
            for entry in entries:
                name = f"{rel}/{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    todo.append((entry.path, name))
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                if st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                data += st.st_size
                holes += max(0, st.st_size - 512 * st.st_blocks)
                largest = max(largest, (st.st_size, name))
    shown = largest[1].encode(errors="surrogateescape").decode(errors="replace")
    return TreeBytes(data, holes, (largest[0], shown))


def size_text(n: int) -> str:
    """``n`` bytes for people: "512 B", "3.0 GiB"."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def extract_tar(
    archive: Path, tree: Path, max_bytes: int | None = None, under: str = "", strip: int = 0
) -> None:
    """Extract ``archive`` into the new directory ``tree``, each entry without the first
    ``strip`` components of its path (entries with no more are left out, as by tar's
    ``--strip-components``) and under the directory ``under`` of the tree (made as needed,
    mtime 0; with nothing stripped, the archive's root entry gives it its metadata);
    QuotaExceeded before its files would hold more than ``max_bytes``."""
    out = _Tree(tree, max_bytes, under, strip)
    out.add(archive, whiteouts=False)
    out.finish()


def extract_oci(
    layout: Path, tree: Path, progress: Callable[[str], None], max_bytes: int | None = None
) -> None:
    """Flatten the layers of the OCI image layout ``layout`` into the new directory ``tree``;
    QuotaExceeded before the layers' files would have written more than ``max_bytes``."""
    layers = _oci_layers(layout)
    out = _Tree(tree, max_bytes)
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

    def __init__(
        self, root: Path, max_bytes: int | None = None, under: str = "", strip: int = 0
    ) -> None:
        parts = [p for p in under.split("/") if p not in ("", ".")]
        if ".." in parts or strip < 0:
            raise InvalidArgument(
                f"entries go under a directory of the layer (not {under!r}, no '..'), "
                f"with 0 or more leading components stripped (not {strip})"
            )
        self.under = "/".join(parts)  # "/workspace/" -> "workspace"
        self.strip = strip
        root.mkdir()
        os.chmod(root, 0o755)  # not left to the umask: images must not depend on it
        self.root = root
        self.dir_mtimes: dict[str, int] = {}  # relative path -> mtime (ns) of its last entry
        self.max_bytes = max_bytes
        self.written = 0  # bytes of regular files written, overwritten ones too

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
            os.utime(dirpath, ns=(mtime, mtime))

    def _entry(
        self, tf: tarfile.TarFile, m: tarfile.TarInfo, what: str, whiteouts: bool, written: set
    ) -> None:
        rel = self._place(m.name, what)
        if rel is None:
            return  # stripped away
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
            self.dir_mtimes[""] = _mtime_ns(m)
            _set_meta(self.root, m)
            return
        parent = self._dir(parent_rel, what, create=True)
        assert parent is not None
        target = parent / base
        if m.isdir():
            if not (target.is_dir() and not target.is_symlink()):
                self._remove(parent, base)
                target.mkdir()
            self.dir_mtimes[rel] = _mtime_ns(m)
        else:
            self._remove(parent, base)
            if not self._create(tf, m, target, what) or m.islnk():
                return  # skipped, or a hard link: the inode it shares has its metadata
        _set_meta(target, m)

    def _create(self, tf: tarfile.TarFile, m: tarfile.TarInfo, target: Path, what: str) -> bool:
        """Create the non-directory ``target``; False if it was skipped."""
        if m.isreg():
            self.written += m.size
            if self.max_bytes is not None and self.written > self.max_bytes:
                raise QuotaExceeded(
                    f"{Path(what).name}: its files hold more than the "
                    f"{size_text(self.max_bytes)} a layer may (build_max_bytes); "
                    f"extraction stopped at {m.name!r} ({size_text(m.size)})"
                )
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out, tf.extractfile(m) as data:
                shutil.copyfileobj(data, out, 1 << 20)
        elif m.issym():
            os.symlink(m.linkname, target)
        elif m.islnk():
            link_dir, _, link_base = (self._place(m.linkname, what) or "").rpartition("/")
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

    def _place(self, name: str, what: str) -> str | None:
        """Where the entry ``name`` goes: its path in the tree, or None if stripped away."""
        rel = _relpath(name, what)
        if self.strip:
            parts = rel.split("/") if rel else []
            if len(parts) <= self.strip:
                return None
            rel = "/".join(parts[self.strip :])
        return f"{self.under}/{rel}".strip("/") if self.under else rel

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
        mtime = _mtime_ns(m)
        os.utime(path, ns=(mtime, mtime), follow_symlinks=False)


def _mtime_ns(m: tarfile.TarInfo) -> int:
    """The entry's mtime in nanoseconds: a pax ``mtime`` exactly as written (tarfile makes it a
    float, which keeps only about a tenth of a microsecond), so a directory and its pax archive
    give the same image."""
    raw = m.pax_headers.get("mtime")
    if raw is not None:
        with contextlib.suppress(ArithmeticError, ValueError):  # decimal's errors are both
            return int(decimal.Decimal(raw).scaleb(9))
    return int(m.mtime * 1_000_000_000)
