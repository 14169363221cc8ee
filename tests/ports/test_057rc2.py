"""LMCache 0.5.7rc2: the ported hybrid-fa series and the one-part engine-driven
set (docs/ports.md, "0.5.7rc2").

* Pristine 0.5.7rc2 still corrupts pure attention whose block spans several
  kernel pages (block 128 and 256 over 64-slot pages, k = 2 and 4): the
  harness restores 0 of the requested attention bytes and writes into other
  blocks.  Hybrids round-trip
  (upstream's registration-time re-view, as in 0.5.6).
* Patched (hybrid-fa revision 1): every preset round-trips, vLLM 0.30+'s
  padded GDN view included, and the CPU restore gate (lmcache-driven)
  restores each base preset byte-exact from the fs tier after a hard kill.
* Upstream's engine-driven path, pristine, gathers one kernel page per logical
  block for a single sub-paged group (a silent wrong restore through the
  gate); the engine-driven set's part 01 makes the worker refuse that
  registration in one line, while the k = 1 hybrid (what a CPU engine has)
  keeps restoring through upstream's multi-group path.

CI runs one harness run each way, one lmcache-driven gate and one stacked
engine-driven gate; ``LMCACHE_PATCHTOOL_FULL=1`` adds pristine's
engine-driven corruption through the gate.
"""

from __future__ import annotations

import os
import sys

import pytest

from .harness_run import REPO, ports_harness, provision
from .test_engine_driven_gate import STACKED, _overlay as stacked_gate_overlay

sys.path.insert(0, str(REPO / "tests" / "gate"))
from test_restore_gate import by_preset, run_gate
from gate import geometry  # stdlib only

FULL = os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
VERSION = "0.5.7rc2"
CELLS = (
    "preset=qwen35-0.8b,chunk_blocks=1,num_chunks=3,skip_blocks=0",
    "preset=qwen35-0.8b,chunk_blocks=2,num_chunks=5,skip_blocks=3",
    "preset=gdn-27b,chunk_blocks=1,num_chunks=2,skip_blocks=0",
    "preset=control-k1,chunk_blocks=2,num_chunks=5,skip_blocks=3",
    "preset=pure-attn-bs128,chunk_blocks=2,num_chunks=5,skip_blocks=2",
    "preset=pure-attn-bs128,chunk_blocks=1,num_chunks=3,skip_blocks=0",
    "preset=pure-attn-bs256,chunk_blocks=1,num_chunks=3,skip_blocks=0",
    "preset=pure-attn-bs256,chunk_blocks=2,num_chunks=5,skip_blocks=2",
    "preset=qwen35-bs576-v030,chunk_blocks=2,num_chunks=3,skip_blocks=1",
    "preset=control-k1-v030,chunk_blocks=1,num_chunks=3,skip_blocks=0",
)
ED_REFUSAL = ("worker_transfer.py: engine-driven registration refused: the attention layers are "
              "sub-paged (128 tokens per block over kernel pages of 64 slots, k=2)")

_RUNS: dict = {}


def harness(patched: bool) -> dict[str, dict]:
    """One harness run over CELLS (cached per session): {cell name: cell}."""
    if patched not in _RUNS:
        doc = ports_harness(VERSION, patched, CELLS if patched else CELLS[:8],
                            ["--no-hashes", "--path", "python", "--layout", "HND", "--edits"],
                            timeout=1200)
        _RUNS[patched] = {c["name"]: c for c in doc["cells"]}
    return _RUNS[patched]


def _preset(name: str) -> str:
    return name.split("/")[0]


def gate(patched: bool, presets: list[str], mode: str, stacked: bool = False) -> dict[str, dict]:
    state = STACKED if stacked else ("hybrid-fa" if patched else "pristine")
    py = provision.runtime_env(VERSION) / "bin" / "python"
    _, report, _ = run_gate(py, stacked_gate_overlay(VERSION, state), presets, "--transfer-mode", mode,
                            timeout=900)
    return by_preset(report)


# pure attention whose block spans k kernel pages of 64 slots (FlashInfer --block-size 128 and 256)
PURE_ATTENTION_K = {name: geometry.preset(name).k for name in ("pure-attn-bs128", "pure-attn-bs256")}


def test_pristine_corrupts_pure_attention_and_keeps_hybrids():
    """Measured 2026-12-06: at block 256 pristine stores 1/4 of each block and restores none of
    the requested attention bytes (524,288 foreign bytes written in the one-block cell)."""
    cells = harness(False)
    attn = [c for n, c in cells.items() if _preset(n) in PURE_ATTENTION_K]
    assert sorted(_preset(c["name"]) for c in attn) == ["pure-attn-bs128"] * 2 + ["pure-attn-bs256"] * 2
    for c in attn:
        assert "error" not in c, c.get("traceback")
        assert not c["verdict"]["pass"], c["name"]
        fa = c["groups"]["fa"]
        k = PURE_ATTENTION_K[_preset(c["name"])]
        assert fa["object_ratio"] == pytest.approx(1 / k) and fa["foreign_bytes"] > 0, (c["name"], fa)
    for n, c in cells.items():
        if _preset(n) not in PURE_ATTENTION_K:
            assert c["verdict"]["pass"], (n, c["verdict"])


def test_patched_round_trips_every_preset_the_v030_view_included():
    cells = harness(True)
    assert len(cells) == len(CELLS)
    for n, c in cells.items():
        assert "error" not in c, c.get("traceback")
        assert c["verdict"]["pass"], (n, c["verdict"])
        assert c["groups"]["fa"]["foreign_bytes"] == 0 and c["groups"]["fa"]["object_ratio"] == 1.0, n
    for n, c in cells.items():
        if _preset(n) in PURE_ATTENTION_K:
            assert c["groups"]["fa"]["object_layouts"] == ["pass-major"], n


def test_restore_gate_lmcache_driven_patched():
    got = gate(True, ["pure-attn-bs128", "qwen35-0.8b", "control-k1"], "lmcache_driven")
    for name, p in got.items():
        assert p["verdict"] == "pass", (name, p.get("reasons"))


def test_restore_gate_engine_driven_stacked_refuses_sub_paged_attention_in_one_line():
    got = gate(True, ["pure-attn-bs128", "control-k1-v030"], "engine_driven", stacked=True)
    k1 = got["control-k1-v030"]
    # Known gap (docs/ports.md, "0.5.7rc2"): through upstream's engine-driven path the gate
    # sometimes finds 2 of the 3 stored chunks after the restart (2 of 7 runs here, one of them
    # the cold CI run): a miss, never wrong bytes.  So: a pass, or only that loss.
    assert k1["verdict"] == "pass" or (k1["verdict"] == "fail" and all(
        r.startswith("lost chunks:") for r in k1["reasons"])), k1.get("reasons")
    refused = got["pure-attn-bs128"]
    assert refused["verdict"] == "error", refused
    # the refusal is the run's reason (one line); a note of the gate's own may follow it
    reason = next((r for r in refused["reasons"] if ED_REFUSAL in r), None)
    assert reason is not None and "\n" not in reason, refused["reasons"]
    assert reason.endswith("use mp_transfer_mode=lmcache_driven [lmcache-patchtool engine-driven]"), reason


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: pristine's engine-driven corruption")
def test_restore_gate_engine_driven_pristine_writes_pure_attention_into_other_blocks():
    p = gate(False, ["pure-attn-bs128"], "engine_driven")["pure-attn-bs128"]
    assert p["verdict"] == "fail", p
    assert any("foreign writes" in r for r in p["reasons"]), p["reasons"]
