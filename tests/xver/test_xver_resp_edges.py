"""The cross-version gate over ONE shared Redis tier (lab/xver_gate.py
--redis-url / --tier redis): every writer and reader build uses LMCache's
``resp`` adapter on the same real ``redis-server``, as a rolling upgrade
does.

* CI subset: one gate run over a Redis the test starts (``tests/_redis.py``),
  all four presets, one block per chunk, five pairs: 0.5.6 pristine <->
  patched both ways (different keys on Redis: a miss both ways, also for
  pure attention k=1, which the fs tier restores pristine <- patched),
  patched 0.5.5 -> patched 0.5.6 (sealed objects across versions follow the
  layout-keyed namespaces), and each 0.5.6 build -> itself (the exact and
  wrong-hit controls: pristine pure attention k=2 restores 1 of k pages
  whatever it reads, so the gate must say ``wrong`` over Redis too).  Every
  cell must be ``expected_outcome(..., tier="redis")``; no wrong hit has a
  patched side.
* The keys on the tier: a patched writer's keys all carry the sealed prefix
  and the trailer, a pristine writer's none; a patched reader's adapter
  refused no object (its misses are absent keys); the gate deletes its keys.
* ``--tier redis`` starts and stops a private redis-server.
* Full matrix (10 x 10 builds x 4 presets x 2 chunk sizes on one private
  Redis, ~15-25 min on 2 CPUs): opt-in with ``LMCACHE_PATCHTOOL_XVER_FULL=1``.

``LMCACHE_PATCHTOOL_XVER_ARGS`` adds xver_gate.py arguments to every run (e.g.
``--exclude-patch 17-resp-checksum``: patched builds then store and serve
unsealed values under the pristine keys, and the edges fail).
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest
from _redis import running_redis

REPO = Path(__file__).resolve().parents[2]
XVER = REPO / "lab" / "xver_gate.py"

from lab import xver_gate  # stdlib + provision + xver_outcome: no torch
from lab.redis_proc import ping
from gate.xver_outcome import ALL_BUILDS, PRESETS, Build, expected_outcome
from xver_run import run_xver  # this folder's helper

FULL = os.environ.get("LMCACHE_PATCHTOOL_XVER_FULL") == "1"

P6, S6, S5 = Build("0.5.6", "pristine"), Build("0.5.6", "patched"), Build("0.5.5", "patched")
RESP_EDGES: tuple[tuple[Build, Build], ...] = ((P6, S6), (S6, P6), (S5, S6), (S6, S6), (P6, P6))


def describe(c: dict) -> str:
    return (f"{c['writer']} -> {c['reader']} {c['preset']} cb{c['chunk_blocks']} on {c['tier']}: {c['outcome']} "
            f"(required {c['expected']}; {c['why']}; FA {c['fa_fidelity']}, GDN {c['gdn_fidelity']}; "
            f"keys {c['tier_keys']})")


@pytest.fixture(scope="module")
def resp_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, int]:
    """One gate run over a Redis this module starts; the keys left afterwards."""
    work = tmp_path_factory.mktemp("xver-resp")
    with running_redis(work) as r:
        pairs = ",".join(f"{w.label}>{rd.label}" for w, rd in RESP_EDGES)
        proc, result = run_xver(work, "--redis-url", r.url, "--pairs", pairs, "--chunk-blocks", "1")
        left = r.client().dbsize()
    return proc, result, left


@pytest.mark.parametrize("edge", RESP_EDGES, ids=lambda e: f"{e[0].short}>{e[1].short}")
def test_resp_edge_is_the_required_outcome(resp_run, edge: tuple[Build, Build]) -> None:
    proc, result, _ = resp_run
    assert result["verdict"] != "error", result.get("reason")
    cells = [c for c in result["cells"] if (c["writer"], c["reader"]) == (edge[0].label, edge[1].label)]
    assert sorted(c["preset"] for c in cells) == sorted(PRESETS), [describe(c) for c in cells]
    wrong = [describe(c) for c in cells if c["outcome"] == "wrong" and "patched" in (edge[0].state, edge[1].state)]
    assert not wrong, "wrong hits with a patched side:\n" + "\n".join(wrong)
    off = [describe(c) for c in cells if c["outcome"] != expected_outcome(*edge, c["preset"], 1, "redis")]
    assert not off, "not the required outcome on Redis:\n" + "\n".join(off)
    for c in cells:
        assert c["tier"] == "redis" and c["chunks_stored"] == 3 and c["object_bytes"], describe(c)
        if c["outcome"] == "exact":
            assert c["chunks_hit"] == 3 and c["fa_fidelity"] == 1.0, describe(c)
            assert c["gdn_fidelity"] in (None, 1.0) and c["foreign_bytes"] == 0, describe(c)
        elif c["outcome"] == "miss":
            assert c["chunks_hit"] == 0 or c["retrieve_ok"] is False, describe(c)
    if edge[0].state != edge[1].state:  # sealed vs bare keys: nothing shared, whatever the preset
        assert {c["outcome"] for c in cells} == {"miss"}, [describe(c) for c in cells]


def test_resp_wrong_hit_control_is_reported_wrong(resp_run) -> None:
    """Pristine 0.5.6 pure attention k=2 restores 1 of k pages even from its own
    objects: over Redis the gate must report that wrong hit, as over fs."""
    _, result, _ = resp_run
    [c] = [c for c in result["cells"] if (c["writer"], c["reader"], c["preset"])
           == (P6.label, P6.label, "pure-attn-bs128")]
    assert c["outcome"] == "wrong" and c["upstream"], describe(c)
    assert c["chunks_hit"] == 3 and c["retrieve_ok"] is True and c["fa_fidelity"] < 1.0, describe(c)


def test_resp_keys_are_sealed_exactly_for_patched_writers(resp_run) -> None:
    """17-resp-checksum: every key a patched writer stored is lmcptsum1@... and
    its value ends in the trailer; a pristine writer's keys are LMCache's own.
    The layout namespaces in the keys are the ones the table assumes."""
    _, result, _ = resp_run
    for c in result["cells"]:
        keys = c["tier_keys"]
        want = c["namespaces_with_layout_keys"]["writer"]
        assert keys["keys"] == 3 * len(want), describe(c)  # one object per chunk and object group
        sealed = keys["keys"] if Build.parse(c["writer"]).state == "patched" else 0
        assert keys["prefixed"] == keys["trailers"] == c["checksum_trailers"] == sealed, describe(c)
        names = sorted(c["l2_model_fields"])
        assert sorted("+kvl" in n for n in names) == sorted(ns != "" for ns in want), describe(c)


def test_resp_patched_reader_refused_no_object(resp_run) -> None:
    """The patched reader's misses are absent keys, not checksum refusals:
    nothing in this run is damaged or misplaced."""
    _, result, _ = resp_run
    statuses = result["readers"][f"{S6.label}/cb1"]["l2_adapters_status"]
    assert statuses and all(s for s in statuses), statuses
    for cycle in statuses:
        for s in cycle:
            assert s["object_checksum"].endswith("lmcptsum1@") and s["rejected_objects"] == 0, s
    for cycle in result["readers"][f"{P6.label}/cb1"]["l2_adapters_status"]:
        assert all("object_checksum" not in s for s in cycle), cycle


def test_resp_run_shares_the_named_redis_and_leaves_it_empty(resp_run) -> None:
    """The run used the server it was given, no reader wrote over a writer's
    object (no load failed here, so no buffer was stored back), and the gate
    deleted the writers' keys and its copies of them: the server is empty."""
    proc, result, left = resp_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["tier_writes"] == [] and all(c["reader_wrote"] == [] for c in result["cells"])
    for key, info in result["readers"].items():
        assert info["redis_commands"].get("set", 0) == 0, (key, info["redis_commands"])
    share = result["share"]
    assert share["tier"] == "redis" and share["private"] is False and share["redis_version"], share
    assert "deleted the writers' 48 keys" in proc.stderr  # 0.5.5P 18 + 0.5.6P 18 + 0.5.6p 12
    assert left == 0


def test_resp_reader_servers_per_request_for_pristine_readers_only(resp_run) -> None:
    """auto: a pristine reader on Redis gets a fresh server per stored request,
    a patched reader serves every writer from one server per chunk size."""
    _, result, _ = resp_run
    for c in result["cells"]:
        want = "per-request" if Build.parse(c["reader"]).state == "pristine" else "shared"
        assert c["reader_server"] == want, describe(c)
    assert result["readers"][f"{P6.label}/cb1"]["server_cycles"] == 2 * len(PRESETS)  # 2 writers
    assert result["readers"][f"{S6.label}/cb1"]["server_cycles"] == 2  # one per chunk size


def test_shared_pristine_reader_misses_its_own_objects_after_a_size_mismatch(tmp_path: Path) -> None:
    """Why pristine readers get a server per request on Redis: one pristine
    0.5.6 server that first loads pristine 0.5.5's shorter hybrid objects
    (a miss: "GET: size header mismatch") then misses pristine 0.5.6's own objects,
    which a fresh server restores exactly.  A miss, never a wrong hit; the
    gate reports the cell as differing from the table (exit 1)."""
    p5 = Build("0.5.5", "pristine")
    with running_redis(tmp_path) as r:
        pairs = f"{p5.label}>{P6.label},{P6.label}>{P6.label}"
        proc, result = run_xver(tmp_path, "--redis-url", r.url, "--pairs", pairs, "--presets", "qwen35-0.8b",
                                "--chunk-blocks", "1", "--reader-servers", "shared", timeout=900)
    assert result["verdict"] != "error", result.get("reason")
    got = {c["writer"]: c for c in result["cells"]}
    assert got[p5.label]["outcome"] == got[p5.label]["expected"] == "miss", describe(got[p5.label])
    own = got[P6.label]
    assert own["expected"] == "exact" and own["outcome"] == "miss" and own["chunks_hit"] == 0, describe(own)
    # the server's native client logged the loads of 0.5.5's 3 objects as size
    # mismatches, and no other kind of failure.  Here it logs each once (3, in every
    # run on a quiet and on a loaded machine); one cold CI run on a loaded machine
    # logged 6 (stop 44): the same reason, the same miss.  The count is timing, the
    # reason and the outcome are the behaviour, so the test pins those.
    failures = result["readers"][f"{P6.label}/cb1"]["native_get_failures"]
    assert set(failures) == {"GET: size header mismatch"}, failures
    count = failures["GET: size header mismatch"]
    assert count >= 3 and count % 3 == 0, failures
    assert proc.returncode == 1 and [c["writer"] for c in result["mismatches"]] == [P6.label]


def test_tier_redis_starts_and_stops_a_private_server(tmp_path: Path) -> None:
    """--tier redis without --redis-url: a private redis-server for the run
    (lab.redis_proc), gone with it."""
    args = argparse.Namespace(tier="redis", redis_url=None)
    share, server = xver_gate.open_share(args, tmp_path, lambda line: None)
    try:
        assert server is not None and share.private and share.url == server.url
        assert ping(server.host, server.port) and share.describe()["redis_version"]
    finally:
        server.stop()
    assert not ping(server.host, server.port) and not server.alive()


@pytest.mark.skipif(not FULL, reason="full RESP matrix: set LMCACHE_PATCHTOOL_XVER_FULL=1 (~15-25 min on 2 CPUs)")
def test_full_resp_matrix_matches_expected_outcome(tmp_path: Path) -> None:
    proc, result = run_xver(tmp_path, "--all", "--tier", "redis", timeout=5400)
    assert result["verdict"] != "error", result.get("reason")
    assert len(result["cells"]) == len(ALL_BUILDS) ** 2 * len(PRESETS) * 2
    off = [describe(c) for c in result["cells"] if not c["as_expected"]]
    assert not off, f"{len(off)} cells differ from expected_outcome on redis:\n" + "\n".join(off)
    assert not [describe(c) for c in result["cells"] if c["outcome"] == "wrong" and "patched" in
                (Build.parse(c["writer"]).state, Build.parse(c["reader"]).state)]
    assert proc.returncode == 0
