"""A shared Redis (RESP) tier through the real server (parts 16 and 17).

Every test starts its own ``redis-server`` on 127.0.0.1 (``tests/_redis.py``,
provisioned by ``lab/provision_redis.py``) and runs
``gate/restore_gate.py --redis-url`` with LMCache's ``resp`` L2 adapter and
its native client:

* **Across nodes.** Node A (a server) stores, is SIGKILLed; node B (another
  server process on other ports, a fresh client) restores from the same Redis
  into other block ids, byte for byte: the hybrid ``qwen35-0.8b`` (from 0.5.4
  on its attention and GDN state are separate objects of different sizes),
  its k = 1 control and pure attention at block 128.
* **The negative control for part 16.** Without ``16-native-l2-size-batches``
  (and 17, written on top of it) LMCache's native client takes the first
  buffer's size for the whole load batch, so the 0.5.4+ hybrid restores
  nothing (``buffer size mismatch``) while pure attention still restores: the
  gate tells the fix from its absence.
* **Integrity (part 17).** A writer phase stores each preset under five model
  names; the values are damaged inside Redis, each copy its own way (one byte
  flipped in place, the second half zeroed at the same size, two chunks'
  values exchanged, another request's intact value planted under a key); a
  reader phase on a fresh server restores every copy. Every damaged object is
  a miss, named by one server log line and counted in ``GET /status``; an
  intact prefix still hits, exact. ``patchtool l2 scan redis://... --verify``
  lists exactly the damaged keys first. Without ``17-resp-checksum``
  (``LMCACHE_PATCHTOOL_EXCLUDE_PATCH=17-resp-checksum``) the flipped, zeroed,
  swapped and planted values are served as hits with wrong bytes and the test
  fails. Damage that changes a value's size is left out here: LMCache's
  native client reads a value only into a buffer of exactly its size, and a
  mismatch also derails that connection (docs/design/resp-tier.md); a miss
  either way, but not a cell a table can pin.

* **Redis restarted between the store and the restore.** Redis is
  SIGKILLed after node A's store and started again on the same port and
  directory: with the append-only file (fsynced per write) every key is back
  and node B restores both presets exact; without persistence the tier is
  empty and node B finds nothing, a clean miss. Node B is a new server, so
  its client is new too: a client that lived through the restart never
  reconnects (docs/disk-tier.md, "Faults").

CI runs the restore across nodes on 0.5.6 and 0.5.3 (merged objects, the
other object layout) and the damage cells on 0.5.6; ``LMCACHE_PATCHTOOL_FULL=1``
runs all four versions of both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .harness_run import REPO, provision
from .tier_damage import assert_outcomes, assert_refusals_logged, damage_copies, remove_work

sys.path.insert(0, str(REPO / "tests"))
from _redis import RedisProc, running_redis
GATE = REPO / "gate" / "restore_gate.py"
FULL = os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
VERSIONS = ["0.5.3", "0.5.4", "0.5.5", "0.5.6"] if FULL else ["0.5.3", "0.5.6"]
DAMAGE_VERSIONS = VERSIONS if FULL else ["0.5.6"]
SEALED = "lmcptsum1@"
TRAILER_LEN = 64
NODE_PRESETS = ("qwen35-0.8b", "control-k1", "pure-attn-bs128")
DAMAGE_PRESETS = ("pure-attn-k1", "qwen35-0.8b")
COPIES = ("intact", "bit-rot", "torn", "swap", "foreign")
# copy -> (first damaged chunk, chunks hit after the restart with one object per chunk)
DAMAGE = {"intact": (None, 3), "bit-rot": (1, 1), "torn": (0, 0), "swap": (0, 0), "foreign": (1, 1)}


def _series(version: str) -> list[Path]:
    """The shipped series minus the parts named in LMCACHE_PATCHTOOL_EXCLUDE_PATCH."""
    skip = {s for s in os.environ.get("LMCACHE_PATCHTOOL_EXCLUDE_PATCH", "").split(",") if s}
    shipped = sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch"))
    if not any(p.stem == "17-resp-checksum" for p in shipped):
        pytest.skip(f"patches/hybrid-fa/{version}: no 17-resp-checksum part")
    return [p for p in shipped if p.stem not in skip]


def _gate(version: str, work: Path, redis: RedisProc, presets: tuple[str, ...], *args: str,
          series: list[Path] | None = None, name: str = "gate") -> dict:
    python = provision.runtime_env(version) / "bin" / "python"
    overlay = provision.overlay(version, _series(version) if series is None else series)
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1")
    out = work / f"{name}.json"
    proc = subprocess.run([str(python), str(GATE), "--redis-url", redis.url, "--json-out", str(out),
                           *[a for p in presets for a in ("--preset", p)], "--chunks", "3",
                           "--no-stay-alive", "--step-timeout", "30", *args],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=900)
    if not out.exists():
        pytest.fail(f"restore_gate {name} wrote no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    report = json.loads(out.read_text())
    report["stderr_tail"] = proc.stderr[-3000:]
    return report


def _by_preset(report: dict) -> dict[str, dict]:
    return {p["preset"]: p for p in report["presets"]}


# ---------------------------------------------------------------------------
# across nodes
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_node_b_restores_what_node_a_stored(version: str, tmp_path: Path) -> None:
    with running_redis(tmp_path) as redis:
        report = _gate(version, tmp_path, redis, NODE_PRESETS)
        keys = [k.decode() for k in redis.client().scan_iter(count=1000)]
    assert report["verdict"] == "pass", report["reason"] + report["stderr_tail"]
    for p in report["presets"]:
        assert p["after_restart"]["l2_hits"] > 0 and p["after_restart"]["l1_hits"] == 0, p
    # node B is another server on other ports over the same Redis
    (cycle, *_) = report["cycles"]
    a, b = cycle["servers"][0], cycle["servers"][-1]
    assert a["zmq_url"] != b["zmq_url"] and a["pid"] != b["pid"]
    # what the tier holds: sealed values only, each with its trailer
    assert keys and all(k.startswith(SEALED) for k in keys), keys[:3]
    on_tier = {name: p["on_disk"] for name, p in _by_preset(report).items()}
    for name, o in on_tier.items():
        assert o["objects"] == o["expected"] == o["checksum_trailers"], (name, o)
    status = cycle["l2_adapters_status"][0]
    assert status["object_checksum"].startswith("blake3 trailer") and status["rejected_objects"] == 0, status


@pytest.mark.slow
def test_without_parts_16_and_17_the_hybrid_restores_nothing(tmp_path: Path) -> None:
    """The negative control: the size split removed (and part 17, which is
    written on top of it in the same file), the shipped rest kept: what the
    previous revision of every series did on Redis."""
    version = "0.5.6"
    series = [p for p in _series(version) if p.stem not in ("16-native-l2-size-batches", "17-resp-checksum")]
    with running_redis(tmp_path) as redis:
        report = _gate(version, tmp_path, redis, ("qwen35-0.8b", "pure-attn-bs128"), "--keep-tmp",
                       series=series)
    try:
        by = _by_preset(report)
        hybrid, attn = by["qwen35-0.8b"], by["pure-attn-bs128"]
        assert hybrid["verdict"] == "fail" and hybrid["after_restart"]["chunks_found"] == 0, hybrid["reasons"]
        assert hybrid["foreign_writes"]["bytes"] == 0  # a miss, never a wrong write
        assert attn["verdict"] == "pass", attn["reasons"]
        logs = "".join(Path(c["workdir"], "server-B.log").read_text(errors="replace") for c in report["cycles"])
        assert "buffer size mismatch" in logs
    finally:
        for c in report.get("cycles", []):
            subprocess.run(["rm", "-rf", c["workdir"]], check=False)


# ---------------------------------------------------------------------------
# integrity: values damaged inside Redis
# ---------------------------------------------------------------------------


def _chunk_keys(client, model: str, hashes: list[str]) -> list[list[str]]:
    """Per chunk, that chunk's keys of ``model`` (one per object group), sorted."""
    keys = [k.decode() for k in client.scan_iter(count=1000)]
    out = []
    for i, h in enumerate(hashes):
        mine = sorted(k for k in keys
                      if k.removeprefix(SEALED).split("@")[0].split("+")[0] == model
                      and k.removeprefix(SEALED).split("@")[3] == h)
        assert mine, f"no key of {model} chunk {i}"
        out.append(mine)
    return out


def _group(key: str) -> str:
    return key.removeprefix(SEALED).split("@")[2]


def _kv_len(value: bytes, sealed: bool) -> int:
    return len(value) - TRAILER_LEN if sealed else len(value)


def _damage(client, entries: dict[str, dict]) -> dict[str, list[str]]:
    """Damage every object of one chunk per copy (:data:`DAMAGE`), sizes kept; the keys touched."""
    chunks = {c: _chunk_keys(client, e["model"], e["chunk_hashes"]) for c, e in entries.items()}

    def apply(copy: str, key: str, partner: str | None) -> str | None:
        value = client.get(key)
        n = _kv_len(value, key.startswith(SEALED))
        swapped = None
        if copy == "bit-rot":
            client.setrange(key, n // 2, bytes([value[n // 2] ^ 0xFF]))
        elif copy == "torn":
            client.setrange(key, n // 2, bytes(len(value) - n // 2))
        elif copy == "swap":
            client.set(key, client.get(partner))
            client.set(partner, value)
            swapped = partner
        elif copy == "foreign":
            client.set(key, client.get(partner))
        assert client.strlen(key) == len(value)  # same size: a damage, not a truncation
        return swapped

    return damage_copies(chunks, DAMAGE, _group, apply)


def _scan_lists_exactly_the_damaged(redis: RedisProc, touched: dict[tuple[str, str], list[str]]) -> None:
    proc = subprocess.run([sys.executable, "-m", "patchtool", "l2", "scan", redis.url, "--assume", "kvl1",
                           "--verify", "--json"], capture_output=True, text=True, cwd=str(REPO), timeout=600)
    res = json.loads(proc.stdout)["result"]
    want = {k for keys in touched.values() for k in keys}
    assert sorted(res["verify"]["corrupt_names"]) == sorted(want), res["verify"]
    assert proc.returncode == 20 and res["flagged_objects"] == len(want), proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("version", DAMAGE_VERSIONS)
def test_damaged_values_are_misses_and_intact_ones_hit(version: str, tmp_path: Path) -> None:
    with running_redis(tmp_path) as redis:
        client = redis.client()
        state_path = tmp_path / "state.json"
        store = _gate(version, tmp_path, redis, DAMAGE_PRESETS, "--chunk-blocks", "1", "--phase", "store",
                      "--state-out", str(state_path), "--copies", str(len(COPIES)), "--model-prefix", "rk",
                      name="store")
        assert store["verdict"] == "pass", store["reason"] + store["stderr_tail"]
        state = json.loads(state_path.read_text())
        per_preset = {name: dict(zip(COPIES, [e for e in state["presets"] if e["preset"] == name], strict=True))
                      for name in DAMAGE_PRESETS}
        merged = {name: len(_chunk_keys(client, e["intact"]["model"], e["intact"]["chunk_hashes"])[2]) == 1
                  for name, e in per_preset.items()}
        touched = {(name, copy): keys for name, entries in per_preset.items()
                   for copy, keys in _damage(client, entries).items()}
        if all(k.startswith(SEALED) for keys in touched.values() for k in keys):
            _scan_lists_exactly_the_damaged(redis, touched)

        report = _gate(version, tmp_path, redis, (), "--chunk-blocks", "1", "--phase", "restore",
                       "--state-in", str(state_path), "--keep-tmp", name="restore")
    try:
        assert report["verdict"] != "error", report["reason"] + report["stderr_tail"]
        assert_outcomes(report, per_preset, DAMAGE, merged)
        assert_refusals_logged(report, touched)
    finally:
        remove_work(report)


# ---------------------------------------------------------------------------
# Redis restarted between the store and the restore
# ---------------------------------------------------------------------------

RESTART_PRESETS = ("qwen35-0.8b", "pure-attn-k1")


@pytest.mark.parametrize("persistence", (True, False), ids=("aof", "no-persistence"))
def test_redis_restarted_between_store_and_restore(persistence: bool, tmp_path: Path) -> None:
    version = "0.5.6"
    state = tmp_path / "state.json"
    with running_redis(tmp_path, persistence=persistence) as redis:
        store = _gate(version, tmp_path, redis, RESTART_PRESETS, "--chunk-blocks", "1", "--phase", "store",
                      "--state-out", str(state), name="store")
        assert store["verdict"] == "pass", store["reason"] + store["stderr_tail"]
        stored = redis.client().dbsize()
        redis.restart()
        kept = redis.client().dbsize()
        report = _gate(version, tmp_path, redis, (), "--chunk-blocks", "1", "--phase", "restore",
                       "--state-in", str(state), name="restore")
    # Never a wrong hit: whatever is found is exact.
    assert report["verdict"] == "pass", report["reason"] + report["stderr_tail"]
    found = {p["preset"]: p["after_restart"]["chunks_found"] for p in report["presets"]}
    if persistence:
        assert stored > 0 and kept == stored, (stored, kept)
        assert found == {name: 3 for name in RESTART_PRESETS}, found
    else:
        assert stored > 0 and kept == 0, (stored, kept)
        assert found == {name: 0 for name in RESTART_PRESETS}, found
