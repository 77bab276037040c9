"""Walks of sandboxes' trees cost what the trees hold, not what names and sizes claim: sparse
files compared by their data, paths at most PATH_MAX bytes, listings (and manifests) capped,
paths resolved parent first, which a brute-force overlay merge checks."""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
from pathlib import Path

import pytest
from dsec_backend_container import overlay
from dsec_backend_container.fsdiff import diff
from dsec_backend_container.overlay import PATH_MAX, Budget, TooLarge, TooLong, scan
from dsec_backend_container.snapshots import Snapshots, _manifest_json

from dsec_kernel.loader import open_store

TIB = 1 << 40
_DIR = os.O_RDONLY | os.O_DIRECTORY


def read_bytes() -> int:
    """Bytes this process has read so far (``rchar``: every read and pread, holes too)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.fixture
def base(tmp_path):
    yield tmp_path
    shutil.rmtree(tmp_path)  # (sparse files cost nothing, but deep trees are many inodes)


@pytest.fixture
def store(base):
    return open_store("3fs", {"root": str(base / "store"), "cache_dir": str(base / "cache")})


def take(snaps: Snapshots, upper: Path, parent: str | None = None):
    return snaps.take(
        upper, tenant="t", sandbox_id="sb-1", backend="container", layers=[], parent=parent,
        baseline=parent, keep=False,
    )  # fmt: skip


def left_over(snaps: Snapshots) -> list[str]:
    return sorted(p.name for p in snaps.root.iterdir())


def sparse(path: Path, size: int, writes: dict[int, bytes] = {}) -> None:  # noqa: B006
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in writes.items():
            os.pwrite(f.fileno(), data, off)
    os.utime(path, ns=(1, 1))  # both copies alike but for their bytes


def chain(root: Path, names: list[str]) -> int:
    """Make directories ``names`` nested in ``root`` (through descriptors: the path may be
    past what a system call takes); return a descriptor of the innermost."""
    fd = os.open(root, _DIR)
    for name in names:
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, _DIR, dir_fd=fd)
        os.close(fd)
        fd = inner
    return fd


def touch(fd: int, name: str) -> None:
    os.close(os.open(name, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644, dir_fd=fd))


# -- sparse files ------------------------------------------------------------------------------


def test_a_sparse_file_is_compared_by_its_data_not_its_size(base):
    now, then = base / "now", base / "then"
    for tree in (now, then):
        sparse(tree / "big", 15 * TIB)
    read = read_bytes()
    assert diff([now], [then], []).modified == []  # holes in both: nothing read
    assert read_bytes() - read < 1 << 20

    sparse(now / "big", 15 * TIB, {TIB: b"x", 14 * TIB: b"same"})
    sparse(then / "big", 15 * TIB, {TIB: b"y", 14 * TIB: b"same"})
    read = read_bytes()
    assert diff([now], [then], []).modified == ["/big"]
    sparse(then / "big", 15 * TIB, {TIB: b"x", 14 * TIB: b"same"})
    assert diff([now], [then], []).modified == []
    assert read_bytes() - read < 1 << 20  # a block or two of data each time

    sparse(now / "big", 15 * TIB, {TIB: bytes(64 << 10)})  # zeros written where then has a hole
    sparse(then / "big", 15 * TIB)
    read = read_bytes()
    assert diff([now], [then], []).modified == []  # the same bytes: not a change
    assert read_bytes() - read < 1 << 20


def test_past_its_budget_a_file_is_taken_as_changed_unread(base):
    data = os.urandom(4 << 20)
    for tree in ("now", "then"):
        (base / tree).mkdir()
        (base / tree / "f").write_bytes(data)
        os.utime(base / tree / "f", ns=(1, 1))
    read = read_bytes()
    assert diff([base / "now"], [base / "then"], [], compare_bytes=4 << 20).modified == ["/f"]
    assert read_bytes() - read < 1 << 20  # conservatively "modified", without reading it
    assert diff([base / "now"], [base / "then"], [], compare_bytes=16 << 20).modified == []


# -- path lengths and listings -----------------------------------------------------------------


def test_a_tree_of_long_paths_is_refused_at_the_first_too_long_one(base, store):
    """The red team's tree: 510 directories of 255-byte names, 1,000 files at the bottom
    (130 KB paths, listed as 156 MiB and a 156 MiB manifest); refused without listing it."""
    upper = base / "upper"
    upper.mkdir()
    fd = chain(upper, [f"{i:03d}".ljust(255, "d") for i in range(510)])
    try:
        for i in range(1000):
            touch(fd, f"{i:04d}".ljust(255, "f"))
    finally:
        os.close(fd)
    snaps = Snapshots(store)
    for walk in (
        lambda: scan(upper),
        lambda: diff([upper], [], []),
        lambda: take(snaps, upper),
    ):
        with pytest.raises(TooLong, match=r"longer than 4096 bytes.*shorten it"):
            walk()
    assert left_over(snaps) == []  # no .tmp-* left by the snapshot


def test_paths_are_counted_in_bytes_up_to_path_max(base):
    names = ["é" * 127] * 16  # 254 bytes each, 127 characters
    ok, long = base / "ok", base / "long"
    for root, name in ((ok, "x" * 15), (long, "x" * 16)):
        root.mkdir()
        fd = chain(root, names)
        touch(fd, name)
        os.close(fd)
    deepest = max(scan(ok), key=len)
    assert len(os.fsencode(deepest)) == PATH_MAX and len(deepest) == 2064
    with pytest.raises(TooLong):
        scan(long)


def test_a_listing_is_capped_and_so_is_the_manifest(base, store):
    upper = base / "upper"
    upper.mkdir()
    for i in range(100):
        (upper / f"f{i:03d}").write_bytes(b"x")
    cost = 100 * (5 + overlay.ENTRY_BYTES)  # "/fNNN" and its metadata, each
    assert len(scan(upper, Budget(cost))) == 100
    with pytest.raises(TooLarge, match="too many to snapshot or diff"):
        scan(upper, Budget(cost - 1))
    snaps = Snapshots(store, max_listing=cost - 1)
    with pytest.raises(TooLarge):
        take(snaps, upper)
    assert left_over(snaps) == []
    copy = base / "copy"  # a diff's deltas share one budget: it holds all their listings
    shutil.copytree(upper, copy)
    assert diff([upper], [copy], [], listed=2 * cost).modified == []
    with pytest.raises(TooLarge):
        diff([upper], [copy], [], listed=2 * cost - 1)


def test_a_manifest_is_no_larger_than_the_listing_it_was_charged(base, store):
    """Names as they are on disk (not UTF-8, controls, quotes), big numbers: the manifest
    fits in the least budget its scan passes with; an increment reads it back."""
    upper = base / "upper"
    upper.mkdir()
    names = [b"\xff\xfe", b"a\xc3", "é".encode(), b"line\nbreak", b'q"uo\\te', b"\x01\x02"]
    for name in names:
        d = os.path.join(os.fsencode(upper), name)
        os.mkdir(d)
        with open(os.path.join(d, name), "wb") as f:
            f.write(b"data")
        os.chown(d, 2**32 - 2, 2**32 - 2)
    listing = scan(upper)
    lo, hi = 1, 1 << 20  # the least budget scan passes with
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            scan(upper, Budget(mid))
            hi = mid
        except TooLarge:
            lo = mid + 1
    assert len(_manifest_json(listing)) <= lo

    snaps = Snapshots(store, max_listing=lo)
    first = take(snaps, upper)
    raw = (snaps.root / first.id / "manifest.json").read_bytes()
    assert b"/\xff\xfe/\xff\xfe" in raw and len(raw) <= lo
    assert snaps.manifest(first.id) == listing
    again = take(snaps, upper, parent=first.id)  # nothing changed, nothing deleted
    assert again.bytes == 0 and os.listdir(snaps.root / again.id / "delta") == []


def test_a_manifest_written_ascii_escaped_reads_the_same(base, store):
    upper = base / "upper"
    upper.mkdir()
    (upper / "é\x01").mkdir()
    os.mkdir(os.path.join(os.fsencode(upper), b"\xff"))
    snaps = Snapshots(store)
    snap = take(snaps, upper)
    old = json.dumps({k: v.as_list() for k, v in scan(upper).items()})  # as it was written
    (snaps.root / snap.id / "manifest.json").write_text(old)
    assert snaps.manifest(snap.id) == scan(upper)
    (snaps.root / snap.id / "manifest.json").write_text(" " * (2 * snaps.max_listing + 1))
    with pytest.raises(Exception, match="restore the sandbox to it"):
        snaps.manifest(snap.id)


# -- resolution --------------------------------------------------------------------------------


def merged(layers: list[Path]) -> dict[str, tuple[overlay.Entry, Path]]:
    """What a stack of layers (newest first) shows, merged bottom up the plain way: each
    layer's whiteouts, opaque directories and non-directories drop what lies below them."""
    view: dict[str, tuple[overlay.Entry, Path]] = {}

    def drop_below(path: str) -> None:
        for k in [k for k in view if k.startswith(path + "/")]:
            del view[k]

    for root in reversed(layers):
        for path, e in scan(root).items():
            if e.kind == "d":
                if e.opaque or (path in view and view[path][0].kind != "d"):
                    drop_below(path)
                view[path] = (e, root)
            else:
                drop_below(path)
                view.pop(path, None)
                if e.kind != "w":
                    view[path] = (e, root)
    return view


def expected(now: list[Path], then: list[Path], env: list[Path]) -> tuple[list, list, list]:
    a, b = merged(now + env), merged(then + env)
    shared = {p for p in now if p in then}
    paths = sorted({p for root in {*now, *then} - shared for p in scan(root)})
    added = [p for p in paths if p in a and p not in b]
    deleted = [p for p in paths if p not in a and p in b]
    modified = []
    for p in paths:
        if p in a and p in b and a[p][0].kind != "d" and a[p][1] != b[p][1]:
            x, y = (os.path.join(a[p][1], p[1:]), os.path.join(b[p][1], p[1:]))
            if not a[p][0].same_meta(b[p][0]) or _content(x) != _content(y):
                modified.append(p)
    return added, modified, deleted


def _content(path: str) -> bytes | str | None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return os.readlink(path)
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            return f.read()
    return None


def random_tree(root: Path, rng: random.Random) -> None:
    """Up to 3 levels of a few names: files, directories (some opaque), whiteouts, links."""
    root.mkdir()
    todo = [(root, 0)]
    while todo:
        d, depth = todo.pop()
        for name in rng.sample("abcd", rng.randint(0, 3)):
            p = d / name
            kind = rng.choice("fffddwl" if depth < 2 else "ffwl")
            if kind == "f":
                p.write_bytes(rng.choice([b"1", b"2"]))
                os.utime(p, ns=(1, 1))  # alike in metadata: compared by bytes
            elif kind == "d":
                p.mkdir()
                if rng.random() < 0.25:
                    os.setxattr(p, overlay.OPAQUE, b"y")
                todo.append((p, depth + 1))
            elif kind == "w":
                os.mknod(p, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            else:
                os.symlink(rng.choice(["/etc", "a"]), p)


@pytest.mark.parametrize("seed", range(40))
def test_resolution_parent_first_agrees_with_a_plain_merge(base, seed):
    rng = random.Random(seed)
    trees = []
    for i in range(6):
        random_tree(base / f"t{i}", rng)
        trees.append(base / f"t{i}")
    env, shared = trees[4:], [trees[3]]
    now, then = [trees[0], trees[1], *shared], [trees[2], *shared]
    got = diff(now, then, env)
    assert (got.added, got.modified, got.deleted) == expected(now, then, env)
