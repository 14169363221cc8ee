"""The engine gate's first-run bugs, each pinned against a stand-in.

1. vLLM 0.27.1 leaves prefix caching off for a hybrid model unless asked, the
   Mamba cache mode then resolves to ``none`` and LMCache refuses the model:
   the gate must pass ``--enable-prefix-caching --mamba-cache-mode align`` in
   every arm, the cold one included.  ``fake_vllm.py`` refuses exactly like that.
2. A restarted LMCache server exports no ``lmcache_mp_l2_prefetch_*`` series
   until the first increment (OpenTelemetry's Prometheus exporter omits unset
   counters): a counter absent before the request counts as 0.
   ``fake_lmcache.py`` exports nothing until the first increment.

Each test here failed on the code before the fix (recorded in
docs/engine-gate.md, "First-run fixes").
"""

from __future__ import annotations

import json
import subprocess
import sys

from gate import engine_metrics as gm
from gate import engine_servers as gs
from gate import engine_verdict as gv

from .conftest import STANDINS, GateRunner

LMCACHE_TEXT_AFTER_RESTORE = (
    "# TYPE lmcache_mp_l2_prefetch_load_completed_chunks_total counter\n"
    'lmcache_mp_l2_prefetch_load_completed_chunks_total{l2_name="fs"} 15.0\n'
    "# TYPE lmcache_mp_l2_prefetch_hit_chunks_total counter\n"
    'lmcache_mp_l2_prefetch_hit_chunks_total{l2_name="fs"} 15.0\n')


# -- 2. absent counter before the request -------------------------------------------------

def test_absent_counter_before_is_zero():
    before = gm.snapshot(gm.parse_prometheus('target_info{service_name="x"} 1.0\n'), gm.LMCACHE)
    after = gm.snapshot(gm.parse_prometheus(LMCACHE_TEXT_AFTER_RESTORE), gm.LMCACHE)
    assert before.values["l2_prefetch_loaded"] is None
    d = gm.delta(before, after)
    assert d["l2_prefetch_loaded"] == 15.0 and d["l2_prefetch_hit"] == 15.0
    assert d["chunks_loaded"] is None  # absent after: still "not found"


def test_verdict_accepts_a_restore_whose_counters_appeared_with_it():
    before = gm.snapshot(gm.parse_prometheus(""), gm.LMCACHE)
    after = gm.snapshot(gm.parse_prometheus(LMCACHE_TEXT_AFTER_RESTORE), gm.LMCACHE)
    keys = ["K-" + "1" * 24]
    score = {"expected": keys, "found": keys, "missing": [], "spurious": [], "all_exact": True, "num_correct": 1}

    def entry(ttft, hits, ld):
        return {"prompt_tokens": 8161, "ttft_s": ttft, "token_ids": [1], "text": keys[0], "score": score,
                "vllm_delta": {"external_hits": hits}, "lmcache_delta": ld}

    rec = {"criterion": "keys", "lengths": [8192], "expect_k": 17,
           "arms": {"cold": {"8192": entry(5.0, 0, None)}, "store": {"8192": entry(5.2, 0, {})},
                    "restore": {"8192": entry(1.0, 8160, gm.delta(before, after))}},
           "health": {"ok": True}, "flush": {"ok": True},
           "logs": {r: {"sub_paged_groups": [{"group": 1, "k": 17}], "compressed_groups": []}
                    for r in ("store", "restore")},
           "placement_violations": []}
    v = gv.evaluate(rec)
    assert v.status == "pass", v.reasons
    check = next(c for c in v.checks if c.name == "lmcache_l2_read")
    assert check.ok is True and "15" in check.detail


def test_fake_lmcache_exports_no_prefetch_series_before_the_first_increment(tmp_path):
    """The stand-in itself: nothing before a read, the series after it."""
    import socket
    import time
    import urllib.request

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port, http = free_port(), free_port()
    p = subprocess.Popen([sys.executable, str(STANDINS / "fake_lmcache.py"), "--host", "127.0.0.1", "--port",
                          str(port), "--http-host", "127.0.0.1", "--http-port", str(http), "--chunk-size", "4",
                          "--l1-size-gb", "1", "--eviction-policy", "LRU", "--fake-flush-delay", "0",
                          "--l2-adapter", json.dumps({"type": "fs", "base_path": str(tmp_path / "l2")})],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def get(path):
            deadline = time.monotonic() + 20
            while True:
                try:
                    return urllib.request.urlopen(f"http://127.0.0.1:{http}{path}", timeout=5).read().decode()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

        def post(path, body):
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(req, timeout=5).read())

        assert "lmcache_mp_" not in get("/metrics")
        (tmp_path / "l2" / "h1.json").write_text("[1, 2, 3, 4]")  # as if a previous server stored it
        assert post("/fake/lookup", {"hashes": ["h1"]})["hit_chunks"] == 1
        text = get("/metrics")
        assert "lmcache_mp_l2_prefetch_load_completed_chunks_total" in text
        assert "lmcache_mp_l2_store_submitted" not in text  # still never incremented
    finally:
        p.terminate()
        p.wait(timeout=10)


# -- 1. prefix caching and the Mamba cache mode --------------------------------------------

def test_vllm_argv_enables_prefix_caching_and_mamba_align():
    argv = gs.vllm_argv(["vllm", "serve"], gs.VllmSettings(model="/m"), None)
    assert "--enable-prefix-caching" in argv
    i = argv.index("--mamba-cache-mode")
    assert argv[i + 1] == "align"


def test_fake_vllm_refuses_a_hybrid_model_without_the_flags(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Fake"]}))
    kv = json.dumps(gs.kv_transfer_config("127.0.0.1", 1))
    res = subprocess.run([sys.executable, str(STANDINS / "fake_vllm.py"), "serve", str(model), "--port", "1",
                          "--max-num-batched-tokens", "544", "--kv-transfer-config", kv],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "mamba_cache_mode='none'" in res.stderr + res.stdout


def test_every_arm_passes_the_flags_and_the_gate_passes(gate: GateRunner):
    """Old code: the store arm's vLLM refused the model (LMCache + mamba_cache_mode none)."""
    res, result = gate.run(control_lmcache="--fake-mode pristine")
    assert result is not None, res.stderr[-2000:]
    assert result["verdict"]["status"] == "pass", json.dumps(result.get("abort") or result["verdict"])[:2000]
    logs = gate.tmp / "work" / "logs"
    for arm in ("cold", "store", "restore", "control_store", "control_restore"):
        text = (logs / f"vllm-{arm}.log").read_text()
        assert "prefix caching enabled, mamba_cache_mode=align" in text, arm
    # the restarted server exported no prefetch series before the request; the delta still counts
    for L, e in result["arms"]["restore"].items():
        assert e["lmcache_delta"]["l2_prefetch_loaded"] > 0, L


def test_without_the_flags_the_gate_aborts_at_the_first_connected_arm(gate: GateRunner):
    _, result = gate.run("--no-enable-prefix-caching", "--mamba-cache-mode", "")
    # an engine that exits at start with LMCache is LMCache refusing the model: a fail, one line
    assert result["verdict"]["status"] == "fail"
    assert result["abort"]["state"] == "STORE_UP" and result["abort"]["type"] == "EngineRefused"
    assert "mamba_cache_mode" in json.dumps(result["abort"])
    assert result["verdict"]["reasons"][0].startswith("engine_starts_with_lmcache: ")

