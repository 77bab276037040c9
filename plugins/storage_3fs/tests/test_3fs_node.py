"""The node side: shared mounts and holds, corrupt images, remove / gc, page-cache usage, and
taking over mounts after a restart."""

from __future__ import annotations

import os

import pytest
from dsec_storage_3fs import ThreeFsStore
from dsec_storage_3fs.pagecache import resident_bytes

from dsec_kernel.contract.errors import Conflict, InvalidArgument, NotFound
from dsec_kernel.linuxhost import syscalls


def test_mount_is_shared_by_holders_and_goes_with_the_last(store, sample_tree):
    layer = store.import_layer(str(sample_tree), "base", "sample", "1")
    a = store.mount(layer.digest, "node-a/sb-1")
    b = store.mount(layer.digest, "node-a/sb-2")
    assert a == b == store.cache_dir / "mounts" / layer.digest[7:]
    assert os.path.ismount(a) and (a / "hello.txt").read_text() == "hello\n"
    assert store.mounted() == {layer.digest: a}
    assert store.holders(layer.digest) == ["node-a/sb-1", "node-a/sb-2"]
    assert (store.root / "holds" / layer.digest[7:] / "node-a%2Fsb-1").is_file()

    store.release(layer.digest, "node-a/sb-1")
    assert os.path.ismount(a) and store.holders(layer.digest) == ["node-a/sb-2"]
    store.release(layer.digest, "node-a/sb-2")
    assert not os.path.ismount(a) and not a.exists()
    assert store.mounted() == {} and store.holders(layer.digest) == []
    store.release(layer.digest, "node-a/sb-2")  # idempotent


@pytest.mark.parametrize("damage", ["truncate", "magic"])
def test_a_corrupt_image_is_refused_and_nothing_is_mounted(store, sample_tree, damage):
    layer = store.import_layer(str(sample_tree), "base", "sample", "1")
    image = store.image_path(layer.digest)
    with open(image, "r+b") as f:
        if damage == "truncate":
            f.truncate(layer.size - 4096)
        else:
            f.seek(1024)
            f.write(b"\0\0\0\0")
    with pytest.raises(InvalidArgument, match="damaged"):
        store.mount(layer.digest, "node-a/sb-1")
    assert store.mounted() == {} and store.holders(layer.digest) == []
    assert not (store.cache_dir / "mounts" / layer.digest[7:]).exists()
    if damage == "truncate":  # importing the same content again repairs it
        store.import_layer(str(sample_tree), "base", "sample", "1")
        assert (store.mount(layer.digest, "node-a/sb-1") / "hello.txt").is_file()
        store.release(layer.digest, "node-a/sb-1")


def test_a_missing_image_or_bad_arguments_are_refused(store, sample_tree):
    layer = store.import_layer(str(sample_tree), "base", "sample", "1")
    with pytest.raises(InvalidArgument, match="holder"):
        store.mount(layer.digest, "")
    with pytest.raises(InvalidArgument, match="digest"):
        store.mount("sha256:xyz", "node-a/sb-1")
    store.image_path(layer.digest).unlink()
    with pytest.raises(NotFound, match="import the layer again"):
        store.mount(layer.digest, "node-a/sb-1")
    assert store.mounted() == {} and store.holders(layer.digest) == []


def test_remove_is_refused_while_held_unless_forced_and_gc_waits_for_holds(store, sample_tree):
    layer = store.import_layer(str(sample_tree), "base", "sample", "1")
    store.mount(layer.digest, "node-a/sb-1")
    with pytest.raises(Conflict, match="in use by node-a/sb-1"):
        store.remove("sample", "1")
    assert store.remove("sample", "1", force=True) == layer
    with pytest.raises(NotFound):
        store.resolve("sample", "1")
    assert store.gc().removed == []  # still held: the image stays
    store.release(layer.digest, "node-a/sb-1")
    report = store.gc()
    assert report.removed == [layer.digest] and report.bytes_freed == layer.size
    assert not store.root.joinpath("blobs/sha256", f"{layer.digest[7:]}.erofs").exists()
    assert list(store.root.glob("holds/*")) == []  # empty hold directories go too


def test_gc_frees_only_unnamed_images(store, sample_tree, tmp_path):
    kept = store.import_layer(str(sample_tree), "base", "kept", "1")
    alias = store.import_layer(str(sample_tree), "base", "alias", "1")  # same image as kept
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "f").write_bytes(os.urandom(100_000))
    gone = store.import_layer(str(tmp_path / "other"), "workspace", "gone", "1")
    store.mount(alias.digest, "node-a/sb-1")
    store.remove("alias", "1")  # held, but "kept" names the same image: allowed
    store.release(alias.digest, "node-a/sb-1")
    store.remove("gone", "1")
    graced = ThreeFsStore(store.config.model_copy(update={"gc_grace_s": 3600}))
    assert graced.gc().removed == []  # too young: might be an import in flight
    report = store.gc()
    assert report.removed == [gone.digest] and report.bytes_freed == gone.size
    assert store.image_path(kept.digest).is_file()
    assert store.gc().removed == []


def test_usage_counts_the_bytes_read_through_the_mount(store, tmp_path, mounted):
    src = tmp_path / "big"
    src.mkdir()
    (src / "data").write_bytes(os.urandom(20 << 20))
    (src / "small").write_text("small")
    layer = store.import_layer(str(src), "workspace", "big", "1")
    fd = os.open(store.image_path(layer.digest), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert store.usage(layer.digest).bytes_read == 0

    mp = mounted(layer)
    assert (mp / "small").read_text() == "small"
    before = store.usage(layer.digest)
    assert before.size == layer.size and before.bytes_read < 2 << 20
    assert (mp / "data").read_bytes() == (src / "data").read_bytes()
    after = store.usage(layer.digest)
    assert 20 << 20 <= after.bytes_read <= after.size and after.fraction > 0.99
    # direct I/O: the data is cached once, in the mounted file, not in the image file too
    with open("/proc/self/mounts") as f:
        assert "directio" in next(line for line in f if str(mp) in line)
    assert resident_bytes(store.image_path(layer.digest))[0] < 2 << 20


def test_adopt_takes_over_mounts_after_a_restart(store, sample_tree, tmp_path):
    mine = store.import_layer(str(sample_tree), "base", "mine", "1")
    (tmp_path / "t2").mkdir()
    (tmp_path / "t2" / "f").write_text("2")
    unused = store.import_layer(str(tmp_path / "t2"), "base", "unused", "1")
    (tmp_path / "t3").mkdir()
    (tmp_path / "t3" / "f").write_text("3")
    stale = store.import_layer(str(tmp_path / "t3"), "base", "stale", "1")
    store.mount(mine.digest, "node-a/sb-1")
    store.mount(mine.digest, "node-b/sb-9")  # another node's hold on the same image
    store.mount(unused.digest, "node-b/sb-8")  # mounted here, but no holder of node-a
    store.mount(stale.digest, "node-a/sb-old")
    syscalls.umount(str(store.mounted()[stale.digest]), syscalls.MNT_DETACH)  # as after a reboot

    restarted = ThreeFsStore(store.config)  # a new process of node-a
    assert restarted.adopt("node-a") == {mine.digest: ["node-a/sb-1"]}
    assert set(restarted.mounted()) == {mine.digest}
    assert restarted.holders(stale.digest) == []  # stale holds of node-a dropped
    assert restarted.holders(unused.digest) == ["node-b/sb-8"]  # node-b's are its own
    assert restarted.mount(mine.digest, "node-a/sb-2") == store.mounted()[mine.digest]
    restarted.release(mine.digest, "node-a/sb-1")
    assert mine.digest in restarted.mounted()
    restarted.release(mine.digest, "node-a/sb-2")
    assert restarted.mounted() == {}
    assert restarted.holders(mine.digest) == ["node-b/sb-9"]
