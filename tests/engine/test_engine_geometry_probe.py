"""The engine gate's geometry probe (engine_geometry.probe) against the real vLLM for CPU: vLLM's own
config and block-size code, the tiny hybrid's layers built on the meta device, no engine started
(about 10 s a probe).

On auto, the SSM state dtype is the machine's: vllm/platforms/cpu.py resets it to float32 where torch
reports AVX-512 BF16 and leaves it otherwise (the model's bfloat16).  Both kinds of CPU are covered
on any host: this host's auto, an explicit dtype each way, and a CPU without AVX-512 BF16 simulated
by a sitecustomize that makes torch.cpu._is_avx512_bf16_supported() return False before vLLM asks.
CI runs all of it (tier engine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gate import engine_geometry as eg

from .conftest import TINY_HYBRID_BLOCK as BLOCK


def probe(engine_python: Path, model: Path, asked: str = "auto", env: dict | None = None) -> eg.EngineGeometry:
    return eg.probe(str(engine_python), eg.engine_args(str(model), ssm_state_dtype=asked), env=env)


@pytest.mark.parametrize("asked", ["float32", "bfloat16"])
def test_an_explicit_state_dtype_pins_the_block_on_any_cpu(engine_python, hybrid_model, asked):
    geo = probe(engine_python, hybrid_model, asked)
    assert (geo.block_size, geo.ssm_state_dtype, geo.kernel_block, geo.expect_k) == (BLOCK[asked], asked,
                                                                                     BLOCK[asked], 1), geo
    assert geo.hybrid and geo.attention_backends == ("CPU_ATTN",) and f"asked {asked}" in geo.why()


def test_auto_follows_this_cpu(engine_python, hybrid_model):
    geo = probe(engine_python, hybrid_model)
    state = "float32" if geo.cpu_features["torch"]["avx512_bf16"] else "bfloat16"
    assert geo.cpu_features["torch"]["avx512_bf16"] == eg.cpu_flags()["avx512_bf16"], geo.cpu_features
    assert (geo.block_size, geo.ssm_state_dtype) == (BLOCK[state], state), geo


def test_auto_on_a_cpu_without_avx512_bf16(engine_python, hybrid_model, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import torch\ntorch.cpu._is_avx512_bf16_supported = lambda: False\n")
    geo = probe(engine_python, hybrid_model, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert geo.cpu_features["torch"]["avx512_bf16"] is False
    assert (geo.block_size, geo.ssm_state_dtype) == (384, "bfloat16"), geo
    assert "no AVX-512 BF16, the model's dtype is kept" in geo.why(), geo.why()


def test_pure_attention_keeps_vllms_block(engine_python, attn_model):
    geo = eg.probe(str(engine_python), eg.engine_args(str(attn_model), mamba_cache_mode=None,
                                                      vllm_block_size=256))
    assert (geo.hybrid, geo.block_size, geo.ssm_state_dtype) == (False, 256, None), geo
