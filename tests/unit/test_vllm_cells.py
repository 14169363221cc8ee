"""LMCache x vLLM support cells come from evidence files alone
(``lab/vllm_cells.py``): each check that can deny a cell is shown to deny
it, on synthetic evidence written here."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

from lab import vllm_cells
LM = "0.5.3"
OLD, NEW = "0.27.1", "0.33.0"


def _preset(ok: bool, view: str = "0.27", gate: str | None = None) -> dict:
    return {"k": 17, "gdn_view": view, "hybrid": True,
            "harness": {"pass": ok, "cells": [{"name": "x", "pass": ok, "error": None,
                                                "reasons": [] if ok else ["FA bytes differ"],
                                                "fa_fraction": 1.0 if ok else 0.0,
                                                "gdn_fraction": 1.0}]},
            "gate": {"verdict": gate or ("pass" if ok else "fail"), "reasons": []}}


def _geometry(patches_root: Path) -> dict:
    all_presets = {p for _, ps in vllm_cells._PRESETS_BY_VLLM for p in ps}
    patched = {n: _preset(True, "0.30" if n.endswith("v030") else "0.27",
                          "not-run" if n.endswith("v030") else None) for n in all_presets}
    pristine = {n: _preset(n in ("control-k1", "control-k1-v030")) for n in all_presets}
    return {"schema": 1, "cells": [
        {"lmcache": LM, "build": "patched",
         "series_sha256": vllm_cells.series_sha256(LM, patches_root), "presets": patched},
        {"lmcache": LM, "build": "pristine", "series_sha256": None, "presets": pristine}]}


def _sched(patches_root: Path) -> dict:
    rows = []
    sha = vllm_cells.series_sha256(LM, patches_root)
    for v in (OLD, NEW):
        rows.append({"lmcache": LM, "vllm": v, "build": "patched", "constructed": True,
                     "series_sha256": sha,
                     "divergences": 0, "wrong_stores": 0, "wrong_state_hits": 0})
        rows.append({"lmcache": LM, "vllm": v, "build": "pristine", "constructed": True,
                     "divergences": 0, "wrong_stores": 3, "wrong_state_hits": 1,
                     "bug_shows": True})
    return {"schema": 1, "cells": rows}


def _engine_driven(patches_root: Path) -> dict:
    """The stacked build's engine-driven CPU restore gate passes every *-v030 preset."""
    v030 = {p for _, ps in vllm_cells._PRESETS_BY_VLLM for p in ps if p.endswith("v030")}
    return {"schema": 1, "cells": [
        {"lmcache": LM, "build": "stacked",
         "patches_sha256": vllm_cells.patches_sha256(vllm_cells.stacked_patches(LM, patches_root)),
         "presets": {n: {"k": 9, "hybrid": True, "gdn_view": "0.30", "outcome": "pass",
                         "reason": "", "identical": None} for n in v030}}]}


@pytest.fixture
def ev(tmp_path):
    root = tmp_path / "patches"
    (root / "hybrid-fa" / LM).mkdir(parents=True)
    (root / "hybrid-fa" / LM / "01-a.patch").write_text("--- a\n+++ b\n")
    (root / "engine-driven" / LM).mkdir(parents=True)
    (root / "engine-driven" / LM / "01-e.patch").write_text("--- e\n+++ e\n")
    (root / "engine-driven" / LM / "manifest.json").write_text("{}")
    results = tmp_path / "results"
    results.mkdir()
    docs = {"geometry": _geometry(root), "sched": _sched(root), "engine_driven": _engine_driven(root)}

    def run(mutate=None) -> dict[str, vllm_cells.Cell]:
        d = copy.deepcopy(docs)
        if mutate:
            mutate(d)
        g, s, e = tmp_path / "g.json", tmp_path / "s.json", tmp_path / "e.json"
        g.write_text(json.dumps(d["geometry"]))
        s.write_text(json.dumps(d["sched"]))
        e.write_text(json.dumps(d["engine_driven"]))
        cols, cells = vllm_cells.cells([LM], root, g, s, results, e)
        assert cols == [OLD, NEW]
        return {c.vllm: c for c in cells}

    run.root, run.results = root, results
    return run


def test_all_checks_pass_is_cpu(ev):
    cells = ev()
    assert {v: c.status for v, c in cells.items()} == {OLD: "CPU", NEW: "CPU"}
    assert vllm_cells.verified(list(cells.values()), LM) == [OLD, NEW]


@pytest.mark.parametrize("field,text", [("divergences", "1 block-id divergences"),
                                        ("wrong_stores", "1 wrong-block stores"),
                                        ("wrong_state_hits", "1 wrong-state hits")])
def test_a_scheduler_fault_denies_the_cell(ev, field, text):
    def m(d):
        d["sched"]["cells"][0][field] = 1  # OLD, patched
    cells = ev(m)
    assert cells[OLD].status == "-" and cells[OLD].why == f"scheduler simulation: {text} patched"
    assert cells[NEW].status == "CPU"


def test_not_constructed_and_missing_pair(ev):
    def m(d):
        d["sched"]["cells"][2].update(constructed=False, reason="TypeError: base class")
        del d["sched"]["cells"][1]  # OLD pristine: absent is fine for patched-only checks
    cells = ev(m)
    assert cells[NEW].status == "-" and "does not construct (TypeError: base class)" in cells[NEW].why
    assert cells[OLD].status == "CPU"


def test_pristine_without_the_bug_denies(ev):
    def m(d):
        d["sched"]["cells"][1]["bug_shows"] = False
    assert "pristine shows no bug" in ev(m)[OLD].why

    def none_ran(d):  # no scenario the bug applies to (0.5.3): geometry decides
        d["sched"]["cells"][1]["bug_shows"] = None
    assert ev(none_ran)[OLD].status == "CPU"


def test_geometry_checks(ev):
    def fail_576(d):
        d["geometry"]["cells"][0]["presets"]["qwen35-bs576-v030"]["harness"] = \
            _preset(False)["harness"]
    cells = ev(fail_576)
    assert cells[OLD].status == "CPU"  # 0.27 registers no 576-v030
    assert cells[NEW].status == "-" and cells[NEW].why.startswith(
        "qwen35-bs576-v030 (vLLM 0.30+'s GDN view) fails pristine and patched")

    def fail_576_patched_only(d):
        fail_576(d)
        d["geometry"]["cells"][1]["presets"]["qwen35-bs576-v030"]["harness"] = \
            _preset(True)["harness"]
    assert ev(fail_576_patched_only)[NEW].why == \
        "harness fails qwen35-bs576-v030 patched: FA bytes differ"

    def gate_fail(d):
        d["geometry"]["cells"][0]["presets"]["qwen35-0.8b"]["gate"]["verdict"] = "fail"
    assert "CPU restore gate fails qwen35-0.8b" in ev(gate_fail)[OLD].why

    def pristine_passes(d):
        for p in d["geometry"]["cells"][1]["presets"].values():
            p["harness"] = _preset(True)["harness"]
            p["gate"]["verdict"] = "pass"
    assert "cannot tell the fix from no fix" in ev(pristine_passes)[OLD].why


def test_v030_geometry_needs_the_engine_driven_gate(ev):
    """vLLM 0.30+'s padded view: lmcache-driven on CPU refuses it, so the
    stacked build's engine-driven CPU restore gate must pass it, on the
    shipped patches."""
    def ed_fails(d):
        d["engine_driven"]["cells"][0]["presets"]["control-k1-v030"]["outcome"] = "wrong"
    cells = ev(ed_fails)
    assert cells[OLD].status == "CPU"
    assert cells[NEW].status == "-" and cells[NEW].why == \
        "control-k1-v030: the engine-driven CPU restore gate of the stacked build: wrong"

    def ed_missing(d):
        del d["engine_driven"]["cells"][0]["presets"]["qwen35-bs576-v030"]
    assert ev(ed_missing)[NEW].why.endswith("the stacked build: not run")

    def ed_stale(d):
        d["engine_driven"]["cells"][0]["patches_sha256"] = "0" * 64
    assert "no engine-driven CPU restore gate of the shipped stacked build" in ev(ed_stale)[NEW].why


def test_stale_series_denies(ev):
    (ev.root / "hybrid-fa" / LM / "02-b.patch").write_text("--- a\n+++ b\n")
    cells = ev()
    assert all(c.status == "-" and "evidence predates the shipped series" in c.why
               for c in cells.values())

    def geometry_fresh(d):  # the scheduler evidence alone is stale: still denied
        d["geometry"]["cells"][0]["series_sha256"] = vllm_cells.series_sha256(LM, ev.root)
    assert all(c.why.startswith("scheduler evidence predates") for c in ev(geometry_fresh).values())


def test_gpu_needs_a_real_patched_pass(ev):
    doc = {"environment": {"target": {"packages": {"lmcache": LM, "vllm": OLD},
                                      "patch_marker_present": True}},
           "verdict": {"status": "pass"}}
    (ev.results / "r.json").write_text(json.dumps(doc))
    cells = ev()
    assert (cells[OLD].status, cells[NEW].status) == ("GPU", "CPU")
    doc["verdict"]["status"] = "fail"
    (ev.results / "r.json").write_text(json.dumps(doc))
    assert ev()[OLD].status == "CPU"


def test_presets_for():
    assert vllm_cells.presets_for("0.27.1") == ("qwen35-0.8b", "gdn-27b", "pure-attn-bs128",
                                                "control-k1")
    assert vllm_cells.presets_for("0.29.0") == vllm_cells.presets_for("0.28.0")
    assert "qwen35-bs576-v030" in vllm_cells.presets_for("0.33.0")
    assert "qwen35-bs576-v030" not in vllm_cells.presets_for("0.30.0")
    assert vllm_cells.presets_for("0.26.0") == ()


def test_render_footnotes_and_manifest_check(ev, tmp_path):
    from lab import support_table  # noqa: PLC0415

    def m(d):
        d["sched"]["cells"][2]["divergences"] = 4
    cells = list(ev(m).values())
    text = support_table._render_cells([OLD, NEW], cells)
    assert f"| {LM} | CPU | - (1) |" in text
    assert "1. scheduler simulation: 4 block-id divergences patched" in text


# vLLM 0.34 (lab/vllm_cells.EXTENDED_REQUIRED_SINCE): the scheduler cell also needs the
# extended sets of sched_matrix (async scheduling, pure attention at blocks 64/128/256).
V034 = "0.34.0"


def _with_034(d: dict, extended: dict | None) -> None:
    sha = d["sched"]["cells"][0]["series_sha256"]
    patched = {"lmcache": LM, "vllm": V034, "build": "patched", "constructed": True,
               "series_sha256": sha, "divergences": 0, "wrong_stores": 0, "wrong_state_hits": 0}
    if extended is not None:
        patched["extended"] = extended
    d["sched"]["cells"] += [patched, {
        "lmcache": LM, "vllm": V034, "build": "pristine", "constructed": False,
        "reason": "raises at step 2: AttributeError: ... resumed_req_ids", "bug_shows": True}]


def _cells_034(ev, tmp_path, extended):
    from lab import vllm_cells as vc
    root, results = ev.root, ev.results
    d = {"geometry": _geometry(root), "sched": _sched(root), "engine_driven": _engine_driven(root)}
    _with_034(d, extended)
    paths = {k: tmp_path / f"{k}.json" for k in d}
    for k, p in paths.items():
        p.write_text(json.dumps(d[k]))
    cols, cells = vc.cells([LM], root, paths["geometry"], paths["sched"], results, paths["engine_driven"])
    assert cols == [OLD, NEW, V034]
    return {c.vllm: c for c in cells}


def test_034_needs_the_extended_sets(ev, tmp_path):
    cell = _cells_034(ev, tmp_path, None)[V034]
    assert cell.status == "-" and "extended sets (async, pure attention) were not run" in cell.why


def test_034_a_failing_extended_set_denies_the_cell(ev, tmp_path):
    ext = {"async": {"passes": True}, "attention-128": {"passes": False,
                                                        "not_constructed_reason": "raises at step 2"}}
    cell = _cells_034(ev, tmp_path, ext)[V034]
    assert cell.status == "-" and "the attention-128 set fails patched (raises at step 2)" in cell.why


def test_034_with_passing_extended_sets_is_cpu(ev, tmp_path):
    ext = {n: {"passes": True} for n in ("async", "attention-64", "attention-128", "attention-256")}
    cells = _cells_034(ev, tmp_path, ext)
    assert cells[V034].status == "CPU" and cells[NEW].status == "CPU"
