"""``patchtool l2 scan --verify``: the ``corrupt`` category, by content.

The tier here is written with the checksum trailer built by this file's own
code from the documented format (``patchtool/l2/checksum.py``'s docstring,
the adapter's in hybrid-fa part 12-l2-checksum), not by the module under
test; tests/ports/test_l2_checksum.py runs the same scan on objects the real
patched server wrote.  Damage as a disk tier suffers it: a flipped byte, a
torn tail, two objects swapped, another key's intact object copied under a
name, a trailer overwritten.  ``--verify`` must flag exactly those, leave
objects without a trailer (a pristine writer's) unflagged, move exactly them
with ``--quarantine``, and run its check in this interpreter or in the
target's.  Breaking the digest comparison in l2checksum.verdict makes
:func:`test_verify_flags_exactly_the_damaged_objects` fail.
"""

from __future__ import annotations

import shutil
import struct
import sys
from pathlib import Path

import blake3
import pytest
from _cli import cli
from .l2tier import FLAGGED, NS1, name, prefix, scan_json, tree

from patchtool.l2 import checksum as l2checksum
from patchtool.errors import Refusal

KV = 4096  # KV bytes per object
DOMAIN = b"lmcache-patchtool l2 object v1\0"


def trailer(fname: str, kv: bytes) -> bytes:
    digest = blake3.blake3(DOMAIN + fname.encode() + b"\0" + kv).digest()
    return struct.pack("<32sQI12s8s", digest, len(kv), 1, bytes(12), b"LMCPTSUM")


def put_checked(d: Path, fname: str, kv: bytes) -> Path:
    p = d / fname
    p.write_bytes(kv + trailer(fname, kv))
    return p


def kv_of(i: int) -> bytes:
    return bytes([i % 251]) * (KV // 2) + bytes(range(256)) * (KV // 512)


@pytest.fixture
def damaged(tmp_path) -> tuple[Path, set[str]]:
    """A namespaced set of 8 checked objects (6 damaged), a plain set of
    checked objects and of pristine (trailer-less) ones; the damaged names."""
    d = tmp_path / "l2"
    d.mkdir()
    ns = [name(0, h, NS1) for h in range(8)]
    for i, n in enumerate(ns):
        put_checked(d, n, kv_of(i))
    for h in range(3):
        put_checked(d, name(1, h), kv_of(100 + h))  # plain, checked
        (d / name(1, 10 + h)).write_bytes(kv_of(200 + h))  # plain, pristine: no trailer
    bad = set()
    p = d / ns[0]  # bit rot
    b = bytearray(p.read_bytes())
    b[100] ^= 0x10
    p.write_bytes(bytes(b))
    bad.add(ns[0])
    p = d / ns[1]  # torn: second half and the trailer zero, same size
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(KV // 2)
        f.truncate(size)
    bad.add(ns[1])
    a, c = d / ns[2], d / ns[3]  # swapped
    tmp = d / "swap.tmp"
    a.rename(tmp)
    c.rename(a)
    tmp.rename(c)
    bad |= {ns[2], ns[3]}
    shutil.copyfile(d / ns[7], d / ns[4])  # foreign: another key's intact object
    bad.add(ns[4])
    with open(d / ns[5], "r+b") as f:  # cut short (a namespaced set: one layout)
        f.truncate(KV // 2)
    bad.add(ns[5])
    return d, bad


def test_verify_flags_exactly_the_damaged_objects(damaged) -> None:
    d, bad = damaged
    rc, doc = scan_json(d, "--assume", "kvl1", "--verify")
    res = doc["result"]
    assert rc == FLAGGED
    v = res["verify"]
    assert sorted(v["corrupt_names"]) == sorted(bad)
    assert v["checked"] == 14 and v["verdicts"] == {"ok": 5, "corrupt": 6, "no-trailer": 3}, v
    assert "in patchtool's interpreter" in v["checked_with"]
    assert "damaged at its end" in v["details"][name(0, 1, NS1)]  # the torn one: trailer zeroed
    assert "checksum mismatch" in v["details"][name(0, 0, NS1)]
    assert "cut short or padded" in v["details"][name(0, 5, NS1)]
    assert res["flagged"]["corrupt"] == {"objects": 6, "bytes": 5 * (KV + 64) + KV // 2}
    # the cut object's second size does not make its set ambiguous: the
    # verified trailers say which size the set's layout has
    assert res["flagged_objects"] == 6 and res["ambiguous_sets"] == 0
    # without --verify sizes alone see only a set of two sizes (ambiguous)
    rc, doc = scan_json(d, "--assume", "kvl1")
    assert rc == 21 and "corrupt" not in doc["result"]["flagged"] and doc["result"]["verify"] is None


def test_verify_quarantine_moves_exactly_them_and_restore_undoes(damaged, tmp_path) -> None:
    d, bad = damaged
    before = tree(d)
    q = tmp_path / "q"
    r = cli("l2", "scan", str(d), "--assume", "kvl1", "--verify", "--quarantine", str(q), "--json")
    assert r.rc == 0, r.err  # the final re-scan (verified again) finds nothing flagged
    res = r.json["result"]
    assert res["quarantine"]["moved_by_category"] == {"never-read": 0, "unpatched": 0,
                                                      "size-mismatch": 0, "corrupt": 6}
    assert set(tree(q)) - {"quarantine.jsonl"} == bad
    assert set(tree(d)) == set(before) - bad
    assert cli("l2", "restore", str(q), "--json").rc == 0
    assert tree(d) == before


def test_trailer_sizes_are_one_layout_for_the_size_rule(tmp_path) -> None:
    """S (pristine's KV bytes) and S + 64 (the same with a trailer) in one set
    are not ambiguous; a 1/k plain object of a namespaced set that carries
    trailers is still unpatched, with the right k."""
    d = tmp_path / "l2"
    d.mkdir()
    for h in range(2):
        put_checked(d, name(1, h), kv_of(h))
        (d / name(1, 10 + h)).write_bytes(kv_of(h))
    for h in range(2):
        put_checked(d, name(0, h, NS1), kv_of(h))  # KV 4096 + trailer
        (d / name(0, 20 + h)).write_bytes(bytes(KV // 4))  # 1/4 of it
    rc, doc = scan_json(d, "--assume", "kvl1")
    res = doc["result"]
    assert res["ambiguous_sets"] == 0
    (flag,) = [f for s in res["sets"] for f in s["flagged"]]
    assert (flag["category"], flag["size"], flag["k"], flag["objects"]) == ("unpatched", KV // 4, 4, 2)
    # --expect-size names the KV size: the trailer-bearing objects are its too
    rc, doc = scan_json(d, "--assume", "kvl1", "--expect-size", f"{prefix(1)}={KV}")
    assert rc == FLAGGED and doc["result"]["flagged"]["size-mismatch"]["objects"] == 0


def test_the_check_runs_in_the_target_interpreter_too(damaged) -> None:
    """Without blake3 here the check runs in the --python target (LMCache's
    venv has it): the same verdicts."""
    d, _ = damaged
    names = sorted(p.name for p in d.iterdir())
    here, where_here = l2checksum.check(d, names, None)
    there, where_there = l2checksum.check(d, names, sys.executable, here=False)
    assert here == there and sys.executable in where_there and "patchtool's" in where_here


def test_refusals(damaged, tmp_path) -> None:
    d, _ = damaged
    with pytest.raises(Refusal, match="no target was given"):
        l2checksum.check(d, ["x.data"], None, here=False)
    no_blake3 = shutil.which("python3", path="/usr/bin:/bin")
    if no_blake3:  # an interpreter without blake3: one line naming it
        with pytest.raises(Refusal, match=f"the check did not run in {no_blake3}: blake3 is not importable"):
            l2checksum.check(d, ["x.data"], no_blake3, here=False)
    r = cli("l2", "scan", str(d), "--assume", "kvl1", "--verify", "--names-only")
    assert r.rc == 2 and "--verify" in r.err and "--names-only" in r.err
    r = cli("l2", "scan", str(d), "--assume", "kvl1", "--quarantine", str(tmp_path / "q"),
            "--only", "corrupt")
    assert r.rc == 2 and "add --verify" in r.err
    assert not (tmp_path / "q").exists()


def test_names_only_and_plain_scans_open_nothing(damaged, monkeypatch) -> None:
    """Without --verify (names only, or names and sizes) nothing is opened:
    the checksum module is never called."""
    from patchtool.l2 import command as l2command, reader as l2reader

    d, _ = damaged

    def boom(*_a, **_k):
        raise AssertionError("content read without --verify")
    monkeypatch.setattr(l2checksum, "verdict", boom)
    reader = l2reader.parse_assume("kvl1")
    for sizes in (False, True):
        res = l2command.run_scan(d, reader, sizes=sizes)
        assert res.verify is None and res.objects == 14 and res.flagged_objects == 0
