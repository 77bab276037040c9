"""Layers belong to a tenant: namespaces, what resolve may see and say, records older than
owners, and remove / gc of images that public and tenant layers share."""

from __future__ import annotations

import json

import pytest

from dsec_kernel.contract.errors import Conflict, Internal, InvalidArgument, NotFound


@pytest.fixture
def tree(tmp_path):
    """``tree(text)``: a directory holding one file with ``text`` (the same text, the same
    directory)."""

    def make(text: str):
        path = tmp_path / "trees" / text
        if not path.exists():
            path.mkdir(parents=True)
            (path / "owner").write_text(text)
        return str(path)

    return make


def _not_found(call) -> str:
    with pytest.raises(NotFound) as info:
        call()
    return info.value.message


def test_tenants_and_the_public_catalog_each_have_their_own_names(store, tree):
    a = store.import_layer(tree("alice"), "workspace", "task", "1", tenant="alice")
    b = store.import_layer(tree("bob"), "workspace", "task", "1", tenant="bob")
    assert (a.tenant, b.tenant) == ("alice", "bob") and a.digest != b.digest
    assert (store.root / "layers/@alice/task/1.json").is_file()
    assert not (store.root / "layers/task").exists()
    assert store.resolve("task", "1", "workspace", tenant="alice") == a
    assert store.resolve("task", "1", "workspace", tenant="bob") == b
    assert store.import_layer(tree("alice"), "workspace", "task", "1", tenant="alice") == a
    with pytest.raises(Conflict) as info:  # names alice's own layer, nothing of bob's
        store.import_layer(tree("alice-2"), "workspace", "task", "1", tenant="alice")
    assert a.digest in info.value.message and b.digest not in info.value.message
    assert store.list_layers("alice") == [a] and store.list_layers("bob") == [b]
    assert store.list_layers() == [a, b]  # the operator's view: every owner's

    # the operator imports a public task:1 afterwards: every tenant now gets that one
    public = store.import_layer(tree("public"), "workspace", "task", "1")
    assert public.tenant is None
    assert store.list_layers() == [public, a, b]
    assert store.list_layers("alice") == [public, a]
    for who in ("alice", "bob", None):
        assert store.resolve("task", "1", tenant=who) == public
    assert store.resolve("task", "1") == public
    assert len(list(store.root.glob("blobs/sha256/*.erofs"))) == 3


def test_a_tenant_cannot_take_a_public_name(store, tree):
    public = store.import_layer(tree("debian"), "base", "debian", "12")
    for source in (tree("squat"), tree("debian")):  # other content, and the same
        with pytest.raises(Conflict, match="is a public layer"):
            store.import_layer(source, "base", "debian", "12", tenant="mallory")
    assert not (store.root / "layers/@mallory").exists()
    assert store.list_layers() == [public]
    assert len(list(store.root.glob("blobs/sha256/*.erofs"))) == 1
    assert store.resolve("debian", "12", "base", tenant="mallory") == public
    assert not list((store.root / "tmp").iterdir())


def test_resolve_never_crosses_tenants_and_not_found_says_nothing_of_them(store, tree):
    secret = store.import_layer(tree("s1"), "workspace", "secret", "1", tenant="alice")
    store.import_layer(tree("s2"), "workspace", "secret", "2", tenant="alice")
    store.import_layer(tree("pub"), "workspace", "shared", "1")

    for who in ("bob", None):
        seen = _not_found(lambda who=who: store.resolve("secret", "1", tenant=who))
        never = _not_found(lambda who=who: store.resolve("nothing", "1", tenant=who))
        assert seen == never.replace("nothing", "secret"), (seen, never)
        assert "none is named secret" in seen
        assert "alice" not in seen and str(store.root) not in seen
        # nor does asking for the wrong kind tell bob that a layer of another kind exists
        assert _not_found(lambda who=who: store.resolve("secret", "1", "base", tenant=who)) == (
            seen
        )
    assert "shared has versions 1" in _not_found(lambda: store.resolve("shared", "9", tenant="bob"))
    assert "secret has versions 1, 2" in _not_found(
        lambda: store.resolve("secret", "3", tenant="alice")
    )
    with pytest.raises(NotFound, match="is a workspace layer, not a base layer"):
        store.resolve("secret", "1", "base", tenant="alice")  # alice may know her own
    assert not (store.cache_dir / "catalog/@bob").exists()  # bob never read alice's record
    assert (store.cache_dir / "catalog/@alice/secret/1.json").is_file()
    assert store.list_layers("bob") == [store.resolve("shared", "1")]

    with pytest.raises(NotFound, match="tenant bob has no layer secret:1"):
        store.remove("secret", "1", tenant="bob")
    with pytest.raises(NotFound, match="the public catalog has no layer secret:1"):
        store.remove("secret", "1")
    assert store.resolve("secret", "1", tenant="alice") == secret


def test_records_written_before_owners_are_public(store, tree):
    old = store.import_layer(tree("old"), "base", "old", "1")
    record = store.root / "layers/old/1.json"
    fields = json.loads(record.read_text())
    del fields["tenant"]  # as the store wrote records before layers had owners
    record.write_text(json.dumps(fields))
    forged = store.import_layer(tree("forged"), "base", "forged", "1")
    path = store.root / "layers/forged/1.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tenant": "alice"}))

    assert store.resolve("old", "1", "base", tenant="bob") == old
    assert store.resolve("old", "1") == old and old.tenant is None
    assert store.resolve("forged", "1") == forged  # where a record lies decides its owner
    assert store.list_layers("bob") == [forged, old] and store.list_layers() == [forged, old]
    with pytest.raises(Conflict, match="is a public layer"):
        store.import_layer(tree("new"), "base", "old", "1", tenant="bob")


@pytest.mark.parametrize("tenant", ["", "../x", "@a", "a/b", "a\n", "-a", "x" * 64])
def test_bad_tenant_names_are_refused_and_change_nothing(store, tree, tenant):
    source = tree("t")
    for call in (
        lambda: store.import_layer(source, "base", "t", "1", tenant=tenant),
        lambda: store.resolve("t", "1", tenant=tenant),
        lambda: store.list_layers(tenant),
        lambda: store.remove("t", "1", tenant=tenant),
    ):
        with pytest.raises(InvalidArgument, match="tenant"):
            call()
    assert not store.root.exists() or list(store.root.rglob("*.json")) == []


def test_remove_and_gc_keep_an_image_while_any_owner_names_it(store, tree):
    source = tree("same")
    mine = store.import_layer(source, "base", "sample", "1", tenant="alice")
    public = store.import_layer(source, "base", "sample", "1")  # later, same content
    assert mine.digest == public.digest and (mine.tenant, public.tenant) == ("alice", None)
    digest = public.digest
    store.mount(digest, "node-a/sb-1")
    try:
        # alice's record goes (the public one names the image); the public one stays
        assert store.remove("sample", "1", tenant="alice") == mine
        assert not (store.root / "layers/@alice").exists()
        assert not (store.cache_dir / "catalog/@alice").exists()
        assert store.resolve("sample", "1", tenant="alice") == public
        assert store.gc().removed == []

        copy = store.import_layer(source, "base", "copy", "1", tenant="alice")
        store.remove("sample", "1")  # held, but alice's copy:1 names the same image
        assert store.gc().removed == [] and store.image_path(digest).is_file()
        with pytest.raises(Conflict, match="in use by node-a/sb-1"):
            store.remove("copy", "1", tenant="alice")  # the last name of a held image
        assert store.remove("copy", "1", force=True, tenant="alice") == copy
        assert store.list_layers() == []
        assert store.gc().removed == []  # still held
    finally:
        store.release(digest, "node-a/sb-1")
    report = store.gc()
    assert report.removed == [digest] and report.bytes_freed == public.size
    assert list((store.root / "layers").iterdir()) == []


def test_errors_a_tenant_can_meet_name_no_host_path(store, tree):
    layer = store.import_layer(tree("t"), "base", "t", "1", tenant="alice")
    image = store.image_path(layer.digest)
    with open(image, "r+b") as f:
        f.seek(1024)
        f.write(b"\0\0\0\0")
    with pytest.raises(InvalidArgument) as damaged:
        store.mount(layer.digest, "node-a/sb-1")
    image.unlink()
    with pytest.raises(NotFound) as missing:
        store.mount(layer.digest, "node-a/sb-1")
    (store.root / "layers/@alice/t/1.json").write_text("{")
    with pytest.raises(Internal) as unreadable:
        store.resolve("t", "1", tenant="alice")
    assert "layers/@alice/t/1.json" in unreadable.value.message
    for error in (damaged, missing, unreadable):
        assert str(store.root) not in error.value.message, error.value.message
        assert str(store.cache_dir) not in error.value.message, error.value.message
