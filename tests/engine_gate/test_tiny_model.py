"""The tiny-model builder's head: explicit and untied, or the engine gate's verdict cannot fail.

vLLM's ``Qwen3NextForCausalLM`` never ties ``lm_head``: a checkpoint without its own head loads
with every logit equal, and "identical to the reference" passes whatever the KV holds.  The
generated model itself is checked in tests/engine (it needs torch); here: the config the builder
writes, and the stdlib check the gate runs before it starts anything (``check_untied``), on
hand-written safetensors files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from lab import tiny_hybrid_model as tiny


@pytest.mark.parametrize("kind,layers", [("qwen3_5", (3, 1)), ("qwen3_next", (3, 1)), ("qwen3", (0, 2))])
def test_builder_config_is_untied(kind, layers):
    cfg = tiny.tiny_config(kind, layers=layers)
    assert cfg["tie_word_embeddings"] is False


def _safetensors(path: Path, tensors: dict[str, bytes], shape: list[int]) -> None:
    header, off = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))


def _model(tmp: Path, arch: str, tensors: dict[str, bytes], tie: bool = False) -> Path:
    (tmp / "config.json").write_text(json.dumps({"architectures": [arch], "tie_word_embeddings": tie}))
    _safetensors(tmp / "model.safetensors", tensors, [4, 2])
    return tmp


EMB, HEAD = bytes(range(16)), bytes(range(16, 32))


def test_check_untied_accepts_an_explicit_head(tmp_path):
    d = _model(tmp_path, "Qwen3NextForCausalLM", {"model.embed_tokens.weight": EMB, "lm_head.weight": HEAD})
    assert tiny.check_untied(d) is None


def test_check_untied_refuses_a_missing_head_vllm_never_ties(tmp_path):
    d = _model(tmp_path, "Qwen3NextForCausalLM", {"model.embed_tokens.weight": EMB}, tie=True)
    problem = tiny.check_untied(d)
    assert problem and "never ties lm_head" in problem


def test_check_untied_refuses_a_head_that_copies_the_embedding(tmp_path):
    d = _model(tmp_path, "Qwen3NextForCausalLM", {"model.embed_tokens.weight": EMB, "lm_head.weight": EMB})
    assert "copy of the embedding" in tiny.check_untied(d)


def test_gate_refuses_a_tied_model_before_starting_anything(tmp_path):
    """The gate's preflight runs the check: a refusal (inconclusive), nothing started."""
    import engine_gate_cli as gate  # conftest loads gate/engine_gate.py under this name

    d = _model(tmp_path, "Qwen3NextForCausalLM", {"model.embed_tokens.weight": EMB}, tie=True)
    run = gate.GateRun(gate.GateConfig(model=str(d), device="cpu", tokenizer="byte", lengths=[1024],
                                       work_dir=str(tmp_path / "w")), log=lambda _m: None)
    res = run.run()
    assert res["verdict"]["status"] == "inconclusive", res["verdict"]
    assert "never ties lm_head" in res["verdict"]["reasons"][0]
    assert not run.proc_records
