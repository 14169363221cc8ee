"""Readers of `lab/resync_sim.py` results, shared by
tests/resync and tests/resync_ports, and the part-08 checks both run."""

from __future__ import annotations

# The vLLM versions the resync tests run on: 0.27.1 (no block state: part 03
# reconstructs the lists) and 0.33.0 (SchedulerOutput.kv_connector_block_state,
# from 0.30: part 08 takes the lists from it).
VLLM_OLD = "0.27.1"
VLLM_BLOCK_STATE = "0.33.0"
VLLMS = (VLLM_OLD, VLLM_BLOCK_STATE)

HYBRID = ("hybrid", "hybrid-c1")
SCENARIOS = HYBRID + ("plain", "plain-spec")
# resync_sim NAME@FAULT scenarios the patched batch runs (see its docstring).
BREAKS = ("hybrid@break-reconstruction", "hybrid-c1@break-block-state")
VLLM_FAULTS = ("hybrid-c1@vllm-missing-request", "hybrid-c1@vllm-group-count",
               "hybrid-c1@vllm-no-state")
FAULT_SCENARIOS = BREAKS + VLLM_FAULTS


def divergent_steps(result: dict) -> list[int]:
    """Steps after which the tracked block ids differ from vLLM's lists."""
    return [s["step"] for s in result["steps"] if s["divergence"]]


def bad_stores(result: dict) -> list[tuple[int, dict]]:
    """(step, store) for every store that read a block the request did not own."""
    return [(s["step"], st) for s in result["steps"] for st in s["stores"] if st["problems"]]


def events(result: dict) -> str:
    return " | ".join(e for s in result["steps"] for e in s["events"])


def stores(result: dict) -> list[dict]:
    return [st for s in result["steps"] for st in s["stores"]]


def check_block_state(new: dict, old: dict, r2_old: dict, where: str) -> dict:
    """Part 08 on one LMCache version.  ``new``: the patched batch on
    VLLM_BLOCK_STATE, ``old``: the patched batch on VLLM_OLD (both with
    ``--check`` and FAULT_SCENARIOS), ``r2_old``: the series without 08 on
    VLLM_OLD.  Returns the figures the docs quote."""
    sc_new, sc_old = new["scenarios"], old["scenarios"]
    assert new["vllm_has_block_state"] and not old["vllm_has_block_state"], where
    figures: dict = {}
    for name in HYBRID:
        n, o = sc_new[name], sc_old[name]
        # On 0.30+ every step took vLLM's lists; on 0.27.1 every step
        # reconstructed them.
        assert n["resync"]["source_steps"] == {"block_state": len(n["steps"]),
                                               "reconstruction": 0}, (where, name)
        assert o["resync"]["source_steps"] == {"block_state": 0,
                                               "reconstruction": len(o["steps"])}, (where, name)
        # The reconstruction, run alongside, agrees with vLLM's block state for
        # every scheduled request at every step.
        ag = n["resync"]["agreement"]
        assert (ag["check"], ag["steps"]) == ("count", len(n["steps"])), (where, name, ag)
        assert ag["requests"] >= len(n["steps"]), (where, name, ag)
        assert ag["disagreements"] == 0, (where, name, ag["examples"][:2])
        assert divergent_steps(n) == [] and bad_stores(n) == [] and stores(n), (where, name)
        figures[name] = {"steps": len(n["steps"]), "requests_checked": ag["requests"],
                         "stores": len(stores(n))}

    # vLLM 0.27.1: nothing changes: the same step log as revision 2 (no 08).
    for name in SCENARIOS:
        assert sc_old[name]["steps"] == r2_old["scenarios"][name]["steps"], (where, name)

    # Reconstruction broken (running deltas appended without the move rule):
    # 0.27.1 diverges and stores a wrong block; on 0.30+ the lists still equal
    # vLLM's and the stores are clean, and only the check sees it.
    n, o = sc_new["hybrid@break-reconstruction"], sc_old["hybrid@break-reconstruction"]
    assert n["fault_applied"] and o["fault_applied"], where
    assert divergent_steps(o) and bad_stores(o), (where, "0.27.1 unaffected by the break")
    assert divergent_steps(n) == [] and bad_stores(n) == [], (where, "0.30+ used the deltas")
    assert n["resync"]["agreement"]["disagreements"] > 0, where
    figures["break-reconstruction"] = {
        "old_divergent_steps": len(divergent_steps(o)), "old_bad_stores": len(bad_stores(o)),
        "new_disagreements": n["resync"]["agreement"]["disagreements"]}

    # Block-state read broken (one step late): 0.30+ diverges and stores a
    # wrong block; 0.27.1 never reads it, so its log equals the unbroken one.
    n, o = sc_new["hybrid-c1@break-block-state"], sc_old["hybrid-c1@break-block-state"]
    assert n["fault_applied"], where
    assert divergent_steps(n) and bad_stores(n), (where, "0.30+ did not use the block state")
    assert n["resync"]["agreement"]["disagreements"] > 0, where
    assert o["steps"] == sc_old["hybrid-c1"]["steps"], where
    figures["break-block-state"] = {"new_divergent_steps": len(divergent_steps(n)),
                                    "new_bad_stores": len(bad_stores(n))}

    # vLLM's block state present but unusable: the request's chunks are
    # refused (logged), never stored from a guess.
    messages = {
        "hybrid-c1@vllm-missing-request":
            "of request A: the request is missing from vLLM's kv_connector_block_state",
        "hybrid-c1@vllm-group-count": "block lists for the request, the connector 3 groups",
        "hybrid-c1@vllm-no-state": "declares SchedulerOutput.kv_connector_block_state but sent none",
    }
    for name, message in messages.items():
        n = sc_new[name]
        assert n["fault_applied"], (where, name)
        assert bad_stores(n) == [], (where, name)
        # missing-request leaves only A out; the other faults hit every request.
        hit = [st for st in stores(n)
               if st["req"] == "A" or not name.endswith("missing-request")]
        assert hit == [], (where, name, hit[:2])
        assert any("Not storing tokens" in line and message in line
                   for line in new["stderr"].splitlines()), (where, name)
        figures[name.split("@")[1]] = len(stores(n))
    assert stores(sc_new["hybrid-c1@vllm-missing-request"]), (where, "B and C still store")
    return figures
