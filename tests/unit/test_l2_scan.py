"""``patchtool l2 scan DIR``: the fs L2 adapter's name grammar, every
category, the reader (``--assume`` and a real synthetic install), JSON,
exit codes, one-line refusals, and ``--quarantine`` (exact moves, collisions,
a kill at every kind of write, the re-run that finishes it, nothing deleted).

Real files in tmp dirs; the CLI runs as a real process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _cli import CRASH_VAR, cli, one_line

from patchtool.l2 import journal as l2journal, names as l2names, reader as l2reader, tally as l2tally
from patchtool.errors import NotInstalled, Refusal

from . import synthwheel as sw
from .l2tier import FLAGGED, JOURNAL, NS1, NS2, M, R, name, prefix, put, scan_json, tree
from .l2tier import check_split

# The tier fixture's group 1 holds 700 B and 900 B objects: ambiguous until
# the operator names the size the reader writes (the size rule's tests are
# in test_l2_size_rule.py).
EXPECT = ("--expect-size", f"{prefix(1)}=700")
KVL1 = ("--assume", "kvl1", *EXPECT)


@pytest.fixture
def tier(tmp_path) -> SimpleNamespace:
    """A tier with one object set per category, for a kvl1 reader:

    * group 0 namespaced kvl1, 1024 B x3: read, clean;
    * group 0 plain, 512 B x2: unpatched (1/2 of kvl1's 1024);
    * group 1 plain, salted, 700 B x3 and 900 B x1: ambiguous; with
      :data:`EXPECT` (the reader writes 700 B) 900 is a size mismatch;
    * group 0 namespaced kvl2, 64 B x2: never read;
    * another model, plain, 300 B x2: clean;
    plus a .tmp file, the adapter's tmp subdir and a foreign file."""
    d = tmp_path / "tier"
    (d / "tmp").mkdir(parents=True)
    put(d / "tmp", name(0, 99), 10)  # a write in progress in the tmp dir: not an object
    clean, flagged = [], {}
    for i in range(3):
        clean.append(put(d, name(0, i, NS1), 1024).name)
    for i in range(2):
        flagged[put(d, name(0, 10 + i), 512).name] = "unpatched"
    for i in range(3):
        clean.append(put(d, name(1, 20 + i, salt="user-a"), 700).name)
    flagged[put(d, name(1, 30, salt="user-b"), 900).name] = "size-mismatch"
    for i in range(2):
        flagged[put(d, name(0, 40 + i, NS2), 64).name] = "never-read"
    for i in range(2):
        clean.append(put(d, name(0, 50 + i, model="meta-llama/Llama-3-8B"), 300).name)
    put(d, name(0, 60)[:-5] + ".tmp", 5)
    put(d, "README.txt", 3)
    return SimpleNamespace(dir=d, clean=clean, flagged=flagged, before=tree(d))


# ------------------------------------------------------------------ names


def test_names_plain_salted_sep_and_namespace():
    n = l2names.parse("Qwen-SEP-Qwen3.5-0.8B@0x01000100@0@00000000000000ff.data")
    assert n.key == l2names.SetKey(M, "", None, R, 0) and n.chunk_hash == "00000000000000ff"
    assert n.salt == ""
    n = l2names.parse("Qwen-SEP-Qwen3.5-0.8B+kvl1-3f2a9c0b1d4e@0x02010200@1f@abcd@tenant-7.data")
    assert n.key == l2names.SetKey(M, NS1, 1, 0x02010200, 0x1F) and n.salt == "tenant-7"
    assert n.key.kv_rank_hex == "0x02010200"
    # a sha256_cbor hash is 32 bytes of hex; any whole number of bytes is a hash
    assert l2names.parse(f"m@0x01000100@0@{'ab' * 32}.data").chunk_hash == "ab" * 32
    # a '+' that is not the series' namespace is part of the model (an alias)
    for model in ("org/m+kvl1-3F2A9C0B1D4E", "org/m+kvl1-3f2a9c0b1d4", "org/m+kvl0-3f2a9c0b1d4e",
                  "org/m+v2"):
        n = l2names.parse(name(model=model))
        assert n.key.model == model and n.key.namespace == "" and n.key.layout_format is None
    n = l2names.parse(name(model="org/m+kvl12-0123456789ab"))
    assert (n.key.model, n.key.namespace, n.key.layout_format) == ("org/m", "kvl12-0123456789ab",
                                                                   12)
    # round trip
    for args in [(0, 1, "", ""), (3, 2, NS1, "s"), (0x10, 3, NS2, "")]:
        fname = name(*args)
        p = l2names.parse(fname)
        assert l2names.object_name(p.key.model, p.key.kv_rank, p.key.object_group, p.chunk_hash,
                                   p.salt, p.key.namespace) == fname


@pytest.mark.parametrize("fname", [
    "m@0x01000100@0@00ff",  # no .data
    "m@0x01000100@0@00ff.tmp",
    "m@0x01000100@0.data",  # 3 fields
    "m@0x01000100@0@00ff@salt@more.data",  # 6 fields
    "m@0x01000100@0@00ff@.data",  # empty salt
    "@0x01000100@0@00ff.data",  # empty model
    "m@01000100@0@00ff.data",  # no 0x
    "m@0x1000100@0@00ff.data",  # 7 digits
    "m@0x01000100@0@0ff.data",  # odd hash
    "m@0x01000100@0@00FF.data",  # uppercase: not what the adapter writes
    "m@0x0100010G@0@00ff.data",
    "m@0x01000100@@00ff.data",  # empty group
    "m@0x01000100@0@.data",  # empty hash
])
def test_foreign_names(fname):
    assert l2names.parse(fname) is None


# ------------------------------------------------------------------ categories


def test_scan_categories_for_a_kvl1_reader(tier):
    rc, doc = scan_json(tier.dir, *KVL1)
    assert rc == FLAGGED and doc["exit_code"] == FLAGGED and doc["command"] == "l2 scan"
    res = doc["result"]
    assert set(res) == {"dir", "reader", "sizes_read", "objects", "bytes", "tmp_files",
                        "subdirs", "foreign", "foreign_names", "vanished", "expect_size",
                        "expect_size_unmatched", "sets", "flagged", "flagged_objects",
                        "flagged_bytes", "ambiguous_sets", "ambiguous_objects", "verify",
                        "quarantine", "final", "remaining_flagged"}
    assert res["verify"] is None  # no --verify: no content read
    assert res["reader"] == {"layout_format": 1, "source": "assume",
                             "detail": "--assume kvl1: reads plain names and +kvl1-* names",
                             "identity": {"assume": "kvl1"}}
    assert res["expect_size"] == {prefix(1): 700} and res["expect_size_unmatched"] == []
    assert (res["ambiguous_sets"], res["ambiguous_objects"]) == (0, 0)
    assert (res["objects"], res["tmp_files"], res["subdirs"], res["foreign"]) == (13, 1, 1, 1)
    assert res["foreign_names"] == ["README.txt"] and res["quarantine"] is None
    assert res["bytes"] == 3 * 1024 + 2 * 512 + 3 * 700 + 900 + 2 * 64 + 2 * 300
    assert res["flagged"] == {"never-read": {"objects": 2, "bytes": 128},
                              "unpatched": {"objects": 2, "bytes": 1024},
                              "size-mismatch": {"objects": 1, "bytes": 900}}
    assert (res["flagged_objects"], res["remaining_flagged"]) == (5, 5)
    rows = {(s["model"], s["namespace"], s["object_group"]): s for s in res["sets"]}
    assert set(rows) == {("meta-llama/Llama-3-8B", "", 0), (M, "", 0), (M, "", 1), (M, NS1, 0),
                         (M, NS2, 0)}
    assert set(rows[M, "", 0]) == {"set", "model", "namespace", "layout_format", "kv_rank",
                                   "object_group", "readable", "objects", "bytes", "sizes",
                                   "expected_size", "expected_from", "ambiguous", "flagged"}
    assert rows[M, "", 0]["set"] == prefix(0) and rows[M, NS1, 0]["set"] == prefix(0, NS1)
    assert rows[M, NS1, 0]["flagged"] == [] and rows[M, NS1, 0]["readable"] is True
    assert rows[M, NS1, 0]["sizes"] == {"1024": 3} and rows[M, NS1, 0]["kv_rank"] == "0x01000100"
    [u] = rows[M, "", 0]["flagged"]
    assert (u["category"], u["size"], u["objects"], u["k"], u["namespace"],
            u["reference_size"]) == ("unpatched", 512, 2, 2, NS1, 1024)
    assert u["example"] == name(0, 10)  # the smallest name: deterministic
    [s] = rows[M, "", 1]["flagged"]
    assert (s["category"], s["size"], s["objects"], s["reference_size"]) == \
        ("size-mismatch", 900, 1, 700)
    assert rows[M, "", 1]["sizes"] == {"700": 3, "900": 1}
    assert (rows[M, "", 1]["expected_size"], rows[M, "", 1]["expected_from"]) == \
        (700, "--expect-size")
    assert rows[M, NS2, 0]["readable"] is False and rows[M, NS2, 0]["layout_format"] == 2
    assert [f["category"] for f in rows[M, NS2, 0]["flagged"]] == ["never-read"]
    assert rows["meta-llama/Llama-3-8B", "", 0]["flagged"] == []
    fin = res["final"]
    assert (fin["rescanned"], fin["flagged_objects"], fin["ambiguous_sets"]) == (False, 5, 0)
    assert fin["examples"]["unpatched"] == name(0, 10)
    # without the operator's size, group 1 is ambiguous; the rest is unchanged
    rc, doc = scan_json(tier.dir, "--assume", "kvl1")
    res = doc["result"]
    assert rc == FLAGGED and (res["flagged_objects"], res["ambiguous_sets"]) == (4, 1)
    [amb] = [s for s in res["sets"] if s["ambiguous"]]
    assert (amb["object_group"], amb["flagged"], amb["expected_size"]) == (1, [], None)
    assert tree(tier.dir) == tier.before  # a scan writes nothing


def test_names_only_judges_never_read_alone(tier):
    """``--names-only``: the same sets, object counts and never-read flags as
    the full scan; no sizes, no size-decided category, exit 20 for what names
    decide; a scan writes nothing."""
    rc_full, full = scan_json(tier.dir, "--assume", "kvl1")
    rc, doc = scan_json(tier.dir, "--assume", "kvl1", "--names-only")
    res, fres = doc["result"], full["result"]
    assert rc == FLAGGED and res["sizes_read"] is False and fres["sizes_read"] is True
    assert res["bytes"] is None and res["flagged_bytes"] is None
    assert res["flagged"] == {"never-read": {"objects": 2, "bytes": None},
                              "unpatched": {"objects": 0, "bytes": None},
                              "size-mismatch": {"objects": 0, "bytes": None}}
    key = lambda s: (s["model"], s["namespace"], s["object_group"])  # noqa: E731
    assert [(key(s), s["objects"], s["readable"]) for s in res["sets"]] == \
        [(key(s), s["objects"], s["readable"]) for s in fres["sets"]]
    for s in res["sets"]:
        assert (s["bytes"], s["expected_size"], s["sizes"], s["ambiguous"]) == \
            (None, None, {}, False)
        assert [f["category"] for f in s["flagged"]] == \
            (["never-read"] if not s["readable"] else [])
    [nr] = [f for s in res["sets"] for f in s["flagged"]]
    assert (nr["size"], nr["objects"], nr["example"]) == (None, 2, name(0, 40, NS2))
    assert (res["objects"], res["tmp_files"], res["subdirs"], res["foreign"]) == \
        (fres["objects"], fres["tmp_files"], fres["subdirs"], fres["foreign"])
    r = cli("l2", "scan", str(tier.dir), "--assume", "kvl1", "--names-only")
    assert r.rc == FLAGGED and "sizes       : not read (--names-only)" in r.out
    assert tree(tier.dir) == tier.before
    # A pristine reader: every namespaced set by name, the plain ones are its own.
    rc, doc = scan_json(tier.dir, "--assume", "pristine", "--names-only")
    assert rc == FLAGGED and doc["result"]["flagged"]["never-read"]["objects"] == 5


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_names_only_never_stats_an_object(tier):
    """The point of ``--names-only``: no stat of any object (the full scan
    makes one per object), proved on the real process with strace."""
    def stats(*extra: str) -> set[str]:
        log = tier.dir.parent / "strace.log"
        subprocess.run(["strace", "-f", "-qq", "-e", "trace=/stat", "-o", str(log),
                        sys.executable, "-m", "patchtool", "l2", "scan", str(tier.dir),
                        "--assume", "kvl1", "--json", *extra], check=False,
                       capture_output=True)
        text = log.read_text()
        log.unlink()
        return {n for n in os.listdir(tier.dir) if n.endswith(".data") and f'"{n}"' in text}
    assert len(stats()) == 13  # the control: the full scan stats every object
    assert stats("--names-only") == set()


def test_names_only_quarantine_moves_never_read_only(tmp_path, tier):
    q = tmp_path / "q"
    r = cli("l2", "scan", str(tier.dir), "--assume", "kvl1", "--names-only", "--only",
            "never-read,size-mismatch", "--quarantine", str(q))
    one_line(r, 2, "--only", "--names-only judges never-read only")
    assert not q.exists() and tree(tier.dir) == tier.before
    r = cli("l2", "scan", str(tier.dir), "--assume", "kvl1", "--names-only", "--quarantine",
            str(q), "--json")
    assert r.rc == 0, r.err
    qr = r.json["result"]["quarantine"]
    assert (qr["only"], qr["moved"], qr["moved_by_category"]) == \
        (["never-read"], 2, {"never-read": 2})
    assert set(tree(q)) - {JOURNAL} == \
        {n for n, c in tier.flagged.items() if c == "never-read"}
    check_split(tier.dir, q, tier.before)
    r = cli("l2", "scan", str(tier.dir), "--assume", "kvl1", "--names-only")
    assert r.rc == 0 and "nothing flagged by name" in r.out


def test_scan_for_a_pristine_reader(tier):
    """Pristine: every namespaced set is never read, and the 1/k plain
    objects are its own (correct) objects, not flagged."""
    rc, doc = scan_json(tier.dir, "--assume", "pristine", *EXPECT)
    res = doc["result"]
    assert rc == FLAGGED and res["reader"]["layout_format"] is None
    assert res["flagged"] == {"never-read": {"objects": 5, "bytes": 3 * 1024 + 128},
                              "unpatched": {"objects": 0, "bytes": 0},
                              "size-mismatch": {"objects": 1, "bytes": 900}}


def test_scan_for_another_format_and_clean_exit(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    for i in range(3):
        put(d, name(0, i, NS2), 1024)
        put(d, name(0, 10 + i), 512)
    rc, doc = scan_json(d, "--assume", "kvl2")
    # the 512 B plain objects are 1/2 of kvl2's 1024: unpatched for this reader
    assert rc == FLAGGED and doc["result"]["flagged"]["unpatched"]["objects"] == 3
    rc, doc = scan_json(d, "--assume", "kvl1")
    assert doc["result"]["flagged"]["never-read"]["objects"] == 3
    # kvl1 reads no namespace here: the 1/k evidence is an unread namespace,
    # which still says an unpatched writer wrote the plain objects
    assert doc["result"]["flagged"]["unpatched"]["objects"] == 3
    for p in d.iterdir():
        if "+kvl" in p.name:
            p.unlink()
    rc, doc = scan_json(d, "--assume", "kvl2")
    assert rc == 0 and doc["exit_code"] == 0 and doc["result"]["flagged_objects"] == 0
    r = cli("l2", "scan", str(d), "--assume", "kvl2")
    assert r.rc == 0 and "nothing flagged" in r.out


def test_unpatched_needs_an_integer_ratio_and_the_same_kv_rank(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    put(d, name(0, 1, NS1), 4456448 // 4096)  # hybrid merged GDN+FA: 1088
    put(d, name(0, 2), 3407872 // 4096)  # 832: 1088/832 is not an integer
    put(d, name(0, 3, NS1, rank=0x02000200), 1024)
    put(d, name(0, 4, rank=0x02010200), 512)  # another rank (TP sharding): not compared
    rc, doc = scan_json(d, "--assume", "kvl1")
    assert rc == 0, doc["result"]["sets"]


def test_skips_and_foreign_are_never_objects(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    (d / "tmp").mkdir()
    (d / name(0, 9)).mkdir()  # a directory named like an object: foreign
    put(d, "x.tmp", 1)
    put(d, name(0, 1)[:-5] + ".tmp", 1)
    os.symlink("/etc/hostname", d / name(0, 2))  # a link named like an object: foreign
    for i in range(150):
        put(d, f"foreign-{i:03d}", 1)
    res = scan_json(d, "--assume", "pristine")[1]["result"]
    assert (res["objects"], res["tmp_files"], res["subdirs"], res["foreign"]) == (0, 2, 1, 152)
    every = sorted([name(0, 2), name(0, 9)] + [f"foreign-{i:03d}" for i in range(150)])
    assert res["foreign_names"] == every[:l2tally.FOREIGN_LISTED]  # the smallest, sorted
    assert res["sets"] == []


# ------------------------------------------------------------------ the reader


def _status(state, **kw):
    from patchtool.classify import State

    base = dict(state=State(state), lmcache_version="9.9.9", site="/s", dist_info="/s/d",
                python="/py", site_dirs=["/s"], patch_set="synthset", revision=2, files=[])
    base.update(kw)
    return SimpleNamespace(**base)


def test_reader_decision_per_state():
    r = l2reader.reader_for(_status("patched"), 1)
    assert r.layout_format == 1 and r.source == "install" and "+kvl1-*" in r.detail
    assert l2reader.reader_for(_status("patched"), None).layout_format is None
    for st in ("pristine", "unsupported-version", "fixed-upstream"):
        assert l2reader.reader_for(_status(st), 1).layout_format is None
    for st in ("patched-older-revision", "partially-patched", "drifted"):
        with pytest.raises(Refusal) as e:
            l2reader.reader_for(_status(st), 1)
        assert e.value.file == "/s/d" and "--assume" in e.value.reason
    with pytest.raises(NotInstalled):
        l2reader.reader_for(_status("not-installed"), 1)
    k = l2names.SetKey(M, NS1, 1, R, 0)
    assert l2reader.parse_assume("kvl1").reads(k) and not l2reader.parse_assume("kvl2").reads(k)
    assert not l2reader.parse_assume("pristine").reads(k)
    assert l2reader.parse_assume("pristine").reads(l2names.SetKey(M, "", None, R, 0))


@pytest.fixture(scope="module")
def l2_patch_root(tmp_path_factory, wheel) -> Path:
    """The synthetic patch set, its manifest carrying ``l2_format: 2``."""
    return sw.make_patch_root(tmp_path_factory.mktemp("patches-l2"), wheel,
                              extra=("--l2-format", "2"))


def test_reader_from_a_real_install(tmp_path, site, patch_root, l2_patch_root):
    d = tmp_path / "t"
    d.mkdir()
    put(d, name(0, 1, NS2), 64)
    sp = ("--site-packages", str(site))
    rc, doc = scan_json(d, *sp, patches=l2_patch_root)  # pristine install
    assert rc == FLAGGED and doc["result"]["reader"]["layout_format"] is None
    assert doc["result"]["reader"]["detail"].startswith("pristine lmcache 9.9.9")
    assert cli("apply", *sp, patches=l2_patch_root).rc == 0
    rc, doc = scan_json(d, *sp, patches=l2_patch_root)  # patched, l2_format 2
    assert rc == 0 and doc["result"]["reader"]["layout_format"] == 2
    assert doc["result"]["reader"]["source"] == "install"
    # the same patch files under a manifest without l2_format: patched, but
    # the series writes pristine keys only
    rc, doc = scan_json(d, *sp, patches=patch_root)
    assert rc == FLAGGED and doc["result"]["reader"]["layout_format"] is None
    assert "pristine keys only" in doc["result"]["reader"]["detail"]
    assert cli("revert", *sp, patches=l2_patch_root).rc == 0
    assert cli("apply", *sp, "--patch", "01", patches=l2_patch_root).rc == 0
    r = cli("l2", "scan", str(d), *sp, patches=l2_patch_root)
    one_line(r, 3, site / "lmcache-9.9.9.dist-info", "partially-patched", "--assume")
    empty = tmp_path / "empty"
    empty.mkdir()
    r = cli("l2", "scan", str(d), "--site-packages", str(empty), "--json", patches=patch_root)
    one_line(r, 4, empty, "lmcache is not installed", "--assume")
    assert r.json["error"]["exit_code"] == 4


# ------------------------------------------------------------------ refusals


def test_refusals_are_one_line_and_write_nothing(tmp_path, tier):
    missing = tmp_path / "nope"
    r = cli("l2", "scan", str(missing), "--assume", "pristine", "--json")
    one_line(r, 3, missing, "no such directory")
    assert r.json["error"] == {"file": str(missing), "reason": "no such directory",
                               "exit_code": 3}
    f = put(tmp_path, "afile", 3)
    one_line(cli("l2", "scan", str(f), "--assume", "pristine"), 3, f, "is not a directory")
    one_line(cli("l2", "scan", str(tier.dir), "--assume", "kvl"), 2, "--assume", "kvlN")
    one_line(cli("l2", "scan", str(tier.dir), "--assume", "kvl0"), 2, "--assume")
    one_line(cli("l2", "scan", str(tier.dir), "--assume", "pristine", "--only", "unpatched"), 2,
             "--only", "--quarantine")
    q = tmp_path / "q"
    one_line(cli("l2", "scan", str(tier.dir), "--assume", "pristine", "--quarantine", str(q),
                 "--only", "bogus"), 2, "--only", "never-read,unpatched,size-mismatch")
    one_line(cli("l2", "scan", str(tier.dir), "--assume", "pristine", "--python", "python3"), 2,
             "--assume", "not both")
    one_line(cli("l2", "scan", str(tier.dir), "--assume", "kvl1", "--quarantine",
                 str(tier.dir)), 2, tier.dir, "DIR itself")
    inside = tier.dir / "quarantine"
    one_line(cli("l2", "scan", str(tier.dir), "--assume", "kvl1", "--quarantine", str(inside)),
             2, inside, "inside DIR")
    deep = tmp_path / "no" / "such"
    one_line(cli("l2", "scan", str(tier.dir), "--assume", "kvl1", "--quarantine", str(deep)),
             3, deep.parent, "DEST's parent must exist")
    one_line(cli("l2", "scan", str(tier.dir), "--assume", "kvl1", "--quarantine", str(f)),
             3, f, "is not a directory")
    assert tree(tier.dir) == tier.before and not q.exists() and not inside.exists()
    assert not (tmp_path / "no").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory: EACCES cannot happen")
def test_unreadable_dir(tmp_path):  # pragma: no cover - runs only as non-root
    d = tmp_path / "t"
    d.mkdir(mode=0)
    one_line(cli("l2", "scan", str(d), "--assume", "pristine"), 3, d, "EACCES")


def _other_fs(tmp_path: Path) -> Path | None:
    """A directory on another filesystem than ``tmp_path``: /dev/shm when it
    is one, else a tmpfs mounted for the test (root only)."""
    dev = os.stat(tmp_path).st_dev
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and os.stat(shm).st_dev != dev:
        return shm
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "none", str(mnt)], capture_output=True)
    return mnt if r.returncode == 0 and os.stat(mnt).st_dev != dev else None


def test_dest_on_another_filesystem_is_refused(tmp_path, tier):
    other = _other_fs(tmp_path)
    if other is None:
        pytest.skip("no second filesystem: /dev/shm is absent and mount -t tmpfs failed")
    dest = other / f"l2q-{os.getpid()}-{tmp_path.name}"
    try:
        r = cli("l2", "scan", str(tier.dir), "--assume", "kvl1", "--quarantine", str(dest))
        one_line(r, 3, dest, "another filesystem", "rename")
        assert not dest.exists() and tree(tier.dir) == tier.before
    finally:
        shutil.rmtree(dest, ignore_errors=True)  # only if the refusal failed
        if other.name == "mnt":
            subprocess.run(["umount", str(other)], check=False)


# ------------------------------------------------------------------ quarantine


def test_quarantine_moves_exactly_the_flagged(tmp_path, tier):
    q = tmp_path / "q"
    r = cli("l2", "scan", str(tier.dir), *KVL1, "--quarantine", str(q), "--json")
    assert r.rc == 0, r.err
    res = r.json["result"]
    qr = res["quarantine"]
    assert (qr["moved"], qr["refused"], qr["resumed"]) == (5, 0, False)
    assert qr["moved_by_category"] == {"never-read": 2, "unpatched": 2, "size-mismatch": 1}
    assert qr["moved_bytes"] == 128 + 1024 + 900 and res["remaining_flagged"] == 0
    moved = tree(q)
    moved.pop(JOURNAL)
    journal = (q / JOURNAL).read_text().splitlines()
    assert set(moved) == set(tier.flagged)  # names kept
    check_split(tier.dir, q, tier.before)
    assert {"tmp", "README.txt", name(0, 60)[:-5] + ".tmp"} <= set(os.listdir(tier.dir))
    recs = [json.loads(x) for x in journal]
    assert [x["event"] for x in recs] == ["begin"] + ["move"] * 5 + ["end"]
    assert {x["name"]: x["category"] for x in recs if x["event"] == "move"} == tier.flagged
    # the same command again: nothing flagged, nothing written
    j = (q / JOURNAL).read_bytes()
    r = cli("l2", "scan", str(tier.dir), *KVL1, "--quarantine", str(q), "--json")
    assert r.rc == 0 and r.json["result"]["quarantine"]["moved"] == 0
    assert r.json["result"]["quarantine"]["run"] is None
    assert (q / JOURNAL).read_bytes() == j
    check_split(tier.dir, q, tier.before)


def test_quarantine_only_and_human_output(tmp_path, tier):
    q = tmp_path / "q"
    r = cli("l2", "scan", str(tier.dir), *KVL1, "--quarantine", str(q),
            "--only", "size-mismatch,never-read")
    assert r.rc == FLAGGED, r.err  # the unpatched objects are still in DIR
    assert "moved 3 object(s)" in r.out and "exit code 20: 2 flagged" in r.out
    assert "left in DIR : 2 flagged object(s) after a re-scan (unpatched 2)" in r.out
    assert set(tree(q)) - {JOURNAL} == {n for n, c in tier.flagged.items()
                                               if c != "unpatched"}
    check_split(tier.dir, q, tier.before)


def test_nothing_selected_writes_nothing(tmp_path, tier):
    q = tmp_path / "q"
    for p in tier.dir.iterdir():
        if p.name in tier.flagged and tier.flagged[p.name] == "size-mismatch":
            p.unlink()
    r = cli("l2", "scan", str(tier.dir), *KVL1, "--quarantine", str(q),
            "--only", "size-mismatch")
    assert r.rc == FLAGGED and not q.exists()


def test_quarantine_never_overwrites(tmp_path, tier):
    q = tmp_path / "q"
    q.mkdir()
    clash = next(n for n, c in tier.flagged.items() if c == "unpatched")
    (q / clash).write_bytes(b"an older quarantined object")
    r = cli("l2", "scan", str(tier.dir), *KVL1, "--quarantine", str(q), "--json")
    assert r.rc == FLAGGED, r.err
    qr = r.json["result"]["quarantine"]
    assert (qr["moved"], qr["refused"], qr["refused_names"]) == (4, 1, [clash])
    assert (q / clash).read_bytes() == b"an older quarantined object"
    assert (tier.dir / clash).is_file() and tree(tier.dir)[clash] == tier.before[clash]
    assert r.json["result"]["remaining_flagged"] == 1


def _many(tmp_path: Path) -> SimpleNamespace:
    """Enough flagged objects for three journal batches, plus clean ones."""
    d = tmp_path / "big"
    d.mkdir()
    n = 2 * l2journal.BATCH + 6
    for i in range(n):
        put(d, name(0, i, NS2), 16 + i % 3)  # never read by kvl1
    for i in range(5):
        put(d, name(0, 10_000 + i, NS1), 64)
        put(d, name(0, 20_000 + i), 32)  # unpatched, 1/2
    return SimpleNamespace(dir=d, before=tree(d), flagged=n + 5)


# Counted writes for _many (1035 flagged): 1 mkdir DEST, 2 begin, 3 the first
# batch's names, 4..515 its renames, 516 the second batch's names, ...,
# 1029 the third's, 1030..1040 its renames, 1041 end.
WRITES = 1041


@pytest.mark.parametrize("at", [1, 2, 3, 4, 516, 1035, WRITES])
def test_kill_half_way_then_rerun_finishes(tmp_path, at):
    """``crash:N`` exits (86, as a kill would) right after the N-th counted
    write.  After any of them every object is in exactly one place, with its
    bytes, and the same command finishes the job."""
    t = _many(tmp_path)
    q = tmp_path / "q"
    args = ("l2", "scan", str(t.dir), "--assume", "kvl1", "--quarantine", str(q), "--json")
    r = cli(*args, env={CRASH_VAR: f"crash:{at}"}, unset=())
    assert r.rc == 86, (r.rc, r.err)
    check_split(t.dir, q, t.before)
    r = cli(*args)
    assert r.rc == 0, r.err
    qr = r.json["result"]["quarantine"]
    assert qr["resumed"] is (2 <= at < WRITES)  # a begin without its end
    left = tree(t.dir)
    assert len(left) == 5 and all("+kvl1-" in n for n in left)
    assert len(tree(q)) - 1 == t.flagged
    check_split(t.dir, q, t.before)
    recs = [json.loads(x) for x in (q / JOURNAL).read_text().splitlines()]
    assert [x["event"] for x in recs].count("begin") == 1 and recs[-1]["event"] == "end"
    assert sum(x["event"] == "move" for x in recs) >= t.flagged
    r = cli(*args)
    assert r.rc == 0 and r.json["result"]["quarantine"]["moved"] == 0


def test_resume_keeps_the_journaled_plan(tmp_path):
    """The unpatched objects' only evidence is an unread namespace.  When a
    killed run moved that namespace first, a fresh scan would no longer flag
    them; the re-run finishes the journaled plan, so they still move."""
    d, q = tmp_path / "t", tmp_path / "q"
    d.mkdir()
    for i in range(3):
        put(d, name(0, i, NS2), 64)
    for i in range(5):
        put(d, name(0, 10 + i), 32)
    put(d, name(1, 20), 8)  # clean
    before = tree(d)
    args = ("l2", "scan", str(d), "--assume", "kvl1", "--quarantine", str(q), "--json")
    assert scan_json(d, "--assume", "kvl1")[1]["result"]["flagged"]["unpatched"]["objects"] == 5
    r = cli(*args, env={CRASH_VAR: "crash:2"}, unset=())  # DEST and begin written
    assert r.rc == 86
    for p in d.iterdir():
        if "+kvl2-" in p.name:
            os.rename(p, q / p.name)  # what the killed run might have done first
    # a fresh scan no longer sees the 1/2 objects as unpatched
    assert scan_json(d, "--assume", "kvl1")[1]["result"]["flagged_objects"] == 0
    r = cli(*args)
    assert r.rc == 0, r.err
    assert r.json["result"]["quarantine"]["moved_by_category"]["unpatched"] == 5
    assert set(tree(d)) == {name(1, 20)}
    check_split(d, q, before)


def test_unfinished_run_of_another_command_is_refused(tmp_path, tier):
    t = _many(tmp_path)
    q = tmp_path / "q"
    r = cli("l2", "scan", str(t.dir), "--assume", "kvl1", "--quarantine", str(q),
            env={CRASH_VAR: "crash:5"}, unset=())
    assert r.rc == 86
    j = (q / JOURNAL).read_bytes()
    r = cli("l2", "scan", str(tier.dir), *KVL1, "--quarantine", str(q))
    one_line(r, 3, q / JOURNAL, "unfinished quarantine with another DIR/--expect-size")
    r = cli("l2", "scan", str(t.dir), "--assume", "kvl1", "--quarantine", str(q), "--only",
            "never-read")
    one_line(r, 3, q / JOURNAL, "unfinished quarantine with another --only")
    r = cli("l2", "scan", str(t.dir), "--assume", "pristine", "--quarantine", str(q))
    one_line(r, 3, q / JOURNAL, "unfinished quarantine with another reader")
    r = cli("l2", "scan", str(t.dir), *KVL1, "--quarantine", str(q))
    one_line(r, 3, q / JOURNAL, "unfinished quarantine with another --expect-size")
    assert (q / JOURNAL).read_bytes() == j and tree(tier.dir) == tier.before


def test_torn_journal_line_is_ignored(tmp_path, tier):
    q = tmp_path / "q"
    q.mkdir()
    (q / JOURNAL).write_text('{"event": "begin", "run": "x", "dir": "/else')
    r = cli("l2", "scan", str(tier.dir), *KVL1, "--quarantine", str(q), "--json")
    assert r.rc == 0, r.err
    lines = (q / JOURNAL).read_text().splitlines()
    assert lines[0].endswith("/else") and json.loads(lines[1])["event"] == "begin"
    check_split(tier.dir, q, tier.before)


def test_never_imports_torch_vllm_or_lmcache(tier):
    """A scan and a quarantine run in a process whose import hook records
    every attempt to import a heavy package (installed or not, caught or
    not): there is none."""
    code = ("import sys, io, contextlib\n"
            "seen = []\n"
            "class Guard:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.partition('.')[0] in ('torch', 'vllm', 'lmcache'):\n"
            "            seen.append(name)\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Guard())\n"
            "from patchtool.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main(['l2', 'scan', {str(tier.dir)!r}, *{KVL1!r}, '--json',"
            f" '--quarantine', {str(tier.dir.parent / 'q')!r}])\n"
            f"    main(['l2', 'scan', {str(tier.dir)!r}, '--assume', 'pristine'])\n"
            "print(rc, seen)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0 and r.stdout.strip() == "0 []", (r.stdout, r.stderr)


def test_reader_from_python_target(tmp_path, venv, patch_root):
    """``--python`` resolves the target as ``status`` does (a probe of that
    interpreter; lmcache is never imported)."""
    d = tmp_path / "t"
    d.mkdir()
    put(d, name(0, 1, NS1), 64)
    rc, doc = scan_json(d, "--python", str(venv / "bin" / "python"), patches=patch_root)
    assert rc == FLAGGED and doc["result"]["reader"]["source"] == "install"
    assert doc["result"]["reader"]["detail"].startswith("pristine lmcache 9.9.9")
    assert doc["result"]["flagged"]["never-read"]["objects"] == 1
