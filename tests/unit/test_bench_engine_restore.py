"""bench/bench_engine_restore.py's reading of a gate run (no engine is run, no timing is
asserted): the server log's restores are paired with the prefetch before each, the k-th
restore with the k-th restored prompt (the first-restore probe first), and the ratios are
the warm restore over vLLM's prefix hit and the first restore over the warm one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_engine_restore", REPO / "bench" / "bench_engine_restore.py")
ber = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ber  # its dataclasses look their module up
_spec.loader.exec_module(ber)

# LMCache's own log lines (0.5.6, colour codes included), trimmed to the parts the bench reads
LOG = """\
\x1b[32;20m[2026-12-06 03:53:27,183] LMCache INFO:\x1b[0m Prefetch request completed (L1+L2): 5/8 retained keys \
(0 L1, 5 L2) in 20.7 ms (external_request_id=cmpl-a, prefetch_request_id=0)
\x1b[32;20m[2026-12-06 03:53:27,254] LMCache INFO:\x1b[0m Retrieved 2560 tokens in 0.057 seconds
INFO:     127.0.0.1:53308 - "GET /metrics HTTP/1.1" 200 OK
[2026-12-06 03:53:27,897] LMCache INFO: Prefetch request completed (L1+L2): 5/8 retained keys (0 L1, 5 L2) in 31.8 ms (x)
[2026-12-06 03:53:28,085] LMCache INFO: Retrieved 2560 tokens in 0.183 seconds
[2026-12-06 03:53:28,989] LMCache INFO: Prefetch request completed (L1+L2): 13/24 retained keys (0 L1, 13 L2) in 28.6 ms
[2026-12-06 03:53:29,024] LMCache INFO: Retrieved 7680 tokens in 0.015 seconds
[2026-12-06 03:53:29,100] LMCache INFO: Stored 640 tokens in 0.008 seconds
[2026-12-06 03:53:29,200] LMCache INFO: Retrieved 640 tokens in 0.010 seconds
"""

RESULT = {"ttft": [
    {"prompt_tokens": 7681, "cold_s": 2.4, "restored_s": 0.12, "prefix_hit_s": 0.04},
    {"prompt_tokens": 2561, "cold_s": 1.0, "restored_s": 0.14, "prefix_hit_s": 0.02, "first_restored_s": 0.07},
]}


def test_server_side_pairs_each_restore_with_its_prefetch():
    got = ber.server_side(LOG)
    assert [(s.tokens, s.prefetch_ms, s.l2_keys, s.retrieve_ms) for s in got] == [
        (2560, 20.7, 5, 57.0), (2560, 31.8, 5, 183.0), (7680, 28.6, 13, 15.0),
        (640, None, None, 10.0),  # a restore without a prefetch line before it keeps no stale one
    ]


def test_rows_skip_the_first_restore_probe_and_follow_the_lengths():
    rows = ber.rows(RESULT, ber.server_side(LOG))
    assert [r.prompt_tokens for r in rows] == [2561, 7681]
    assert [r.server.retrieve_ms for r in rows] == [183.0, 15.0]  # the probe's restore is the first line
    j = rows[0].to_json()
    assert j["warm_over_prefix_hit"] == 7.0 and j["first_over_warm"] == 0.5 and j["warm_over_cold"] == 0.14
    assert rows[1].to_json()["first_over_warm"] is None


def test_without_a_probe_the_first_restore_is_the_first_length():
    result = {"ttft": [{"prompt_tokens": 2561, "restored_s": 0.1}]}
    [row] = ber.rows(result, ber.server_side(LOG))
    assert row.server.retrieve_ms == 57.0 and row.first_restored_s is None


def test_render_prints_the_ratios_and_the_load():
    text = ber.render(ber.rows(RESULT, ber.server_side(LOG)), (1.5, 2.25), "0.5.6")
    assert "load 1.50 -> 2.25" in text and "LMCache 0.5.6 stacked" in text
    assert "7.000x" in text and "0.500x" in text


def _ev(p: int, pp: int, f: str, t0: float, t1: float, r: str | None = None) -> dict:
    return {"p": p, "pp": pp, "f": f, "t0": t0, "t1": t1, "r": r}


def test_breakdown_reads_the_restore_engine_and_clips_each_call_to_its_window():
    lookup, load = "LMCacheMPConnector.get_num_new_matched_tokens", "LMCacheMPConnector.start_load_kv"
    events = [
        # an earlier engine (the store arm): never read
        _ev(10, 1, "Scheduler.add_request", 0.0, 0.0, "old"), _ev(11, 10, load, 0.1, 0.9),
        # the restore engine (EngineCore 20, its worker 21): warm-up, then the first restore
        _ev(20, 1, "Scheduler.add_request", 100.0, 100.0, "warm-up"),
        _ev(20, 1, "Scheduler.add_request", 101.0, 101.0, "req-1"),
        _ev(20, 1, lookup, 101.01, 101.02, "req-1"), _ev(20, 1, lookup, 101.05, 101.06, "req-1"),
        _ev(20, 1, lookup, 101.05, 101.06, "someone-else"),
        _ev(21, 20, load, 101.08, 101.30),  # half of it after the 0.2 s window
        _ev(99, 1, load, 101.0, 101.1),  # another process: not this engine's
    ]
    [row] = ber.breakdown(events, [("first", 0.2)])
    assert row["request"] == "req-1" and row["ttft_ms"] == 200.0
    assert row["lookup_polls"] == 2 and row["until_last_poll_ms"] == 60.0
    assert row[lookup] == 30.0  # three polls inside the window, one of another request's
    assert row[load] == 120.0  # clipped at 101.2; process 99 and the store engine not counted


def test_the_engine_geometry_names_the_block_and_the_cpu_features_that_chose_it():
    """Two machines' runs compare only with their blocks beside them (640 tokens with
    AVX-512 BF16, 384 without): the bench records what the gate's probe found."""
    result = {"geometry": {"engine": {"block_size": 384, "ssm_state_dtype": "float32", "source": "probe",
                                      "cpu_features": {"avx512_bf16": False, "amx_bf16": False}}}}
    geo = ber.engine_geometry(result)
    assert (geo["block"], geo["cpu_avx512_bf16"], geo["cpu_amx_bf16"]) == (384, False, False)
    assert ber.engine_geometry({}) is None  # a run without the probe: nothing is made up
