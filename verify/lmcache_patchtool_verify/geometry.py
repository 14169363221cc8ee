"""KV-cache geometries as vLLM 0.27.1 registers them with a KV connector.

This module is deliberately free of torch/lmcache imports at module level: the
CLI (which never imports torch) reads the preset table to print and validate
``--preset`` names, while the harness and the restore gate call
:func:`build_kv_caches` inside the target environment.

Notation (see EXPLAINER.md): ``N`` tokens per logical (scheduler) block, ``P``
slots per kernel page, ``k = N // P`` kernel pages per logical block.

What vLLM hands ``register_kv_caches`` (vllm-geometry notes §3, checked against
vLLM's ``_reshape_kv_cache_tensors``):

* full-attention layer: rank-4 ``(num_logical_blocks * k, H, P, 2 * D)`` in the
  model dtype. On CPU LMCache's detector forces HND, so the tensor is built
  contiguous in HND order; logical block ``L`` is kernel pages ``L*k .. L*k+k-1``.
* GDN/Mamba layer: one ``int8`` tensor ``(num_logical_blocks, 1, 1, page_bytes)``,
  whose page is padded to the attention page.  LMCache 0.5.3's connector re-views
  it (``_MambaUnifiedViewEdit``, HND) as ``(nb, 1, N, page_bytes // N)`` before
  registering; :func:`build_kv_caches` returns that post-edit view, because the
  server side (what the harness and gate drive) only ever sees the edited tensor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Geometry:
    """One model's KV layout as the LMCache server sees it."""

    name: str
    tokens_per_block: int  # N, the scheduler's logical block size
    kernel_page: int  # P, the attention backend's kernel block size
    num_kv_heads: int  # H (per TP rank)
    head_size: int  # D
    num_fa_layers: int
    num_gdn_layers: int = 0
    dtype: str = "bfloat16"
    description: str = ""
    # Layer order: GDN layers first (as in Qwen3.5, where layer 0 is GDN), so
    # the FA segment of a host object sits after the Mamba segment.
    gdn_first: bool = True

    def __post_init__(self) -> None:
        if self.tokens_per_block % self.kernel_page:
            raise ValueError(f"{self.name}: N={self.tokens_per_block} is not a multiple of P={self.kernel_page}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"{self.name}: unsupported dtype {self.dtype}")

    @property
    def k(self) -> int:
        """Kernel pages per logical block."""
        return self.tokens_per_block // self.kernel_page

    @property
    def sub_paged(self) -> bool:
        return self.k > 1

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def fa_block_bytes(self) -> int:
        """Bytes of one logical block of one FA layer (all k pages)."""
        return self.tokens_per_block * self.num_kv_heads * 2 * self.head_size * self.itemsize

    @property
    def fa_page_bytes(self) -> int:
        return self.fa_block_bytes // self.k

    @property
    def gdn_block_bytes(self) -> int:
        """A GDN state page, padded by vLLM to the attention page size."""
        return self.fa_block_bytes

    @property
    def layer_kinds(self) -> list[str]:
        gdn = ["gdn"] * self.num_gdn_layers
        fa = ["fa"] * self.num_fa_layers
        return gdn + fa if self.gdn_first else fa + gdn

    def with_dtype(self, dtype: str) -> "Geometry":
        data = asdict(self)
        data.update(dtype=dtype, name=f"{self.name}-{dtype}")
        return Geometry(**data)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(k=self.k, sub_paged=self.sub_paged)
        return data


PRESETS: dict[str, Geometry] = {
    g.name: g
    for g in (
        Geometry("qwen35-0.8b", 544, 32, num_kv_heads=2, head_size=256, num_fa_layers=1, num_gdn_layers=3,
                 description="Qwen3.5-0.8B-like hybrid, FlashInfer 32-token pages: 544/32, k=17"),
        Geometry("gdn-27b", 1600, 64, num_kv_heads=4, head_size=256, num_fa_layers=1, num_gdn_layers=3,
                 description="27B-GDN-like hybrid, 64-token pages: 1600/64, k=25"),
        Geometry("pure-attn-bs128", 128, 64, num_kv_heads=8, head_size=128, num_fa_layers=2, num_gdn_layers=0,
                 description="pure attention, FlashInfer with --block-size 128: 128/64, k=2, no GDN layers"),
        Geometry("control-k1", 544, 544, num_kv_heads=2, head_size=256, num_fa_layers=1, num_gdn_layers=3,
                 description="hybrid under FlashAttention (no sub-paging): 544/544, k=1 control"),
    )
}


def preset(name: str) -> Geometry:
    """Look a preset up; ``NAME@dtype`` selects another dtype (e.g. ``qwen35-0.8b@float16``)."""
    base, _, dtype = name.partition("@")
    if base not in PRESETS:
        raise KeyError(f"unknown geometry preset {base!r}; known: {', '.join(PRESETS)}")
    geo = PRESETS[base]
    return geo.with_dtype(dtype) if dtype else geo


@dataclass
class KVCaches:
    """Registered tensors plus what the caller needs to address them."""

    geometry: Geometry
    num_logical_blocks: int
    tensors: list  # list[torch.Tensor], in layer order (post-edit views)
    raw: list  # list[torch.Tensor], the vLLM-shaped tensors (pre-edit views of the same memory)
    layer_kinds: list[str] = field(default_factory=list)

    def fa_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == "fa"]

    def gdn_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == "gdn"]


def build_kv_caches(geo: Geometry, num_logical_blocks: int, *, fill: int | None = None, seed: int | None = None,
                    device: str = "cpu") -> KVCaches:
    """Allocate CPU tensors laid out as vLLM 0.27.1 registers them (HND on CPU).

    Caveat for callers that register through LMCache's worker adapter: its
    ``CpuShmTensorWrapper`` re-points each registered tensor's storage at a new
    shared-memory segment (``Tensor.set_``). Content written before that is
    lost and ``raw`` views then point at the old memory, so fill and read the
    *registered* tensors after registering (the restore gate does). The
    in-process harness hands the tensors over unchanged, so this does not
    arise there.

    ``seed`` fills with deterministic random bytes; ``fill`` with one byte value
    (a poison pattern for retrieve destinations).  Exactly one must be given.
    ``device`` places the tensors (``"cuda"`` for the CUDA round trip); the
    random bytes are drawn on CPU either way, so a seed gives the same bytes.
    """
    import torch  # noqa: PLC0415 - only inside the target environment

    if (fill is None) == (seed is None):
        raise ValueError("give exactly one of fill= or seed=")
    dtype = getattr(torch, geo.dtype)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tensors, raw = [], []
    for kind in geo.layer_kinds:
        if kind == "fa":
            shape = (num_logical_blocks * geo.k, geo.num_kv_heads, geo.kernel_page, 2 * geo.head_size)
            nbytes = num_logical_blocks * geo.fa_block_bytes
        else:
            nbytes = num_logical_blocks * geo.gdn_block_bytes
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if gen is not None:
            buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
        else:
            buf.fill_(fill)
        if kind == "fa":
            t = buf.view(dtype).view(shape)
            raw.append(t)
            tensors.append(t)
        else:
            t = buf.view(torch.int8).view(num_logical_blocks, 1, 1, geo.gdn_block_bytes)
            raw.append(t)
            # LMCache 0.5.3's _MambaUnifiedViewEdit (HND): (nb, 1, N, row // N).
            tensors.append(t.view(num_logical_blocks, 1, geo.tokens_per_block, -1))
    return KVCaches(geo, num_logical_blocks, tensors, raw, list(geo.layer_kinds))


def block_bytes(caches: KVCaches, layer: int, logical_id: int):
    """The bytes of one logical block of one layer, as a uint8 tensor view."""
    import torch  # noqa: PLC0415

    t = caches.raw[layer]
    flat = t.view(-1).view(torch.uint8) if t.dtype != torch.int8 else t.view(-1).view(torch.uint8)
    size = flat.numel() // caches.num_logical_blocks
    return flat[logical_id * size:(logical_id + 1) * size]


def engine_group_infos(geo: Geometry) -> list[dict[str, Any]]:
    """EngineGroupInfo fields, in kernel-group order (sorted by first layer).

    GDN layers form engine group 0 when present, FA layers the next one; both
    declare ``tokens_per_block = N`` exactly as ``create_engine_group_infos_from_vllm``
    does from vLLM's specs.
    """
    infos: list[dict[str, Any]] = []
    kinds = geo.layer_kinds
    order = ["gdn", "fa"] if geo.gdn_first else ["fa", "gdn"]
    for kind in order:
        layers = tuple(i for i, k in enumerate(kinds) if k == kind)
        if layers:
            infos.append({"engine_group_id": len(infos), "layer_indices": layers,
                          "tokens_per_block": geo.tokens_per_block, "kind": kind})
    return infos
