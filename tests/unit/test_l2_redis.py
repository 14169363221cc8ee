"""``patchtool l2 scan redis://HOST:PORT[/DB]`` and ``l2 restore redis://...``
on a real ``redis-server`` (``tests/_redis.py``: one per module, 127.0.0.1,
a free port, no persistence; skipped with the reason when none can be
provisioned).

The tier is written with values sealed by the tests' own code from the
format the patch writes (``tests/unit/l2redistier.py``), not by the module
under test: sealed objects (good; corrupted in place; two swapped between
keys; one truncated), a salted one, unsealed native keys (pristine
LMCache's), a namespace the reader never reads, and foreign keys (a string,
a key of the wrong shape, uppercase hex, a hash named like an object).
The listing, ``--verify``, ``--quarantine`` (RENAMENX to ``lmcptq@``) and
``l2 restore`` by key must treat exactly those as the fs scan treats their
counterparts, with the fs scan's JSON shape and exit codes.

Broken once each, and watched failing: binding the digest to nothing instead
of the wire key (``l2redis.sealed_verdict`` passing ``b""``) fails
:func:`test_verify_flags_exactly_the_damaged_objects` and eight others (every
good value is then corrupt); skipping the digest comparison in
``l2checksum.value_verdict`` fails it and six others (the flipped byte and
the swapped pair then verify).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _cli import cli, one_line
from _redis import free_port, running_redis

from patchtool.l2 import checksum as l2checksum, reader as l2reader, redis_tier as l2redis, redis_move as l2redismove, scan as l2scan
from patchtool.errors import Refusal

from .l2redistier import (NS1, NS2, QPREFIX, kv_of, native, prefix, seal, sealed_ok, snapshot,
                          wire)
from .test_no_heavy_imports import GUARD

KV = 4096
FLAGGED, AMBIGUOUS = 20, 21


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_redis(tmp_path_factory.mktemp("redis")) as r:
        yield r


@dataclass
class Tier:
    url: str
    client: object
    corrupt: set[str]  # the damaged sealed keys
    never_read: set[str]  # the NS2 key (a kvl1 reader never reads it)
    good: set[str]  # sealed keys that verify
    unsealed: set[str]
    foreign: set[str]


@pytest.fixture
def tier(server) -> Tier:
    c = server.client()
    c.flushall()
    good, corrupt, unsealed = set(), set(), set()
    for h in range(8):  # a namespaced set of the reader's own format
        k = wire(1, h, NS1)
        c.set(k, seal(k, kv_of(k, KV)))
        good.add(k)
    k = wire(1, 8, NS1, salt="tenant-a")
    c.set(k, seal(k, kv_of(k, KV)))
    good.add(k)
    for h in range(3):  # a plain set: sealed, and pristine LMCache's unsealed keys
        k = wire(0, h)
        c.set(k, seal(k, kv_of(k, KV)))
        good.add(k)
        n = native(0, 10 + h)
        c.set(n, kv_of(n, KV))
        unsealed.add(n)
    nr = wire(1, 0, NS2)
    c.set(nr, seal(nr, kv_of(nr, KV)))
    # damage: a flipped byte, a truncation, a swap
    k0, k1, k2, k3 = (wire(1, h, NS1) for h in range(4))
    v = bytearray(c.get(k0))
    v[100] ^= 0x10
    c.set(k0, bytes(v))
    c.set(k1, c.get(k1)[:KV // 2])
    a, b = c.get(k2), c.get(k3)
    c.set(k2, b)
    c.set(k3, a)
    corrupt = {k0, k1, k2, k3}
    good -= corrupt
    foreign = {"foo", "lmcptsum1@not-an-object", native(0, 0xABCD).replace("abcd", "ABCD")}
    for f in foreign:
        c.set(f, b"x")
    hashed = wire(5, 1)  # a hash named like an object: not an object
    c.hset(hashed, "f", "v")
    foreign.add(hashed)
    return Tier(server.url, c, corrupt, {nr}, good, unsealed, foreign)


def scan(url: str, *extra: str, **kw) -> tuple[int, dict]:
    r = cli("l2", "scan", url, "--assume", "kvl1", "--json", *extra, **kw)
    assert r.err == "", r.err
    return r.rc, r.json["result"]


def test_listing_counts_and_sizes(tier: Tier) -> None:
    rc, res = scan(tier.url)
    assert rc == FLAGGED  # the never-read namespace
    assert res["dir"] == tier.url and res["sizes_read"] is True
    assert res["objects"] == 16 and res["vanished"] == 0
    assert res["bytes"] == 12 * (KV + 64) + KV // 2 + 3 * KV
    assert res["foreign"] == 4 and res["foreign_names"] == sorted(tier.foreign)
    assert (res["tmp_files"], res["subdirs"]) == (0, 0)
    info = res["redis"]
    assert (info["sealed"], info["unsealed"], info["quarantined"]) == (13, 3, 0)
    assert info["db"] == 0 and info["server"] and info["seal_prefix"] == "lmcptsum1@"
    sets = {s["set"]: s for s in res["sets"]}
    assert set(sets) == {prefix(0), prefix(1, NS1), prefix(1, NS2)}
    plain, mine, other = sets[prefix(0)], sets[prefix(1, NS1)], sets[prefix(1, NS2)]
    # sealed S + 64 beside unsealed S: one layout, not ambiguous
    assert plain["sizes"] == {str(KV): 3, str(KV + 64): 3} and not plain["ambiguous"]
    assert plain["model"] == "Qwen/Qwen3-0.6B" and plain["kv_rank"] == "0x01000100"
    # the truncated object is a second size: ambiguous until --verify
    assert mine["sizes"] == {str(KV // 2): 1, str(KV + 64): 8} and mine["ambiguous"]
    assert mine["namespace"] == NS1 and mine["layout_format"] == 1 and mine["flagged"] == []
    assert not other["readable"]
    [flag] = other["flagged"]
    assert (flag["category"], flag["objects"], flag["example"]) == ("never-read", 1,
                                                                    min(tier.never_read))
    assert res["final"]["rescanned"] is False and res["remaining_flagged"] == 1
    assert res["verify"] is None and res["quarantine"] is None
    # the human output: the same report
    r = cli("l2", "scan", tier.url, "--assume", "kvl1")
    assert r.rc == FLAGGED
    assert f"tier        : {tier.url} (Redis " in r.out
    assert "objects     : 16 (" in r.out and "13 sealed (lmcptsum1@), 3 unsealed" in r.out
    assert "never-read: 1 object(s)" in r.out and "ambiguous   : Qwen/Qwen3-0.6B kvl1-" in r.out
    assert f"--expect-size '{prefix(1, NS1)}=SIZE'" in r.out
    assert f"exit code 20: 1 flagged object(s) in {tier.url}" in r.out


def test_names_only_reads_no_sizes(tier: Tier) -> None:
    rc, res = scan(tier.url, "--names-only")
    assert rc == FLAGGED and res["sizes_read"] is False and res["bytes"] is None
    # without a size there is no type either: the hash named like an object counts as one
    assert res["objects"] == 17 and res["foreign"] == 3
    # and it moves what a name decides: the never-read namespace, nothing else
    before = snapshot(tier.client)
    rc, res = scan(tier.url, "--names-only", "--quarantine")
    assert rc == 0 and res["quarantine"]["moved"] == 1
    after = snapshot(tier.client)
    assert set(after) - set(before) == {(QPREFIX + k).encode() for k in tier.never_read}
    assert set(before) - set(after) == {k.encode() for k in tier.never_read}


def test_verify_flags_exactly_the_damaged_objects(tier: Tier) -> None:
    before = snapshot(tier.client)
    rc, res = scan(tier.url, "--verify")
    assert rc == FLAGGED
    v = res["verify"]
    assert set(v["corrupt_names"]) == tier.corrupt
    assert v["verdicts"] == {"corrupt": 4, "ok": len(tier.good), "unsealed": 3}
    assert v["checked"] == 4 + len(tier.good) + 3
    assert "patchtool's interpreter" in v["checked_with"]
    k1 = wire(1, 1, NS1)
    assert "sealed key without a valid trailer" in v["details"][k1]
    assert "checksum mismatch" in v["details"][wire(1, 2, NS1)]
    mine = next(s for s in res["sets"] if s["set"] == prefix(1, NS1))
    assert not mine["ambiguous"]  # the verified trailers say which size is the layout's
    assert {(f["category"], f["size"], f["objects"]) for f in mine["flagged"]} == {
        ("corrupt", KV // 2, 1), ("corrupt", KV + 64, 3)}
    assert res["flagged"]["corrupt"] == {"objects": 4, "bytes": KV // 2 + 3 * (KV + 64)}
    assert snapshot(tier.client) == before  # read only


def test_quarantine_renames_exactly_the_flagged_and_restore_by_key(tier: Tier) -> None:
    c = tier.client
    before = snapshot(c)
    flagged = tier.corrupt | tier.never_read
    rc, res = scan(tier.url, "--verify", "--quarantine")
    assert rc == 0, res["final"]
    q = res["quarantine"]
    assert (q["moved"], q["refused"], q["changed"], q["vanished"]) == (5, 0, 0, 0)
    assert q["moved_by_category"] == {"never-read": 1, "unpatched": 0, "size-mismatch": 0,
                                      "corrupt": 4}
    assert q["moved_bytes"] == sum(len(before[k.encode()]) for k in flagged)
    assert q["journal"] is None and q["run"] is None and q["prefix"] == QPREFIX
    assert res["final"]["rescanned"] and res["final"]["flagged_objects"] == 0
    after = snapshot(c)
    # exactly the flagged keys moved, under lmcptq@, with their bytes; nothing else changed
    assert {k for k in after if k.startswith(QPREFIX.encode())} == \
        {(QPREFIX + k).encode() for k in flagged}
    assert {k: v for k, v in after.items() if not k.startswith(QPREFIX.encode())} == \
        {k: v for k, v in before.items() if k.decode() not in flagged}
    for k in flagged:
        assert after[(QPREFIX + k).encode()] == before[k.encode()]
    rc, res = scan(tier.url, "--verify")
    assert rc == 0 and res["redis"]["quarantined"] == 5 and res["objects"] == 11

    # restore one by key: back under its own name, with its bytes
    k0 = wire(1, 0, NS1)
    r = cli("l2", "restore", tier.url, k0, "--json")
    assert r.rc == 0, r.err
    out = r.json["result"]
    assert (out["restored"], out["kept"], out["restored_names"]) == (1, 0, [k0])
    assert out["restored_bytes"] == len(before[k0.encode()]) and out["journal"] is None
    assert c.get(k0) == before[k0.encode()] and not c.exists(QPREFIX + k0)

    # the server stored a key again: restoring that key by name is refused, nothing moves
    k2 = wire(1, 2, NS1)
    c.set(k2, seal(k2, kv_of("again", KV)))
    state = snapshot(c)
    r = cli("l2", "restore", tier.url, QPREFIX + k2)
    line = one_line(r, 3, tier.url, "a live key", k2)
    assert "nothing was moved" in line and snapshot(c) == state
    r = cli("l2", "restore", tier.url, "lmcptsum1@never-quarantined@00000000@0@00")
    one_line(r, 3, tier.url, "no quarantined key")

    # restore the rest: the live k2 stays, its quarantined copy is kept aside
    r = cli("l2", "restore", tier.url)
    assert r.rc == 0, r.err
    assert "restored    : 3 object(s)" in r.out and "kept aside  : 1 object(s)" in r.out
    assert k2 in r.out
    final = snapshot(c)
    assert {k for k in final if k.startswith(QPREFIX.encode())} == {(QPREFIX + k2).encode()}
    assert final[k2.encode()] == seal(k2, kv_of("again", KV))
    for k in flagged - {k2}:
        assert final[k.encode()] == before[k.encode()]


def test_only_corrupt_leaves_the_rest_flagged(tier: Tier) -> None:
    rc, res = scan(tier.url, "--verify", "--quarantine", "--only", "corrupt")
    assert rc == FLAGGED
    assert res["quarantine"]["moved"] == 4 and res["quarantine"]["only"] == ["corrupt"]
    assert res["final"]["flagged"]["never-read"]["objects"] == 1
    assert res["final"]["flagged"]["corrupt"]["objects"] == 0
    r = cli("l2", "scan", tier.url, "--assume", "kvl1", "--verify", "--quarantine", "--only",
            "corrupt")
    assert r.rc == FLAGGED and "left        : 1 flagged object(s) in the tier" in r.out


def test_a_key_rewritten_after_its_judgement_is_not_moved(tier: Tier) -> None:
    """The scan judged a key corrupt; a server stores a good value under it
    before the quarantine reaches it: the guarded rename leaves it."""
    reader = l2reader.parse_assume("kvl1")
    k0 = wire(1, 0, NS1)
    with l2redis.connect(l2redis.parse_url(tier.url)) as t, l2checksum.Digester(None) as dg:
        res, plan = l2scan.scan(t, reader, check=t.checker(dg))
        assert set(res.verify.corrupt_names) == tier.corrupt
        good = seal(k0, kv_of("rewritten", KV))
        tier.client.set(k0, good)
        q, _ = l2redismove.quarantine(t, plan, ["corrupt"], dg)
    assert (q.moved, q.changed) == (3, 1)
    assert tier.client.get(k0) == good and not tier.client.exists(QPREFIX + k0)


def test_a_changing_value_is_never_judged_on_one_read(tier: Tier) -> None:
    """Corrupt only when two consecutive reads agree and fail; a value fixed
    between reads is ok; one that changes on every read is not judged."""
    c = tier.client
    k = wire(1, 0, NS1)  # corrupted in place by the fixture
    bad = c.get(k)
    with l2redis.connect(l2redis.parse_url(tier.url)) as t, l2checksum.Digester(None) as dg:
        reads: list[int] = []

        def counted(name: str):
            reads.append(1)
            return t.get(name)
        assert t.judge(k, dg.digest, counted)[0] == "corrupt" and len(reads) == 2

        def fixed_after_first(name: str):
            value = t.get(name)
            c.set(name, seal(name, kv_of("fixed", KV)))
            return value
        assert t.judge(k, dg.digest, fixed_after_first) == ("ok", "")

        n = iter(range(100))

        def always_changing(name: str):
            v = bytearray(bad)
            v[200] = next(n)
            c.set(name, bytes(v))
            return t.get(name)
        verdict, detail = t.judge(k, dg.digest, always_changing)
        assert verdict == "unreadable" and "changed between each" in detail

        def gone(name: str):
            c.delete(name)
            return t.get(name)
        assert t.judge(k, dg.digest, gone)[0] == "unreadable"


def test_the_check_runs_in_the_target_interpreter_too(tier: Tier) -> None:
    names = sorted(tier.corrupt | tier.good | tier.unsealed)
    with l2redis.connect(l2redis.parse_url(tier.url)) as t:
        with l2checksum.Digester(None) as here:
            a = t.checker(here)(names)
        with l2checksum.Digester(sys.executable, here=False) as there:
            b = t.checker(there)(names)
            assert sys.executable in there.checked_with
    assert a == b and {n for n, v in a.items() if v[0] == "corrupt"} == tier.corrupt
    no_blake3 = shutil.which("python3", path="/usr/bin:/bin")
    if no_blake3:
        with pytest.raises(Refusal, match=f"the check did not run in {no_blake3}"):
            l2checksum.Digester(no_blake3, here=False)
    with pytest.raises(Refusal, match="no target was given"):
        l2checksum.Digester(None, here=False)


def test_expect_size_takes_the_redis_set_form(tier: Tier) -> None:
    rc, res = scan(tier.url, "--expect-size", f"{prefix(1, NS1)}={KV}")
    mine = next(s for s in res["sets"] if s["set"] == prefix(1, NS1))
    assert mine["expected_size"] == KV and not mine["ambiguous"]
    assert [(f["category"], f["size"]) for f in mine["flagged"]] == [("size-mismatch", KV // 2)]
    assert rc == FLAGGED
    fs_form = f"Qwen-SEP-Qwen3-0.6B@0x01000100@0={KV}"
    r = cli("l2", "scan", tier.url, "--assume", "kvl1", "--expect-size", fs_form)
    one_line(r, 2, "--expect-size", "<model>@<kv_rank 8 hex>@<group hex>")


def test_json_has_the_fs_shape(tier: Tier, tmp_path: Path) -> None:
    """The fs scan's keys, in its order, plus ``redis``; the quarantine's and
    the restore's likewise, plus their Redis fields."""
    d = tmp_path / "fs"
    d.mkdir()
    (d / "Qwen-SEP-Qwen3-0.6B@0x01000100@0@00.data").write_bytes(b"")  # empty: size-mismatch
    fs = cli("l2", "scan", str(d), "--assume", "kvl1", "--quarantine", str(tmp_path / "q"),
             "--json").json
    fs_restore = cli("l2", "restore", str(tmp_path / "q"), "--json").json
    rc, res = scan(tier.url, "--verify", "--quarantine")
    assert list(res) == [*fs["result"], "redis"]
    assert list(res["quarantine"]) == [*fs["result"]["quarantine"], "prefix", "changed",
                                       "vanished"]
    assert list(res["final"]) == list(fs["result"]["final"])
    r = cli("l2", "restore", tier.url, "--json")
    assert r.json["command"] == "l2 restore" and r.json["exit_code"] == 0
    assert list(r.json["result"]) == [*fs_restore["result"], "restored_names"]
    r = cli("l2", "scan", tier.url, "--assume", "kvl1", "--json")
    assert r.json["command"] == "l2 scan" and r.json["exit_code"] == r.rc == FLAGGED


def test_refusals_and_exit_codes(tier: Tier, server, tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    dead = f"redis://127.0.0.1:{port}/0"
    r = cli("l2", "scan", dead, "--assume", "kvl1")
    one_line(r, 3, dead, "cannot connect")
    r = cli("l2", "scan", dead, "--assume", "kvl1", "--json")
    assert r.rc == 3 and json.loads(r.out)["error"]["file"] == dead
    r = cli("l2", "restore", dead)
    one_line(r, 3, dead, "cannot connect")
    for bad, why in ((f"redis://127.0.0.1:{server.port}/x", "not a number"),
                     ("redis://127.0.0.1:99999/0", "port"),
                     (f"redis://127.0.0.1:{server.port}/0?db=1", "no ?options")):
        assert cli("l2", "scan", bad, "--assume", "kvl1").rc == 2, bad
        assert why in cli("l2", "scan", bad, "--assume", "kvl1").err
    before = snapshot(tier.client)
    r = cli("l2", "scan", tier.url, "--assume", "kvl1", "--quarantine", str(tmp_path / "q"))
    one_line(r, 2, "--quarantine", "without DEST")
    r = cli("l2", "scan", tier.url, "--assume", "kvl1", "--verify", "--names-only")
    assert r.rc == 2 and "--names-only" in r.err
    r = cli("l2", "scan", tier.url, "--assume", "kvl1", "--quarantine", "--only", "corrupt")
    one_line(r, 2, "--only", "add --verify")
    r = cli("l2", "scan", tier.url, "--assume", "kvl1", "--only", "corrupt")
    one_line(r, 2, "--only", "applies only to --quarantine")
    assert snapshot(tier.client) == before and not (tmp_path / "q").exists()
    # the fs commands refuse the Redis-only forms
    r = cli("l2", "scan", str(tmp_path), "--assume", "kvl1", "--quarantine")
    one_line(r, 2, "--quarantine", "needs DEST")
    r = cli("l2", "restore", str(tmp_path), "somekey")
    one_line(r, 2, "KEY", "redis:// tier")
    # exit 0 and 21
    tier.client.delete(*tier.never_read)
    assert scan(tier.url)[0] == AMBIGUOUS  # the truncated size, unjudged without --verify
    tier.client.delete(*tier.corrupt)
    assert scan(tier.url, "--verify")[0] == 0


def test_password_and_database(tier: Tier, server) -> None:
    c = tier.client
    host = f"127.0.0.1:{server.port}"
    k = wire(0, 1)
    db1 = server.client(db=1)
    db1.set(k, seal(k, kv_of("db1", KV)))
    rc, res = scan(f"redis://{host}/1", "--verify")
    assert rc == 0 and res["objects"] == 1 and res["redis"]["db"] == 1
    c.config_set("requirepass", "s3cret")
    try:
        for url in (f"redis://:s3cret@{host}/1", f"redis://default:s3cret@{host}/1"):
            r = cli("l2", "scan", url, "--assume", "kvl1", "--json")
            assert r.rc == 0, r.err
            assert "s3cret" not in r.out and ":***@" in r.json["result"]["dir"]
        r = cli("l2", "scan", f"redis://:nope@{host}/1", "--assume", "kvl1")
        line = one_line(r, 3, f"redis://:***@{host}/1", "cannot connect")
        assert "nope" not in line
        r = cli("l2", "scan", f"redis://{host}/1", "--assume", "kvl1")
        one_line(r, 3, f"redis://{host}/1", "cannot connect")
    finally:
        c.execute_command("AUTH", "s3cret")
        c.config_set("requirepass", "")
        db1.flushdb()


def test_sealed_values_are_what_the_tests_built(tier: Tier) -> None:
    """The fixture's own check agrees with the tool on which keys are good."""
    c = tier.client
    assert all(sealed_ok(k, c.get(k)) for k in tier.good)
    assert not any(sealed_ok(k, c.get(k)) for k in tier.corrupt)


def _modules_after(*args: str, env: dict | None = None) -> tuple[int, bool]:
    """Run the CLI in a fresh interpreter; (exit code, whether redis was imported)."""
    code = ("import sys; from patchtool.cli import main; rc = main(sys.argv[1:]); "
            "print('REDIS', 'redis' in sys.modules); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    return p.returncode, p.stdout.strip().endswith("REDIS True")


def test_only_the_redis_path_loads_redis_and_nothing_heavy(tier: Tier, tmp_path: Path) -> None:
    d = tmp_path / "fs"
    d.mkdir()
    assert _modules_after("l2", "scan", str(d), "--assume", "kvl1", "--json") == (0, False)
    assert _modules_after("l2", "scan", str(d), "--assume", "kvl1") == (0, False)
    assert _modules_after("status", "--json")[1] is False
    assert _modules_after("l2", "scan", tier.url, "--assume", "kvl1", "--json") == (FLAGGED, True)
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD)
    log = tmp_path / "imports.log"
    env = {"PYTHONPATH": str(guard), "PATCHTOOL_IMPORT_GUARD_LOG": str(log)}
    r = cli("l2", "scan", tier.url, "--assume", "kvl1", "--verify", "--quarantine", env=env)
    assert r.rc == 0, r.err
    r = cli("l2", "restore", tier.url, env=env)
    assert r.rc == 0, r.err
    assert not log.exists(), log.read_text()


def test_reader_from_an_install(tier: Tier, site, patch_root) -> None:
    """The reader comes from a target as on the fs tier: a pristine install
    reads plain keys only, so both namespaces are never read."""
    r = cli("l2", "scan", tier.url, "--site-packages", str(site), "--json", patches=patch_root)
    assert r.rc == FLAGGED, r.err
    res = r.json["result"]
    assert res["reader"]["source"] == "install" and res["reader"]["layout_format"] is None
    assert res["flagged"]["never-read"]["objects"] == 10  # NS1's 9 and NS2's 1
    r = cli("l2", "scan", tier.url, "--site-packages", str(site), "--assume", "kvl1")
    one_line(r, 2, "--assume", "not both")


def test_a_taken_quarantine_name_is_refused_never_overwritten(tier: Tier) -> None:
    c = tier.client
    k0 = wire(1, 0, NS1)
    c.set(QPREFIX + k0, b"an earlier quarantine's object")
    rc, res = scan(tier.url, "--verify", "--quarantine", "--only", "corrupt")
    q = res["quarantine"]
    assert (q["moved"], q["refused"], q["refused_names"]) == (3, 1, [k0])
    assert rc == FLAGGED and res["final"]["flagged"]["corrupt"]["objects"] == 1
    assert c.get(QPREFIX + k0) == b"an earlier quarantine's object" and c.exists(k0)
    assert res["final"]["examples"]["corrupt"] == k0
