"""The size rule of ``patchtool l2 scan``: a size is wrong only when the
reader would not serve it, decided from evidence, never from a majority.

The tier that showed why: one plain set of Qwen3.5-0.8B (kv_rank 0x01000100,
group 0, two blocks per chunk) holding pristine 0.5.3's objects (6,815,744 B:
1/k of the FA bytes and every GDN block, docs/design/disk-tier-keys.md §3.2)
and pristine 0.5.6's (8,912,896 B) under different chunk hashes.  Each
release serves its own objects byte-exact after a restart, so whichever is
the majority, flagging the other size quarantines a reader's correct
objects.  The tier alone cannot tell which size the reader writes: the scan
says *ambiguous*, exits non-zero and moves nothing until the operator names
the size (``--expect-size SET=SIZE``)."""

from __future__ import annotations

import pytest
from _cli import cli

from .l2tier import FLAGGED, M, NS1, R, check_split, name, prefix, put, put_sparse, \
    scan_json, tree

AMBIGUOUS = 21  # ExitCode.L2_AMBIGUOUS (docs/disk-tier.md)
OLD, NEW = 6_815_744, 8_912_896  # pristine 0.5.3 / pristine 0.5.6, hybrid k=17, C=2N
SET = prefix()  # "Qwen-SEP-Qwen3.5-0.8B@0x01000100@0"


def mixed_tier(d, old: int, new: int):
    """``old`` objects of pristine 0.5.3's size and ``new`` of 0.5.6's, one
    plain set, 32-byte chunk hashes (the real server's sha256 keys)."""
    d.mkdir()
    olds = [put_sparse(d, name(0, i, hash_bytes=32), OLD).name for i in range(old)]
    news = [put_sparse(d, name(0, 100 + i, hash_bytes=32), NEW).name for i in range(new)]
    return olds, news


@pytest.mark.parametrize("old,new", [(6, 4), (4, 6)], ids=["0.5.3-majority", "0.5.6-majority"])
@pytest.mark.parametrize("reader", ["pristine", "kvl1"])
def test_mixed_releases_are_ambiguous_never_flagged(tmp_path, old, new, reader):
    """Either majority, either reader: nothing in the mixed set is flagged or
    moved; one line names the set, its sizes and the option that resolves it."""
    d, q = tmp_path / "t", tmp_path / "q"
    mixed_tier(d, old, new)
    before = tree(d)
    rc, doc = scan_json(d, "--assume", reader)
    res = doc["result"]
    assert rc == AMBIGUOUS, res["sets"]
    assert res["flagged_objects"] == 0 and res["remaining_flagged"] == 0
    [row] = res["sets"]
    assert row["flagged"] == [] and row["ambiguous"] is True and row["expected_size"] is None
    assert row["set"] == SET and row["sizes"] == {str(OLD): old, str(NEW): new}
    assert (res["ambiguous_sets"], res["ambiguous_objects"]) == (1, old + new)
    r = cli("l2", "scan", str(d), "--assume", reader)
    assert r.rc == AMBIGUOUS
    [line] = [x for x in r.out.splitlines() if x.startswith("ambiguous")]
    assert M in line and f"{OLD} B x{old}" in line and f"{NEW} B x{new}" in line
    assert f"--expect-size '{SET}=SIZE'" in line
    assert "size-mismatch" not in r.out
    r = cli("l2", "scan", str(d), "--assume", reader, "--quarantine", str(q), "--json")
    assert r.rc == AMBIGUOUS and r.json["result"]["quarantine"]["moved"] == 0
    assert not q.exists() and tree(d) == before


@pytest.mark.parametrize("keep,move", [(NEW, OLD), (OLD, NEW)], ids=["0.5.6", "0.5.3"])
def test_expect_size_names_the_readers_size(tmp_path, keep, move):
    """The operator names the size the reader writes: every other size of
    that set is flagged (and moved), the named size never is."""
    d, q = tmp_path / "t", tmp_path / "q"
    olds, news = mixed_tier(d, 6, 4)
    before = tree(d)
    wrong = olds if move == OLD else news
    rc, doc = scan_json(d, "--assume", "pristine", "--expect-size", f"{SET}={keep}")
    res = doc["result"]
    assert rc == FLAGGED and res["ambiguous_sets"] == 0
    [row] = res["sets"]
    assert (row["ambiguous"], row["expected_size"], row["expected_from"]) == \
        (False, keep, "--expect-size")
    [f] = row["flagged"]
    assert (f["category"], f["size"], f["objects"], f["reference_size"]) == \
        ("size-mismatch", move, len(wrong), keep)
    r = cli("l2", "scan", str(d), "--assume", "pristine", "--expect-size", f"{SET}={keep}",
            "--quarantine", str(q), "--json")
    assert r.rc == 0, r.err
    assert set(tree(q)) - {"quarantine.jsonl"} == set(wrong)
    check_split(d, q, before)


def test_expect_size_of_a_size_absent_flags_the_whole_set(tmp_path):
    d = tmp_path / "t"
    mixed_tier(d, 2, 0)
    rc, doc = scan_json(d, "--assume", "pristine", "--expect-size", f"{SET}={NEW}")
    [row] = doc["result"]["sets"]
    assert rc == FLAGGED and [(f["size"], f["objects"]) for f in row["flagged"]] == [(OLD, 2)]


def test_one_size_is_never_judged_without_evidence(tmp_path):
    """A set of one size is what some writer wrote for every key: nothing to
    compare it with, so nothing is flagged (whatever the reader)."""
    d = tmp_path / "t"
    mixed_tier(d, 3, 0)
    for reader in ("pristine", "kvl1"):
        rc, doc = scan_json(d, "--assume", reader)
        assert rc == 0 and doc["result"]["sets"][0]["ambiguous"] is False


def test_two_sizes_tie_is_ambiguous(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    put(d, name(0, 1), 100)
    put(d, name(0, 2), 200)
    rc, doc = scan_json(d, "--assume", "pristine")
    [row] = doc["result"]["sets"]
    assert rc == AMBIGUOUS and row["flagged"] == [] and row["ambiguous"] is True
    put(d, name(0, 3), 200)  # a majority changes nothing
    rc, doc = scan_json(d, "--assume", "pristine")
    assert rc == AMBIGUOUS and doc["result"]["sets"][0]["flagged"] == []


def test_empty_object_is_flagged_without_evidence(tmp_path):
    """A 0-byte object is no layout's size: every reader's load of it is a
    short read (a miss).  It is flagged, and once it is set aside the set has
    one size left: not ambiguous."""
    d = tmp_path / "t"
    d.mkdir()
    put(d, name(0, 1, NS1), 1024)
    for i in range(2):
        put(d, name(0, 10 + i), 1024)
    put(d, name(0, 20), 0)
    rc, doc = scan_json(d, "--assume", "kvl1")
    flags = [f for s in doc["result"]["sets"] for f in s["flagged"]]
    assert rc == FLAGGED and [(f["category"], f["size"], f["reference_size"]) for f in flags] \
        == [("size-mismatch", 0, None)]
    assert doc["result"]["ambiguous_sets"] == 0


def test_unpatched_then_ambiguous(tmp_path):
    """For a kvl1 reader the 1/k objects are set aside first (they are
    decided by the namespaced set); what is left is judged on its own."""
    d = tmp_path / "t"
    d.mkdir()
    put(d, name(0, 1, NS1), 1024)
    put(d, name(0, 2), 512)  # 1/2 of kvl1's: unpatched
    put(d, name(0, 3), 1024)  # a pristine 0.5.6-like full-size plain object
    put(d, name(0, 4), 700)
    rc, doc = scan_json(d, "--assume", "kvl1")
    row = next(s for s in doc["result"]["sets"] if s["namespace"] == "")
    assert rc == FLAGGED  # the unpatched object is still in DIR (20 before 21)
    assert [f["category"] for f in row["flagged"]] == ["unpatched"] and row["ambiguous"]
    rc, doc = scan_json(d, "--assume", "kvl1", "--expect-size", f"{prefix()}=512")
    row = next(s for s in doc["result"]["sets"] if s["namespace"] == "")
    # the operator's size wins over the 1/k rule: 512 is what this reader reads
    assert [(f["category"], f["size"]) for f in row["flagged"]] == \
        [("size-mismatch", 700), ("size-mismatch", 1024)]


def test_expect_size_refusals_are_one_line(tmp_path):
    from _cli import one_line

    d = tmp_path / "t"
    mixed_tier(d, 1, 1)
    before = tree(d)
    for bad in ("nonsense", f"{SET}=0", f"{SET}=-4", f"{SET}=12k", f"{SET}@ff=10",
                "m@0x0100010@0=10", f"{SET}"):
        r = cli("l2", "scan", str(d), "--assume", "pristine", "--expect-size", bad)
        line = one_line(r, 2, "--expect-size")
        assert len(line) < 200, line
    r = cli("l2", "scan", str(d), "--assume", "pristine", "--expect-size", f"{SET}=10",
            "--expect-size", f"{SET}=11")
    one_line(r, 2, "--expect-size", "twice")
    r = cli("l2", "scan", str(d), "--assume", "pristine", "--names-only", "--expect-size",
            f"{SET}=10")
    one_line(r, 2, "--expect-size", "--names-only")
    assert tree(d) == before


def test_expect_size_for_a_set_not_in_dir_is_reported(tmp_path):
    d = tmp_path / "t"
    mixed_tier(d, 1, 0)
    other = prefix(model="org/other")
    rc, doc = scan_json(d, "--assume", "pristine", "--expect-size", f"{other}=10")
    assert rc == 0 and doc["result"]["expect_size_unmatched"] == [other]
    r = cli("l2", "scan", str(d), "--assume", "pristine", "--expect-size", f"{other}=10")
    assert r.rc == 0 and f"--expect-size {other}=10 matched no set" in r.out


def test_expect_size_reaches_a_salted_and_ranked_set(tmp_path):
    """The set key is model, namespace, kv_rank and group: salts share it."""
    d = tmp_path / "t"
    d.mkdir()
    rank = 0x02010200
    put(d, name(3, 1, salt="tenant-a", rank=rank), 300)
    put(d, name(3, 2, salt="tenant-b", rank=rank), 300)
    put(d, name(3, 3, rank=rank), 200)
    rc, doc = scan_json(d, "--assume", "pristine")
    assert rc == AMBIGUOUS
    rc, doc = scan_json(d, "--assume", "pristine", "--expect-size",
                        f"{prefix(3, rank=rank)}=300")
    assert rc == FLAGGED and doc["result"]["flagged"]["size-mismatch"]["objects"] == 1
    assert R != rank
