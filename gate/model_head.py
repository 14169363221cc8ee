"""Is a checkpoint's ``lm_head`` one vLLM loads (stdlib only: safetensors headers and bytes).

The engine gate (``gate/engine_gate.py``) runs :func:`check_untied` on a model
directory before it starts anything; the tiny-model builder
(``lab/tiny_hybrid_model.py``) runs it on what it saved.  vLLM's
``Qwen3NextForCausalLM`` never ties ``lm_head``: a checkpoint without its own
head loads with every logit equal, and "identical to the reference" would pass
whatever the KV holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


# Architectures whose vLLM implementation never ties lm_head to the embedding
# (vllm/model_executor/models/qwen3_next.py builds its own ParallelLMHead).
NEVER_TIED = ("Qwen3NextForCausalLM",)


def _safetensors_names(model_dir: Path) -> dict[str, dict[str, Any]]:
    """tensor name -> header entry (dtype, shape, data_offsets, file) of every
    ``*.safetensors`` file in ``model_dir`` (stdlib: the 8-byte length + JSON header)."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                out[name] = dict(entry, file=f.name, header_len=n)
    return out


def _tensor_bytes(model_dir: Path, entry: dict[str, Any]) -> bytes:
    start, end = entry["data_offsets"]
    with open(model_dir / entry["file"], "rb") as fh:
        fh.seek(8 + entry["header_len"] + start)
        return fh.read(end - start)


def check_untied(model_dir: str | Path) -> str | None:
    """None when the checkpoint's logits can depend on its weights as vLLM loads them, else one line
    saying why not: for an architecture vLLM never ties (``Qwen3NextForCausalLM``), the
    checkpoint must hold an ``lm_head.weight`` that differs from the embedding.  Stdlib only
    (the gate runs it before starting anything)."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"{d / 'config.json'}: unreadable ({exc})"
    try:
        names = _safetensors_names(d)
    except (OSError, ValueError) as exc:
        return f"{d}: safetensors header unreadable ({exc})"
    if not names:
        return None  # not a safetensors checkpoint: nothing to read here
    arch = (cfg.get("architectures") or [""])[0]
    never_ties = arch in NEVER_TIED
    head = names.get("lm_head.weight")
    if head is None:
        if never_ties:
            return (f"{d}: {arch} in vLLM never ties lm_head and the checkpoint has no lm_head.weight: "
                    "every logit would be equal (regenerate it with lab/tiny_hybrid_model.py)")
        if not cfg.get("tie_word_embeddings", False):
            return f"{d}: no lm_head.weight and tie_word_embeddings is false"
        return None
    emb = next((e for n, e in names.items() if n.endswith("embed_tokens.weight")), None)
    if emb is not None and emb["shape"] == head["shape"] and _tensor_bytes(d, emb) == _tensor_bytes(d, head):
        return f"{d}: lm_head.weight is a copy of the embedding (a tied head saved twice)"
    return None

