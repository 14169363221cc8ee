"""README's support table is generated from the manifests, never typed."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_support_table_is_generated_from_manifests():
    proc = subprocess.run([sys.executable, str(REPO / "lab" / "support_table.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_support_table_lists_every_shipped_manifest():
    from lab import support_table  # noqa: PLC0415

    table = support_table.render(REPO / "patches")
    for manifest in (REPO / "patches").glob("*/*/manifest.json"):
        assert f"| {manifest.parent.name} | {manifest.parent.parent.name} |" in table


def _engine_cell(scenario, build, status, *, lm="0.5.6", model="hybrid-640", refused=None, sha="shipped"):
    from lab import vllm_cells  # noqa: PLC0415

    expect = "fail" if scenario == "hybrid-start" else "pass"
    return {"scenario": scenario, "lmcache": lm, "build": build, "status": status, "expect": expect,
            "as_expected": status == expect, "model": model, "engine_refused": refused, "reasons": [],
            "patches_sha256": vllm_cells.engine_series_sha256(lm, build) if sha == "shipped" else sha}


def test_real_engine_mark_is_decided_by_the_engine_gate_evidence(tmp_path):
    """The 'real engine' mark comes from lab/evidence/engine-gate.json only: CPU when the stacked
    build passes a full cycle, one block per step, chunk = 2 blocks, both CPU geometries (the SSM
    state float32 and bfloat16) and pure attention at block 128 and 256 on the shipped patches and
    the pristine and hybrid-fa builds fail on the hybrid; GPU when a GPU run of the gate also passed."""
    import json  # noqa: PLC0415

    from lab import vllm_cells  # noqa: PLC0415

    refused = {"store": "ValueError: engine-driven transfer does not support multiple KV transfer groups now"}
    good = [_engine_cell("hybrid-followups", "stacked", "pass"), _engine_cell("hybrid-one-block", "stacked", "pass"),
            _engine_cell("hybrid-chunk-2n", "stacked", "pass"),
            _engine_cell("hybrid-fp32-state", "stacked", "pass"), _engine_cell("hybrid-bf16-state", "stacked", "pass"),
            _engine_cell("attn-bs128", "stacked", "pass", model="attn"),
            _engine_cell("attn-bs256", "stacked", "pass", model="attn"),
            _engine_cell("hybrid-start", "pristine", "fail", refused=refused),
            _engine_cell("hybrid-start", "hybrid-fa", "fail", refused=refused)]
    results = tmp_path / "results"
    results.mkdir()

    def mark(cells):
        path = tmp_path / "engine-gate.json"
        path.write_text(json.dumps({"cells": cells}))
        return vllm_cells.engine_marks(["0.5.6"], REPO / "patches", path, results)[0]

    m = mark(good)
    assert (m.status, m.builds["pristine"], m.builds["stacked"]) == (
        "CPU", "hybrid refused at engine start", "7/7 scenarios as expected"), m
    assert mark(good[:-1]).why == "no real-engine run of the hybrid-fa build on the hybrid"
    stale = [_engine_cell("hybrid-followups", "stacked", "pass", sha="0" * 64)] + good[1:]
    assert mark(stale).why.startswith("real-engine evidence predates the shipped patches")
    failing = [_engine_cell("hybrid-followups", "stacked", "fail")] + good[1:]
    assert mark(failing).why.startswith("real engine: hybrid-followups fails with the stacked build")
    no_bs256 = [c for c in good if c["scenario"] != "attn-bs256"]
    assert mark(no_bs256).why == "missing real-engine scenario(s): attn-bs256"
    one_geometry = [c for c in good if c["scenario"] != "hybrid-bf16-state"]
    assert mark(one_geometry).why == "missing real-engine scenario(s): hybrid-bf16-state"
    lenient = good[:7] + [_engine_cell("hybrid-start", "pristine", "pass"), good[8]]
    assert mark(lenient).why.startswith("real engine: the pristine build passes the hybrid")
    (results / "gpu.json").write_text(json.dumps({"device": "gpu", "verdict": {"status": "pass"}, "environment": {
        "target": {"packages": {"lmcache": "0.5.6"}, "patch_marker_present": True}}}))
    assert mark(good).status == "GPU"


def test_real_engine_table_is_rendered_from_the_evidence():
    from lab import support_table  # noqa: PLC0415

    table = support_table.engine_table(REPO / "patches")
    assert "| LMCache | real engine | pristine | hybrid-fa | hybrid-fa + engine-driven |" in table
    for v in ("0.5.3", "0.5.4", "0.5.5", "0.5.6"):
        assert f"| {v} | " in table
