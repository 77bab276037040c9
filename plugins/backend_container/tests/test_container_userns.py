"""uid ranges of sandboxes' user namespaces: claimed node-wide, released, adopted after a
restart, and collected when their sandbox is gone without a word."""

from __future__ import annotations

import os
import time

from dsec_backend_container.userns import FIRST_UID, RANGE, UidRanges


def test_ranges_are_distinct_released_and_reused(tmp_path):
    ranges = UidRanges(tmp_path / "claims")
    other_edge = UidRanges(tmp_path / "claims")  # another edge of the node
    bases = [r.claim(tmp_path / f"sb-{i}") for i, r in enumerate([ranges, other_edge] * 50)]
    assert len(set(bases)) == 100
    assert all(b >= FIRST_UID and (b - FIRST_UID) % RANGE == 0 and b + RANGE <= 1 << 31
               for b in bases)  # fmt: skip
    ranges.release(bases[0])
    ranges.release(bases[0])  # idempotent
    assert len(os.listdir(tmp_path / "claims")) == 99


def test_a_restart_keeps_its_own_and_drops_what_is_gone(tmp_path):
    root, elsewhere = tmp_path / "edge-a", tmp_path / "edge-b"
    ranges = UidRanges(tmp_path / "claims")
    kept, dropped, theirs = root / "sb-1", root / "sb-2", elsewhere / "sb-3"
    for d in (kept, theirs):
        d.mkdir(parents=True)
    bases = {d: ranges.claim(d) for d in (kept, dropped, theirs)}
    ranges.adopt(root, {kept: bases[kept]})
    targets = {os.readlink(p) for p in (tmp_path / "claims").iterdir()}
    assert targets == {str(kept), str(theirs)}  # another edge's live claim is left alone


def test_claims_whose_sandbox_vanished_are_collected_after_a_grace(tmp_path):
    ranges = UidRanges(tmp_path / "claims")
    gone, creating = tmp_path / "sb-gone", tmp_path / "sb-new"
    old = ranges.claim(gone)
    ranges.claim(creating)  # claimed a moment ago: its directory is about to be made
    past = time.time() - 3600
    os.utime(tmp_path / "claims" / str((old - FIRST_UID) // RANGE), (past, past),
             follow_symlinks=False)  # fmt: skip
    ranges.collect()
    assert [os.readlink(p) for p in (tmp_path / "claims").iterdir()] == [str(creating)]
