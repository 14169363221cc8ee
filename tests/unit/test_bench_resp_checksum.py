"""bench/bench_resp_checksum.py's plan and summary (no timing is run or asserted):
the hybrid case mixes both sizes in one task, which arm goes first alternates,
and the ratios are sealed over unsealed (worker + redis-server CPU together
for the CPU ratios), never inverted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_resp_checksum", REPO / "bench" / "bench_resp_checksum.py")
brc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(brc)


def test_plan_mixes_sizes_only_in_the_hybrid_case():
    cases = brc.plan(10, 30, 8, 3)
    assert cases["attn"] == [(1, 10)] * 3 and cases["state"] == [(0, 30)] * 3 and cases["pure"] == [(0, 8)] * 3
    assert cases["hybrid"] == [(1, 10), (0, 30)] * 3  # chunk-major: the sizes alternate in one task


def test_each_arm_goes_first_equally_often():
    for case_no in range(4):
        firsts = [brc.order(r, case_no)[0] for r in range(6)]
        assert firsts.count("sealed") == firsts.count("unsealed") == 3
        assert all(sorted(brc.order(r, case_no)) == sorted(brc.ARMS) for r in range(6))


def _arm(scale: float, base: float) -> dict:
    return {f: base * scale for f in brc.TIMED}


def test_summary_is_sealed_over_unsealed():
    rounds = []
    for base in (1.0, 2.0, 9.0):  # one drifting round: medians and paired ratios both stay 2
        rounds.append({"cases": {"hybrid": {"objects": [10, 30], "bytes": 40, "first": "sealed",
                                            "unsealed": _arm(1.0, base), "sealed": _arm(2.0, base),
                                            "micro": {f: 0.5 for f in brc.MICRO} | {"copy_s": 0.25}}}})
    s = brc.summarize(rounds)["hybrid"]
    assert s["ratio_sealed_over_unsealed"]["store_s"] == 2.0
    assert s["paired_ratio_sealed_over_unsealed"]["store_s"] == 2.0
    assert s["extra_s"] == {"store": 2.0, "load": 2.0}  # medians 4 - 2
    assert s["ratio_sealed_over_unsealed"]["load_all_cpu_s"] == 2.0
    assert s["micro_over_copy"]["blake3_s"] == 2.0
