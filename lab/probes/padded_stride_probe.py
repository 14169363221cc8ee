"""Probe of the non-CUDA transfer fallback on pools with a padded per-block
stride (the hybrid-fa series' part padded-block-stride), run in a runtime venv
with an overlay first on PYTHONPATH::

    PYTHONPATH=<overlay>:<repo> <runtime>/bin/python -m lab.probes.padded_stride_probe

Prints one JSON object.  Everything it calls is the installed LMCache's own
code; only the expected bytes are computed here, from the addressing LMCache's
CUDA kernels use (0.5.6 ``cuda_ops`` ``resolve_block_addressing``: a block
starts at ``block_id * block_stride_elems * element_size`` when the stride is
set, and ``bs * nh * hs * element_size`` bytes of it are copied).

* ``transfer``: per case (engine format, dtype, pool layout), the real
  ``multi_layer_block_kv_transfer`` fallback with raw layer pointers, as the
  CPU cache context calls it.  D2H: the host objects must hold each block's
  tight bytes in the staging layout ``(nl, tokens, nh * hs)``; H2D (into other
  block ids, with a skipped first block): the tight bytes of the destination
  blocks must be the source's and every other byte of the pool unchanged (the
  padding, which in the ``interleaved`` layout is the other layers' bytes, as
  in vLLM's blocks-first pools).  An exception is recorded as the case's
  ``error`` (a pristine fallback refuses the stride).
* ``span``: the real ``CPUCacheContext`` on a padded GDN-like group whose
  second layer is one block short of what the group's stride and block count
  reach, and on one whose second layer has another stride: the registration
  error, if any (``None`` for the well-formed control).
* ``shm``: the message ``migrate_to_shm_and_wrap`` raises for a padded view.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from typing import Any

import torch

try:
    from lmcache.lmcache_native import EngineKVFormat, TransferDirection
except ImportError:  # 0.5.3: the native module is lmcache.c_ops
    from lmcache.c_ops import EngineKVFormat, TransferDirection  # type: ignore[no-redef]
from lmcache.v1.platform.ops_types import PageBufferShapeDesc

try:  # 0.5.6: a package; the MP fallback lives in mp_mem_kernels
    from lmcache.v1.platform.torch_ops import mp_mem_kernels as fallback
except ImportError:  # 0.5.5: one module
    from lmcache.v1.platform import torch_ops as fallback  # type: ignore[no-redef]

try:
    from lmcache.v1.platform.devices.cpu import shm as cpu_shm
    from lmcache.v1.platform.devices.cpu.cache_context import CPUCacheContext
except ImportError:
    from lmcache.v1.platform.cpu import shm as cpu_shm  # type: ignore[no-redef]
    from lmcache.v1.platform.cpu.cache_context import CPUCacheContext  # type: ignore[no-redef]

CANARY = 0xC3
NL, NB, BS, HS = 2, 7, 8, 16
PAD = 40  # padding elements after each block (the separate layout)


@dataclass(frozen=True)
class Case:
    fmt: str  # EngineKVFormat name
    dtype: str
    layout: str  # "separate": one padded buffer per layer; "interleaved": one pool, blocks first
    nh: int

    @property
    def name(self) -> str:
        return f"{self.fmt}/{self.dtype}/{self.layout}"


CASES = [
    Case("NL_X_NB_NH_BS_CS", "int8", "separate", 1),  # the vLLM 0.30+ GDN view on CPU (HND)
    Case("NL_X_NB_NH_BS_CS", "bfloat16", "interleaved", 2),
    Case("NL_X_NB_BS_NH_CS", "int8", "separate", 1),  # the same under NHD (the GPU's layout)
    Case("NL_X_NB_BS_NH_CS", "bfloat16", "interleaved", 2),
    Case("NL_X_NB_BS_HS", "bfloat16", "separate", 1),  # MLA-style, the format upstream padded first
]


def _layer_shape(case: Case) -> tuple[int, ...]:
    if case.fmt == "NL_X_NB_NH_BS_CS":
        return (NB, case.nh, BS, HS)
    if case.fmt == "NL_X_NB_BS_NH_CS":
        return (NB, BS, case.nh, HS)
    return (NB, BS, HS)


def _pool(case: Case, seed: int) -> tuple[torch.Tensor, list[int], int]:
    """The pool's bytes (random), each layer's element offset, the block stride."""
    dtype = getattr(torch, case.dtype)
    tight = BS * case.nh * HS
    stride = NL * tight + PAD if case.layout == "interleaved" else tight + PAD
    nbytes = (NB * stride * NL if case.layout == "separate" else NB * stride) * dtype.itemsize
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if case.layout == "separate":
        offsets = [layer * NB * stride for layer in range(NL)]
    else:
        offsets = [layer * tight for layer in range(NL)]
    return buf, offsets, stride


def _block_bytes(buf: torch.Tensor, offset: int, stride: int, block: int, tight: int, item: int) -> torch.Tensor:
    """The tight bytes of one block, straight from the CUDA addressing."""
    start = (offset + block * stride) * item
    return buf[start:start + tight * item]


def _tokens_major(block: torch.Tensor, case: Case) -> torch.Tensor:
    """A block's bytes in the staging order (token, head, hs)."""
    item = getattr(torch, case.dtype).itemsize
    if case.fmt == "NL_X_NB_NH_BS_CS":  # (nh, bs, hs) -> (bs, nh, hs)
        return block.view(case.nh, BS, HS * item).transpose(0, 1).reshape(-1)
    return block


def _desc(case: Case, stride: int) -> Any:
    desc = PageBufferShapeDesc()
    desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs = 1, NL, NB, BS, case.nh, HS
    dtype = getattr(torch, case.dtype)
    desc.element_size = dtype.itemsize
    desc.block_stride_elems = stride
    desc.dtype = dtype
    return desc


def transfer_case(case: Case) -> dict[str, Any]:
    fmt = getattr(EngineKVFormat, case.fmt)
    dtype = getattr(torch, case.dtype)
    item, tight = dtype.itemsize, BS * case.nh * HS
    blocks_per_chunk = 2
    chunk_tokens = blocks_per_chunk * BS
    src_ids, dst_ids = [4, 1, 6, 3], [2, 5, 0, 1]
    out: dict[str, Any] = {"case": case.name}
    src, offsets, stride = _pool(case, 1)
    desc = _desc(case, stride)
    ptrs = torch.tensor([src.data_ptr() + o * item for o in offsets], dtype=torch.int64)
    n_objs = len(src_ids) // blocks_per_chunk
    objs = [torch.zeros(NL * chunk_tokens * case.nh * HS, dtype=dtype) for _ in range(n_objs)]
    src_before = src.clone()
    try:
        fallback.multi_layer_block_kv_transfer(ptrs, [o.data_ptr() for o in objs], src_ids, "cpu",
                                               TransferDirection.D2H, desc, chunk_tokens, fmt, 0)
    except Exception as exc:  # noqa: BLE001 - recorded: pristine refuses here
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return out
    want = []
    for c in range(n_objs):
        per_layer = []
        for layer in range(NL):
            per_layer += [_tokens_major(_block_bytes(src, offsets[layer], stride, b, tight, item), case)
                          for b in src_ids[c * blocks_per_chunk:(c + 1) * blocks_per_chunk]]
        want.append(torch.cat(per_layer))
    out["d2h_objects_exact"] = sum(bool(torch.equal(o.view(torch.uint8), w)) for o, w in zip(objs, want))
    out["d2h_objects"] = n_objs
    out["d2h_source_unchanged"] = bool(torch.equal(src, src_before))

    dst, _, _ = _pool(case, 2)
    dst_before = dst.clone()
    dptrs = torch.tensor([dst.data_ptr() + o * item for o in offsets], dtype=torch.int64)
    skip = 1
    fallback.multi_layer_block_kv_transfer(dptrs, [o.data_ptr() for o in objs], dst_ids, "cpu",
                                           TransferDirection.H2D, desc, chunk_tokens, fmt, skip)
    expected = dst_before.clone()
    for pos, (s, d) in enumerate(zip(src_ids, dst_ids)):
        if pos < skip:
            continue
        for layer in range(NL):
            _block_bytes(expected, offsets[layer], stride, d, tight, item).copy_(
                _block_bytes(src, offsets[layer], stride, s, tight, item))
    out["h2d_pool_exact"] = bool(torch.equal(dst, expected))
    out["h2d_bytes_differing"] = int((dst != expected).sum())
    out["h2d_bytes_written"] = int((dst != dst_before).sum())
    return out


class _Wrapped:
    """What the CPU cache context unwraps (``to_tensor``), around a plain tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def to_tensor(self) -> torch.Tensor:
        return self.tensor


def _gdn_layer(nb: int, page: int, content: int) -> torch.Tensor:
    """A layer as the 0.5.5+ connector edit leaves vLLM 0.30+'s GDN view (HND,
    ``(nb, 1, N, hs)`` int8, ``stride(0)`` = the page), over exactly the
    memory its ``nb`` blocks reach."""
    hs = content // BS
    storage = torch.zeros((nb - 1) * page + BS * hs, dtype=torch.int8)
    return torch.as_strided(storage, (nb, 1, BS, hs), (page, BS * hs, hs, 1))


def span_case(kind: str) -> str | None:
    """``control``: two well-formed layers; ``short``: the second layer has one
    block fewer (the group's descriptor, from the first layer, reaches one
    block past its memory); ``stride``: the second layer's blocks sit 64 bytes
    further apart than the first's."""
    page, content, nb = 512, BS * 48, 5
    layers = [_gdn_layer(nb, page, content), _gdn_layer(nb, page, content)]
    if kind == "short":
        layers[1] = _gdn_layer(nb - 1, page, content)
    elif kind == "stride":
        layers[1] = _gdn_layer(nb, page + 64, content)
    try:
        CPUCacheContext([_Wrapped(t) for t in layers], lmcache_tokens_per_chunk=BS,
                        layout_hints={"kv_layout": "HND"})
    except Exception as exc:  # noqa: BLE001 - the registration error is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def shm_refusal() -> str | None:
    page, content, nb = 512, 384, 4
    raw = torch.zeros(nb * page, dtype=torch.int8)
    view = torch.as_strided(raw, (nb, 1, 1, content), (page, content, content, 1))
    try:
        cpu_shm.migrate_to_shm_and_wrap(view)
    except ValueError as exc:
        return str(exc)
    return None


def main() -> int:
    doc: dict[str, Any] = {"transfer": [], "span": {}, "shm": None}
    for case in CASES:
        try:
            doc["transfer"].append(transfer_case(case))
        except Exception:  # noqa: BLE001
            doc["transfer"].append({"case": case.name, "error": traceback.format_exc().splitlines()[-1]})
    for kind in ("control", "short", "stride"):
        doc["span"][kind] = span_case(kind)
    doc["shm"] = shm_refusal()
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
