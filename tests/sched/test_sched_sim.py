"""Hybrid (Mamba align + FA) caching under vLLM 0.27.1's REAL Scheduler:
what LMCache stores, whether it is right, and how much of it a second request
can use.  See lab/sched_sim.py
and docs/scheduler-sim.md for what is real and what is modelled.

CI subset: LMCache 0.5.3 and 0.5.6; builds pristine, r1 (part 03 revision 1:
the tracked series without revision 2's parts) and patched (the tracked
series).  ``LMCACHE_PATCHTOOL_SCHED_FULL=1`` adds 0.5.4/0.5.5 and the wide
matrix (4k-32k prompts x schedules x chunk sizes).

Every second request also runs through a restarted vLLM against the same
modelled LMCache server (the connector's own lookup handling, RETRIEVE ops
loaded into the new blocks): ``restore.restored_state_ok`` says whether the
SSM state the request then starts from is the true one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

FULL = os.environ.get("LMCACHE_PATCHTOOL_SCHED_FULL") == "1"
pytestmark = pytest.mark.slow

N = 544
REPO = Path(__file__).resolve().parents[2]
CI_VERSIONS = ("0.5.3", "0.5.6")
VERSIONS = ("0.5.3", "0.5.4", "0.5.5", "0.5.6") if FULL else CI_VERSIONS
BUILDS = ("pristine", "r1", "patched")


def expected_build(version: str) -> str:
    """What the tracked series of ``version`` must achieve under multi-block
    steps: "r2" once it carries a revision-2 part (part 06: judge the chunk-end
    slot, separate state objects), else "r1" (part 03 r1 refuses a whole chunk
    when any of its Mamba slots is null: nothing wrong, nearly nothing useful).
    ``LMCACHE_PATCHTOOL_SCHED_EXPECT`` overrides it."""
    if env := os.environ.get("LMCACHE_PATCHTOOL_SCHED_EXPECT"):
        return env
    return "r2" if has_state_chunk_ends(version) else "r1"


def has_state_chunk_ends(version: str) -> bool:
    """Whether the tracked series has part 06 (0.5.4+) or its 0.5.3 port, 19."""
    series = REPO / "patches" / "hybrid-fa" / version
    return any(series.glob("06-*.patch")) or any(series.glob("19-state-chunk-ends.patch"))


# r1's measured usefulness under multi-block prefill steps: chunk 0 is
# refused, so no prefix is usable (hit 0 of an ideal 1088-8704 tokens).
R1_HIT_RATIO_MAX = 0.0
# r2's target: every scenario with steps >= 2N.
R2_HIT_RATIO_MIN = 0.95
# Versions whose connector looks up the whole prompt (no reserve_last_token,
# which 0.5.6 added for Mamba align mode): on a full-prompt hit vLLM
# recomputes the last token (Scheduler._update_waiting_for_remote_kv) on top
# of a restored SSM state that already includes it.
FULL_PROMPT_RESTORE_BROKEN = {"0.5.3", "0.5.4", "0.5.5"}


def full_prompt_broken(version: str, build: str) -> bool:
    """Pristine and r1 builds of those versions; the series' part 07 ports
    0.5.6's reserve_last_token to them (patched)."""
    if version not in FULL_PROMPT_RESTORE_BROKEN:
        return False
    return build != "patched" or not any((REPO / "patches" / "hybrid-fa" / version).glob("07-*.patch"))

ONE_BLOCK = ("1blk-c1-8N", "1blk-c2-8N")  # pristine 0.5.3's enforced schedule
MULTI_BLOCK = ("2048-c1-8N", "2048-c2-8N", "8192-c1-16N", "2048-lpt1200-c1-8N",
               "2048-c1-spec", "2048-c1-preempt")


def one_block_only(version: str, build: str) -> bool:
    """Builds whose connector enforces one block per prefill step: 0.5.3's
    own rule, which its part 06 (hybrid-fa revision 9) relaxes to >= 1 block."""
    return version == "0.5.3" and (build != "patched" or not has_state_chunk_ends(version))


def _runs(sched_run, version: str, build: str) -> dict[str, dict[str, Any]]:
    return sched_run(version, build, "all" if FULL else "ci")


def _constructed(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results.values() if r["constructed"]]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("version", VERSIONS)
def test_real_scheduler_ran_every_scenario(sched_run, version, build):
    """The real Scheduler (with vLLM's own asserts live) drove every scenario
    to completion, and the worker model agreed with its block lists at every
    step: the running Mamba state read at each step start is the true state,
    and no read or write hit a slot the scheduler does not list.  The run
    covers what it claims: multi-block steps, spec decode with 0/1/2 accepted
    drafts, a preemption and its resume."""
    results = _runs(sched_run, version, build)
    for r in _constructed(results):
        assert r["asserts_enabled"], "python -O would silence vLLM's asserts"
        # Something was planned: stored, or refused by part 03.
        assert r["steps"] > 0 and r["store_ops"] + r["refused_chunks"] > 0, r["scenario"]
        assert r["num_model_inconsistencies"] == 0, (r["scenario"], r["model_inconsistencies"])
        for name, sec in r["second"].items():  # the restarted second requests too
            assert not sec["restore"].get("model_inconsistencies"), (r["scenario"], name, sec)
    for name, r in results.items():
        if r["max_num_batched_tokens"] >= 2 * N and one_block_only(version, build):
            # 0.5.3 enforces one block per step: it refuses these configs.
            assert not r["constructed"] and "max_num_batched_tokens" in r["error"], name
        elif not r.get("full_only"):
            assert r["constructed"], (name, r.get("error"))
    if not one_block_only(version, build):
        steps = results["2048-c1-8N"]["prefill_steps"]
        assert steps == [[0, 3 * N], [3 * N, 6 * N], [6 * N, 8 * N]], steps
        spec = results["2048-c1-spec"]
        assert spec["spec_steps"] > 100 and set(spec["drafts_accepted"]) == {"0", "1", "2"}
        events = " ".join(results["2048-c1-preempt"]["events"])
        assert "preempt ['B']" in events and "resume B" in events, events


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("scenario", ONE_BLOCK)
def test_one_block_per_step_stores_every_chunk_correctly(sched_run, version, build, scenario):
    r = _runs(sched_run, version, build)[scenario]
    chunks = r["prompt"] // r["chunk"]
    assert r["chunks_stored"] == chunks and r["refused_chunks"] == 0, r
    assert r["wrong_block_stores"] == 0 and r["wrong_state_hits"] == 0, r["wrong_stores"]
    for name, s in r["second"].items():
        assert s["hit_tokens"] == s["ideal_tokens"] > 0, (name, s)
        assert not s["wrong_state_hit"] and not s["wrong_fa_in_hit"], (name, s)


def test_pristine_056_stores_null_state_inside_multi_block_steps(sched_run):
    """2048-token steps, C = N, 8N prompt: steps of 3, 3 and 2 blocks, so the
    chunks ending at 1N, 2N, 4N, 5N, 7N end inside a step and get the null
    block's bytes as their GDN state (the issue's 5 corrupt stores); a second
    request sharing 4N tokens (a boundary inside step 2) hits 4N and restores
    that garbage as its SSM state."""
    r = _runs(sched_run, "0.5.6", "pristine")["2048-c1-8N"]
    assert r["wrong_block_stores"] == 5 and r["wrong_state_stores"] == 5, r["wrong_stores"]
    assert sorted(w["end"] for w in r["wrong_stores"]) == [N, 2 * N, 4 * N, 5 * N, 7 * N]
    assert all("null block" in p for w in r["wrong_stores"] for p in w["problems"])
    b = r["second"]["b"]
    assert b["inside_step"] and b["shared_prefix"] == 4 * N
    assert b["hit_tokens"] == 4 * N and b["wrong_state_hit"], b
    assert b["ideal_tokens"] == 3 * N  # the last true state at or before 4N


@pytest.mark.parametrize("build", ("r1", "patched"))
@pytest.mark.parametrize("version", VERSIONS)
def test_patched_never_stores_or_restores_a_wrong_state(sched_run, version, build):
    """No wrong block stored, no hit whose boundary chunk has a wrong state,
    and after a restart every load leaves vLLM on the true state (the full
    prompt's hit on versions in FULL_PROMPT_RESTORE_BROKEN aside: see below)."""
    for r in _constructed(_runs(sched_run, version, build)):
        assert r["wrong_block_stores"] == 0, (r["scenario"], r["wrong_stores"])
        assert r["wrong_state_hits"] == 0, (r["scenario"], r["second"])
        assert r["restore_errors"] == 0, (r["scenario"], r["second"])
        for name, sec in r["second"].items():
            assert not sec["wrong_fa_in_hit"], (r["scenario"], name)
            if name == "a" and full_prompt_broken(version, build):
                continue
            assert sec["restore"]["restored_state_ok"] is not False, (r["scenario"], name, sec)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("version", VERSIONS)
def test_full_prompt_hit_restores_the_true_state(sched_run, version, build, request):
    """One block per step, C = N: every chunk of the 8N prompt is stored
    correctly, and the same prompt again hits all of it.  0.5.6 looks up all
    but the last token (reserve_last_token) and restarts at 7N from a true
    state; 0.5.3-0.5.5 hit 8N = the whole prompt, vLLM then recomputes the
    last token from the restored state after 8N tokens: a wrong state."""
    if full_prompt_broken(version, build):
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "full-prompt hit: vLLM recomputes the last token on a restored SSM state "
            "that already includes it (no reserve_last_token before 0.5.6)")))
    a = _runs(sched_run, version, build)["1blk-c1-8N"]["second"]["a"]
    assert a["hit_tokens"] == 8 * N and not a["wrong_state_hit"], a
    assert a["restore"]["restored_state_ok"] is True, a


def _hit_ratio(r: dict[str, Any]) -> float:
    sec = [s for s in r["second"].values() if s["ideal_tokens"]]
    return sum(s["hit_tokens"] for s in sec) / sum(s["ideal_tokens"] for s in sec)


def assert_patched_usefulness(r: dict[str, Any], expected: str) -> None:
    """Hit tokens of the second requests against the ideal, for one scenario."""
    ratio = _hit_ratio(r)
    if expected == "r1":
        # Known limitation of part 03 r1 (chunk refused when any slot is null).
        assert ratio <= R1_HIT_RATIO_MAX, (r["scenario"], ratio, r["second"])
        assert r["refused_chunks"] > 0, r["scenario"]
    elif expected == "r2":
        assert ratio >= R2_HIT_RATIO_MIN, (r["scenario"], ratio, r["second"])
    else:
        raise ValueError(f"unknown expected build {expected!r}")


@pytest.mark.parametrize("scenario", MULTI_BLOCK)
@pytest.mark.parametrize("version,build", [(v, b) for v in VERSIONS for b in ("r1", "patched")
                                           if not one_block_only(v, b)])
def test_patched_usefulness_under_multi_block_steps(sched_run, version, build, scenario):
    """r1 (the baseline, always measured) keeps its known limitation; the
    tracked series must reach ``expected_build(version)``."""
    r = _runs(sched_run, version, build)[scenario]
    assert r["max_num_batched_tokens"] >= 2 * N
    assert_patched_usefulness(r, "r1" if build == "r1" else expected_build(version))


@pytest.mark.skipif(not FULL, reason="wide matrix: LMCACHE_PATCHTOOL_SCHED_FULL=1")
@pytest.mark.parametrize("version", [v for v in VERSIONS if not one_block_only(v, "patched")])
def test_patched_usefulness_in_every_multi_block_scenario(sched_run, version):
    """The scheduler simulation's acceptance rule over the whole matrix: every scenario with
    steps >= 2N reaches ``expected_build(version)``'s bar."""
    expected = expected_build(version)
    short = []
    for r in _constructed(_runs(sched_run, version, "patched")):
        if r["max_num_batched_tokens"] < 2 * N or not any(
                s["ideal_tokens"] for s in r["second"].values()):
            continue
        ratio = _hit_ratio(r)
        if (ratio < R2_HIT_RATIO_MIN) if expected == "r2" else (ratio > R1_HIT_RATIO_MAX):
            short.append((r["scenario"], round(ratio, 3),
                          {k: (s["hit_tokens"], s["ideal_tokens"]) for k, s in r["second"].items()}))
    assert not short, short


def test_pristine_053_refuses_multi_block_schedules(sched_run):
    """0.5.3's connector enforces block_size <= max_num_batched_tokens < 2N
    (validate_mamba_step_alignment): the 2048/8192 configs never start on
    pristine and r1; the tracked series (part 06) runs them."""
    for build in BUILDS:
        r = _runs(sched_run, "0.5.3", build)["2048-c1-8N"]
        if one_block_only("0.5.3", build):
            assert not r["constructed"] and "max_num_batched_tokens" in r["error"], r
        else:
            assert r["constructed"], r.get("error")
