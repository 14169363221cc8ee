"""``l2 scan redis://... --verify`` (and ``--quarantine``) under a live writer.

A separate process keeps storing, overwriting and deleting sealed keys of one
namespaced set with *valid* values of two sizes, as LMCache servers sharing a
tier do, while the scan runs again and again.  Beside them sit a few
damaged keys that the writer never touches.  Every scan must finish, must
name exactly the damaged keys corrupt (never one of the writer's valid
values, whatever it read between the writer's commands), and must count the
keys that vanished under it; a quarantine under the writer must rename
exactly the damaged keys.  A real ``redis-server`` (``tests/_redis.py``).

Judging a key that vanished between the listing and its ``GET`` as an empty
value (``RedisTier.judge`` without its ``None`` check) makes
:func:`test_verify_under_a_live_writer` fail: the writer's deleted keys are
then reported corrupt.  Taking the re-read out of ``judge`` does not: a
Redis ``GET`` is atomic, so a valid writer never shows a failing value; the
re-read is tested with an instrumented read in ``test_l2_redis.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cli import cli
from _redis import running_redis

from .l2redistier import NS1, QPREFIX, kv_of, seal, wire

POOL = 150  # keys the writer cycles through
SIZES = (64 << 10, 96 << 10)  # KV bytes of the writer's values
DAMAGED = 4
MAX_SCANS = 12

WRITER = r'''
import os, random, struct, sys, time
import blake3, redis
port, stop, pool = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
sizes = [int(s) for s in sys.argv[4].split(",")]
D = b"lmcache-patchtool l2 object v1\0"
c = redis.Redis(host="127.0.0.1", port=port)
def key(h):
    return "lmcptsum1@Qwen/Qwen3-0.6B+kvl1-802ccd5fdf07@01000100@1@%016x" % h
def sealed(k, kv):
    d = blake3.blake3(D + k.encode() + b"\0" + kv).digest()
    return kv + struct.pack("<32sQI12s8s", d, len(kv), 1, bytes(12), b"LMCPTSUM")
rng = random.Random(7)
ops = {"set": 0, "del": 0}
while not os.path.exists(stop):
    k = key(rng.randrange(pool))
    if rng.random() < 0.35:
        c.delete(k)
        ops["del"] += 1
    else:
        c.set(k, sealed(k, os.urandom(rng.choice(sizes))))
        ops["set"] += 1
print(ops["set"], ops["del"])
'''


def _damaged(c) -> set[str]:
    """Sealed keys in another group, damaged; the writer never touches them."""
    out = set()
    for h in range(DAMAGED):
        k = wire(2, h, NS1)
        v = bytearray(seal(k, kv_of(k, SIZES[0])))
        v[h * 10] ^= 0xFF
        c.set(k, bytes(v))
        out.add(k)
    for h in range(DAMAGED, 2 * DAMAGED):  # and good ones beside them
        k = wire(2, h, NS1)
        c.set(k, seal(k, kv_of(k, SIZES[0])))
    return out


def test_verify_under_a_live_writer(tmp_path: Path) -> None:
    with running_redis(tmp_path) as r:
        c = r.client()
        damaged = _damaged(c)
        stop = tmp_path / "stop"
        script = tmp_path / "writer.py"
        script.write_text(WRITER)
        writer = subprocess.Popen([sys.executable, str(script), str(r.port), str(stop), str(POOL),
                                   ",".join(map(str, SIZES))], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(0.5)  # let it fill the pool
            vanished = unjudged = scans = 0
            verdicts: dict[str, int] = {}
            while scans < MAX_SCANS and (scans < 3 or not vanished + unjudged):
                t0 = time.monotonic()
                res = cli("l2", "scan", r.url, "--assume", "kvl1", "--verify", "--json",
                          timeout=120)
                scans += 1
                assert res.err == "" and res.rc == 20, (res.rc, res.err)
                doc = res.json["result"]
                assert set(doc["verify"]["corrupt_names"]) == damaged, \
                    (doc["verify"]["details"], time.monotonic() - t0)
                vanished += doc["vanished"]
                unjudged += doc["verify"]["verdicts"].get("unreadable", 0)
                for v, n in doc["verify"]["verdicts"].items():
                    verdicts[v] = verdicts.get(v, 0) + n
                assert writer.poll() is None, writer.communicate()
            assert vanished + unjudged > 0, (scans, verdicts)
            assert verdicts.get("ok", 0) > scans * DAMAGED  # the writer's keys were read

            q = cli("l2", "scan", r.url, "--assume", "kvl1", "--verify", "--quarantine", "--json",
                    timeout=120)
            assert q.rc in (0, 21), (q.rc, q.err)  # two sizes in the writer's set: ambiguous
            moved = q.json["result"]["quarantine"]
            assert moved["moved"] == DAMAGED and moved["moved_by_category"]["corrupt"] == DAMAGED
            assert {k.decode() for k in c.scan_iter(match=QPREFIX + "*")} == \
                {QPREFIX + k for k in damaged}
        finally:
            stop.touch()
            out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        sets, dels = map(int, out.split())
        assert sets > 100 and dels > 50, out
        print(f"scans {scans}, vanished {vanished}, unjudged {unjudged}, verdicts {verdicts}, "
              f"writer set {sets} del {dels}")


@pytest.mark.parametrize("sizes", [True, False], ids=["sizes", "names-only"])
def test_listing_under_a_live_writer_counts_what_vanished(tmp_path: Path, sizes: bool) -> None:
    """Without --verify the pass is SCAN and STRLEN only: it finishes and
    every listed key is an object, vanished or foreign, never lost."""
    with running_redis(tmp_path) as r:
        stop = tmp_path / "stop"
        script = tmp_path / "writer.py"
        script.write_text(WRITER)
        writer = subprocess.Popen([sys.executable, str(script), str(r.port), str(stop), str(POOL),
                                   "1024,2048"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        try:
            time.sleep(0.3)
            for _ in range(5):
                res = cli("l2", "scan", r.url, "--assume", "kvl1", "--json",
                          *(() if sizes else ("--names-only",)), timeout=120)
                assert res.err == "" and res.rc in (0, 21), (res.rc, res.err)
                doc = res.json["result"]
                assert doc["foreign"] == 0 and 0 < doc["objects"] + doc["vanished"] <= POOL
                assert doc["flagged_objects"] == 0
        finally:
            stop.touch()
            writer.communicate(timeout=60)
