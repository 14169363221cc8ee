#!/usr/bin/env python3
"""Generate a tiny random-weight hybrid (GDN + full attention) checkpoint for the engine gate.

3 GDN ("linear_attention") layers + 1 full-attention layer with the real
Qwen3.5-0.8B attention/GDN dimensions, so vLLM 0.27.1 picks the same 544-token
logical block and FlashInfer the same 32-token kernel page (k = 17) as for the
real model (``vllm-geometry.md`` §1.2, §6.2), while the checkpoint is ~25 MB.
It ships a byte-level tokenizer that needs no training data (§6.3) and a small
ChatML template.

Random weights cannot recall keys, so the gate's criterion for such a model is
"the greedy continuation and its logprobs after restore are identical to a warm
reference" (``config.json`` carries ``"lmcache_patchtool_tiny": true``, which the
gate reads).

The checkpoint always holds an explicit, untied ``lm_head.weight``
(``tie_word_embeddings: false``): vLLM's ``Qwen3NextForCausalLM`` never ties
``lm_head`` (``qwen3_next.py``), so a checkpoint without one loads with an
uninitialised head whose logits are all equal (every logprob -ln vocab, every
greedy token 0) and an "identical to cold" check passes whatever the KV holds.
``generate`` refuses to finish when the saved head is missing or equal to the
embedding, and ``check_untied(dir)`` (stdlib only) is what the gate runs on a
model directory before it starts anything.

Kinds: ``qwen3_5`` (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``; SSM
state float32 via ``mamba_ssm_dtype``), ``qwen3_next``
(``Qwen3NextForCausalLM``, a tiny MoE; SSM state in the model dtype, so it uses
32 value heads to reach the same 544 block) and ``qwen3`` (``Qwen3ForCausalLM``,
pure attention: ``--gdn-layers 0``).  vLLM's ``qwen3_5.py`` imports
torchvision (a CUDA build on PyPI, absent from the CPU engine venv);
``qwen3_next.py`` and ``qwen3.py`` do not.

Only the generation needs torch + transformers + tokenizers (the target venv);
the config and the geometry arithmetic are pure python::

    python -m lab.tiny_hybrid_model --out /tmp/tiny-hybrid            # generate
    python -m lab.tiny_hybrid_model --print-geometry [--kind qwen3_next] [--tp 2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

# The stdlib head check lives in the helper package, where the engine gate imports it.
from gate.model_head import check_untied

MARKER = "lmcache_patchtool_tiny"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
FLASHINFER_PAGES = (16, 32, 64)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# config values ``--set`` may change (integers): the GDN and attention sizes that decide the page
# geometry, e.g. a hybrid whose Mamba page needs no padding on vLLM for CPU (``hybrid-contig``)
SETTABLE = ("linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "num_key_value_heads", "head_dim", "num_attention_heads")


def tiny_config(kind: str = "qwen3_5", *, layers: tuple[int, int] = (3, 1), vocab_size: int = 512,
                eos_token_id: int = 256, linear_value_heads: int | None = None,
                overrides: dict[str, int] | None = None) -> dict[str, Any]:
    """HF config dict of the tiny model (pure python)."""
    bad = sorted(set(overrides or {}) - set(SETTABLE))
    if bad:
        raise ValueError(f"--set {bad[0]}: settable are {', '.join(SETTABLE)}")
    return _tiny_config(kind, layers=layers, vocab_size=vocab_size, eos_token_id=eos_token_id,
                        linear_value_heads=linear_value_heads) | dict(overrides or {})


def _tiny_config(kind: str, *, layers: tuple[int, int], vocab_size: int, eos_token_id: int,
                 linear_value_heads: int | None) -> dict[str, Any]:
    n_gdn, n_fa = layers
    if n_fa < 1 or (n_gdn < 1 and kind != "qwen3") or (n_gdn and kind == "qwen3"):
        raise ValueError("qwen3 is pure attention (0 GDN layers); qwen3_5/qwen3_next need at least "
                         "one GDN and one attention layer")
    # interleave like the real models: (gdn x r, fa) repeated
    per = max(1, n_gdn // n_fa)
    layer_types: list[str] = []
    g, f = n_gdn, n_fa
    while g or f:
        take = min(per, g)
        layer_types += ["linear_attention"] * take
        g -= take
        if f:
            layer_types.append("full_attention")
            f -= 1
    common = {
        "vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": len(layer_types), "layer_types": layer_types,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
        # untied: vLLM's Qwen3-Next never ties lm_head, so a tied checkpoint has no head there
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "eos_token_id": eos_token_id, "bos_token_id": None, "pad_token_id": None,
        "torch_dtype": "bfloat16", MARKER: True,
    }
    if kind == "qwen3_5":
        return common | {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
                         "linear_num_value_heads": linear_value_heads or 16, "mamba_ssm_dtype": "float32"}
    if kind == "qwen3_next":
        # 32 value heads: block 544 on a GPU (bf16 state); 16: 640 on vLLM for CPU (fp32 state)
        return common | {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                         "linear_num_value_heads": linear_value_heads or 32, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
                         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                         "full_attention_interval": per + 1}
    if kind == "qwen3":
        return common | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                         "layer_types": ["full_attention"] * n_fa, "rope_theta": 10000000.0}
    raise ValueError(f"unknown kind {kind!r} (qwen3_5 | qwen3_next | qwen3)")


def expected_geometry(cfg: dict[str, Any], *, tp: int = 1, kv_cache_dtype: str = "auto", model_dtype: str = "bfloat16",
                      num_spec_tokens: int = 0, user_block_size: int | None = None) -> dict[str, Any]:
    """vLLM 0.27.1's hybrid block alignment (``platforms/interface.py:765-940``, align mode), in pure python."""
    kv_bytes = DTYPE_BYTES[model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype]
    h_kv = max(1, cfg["num_key_value_heads"] // tp)
    attn_1 = 2 * h_kv * cfg["head_dim"] * kv_bytes
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv_dim = 2 * nk * dk + nv * dv
    conv_bytes = (cfg["linear_conv_kernel_dim"] - 1 + num_spec_tokens) * (conv_dim // tp) * DTYPE_BYTES[model_dtype]
    ssm_dtype = cfg.get("mamba_ssm_dtype") or model_dtype
    ssm_bytes = (nv // tp) * dv * dk * DTYPE_BYTES[ssm_dtype]
    mamba_page = conv_bytes + ssm_bytes
    A = max(16, user_block_size or 16)
    block = A * math.ceil(mamba_page / (A * attn_1))
    block = max(block, user_block_size or 0)
    fi_page = max([p for p in FLASHINFER_PAGES if block % p == 0], default=None)
    return {"attn_bytes_per_token": attn_1, "mamba_page_bytes": mamba_page, "block_size": block,
            "attn_page_bytes": block * attn_1, "flashinfer_kernel_page": fi_page,
            "k_flashinfer": block // fi_page if fi_page else None, "k_flash_attn": 1, "tp": tp}


def byte_level_tokenizer(out: Path) -> None:
    """A byte-level BPE with no merges (every byte one token) + ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = {chr(c): b for b, c in zip(bs, cs)}
    return table[ch]


def generate(out: Path, kind: str = "qwen3_5", seed: int = 0, layers: tuple[int, int] = (3, 1),
             linear_value_heads: int | None = None, overrides: dict[str, int] | None = None) -> dict[str, Any]:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    byte_level_tokenizer(out)
    eos = 256 + SPECIALS.index("<|im_end|>")
    cfg_dict = tiny_config(kind, layers=layers, eos_token_id=eos, linear_value_heads=linear_value_heads,
                           overrides=overrides)
    hf_kw = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type", "torch_dtype", MARKER)}
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(**hf_kw)
        model_cls = transformers.Qwen3_5ForCausalLM
    elif kind == "qwen3_next":
        hf_kw.pop("mamba_ssm_dtype", None)
        cfg = transformers.Qwen3NextConfig(**hf_kw)
        model_cls = transformers.Qwen3NextForCausalLM
    else:
        hf_kw = {k: v for k, v in hf_kw.items() if not k.startswith("linear_") and k != "mamba_ssm_dtype"}
        cfg = transformers.Qwen3Config(**hf_kw)
        model_cls = transformers.Qwen3ForCausalLM
    cfg.architectures = cfg_dict["architectures"]
    if kind == "qwen3_5":
        cfg.mamba_ssm_dtype = "float32"
    cfg.tie_word_embeddings = False
    model = model_cls(cfg).to(torch.bfloat16)
    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if head.data_ptr() == emb.data_ptr() or torch.equal(head, emb):
        raise SystemExit("tiny_hybrid_model: lm_head is tied to the embedding; refusing to save a model whose "
                         "head vLLM would not load")
    model.save_pretrained(str(out), safe_serialization=True)
    # the gate's marker, and the values vLLM must read back
    path = out / "config.json"
    data = json.loads(path.read_text())
    data[MARKER] = True
    data.setdefault("mamba_ssm_dtype", cfg_dict.get("mamba_ssm_dtype")) if kind == "qwen3_5" else None
    data["tie_word_embeddings"] = False
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}, indent=2))
    problem = check_untied(out)
    if problem:
        raise SystemExit(f"tiny_hybrid_model: {problem}")
    n_params = sum(p.numel() for p in model.parameters())
    info = {"out": str(out), "kind": kind, "params": n_params,
            "geometry": expected_geometry(cfg_dict) if "linear_attention" in cfg_dict["layer_types"] else None,
            "torch": torch.__version__, "transformers": transformers.__version__}
    (out / "tiny_hybrid_model.json").write_text(json.dumps(info, indent=2))
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output directory")
    ap.add_argument("--kind", choices=["qwen3_5", "qwen3_next", "qwen3"], default="qwen3_5",
                    help="qwen3_next for vLLM on CPU (qwen3_5 needs torchvision); qwen3: pure attention "
                         "(with --gdn-layers 0)")
    ap.add_argument("--linear-value-heads", type=int,
                    help="GDN value heads (default 16 for qwen3_5, 32 for qwen3_next; 16 gives the "
                         "640-token block of vLLM for CPU)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=INT",
                    help="change a config size (repeatable): " + ", ".join(SETTABLE))
    ap.add_argument("--check", metavar="DIR", help="check DIR's lm_head (untied, present) and exit 0/1")
    ap.add_argument("--gdn-layers", type=int, default=3)
    ap.add_argument("--attn-layers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--print-config", action="store_true")
    ap.add_argument("--print-geometry", action="store_true")
    args = ap.parse_args(argv)
    if args.check:
        problem = check_untied(args.check)
        print(problem or f"{args.check}: lm_head present and untied")
        return 1 if problem else 0
    overrides = {k: int(v) for k, _, v in (o.partition("=") for o in args.overrides)}
    cfg = tiny_config(args.kind, layers=(args.gdn_layers, args.attn_layers),
                      linear_value_heads=args.linear_value_heads, overrides=overrides)
    if args.print_config:
        print(json.dumps(cfg, indent=2))
    if args.print_geometry:
        print(json.dumps(expected_geometry(cfg, tp=args.tp), indent=2))
    if args.out:
        try:
            info = generate(Path(args.out), args.kind, args.seed, (args.gdn_layers, args.attn_layers),
                            args.linear_value_heads, overrides)
        except ImportError as exc:
            print(f"generation needs torch, transformers and tokenizers: {exc}", file=sys.stderr)
            return 3
        print(json.dumps(info, indent=2))
    elif not (args.print_config or args.print_geometry):
        ap.error("give --out DIR, --print-config or --print-geometry")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
