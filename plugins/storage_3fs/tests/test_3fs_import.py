"""Importing layers: directories, tar archives, OCI layouts; idempotence, conflicts, errors."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import stat
import subprocess
import tarfile

import pytest

from dsec_kernel.contract.errors import Conflict, InvalidArgument, NotFound

MTIME = 1_600_000_000


def _member(name, kind=tarfile.REGTYPE, data=b"", **attrs):
    info = tarfile.TarInfo(name)
    info.type, info.mtime, info.size = kind, MTIME, len(data)
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, (io.BytesIO(data) if data else None)


def _tar(members, gz=False) -> bytes:
    """An archive (PAX format, so xattrs travel) of ``_member`` tuples."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, data)
    return gzip.compress(buf.getvalue(), mtime=0) if gz else buf.getvalue()


def _assert_clean(store):
    assert not list((store.root / "tmp").iterdir()), "an import left temporary files"


def test_import_directory_keeps_owners_modes_links_and_xattrs(store, sample_tree, mounted):
    steps = []
    layer = store.import_layer(str(sample_tree), "base", "sample", "1", steps.append)
    assert steps == ["building image", "hashing", "publishing"]
    image = store.image_path(layer.digest)
    assert image == store.root / "blobs/sha256" / f"{layer.digest[7:]}.erofs"
    assert image.stat().st_size == layer.size
    assert hashlib.sha256(image.read_bytes()).hexdigest() == layer.digest[7:]
    assert layer.files == 7  # root, bin, tool, hello.txt (= hard), link, empty, opaque
    assert (store.root / "layers/sample/1.json").is_file()
    assert store.list_layers() == [layer]

    mp = mounted(layer)
    assert (mp / "hello.txt").read_text() == "hello\n"
    tool = os.stat(mp / "bin/tool")
    assert (tool.st_uid, tool.st_gid, stat.S_IMODE(tool.st_mode)) == (1234, 5678, 0o4755)
    assert os.readlink(mp / "link") == "hello.txt"
    assert os.stat(mp / "hard").st_ino == os.stat(mp / "hello.txt").st_ino
    assert os.getxattr(mp / "opaque", "trusted.overlay.opaque") == b"y"
    assert os.listdir(mp / "empty") == []
    assert os.stat(mp / "hello.txt").st_mtime == os.stat(sample_tree / "hello.txt").st_mtime
    with pytest.raises(OSError):
        (mp / "new").write_text("read-only")
    _assert_clean(store)


def test_import_tar_gz_with_devices_fifos_xattrs(store, tmp_path, mounted):
    archive = tmp_path / "layer.tgz"
    archive.write_bytes(
        _tar(
            [
                _member("./", tarfile.DIRTYPE),
                _member("./etc/", tarfile.DIRTYPE),
                _member("./etc/motd", data=b"hi\n", uid=7, gid=8),
                _member("./etc/link", tarfile.SYMTYPE, linkname="motd"),
                _member("./etc/hard", tarfile.LNKTYPE, linkname="etc/motd"),
                _member("./dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666),
                _member("./run/fifo", tarfile.FIFOTYPE),
                _member("./deep/er/file", data=b"x", pax_headers={"SCHILY.xattr.user.k": "v"}),
            ],
            gz=True,
        )
    )
    layer = store.import_layer(str(archive), "workspace", "ws", "1")
    mp = mounted(layer)
    assert (mp / "etc/motd").read_text() == "hi\n"
    assert os.stat(mp / "etc/motd").st_uid == 7
    assert os.stat(mp / "etc/motd").st_mtime == MTIME
    assert os.stat(mp / "etc").st_mtime == MTIME
    assert os.stat(mp / "deep/er").st_mtime == 0  # named by no entry
    assert os.readlink(mp / "etc/link") == "motd"
    assert os.stat(mp / "etc/hard").st_ino == os.stat(mp / "etc/motd").st_ino
    dev = os.stat(mp / "dev/null", follow_symlinks=False)
    assert stat.S_ISCHR(dev.st_mode) and os.major(dev.st_rdev) == 1 and os.minor(dev.st_rdev) == 3
    assert stat.S_ISFIFO(os.stat(mp / "run/fifo").st_mode)
    assert os.getxattr(mp / "deep/er/file", "user.k") == b"v"
    # the same archive builds the same image, so a re-import is a no-op
    assert store.import_layer(str(archive), "workspace", "ws", "1") == layer


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([_member("../evil", data=b"x")], "outside the tree"),
        ([_member("/etc/evil", data=b"x")], "outside the tree"),
        (
            [_member("esc", tarfile.SYMTYPE, linkname="/tmp"), _member("esc/evil", data=b"x")],
            "crosses 'esc', a symlink",
        ),
        ([_member("hard", tarfile.LNKTYPE, linkname="../../etc/passwd")], "outside the tree"),
    ],
    ids=["dotdot", "absolute", "through-symlink", "hardlink-out"],
)
def test_archives_that_escape_their_tree_are_refused(store, tmp_path, members, match):
    archive = tmp_path / "bad.tar"
    archive.write_bytes(_tar(members))
    with pytest.raises(InvalidArgument, match=match):
        store.import_layer(str(archive), "base", "bad", "1")
    assert not (tmp_path / "evil").exists() and not os.path.exists("/tmp/evil")
    assert store.list_layers() == []
    assert not list(store.root.glob("blobs/sha256/*"))
    _assert_clean(store)


def _oci_layout(root, layers, nested):
    """An OCI image layout whose manifest (through a manifest list when ``nested``, listing
    another architecture first) has ``layers`` (archive bytes) in order."""

    def blob(data: bytes | dict) -> dict:
        raw = json.dumps(data).encode() if isinstance(data, dict) else data
        digest = hashlib.sha256(raw).hexdigest()
        (root / "blobs/sha256").mkdir(parents=True, exist_ok=True)
        (root / "blobs/sha256" / digest).write_bytes(raw)
        return {"digest": f"sha256:{digest}", "size": len(raw)}

    def manifest(archives):
        config = blob({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers"}})
        descs = [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar"
             + ("+gzip" if data[:2] == b"\x1f\x8b" else ""), **blob(data)}
            for data in archives
        ]  # fmt: skip
        doc = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
            "layers": descs,
        }
        return {"mediaType": doc["mediaType"], **blob(doc)}

    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    top = manifest(layers)
    if nested:
        other = manifest([_tar([_member("wrong-arch", data=b"x")])])
        listing = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.list.v2+json",
            "manifests": [
                {**other, "platform": {"os": "linux", "architecture": "s390x"}},
                {**top, "platform": {"os": "linux", "architecture": arch}},
            ],
        }
        top = {"mediaType": listing["mediaType"], **blob(listing)}
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [top]}))
    return root


@pytest.mark.parametrize("nested", [False, True], ids=["manifest", "manifest-list"])
def test_import_oci_layout_applies_whiteouts_and_opaque_dirs(store, tmp_path, mounted, nested):
    d = tarfile.DIRTYPE
    lower = _tar(
        [
            _member("etc", d),
            _member("etc/keep", data=b"k"),
            _member("etc/gone", data=b"g"),
            _member("opq", d),
            _member("opq/a", data=b"a"),
            _member("opq/sub", d),
            _member("opq/sub/b", data=b"b"),
            _member("dir/x", data=b"x"),
        ],
        gz=True,
    )
    upper = _tar(
        [
            _member("etc/.wh.gone"),
            _member("opq", d),
            _member("opq/c", data=b"c"),  # this layer's own entry, before the opaque marker
            _member("opq/.wh..wh..opq"),
            _member("new", data=b"n"),
        ]
    )
    layout = _oci_layout(tmp_path / "oci", [lower, upper], nested)
    steps = []
    layer = store.import_layer(str(layout), "base", "oci", "1", steps.append)
    assert steps[:2] == ["extracting layer 1/2", "extracting layer 2/2"]
    mp = mounted(layer)
    assert sorted(os.listdir(mp)) == ["dir", "etc", "new", "opq"]
    assert os.listdir(mp / "etc") == ["keep"]
    assert os.listdir(mp / "opq") == ["c"]
    assert (mp / "dir/x").read_text() == "x"
    _assert_clean(store)


def test_reimport_is_idempotent_and_content_is_shared(store, sample_tree):
    first = store.import_layer(str(sample_tree), "base", "sample", "1")
    assert store.import_layer(str(sample_tree), "base", "sample", "1") == first
    other = store.import_layer(str(sample_tree), "base", "alias", "7")
    assert other.digest == first.digest
    assert len(list(store.root.glob("blobs/sha256/*.erofs"))) == 1
    _assert_clean(store)


def test_a_directory_and_its_pax_archive_are_one_image(store, tmp_path):
    """Mtimes to the nanosecond, as GNU tar's pax format keeps them (a float keeps ~100 ns)."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_text("f\n")
    for i, path in enumerate([src / "a" / "f", src / "a", src]):
        os.utime(path, ns=(0, 1_714_557_600_123_456_789 + i))
    archive = tmp_path / "src.tar"
    subprocess.run(["tar", "--format=pax", "-C", src, "-cf", archive, "."], check=True)
    from_dir = store.import_layer(str(src), "base", "ns", "dir")
    assert store.import_layer(str(archive), "base", "ns", "tar").digest == from_dir.digest
    _assert_clean(store)


def test_an_archives_entries_can_go_under_a_directory_stripped(store, tmp_path, mounted):
    """An sdist (``pkg-1.0/...``) as ``/workspace/...``, the same image at every import."""
    sdist = tmp_path / "pkg-1.0.tar.gz"
    sdist.write_bytes(_tar([
        _member("pkg-1.0", tarfile.DIRTYPE, mtime=MTIME + 5),
        _member("pkg-1.0/setup.py", data=b"setup()\n"),
        _member("pkg-1.0/src/pkg.py", data=b"x = 1\n"),
        _member("pkg-1.0/hard", tarfile.LNKTYPE, linkname="pkg-1.0/setup.py"),
        _member("pkg-1.0/link", tarfile.SYMTYPE, linkname="setup.py"),
        _member("stray", data=b"left out: nothing left after stripping one component"),
    ], gz=True))  # fmt: skip
    layer = store.import_layer(str(sdist), "workspace", "pkg", "1.0", under="/workspace", strip=1)
    mp = mounted(layer)
    assert os.listdir(mp) == ["workspace"]
    assert sorted(os.listdir(mp / "workspace")) == ["hard", "link", "setup.py", "src"]
    assert (mp / "workspace/src/pkg.py").read_text() == "x = 1\n"
    assert os.stat(mp / "workspace/hard").st_ino == os.stat(mp / "workspace/setup.py").st_ino
    assert os.readlink(mp / "workspace/link") == "setup.py"
    # pkg-1.0/ itself is stripped away, as by tar: these three no kept entry names
    assert {os.stat(mp / d).st_mtime for d in ("", "workspace", "workspace/src")} == {0}
    assert os.stat(mp / "workspace/setup.py").st_mtime == MTIME
    again = store.import_layer(str(sdist), "workspace", "pkg", "again", under="workspace/", strip=1)
    assert again.digest == layer.digest
    with pytest.raises(InvalidArgument, match="imported as it is"):
        store.import_layer(str(tmp_path), "workspace", "dir", "1", under="workspace")
    with pytest.raises(InvalidArgument, match=r"no '\.\.'"):
        store.import_layer(str(sdist), "workspace", "up", "1", under="../x")
    _assert_clean(store)


def test_reimport_with_other_content_or_kind_is_a_conflict(store, sample_tree):
    layer = store.import_layer(str(sample_tree), "base", "sample", "1")
    with pytest.raises(Conflict, match="new version"):
        store.import_layer(str(sample_tree), "toolkit", "sample", "1")
    (sample_tree / "more").write_text("changed")
    with pytest.raises(Conflict, match=layer.digest):
        store.import_layer(str(sample_tree), "base", "sample", "1")
    assert store.resolve("sample", "1") == layer
    assert len(list(store.root.glob("blobs/sha256/*.erofs"))) == 1
    _assert_clean(store)


@pytest.mark.parametrize(
    ("kind", "name", "version", "match"),
    [
        ("bogus", "a", "1", "kind"),
        ("base", "../a", "1", "name"),
        ("base", "a", "", "version"),
        ("base", "a", "1 2", "version"),
    ],
)
def test_bad_references_are_refused(store, sample_tree, kind, name, version, match):
    with pytest.raises(InvalidArgument, match=match):
        store.import_layer(str(sample_tree), kind, name, version)


def test_bad_sources(store, tmp_path):
    with pytest.raises(NotFound, match="does not exist"):
        store.import_layer(str(tmp_path / "nope"), "base", "a", "1")
    (tmp_path / "junk.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(InvalidArgument, match="not a readable tar"):
        store.import_layer(str(tmp_path / "junk.tar"), "base", "a", "1")
    _assert_clean(store)


def test_resolve_uses_the_node_cache_and_says_what_exists(store, sample_tree):
    layer = store.import_layer(str(sample_tree), "base", "sample", "1")
    assert store.resolve("sample", "1", "base") == layer
    cached = store.cache_dir / "catalog/sample/1.json"
    record = store.root / "layers/sample/1.json"
    assert cached.read_bytes() == record.read_bytes()
    assert cached.stat().st_mtime_ns == record.stat().st_mtime_ns
    with pytest.raises(NotFound, match=r"sample has versions 1.*dsec layer import"):
        store.resolve("sample", "2")
    with pytest.raises(NotFound, match="none is named other"):
        store.resolve("other", "1")
    with pytest.raises(NotFound, match="is a base layer, not a toolkit layer"):
        store.resolve("sample", "1", "toolkit")
    record.unlink()  # the store is the truth, not the cache
    with pytest.raises(NotFound):
        store.resolve("sample", "1")
