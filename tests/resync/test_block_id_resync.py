"""03-block-id-resync.patch (with 08-block-state-from-vllm.patch): LMCache's
tracked block ids vs vLLM's real scheduler-side lists (BlockPool + MambaManager
align/spec + FA), on vLLM 0.27.1 (part 03 reconstructs the lists) and 0.33.0
(part 08 takes them from ``SchedulerOutput.kv_connector_block_state``).

lab/resync_sim.py drives the real vLLM KVCacheManager
and the real LMCacheMPConnector (scheduler role); see its docstring for what is emulated.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SERIES = Path(__file__).resolve().parents[2] / "patches" / "hybrid-fa" / "0.5.3"
PATCH_03 = SERIES / "03-block-id-resync.patch"
PATCH_08 = SERIES / "08-block-state-from-vllm.patch"

pytestmark = pytest.mark.slow


from _resync_results import HYBRID, VLLM_BLOCK_STATE, VLLM_OLD, VLLMS
from _resync_results import bad_stores as _bad_stores
from _resync_results import check_block_state
from _resync_results import divergent_steps as _divergent_steps
from _resync_results import events as _events
def test_patch_is_connector_only_and_applies_with_zero_fuzz(resync_overlays):
    # provision.overlay applied them with `patch -p1 -F0`; check the target.
    for patch in (PATCH_03, PATCH_08):
        text = patch.read_text()
        targets = {line.split()[1] for line in text.splitlines()
                   if line.startswith(("--- ", "+++ "))}
        assert targets == {"a/lmcache/integration/vllm/lmcache_mp_connector.py",
                           "b/lmcache/integration/vllm/lmcache_mp_connector.py"}, patch.name
    patched = resync_overlays["patched"] / "lmcache/integration/vllm/lmcache_mp_connector.py"
    assert "class _BlockIdResync" in patched.read_text()
    assert "def resync_block_state" in patched.read_text()


@pytest.mark.parametrize("vllm", VLLMS)
@pytest.mark.parametrize("scenario", HYBRID)
def test_scenario_covers_the_required_sequence(run_sim, scenario, vllm):
    """The sequence really contains what the issue is about (else the
    equality below would prove nothing)."""
    pristine = run_sim(scenario, "pristine", vllm)
    ev = _events(pristine)
    for needle in ("drafts accepted", "0/2 drafts", "2/2 drafts", "preempt B",
                   "resume B", "admit C", "finish A"):
        assert needle in ev, needle
    divs = [d for s in pristine["steps"] for d in s["divergence"]]
    # Relocation: the append-only list holds a moved id twice in one group.
    assert any(len([b for b in ids if b]) != len({b for b in ids if b})
               for d in divs for ids in d["tracked"]), "no speculative-block relocation seen"
    # In-place frees: vLLM has the null block where LMCache keeps an id.
    assert any(t and v == 0 for d in divs for tg, vg in zip(d["tracked"], d["vllm"])
               for t, v in zip(tg, vg)), "no in-place free seen"
    problems = " ".join(p for _, st in _bad_stores(pristine) for p in st["problems"])
    assert "now at ['A/" in problems and "now at ['B/" in problems  # reused ids
    assert any(f"/g{g}/" in problems for g in (0, 1))


@pytest.mark.parametrize("vllm", VLLMS)
@pytest.mark.parametrize("scenario", HYBRID)
def test_pristine_diverges_from_vllm(run_sim, scenario, vllm):
    steps = _divergent_steps(run_sim(scenario, "pristine", vllm))
    assert steps and steps[0] <= 4, steps


@pytest.mark.parametrize("vllm", VLLMS)
@pytest.mark.parametrize("scenario", HYBRID)
def test_patched_tracker_equals_vllm_after_every_step(run_sim, scenario, vllm):
    result = run_sim(scenario, "patched", vllm)
    assert len(result["steps"]) >= 20
    assert _divergent_steps(result) == [], [
        (s["step"], s["divergence"]) for s in result["steps"] if s["divergence"]][:2]


@pytest.mark.parametrize("vllm", VLLMS)
@pytest.mark.parametrize("scenario", HYBRID)
def test_patched_stores_use_vllm_blocks_only(run_sim, scenario, vllm):
    result = run_sim(scenario, "patched", vllm)
    assert _bad_stores(result) == []
    stores = [st for s in result["steps"] for st in s["stores"]]
    assert stores, "nothing stored: the check above would be vacuous"


@pytest.mark.parametrize("vllm", VLLMS)
def test_patched_stores_decode_chunks_when_safe(run_sim, vllm):
    """With one Mamba block per chunk, decode-phase chunks are still stored
    (correctly), so fail-closed does not mean store-nothing."""
    result = run_sim("hybrid-c1", "patched", vllm)
    decode_stores = [st for s in result["steps"] if s["drafts"] for st in s["stores"]]
    assert len(decode_stores) >= 5


@pytest.mark.parametrize("vllm", VLLMS)
@pytest.mark.parametrize("scenario", HYBRID)
def test_recycled_block_store_is_refused_or_redirected(run_sim, scenario, vllm):
    """Every store where pristine reads a recycled/free/null/foreign block is,
    in the patched connector, either not issued or issued with vLLM's ids."""
    pristine, patched = run_sim(scenario, "pristine", vllm), run_sim(scenario, "patched", vllm)
    bad = _bad_stores(pristine)
    assert bad
    patched_stores = {(s["step"], st["req"], st["start"]): st
                      for s in patched["steps"] for st in s["stores"]}
    for step, st in bad:
        redo = patched_stores.get((step, st["req"], st["start"]))
        assert redo is None or redo["problems"] == [], (step, st, redo)
    assert "Not storing tokens" in patched["stderr"]  # refusal is logged


@pytest.mark.parametrize("vllm", VLLMS)
@pytest.mark.parametrize("scenario", ["plain", "plain-spec"])
def test_non_hybrid_behaviour_unchanged(run_sim, scenario, vllm):
    """Full-attention-only models, with and without drafts: same tracked
    lists and same STORE ops, step by step, pristine vs patched."""
    a, b = run_sim(scenario, "pristine", vllm), run_sim(scenario, "patched", vllm)
    assert a["steps"] == b["steps"]
    assert sum(len(s["stores"]) for s in a["steps"]) >= 5


def test_patch_applies_to_fresh_wheel(tmp_path):
    import zipfile

    from lab import provision

    with zipfile.ZipFile(provision.wheel("0.5.3")) as zf:
        zf.extract("lmcache/integration/vllm/lmcache_mp_connector.py", tmp_path)
    subprocess.run(["patch", "-p1", "-F0", "--dry-run", "-d", str(tmp_path), "-i",
                    str(PATCH_03)], check=True, capture_output=True)


def test_block_state_from_vllm(run_batch):
    """Part 08: on vLLM 0.33 the lists come from kv_connector_block_state
    (breaking the reconstruction changes nothing there, breaking the
    block-state read does), the reconstruction run alongside agrees at every
    step, an unusable block state refuses the request's chunks; on 0.27.1
    the step log is revision 2's, step for step."""
    check_block_state(run_batch("patched", VLLM_BLOCK_STATE), run_batch("patched", VLLM_OLD),
                      run_batch("r2", VLLM_OLD), "0.5.3")
