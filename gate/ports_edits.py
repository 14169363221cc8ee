"""Reproduce the connector-side registration edits of each LMCache version.

lmcache-patchtool hybrid-fa ports.  ``geometry.build_kv_caches`` returns the
server-side view LMCache 0.5.3's connector produces (HND, GDN re-viewed with
``.view``).  LMCache 0.5.5 rewrote the Mamba edit (``as_strided``) and 0.5.6
re-views sub-paged rank-4 attention at registration
(``_SubpagedAttentionViewEdit``, only when the model has Mamba layers).  To
measure a version faithfully this module runs that version's REAL
``apply_kv_cache_group_edits`` (``lmcache/integration/vllm/kv_cache_group_edits.py``)
on the tensors vLLM 0.27.1 registers, with minimal vLLM spec objects:

* FA layer: a full-attention spec, ``block_size = N`` (the logical size),
  ``page_size_bytes`` = one logical block of one layer;
* GDN layer: a Mamba spec (``mamba_cache_mode="align"``), ``block_size = N``,
  ``page_size_bytes`` = the padded state page;
* ``KVCacheConfig.has_mamba_layers`` = the model has GDN layers.

If vLLM itself is not importable (the CPU runtime envs carry no vLLM), a stub
``vllm.v1.kv_cache_interface`` with the four names the module imports is
installed; ``get_kv_cache_spec_kind`` returns the spec's declared kind.

``layout`` selects how the raw tensors are laid out in memory, as vLLM's
FlashInfer backend does: ``HND`` contiguous ``(nb*k, H, P, 2D)``; ``NHD``
physically ``(nb*k, P, H, 2D)`` registered as the permuted view
``(nb*k, H, P, 2D)``.  GDN tensors are ``(nb, 1, 1, row)`` in both.
"""

from __future__ import annotations

from types import SimpleNamespace

from gate import geometry
from gate.vllm_stub import ensure_vllm_interface as _ensure_vllm_interface

# The unpatched builder (the ports runner rebinds geometry.build_kv_caches).
_BUILD = geometry.build_kv_caches


def _spec(kind, geo):
    import vllm.v1.kv_cache_interface as kci  # noqa: PLC0415

    kind_enum = getattr(kci.KVCacheSpecKind, kind)
    if kind == "MAMBA":
        return SimpleNamespace(kind=kind_enum, block_size=geo.tokens_per_block,
                               page_size_bytes=geo.gdn_block_bytes, mamba_cache_mode="align")
    return SimpleNamespace(kind=kind_enum, block_size=geo.tokens_per_block, page_size_bytes=geo.fa_block_bytes)


def build_raw(geo, nb: int, *, layout: str = "HND", fill: int | None = None, seed: int | None = None,
              device: str = "cpu", pad_fill: int | None = None):
    """``geometry.build_kv_caches`` with the FA tensors in ``layout`` memory order.

    Returns a ``geometry.KVCaches`` whose ``raw`` are the vLLM-registered tensors
    and whose ``tensors`` are still 0.5.3's post-edit views (HND only); call
    :func:`apply_edits` to replace them with the version's own edits.
    """
    import torch  # noqa: PLC0415

    caches = _BUILD(geo, nb, fill=fill, seed=seed, device=device, pad_fill=pad_fill)
    if layout == "HND":
        return caches
    if layout != "NHD":
        raise ValueError(f"layout {layout!r}: HND or NHD")
    dtype = getattr(torch, geo.dtype)
    for i, kind in enumerate(caches.layer_kinds):
        if kind != "fa":
            continue
        hnd = caches.raw[i]
        # Same logical content, NHD memory: physical (nb*k, P, H, 2D).
        phys = hnd.permute(0, 2, 1, 3).contiguous()
        assert phys.dtype == dtype
        view = phys.permute(0, 2, 1, 3)  # logical (nb*k, H, P, 2D), strides of NHD
        caches.raw[i] = view
        caches.tensors[i] = view
        if caches.registered is not None:
            caches.registered[i] = view
    return caches


def apply_edits(caches, layout: str = "HND") -> dict:
    """Run the version's real ``apply_kv_cache_group_edits`` on ``caches.raw``.

    Replaces ``caches.tensors`` with the edited views; returns what happened
    (edit names per layer, shapes, the vLLM interface used).
    """
    which = _ensure_vllm_interface()
    from lmcache.integration.vllm import kv_cache_group_edits as edits  # noqa: PLC0415

    geo = caches.geometry
    names = [f"model.layers.{i}.attn" for i in range(len(caches.raw))]
    vllm_tensors = caches.vllm_tensors()  # vLLM 0.30+ GDN: (nb, 1, 1, content), padded stride(0)
    groups = []
    for kind_name, lmkind in (("gdn", "MAMBA"), ("fa", "FULL_ATTENTION")):
        layers = [n for n, k in zip(names, caches.layer_kinds) if k == kind_name]
        if layers:
            groups.append(SimpleNamespace(kv_cache_spec=_spec(lmkind, geo), layer_names=layers))
    config = SimpleNamespace(kv_cache_groups=groups, has_mamba_layers="gdn" in caches.layer_kinds)
    edited = edits.apply_kv_cache_group_edits(config, dict(zip(names, vllm_tensors)), {"kv_layout": layout})
    applied = []
    for i, name in enumerate(names):
        t = edited[name]
        applied.append({"layer": i, "kind": caches.layer_kinds[i], "edited": t is not vllm_tensors[i],
                        "shape": list(t.shape), "stride": list(t.stride())})
        caches.tensors[i] = t
    return {"vllm_interface": which, "layout": layout, "has_mamba_layers": config.has_mamba_layers,
            "layers": applied}
