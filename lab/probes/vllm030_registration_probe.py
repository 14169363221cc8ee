"""What the installed LMCache connector does with the KV views a real vLLM
registers, at registration (worker side), for a Qwen3.5-0.8B-like hybrid.

Run in an LMCache runtime venv with ``PYTHONPATH = <lmcache overlay>:<vLLM
layer>:<repo>`` (``lab/provision_vllm.py``)::

    python -m lab.probes.vllm030_registration_probe

Prints one JSON object (also written to ``--out PATH``: LMCache logs to
stdout).  Per KV cache layout (vLLM 0.30+: ``LBHNC`` = HND and ``LBNHC`` =
NHD, the layer-compact layouts a hybrid with kernel-block splitting can use;
``BLHNC``, blocks-first, only without splitting), the views come from vLLM's
own ``create_kv_cache_views``: two attention layers 576/64 (k = 9; k = 1
blocks-first; 2 KV heads of 256, bf16) and two GDN layers of a ``MambaSpec``
whose state (conv + ssm, 1,085,440 B) is padded to the attention page.  Then the installed connector's own steps, in
``register_kv_caches`` order: ``vllm_layout_hints`` (with the views, where
the installed signature takes them), ``apply_kv_cache_group_edits``,
``create_engine_group_infos_from_vllm``.  Recorded: the hint, each edited
view's shape and strides, or the exception (type and message), which is
what a vLLM engine start would raise there.

vLLM <= 0.29 has no ``create_kv_cache_views``: there the probe records the
hint ``vllm_layout_hints`` gives when vLLM's own ``get_kv_cache_layout``
answers one layout (``set_kv_cache_layout``) and the view's strides say the
other: it must be vLLM's answer there, as before.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

import torch

N, P, HEADS, HEAD = 576, 64, 2, 256  # 576/64: k = 9
NUM_BLOCKS = 5
CONV, SSM = (3, 6144), (16, 128, 128)  # bf16 conv + fp32 ssm = 1,085,440 B


def _specs() -> tuple[Any, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: PLC0415

    attn = FullAttentionSpec(block_size=N, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=N, shapes=(CONV, SSM), dtypes=(torch.bfloat16, torch.float32),
                      page_size_padded=attn.page_size_bytes, mamba_cache_mode="align")
    return attn, mamba


def _views(layout_name: str) -> tuple[dict[str, torch.Tensor], Any]:
    """vLLM's own views and a KVCacheConfig for them.  Layer-compact layouts
    (``LB*``): one buffer per layer, the attention split into 64-token kernel
    blocks (k = 9).  Blocks-first (``BL*``, which vLLM allows only without
    kernel-block splitting: k = 1): one pool per group whose block holds both
    layers' pages, so a view's block step is two pages."""
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415

    layout = KVCacheLayout[layout_name]
    blocks_first = layout_name.startswith("BL")
    attn, mamba = _specs()
    groups = ((["model.layers.0.linear_attn", "model.layers.1.linear_attn"], mamba, None),
              (["model.layers.3.self_attn.attn", "model.layers.7.self_attn.attn"], attn,
               None if blocks_first else P))
    views: dict[str, torch.Tensor] = {}
    tensors = []
    for names, spec, kernel in groups:
        page = spec.page_size_bytes
        pools = [names] if blocks_first else [[n] for n in names]
        for layers in pools:
            if blocks_first:
                kvt = KVCacheTensor(size=NUM_BLOCKS * page * len(layers), layers=layers,
                                    layer_stride=page, block_stride=page * len(layers))
            else:
                kvt = KVCacheTensor(size=NUM_BLOCKS * page, layers=layers,
                                    layer_stride=NUM_BLOCKS * page, block_stride=page)
            raw = torch.zeros(kvt.size, dtype=torch.int8)
            views.update(zip(layers, create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, kvt,
                                                           kernel)))
            tensors.append(kvt)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=[
        KVCacheGroupSpec(names, spec) for names, spec, _ in groups])
    return views, config


def _describe(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype)}
    return type(t).__name__


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _hints(views: dict[str, torch.Tensor]) -> dict:
    from lmcache.integration.vllm import utils  # noqa: PLC0415

    if "kv_caches" in inspect.signature(utils.vllm_layout_hints).parameters:
        return dict(utils.vllm_layout_hints(views))
    return dict(utils.vllm_layout_hints())  # pristine: vLLM's function only


def register(layout_name: str) -> dict[str, Any]:
    from lmcache.integration.vllm.kv_cache_group_edits import (  # noqa: PLC0415
        apply_kv_cache_group_edits)
    from lmcache.integration.vllm.kv_cache_groups import (  # noqa: PLC0415
        create_engine_group_infos_from_vllm)

    views, config = _views(layout_name)
    out: dict[str, Any] = {"registered": {k: _describe(v) for k, v in views.items()}}
    try:
        out["hints"] = hints = _hints(views)
        edited = apply_kv_cache_group_edits(config, views, layout_hints=hints)
        out["edited"] = {k: _describe(v) for k, v in edited.items()}
        infos = create_engine_group_infos_from_vllm(config, edited, layout_hints=hints)
        out["engine_groups"] = len(infos)
    except Exception as exc:  # noqa: BLE001  what an engine start would raise here
        out["error"] = _error(exc)
    return out


def older_vllm() -> dict[str, Any]:
    """vLLM <= 0.29: the hint is vLLM's answer, never the strides'.  vLLM's
    own ``set_kv_cache_layout`` sets the answer to the layout the view's
    strides contradict."""
    from vllm.v1.attention.backends.utils import set_kv_cache_layout  # noqa: PLC0415

    # HND-packed attention (H, N, C) = (2, 64, 512), and NHD-packed.
    hnd = torch.zeros(4, HEADS, P, 2 * HEAD, dtype=torch.bfloat16)
    nhd = torch.zeros(4, P, HEADS, 2 * HEAD, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    got = {}
    for answer, view in (("NHD", hnd), ("HND", nhd)):
        set_kv_cache_layout(answer)
        try:
            got[answer] = _hints({"model.layers.0.self_attn.attn": view}).get("kv_layout")
        except Exception as exc:  # noqa: BLE001
            got[answer] = _error(exc)
    set_kv_cache_layout(None)
    return {"hint_for_vllm_answer": got}


def main() -> int:
    import vllm.v1.kv_cache_interface as kci  # noqa: PLC0415
    from importlib.metadata import version  # noqa: PLC0415

    doc: dict[str, Any] = {"vllm": version("vllm")}
    if hasattr(kci, "create_kv_cache_views"):
        doc["layouts"] = {name: register(name) for name in ("LBHNC", "LBNHC", "BLHNC")}
    else:
        doc["older_vllm"] = older_vllm()
    text = json.dumps(doc, indent=1)
    if len(sys.argv) > 2 and sys.argv[1] == "--out":
        with open(sys.argv[2], "w") as fh:
            fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
