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

vLLM 0.30+ (``gdn_view="0.30"``): ``create_kv_cache_views``
(``vllm/v1/kv_cache_interface.py`` of the 0.30.0 wheel) views every layer as
``[B, H, N, C]`` bytes with explicit strides.  Attention stays rank-4 as above.
A Mamba spec has ``num_heads = 1``, one state per block and no ``dtype``, so the
GDN layer becomes an ``int8`` ``(nb, 1, 1, content)`` view whose row is the
**unpadded** state (``MambaSpec.state_content_size_bytes``) while ``stride(0)``
is the block stride of the shared pool, i.e. the **padded** page (strides
``(page, content, content, 1)``).  :func:`build_kv_caches` then runs the
installed LMCache's own connector edit (``_MambaUnifiedViewEdit``) on that view
to get what the server sees; 0.5.3/0.5.4's edit is a plain ``.view(nb, 1, N,
-1)``, 0.5.5+'s an ``as_strided`` that keeps ``stride(0)``.  ``raw`` stays the
whole padded page (the memory), ``registered`` is vLLM's view.
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
    # The GDN state's real size (conv + ssm); 0 = the whole padded page.  vLLM
    # pads it up to the attention page (``mamba_page_size_padded``).
    gdn_state_bytes: int = 0
    # Which vLLM registers the tensors: "0.27" (0.27.1-0.29: the GDN row is the
    # padded page) or "0.30" (create_kv_cache_views: unpadded row, padded stride).
    gdn_view: str = "0.27"

    def __post_init__(self) -> None:
        if self.tokens_per_block % self.kernel_page:
            raise ValueError(f"{self.name}: N={self.tokens_per_block} is not a multiple of P={self.kernel_page}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"{self.name}: unsupported dtype {self.dtype}")
        if self.gdn_view not in ("0.27", "0.30"):
            raise ValueError(f"{self.name}: gdn_view {self.gdn_view!r}: 0.27 or 0.30")
        if self.gdn_state_bytes > self.fa_block_bytes:
            raise ValueError(f"{self.name}: GDN state {self.gdn_state_bytes} B exceeds the page")

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
    def gdn_content_bytes(self) -> int:
        """The unpadded GDN state (what vLLM 0.30+ registers as the row)."""
        return self.gdn_state_bytes or self.gdn_block_bytes

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
        # vLLM 0.28-0.33 geometries.  GDN state of Qwen3.5-0.8B: conv (3, 6144) bf16
        # + ssm (16, 128, 128) fp32 = 1,085,440 B at TP=1, 271,360 B at TP=4 (vllm-geometry.md 1.3).
        Geometry("qwen35-bs576", 576, 64, num_kv_heads=2, head_size=256, num_fa_layers=1, num_gdn_layers=3,
                 gdn_state_bytes=1_085_440,
                 description="vLLM 0.33 align mode + FlashInfer GDN prefill (block rounded to 64): "
                             "Qwen3.5-0.8B-like 576/64, k=9"),
        Geometry("qwen35-tp4-bs320", 320, 64, num_kv_heads=1, head_size=256, num_fa_layers=1, num_gdn_layers=3,
                 gdn_state_bytes=271_360,
                 description="the same at TP=4 (1 KV head, GDN heads / 4): 320/64, k=5"),
        Geometry("qwen35-fa4-bs640", 640, 128, num_kv_heads=2, head_size=256, num_fa_layers=1, num_gdn_layers=3,
                 gdn_state_bytes=1_085_440,
                 description="FA4 on Blackwell, head_dim 256, 128-token kernel pages: 640/128, k=5"),
        # The same models as vLLM 0.30+ registers them: GDN (nb, 1, 1, content), unpadded row,
        # padded stride(0); attention unchanged.
        Geometry("qwen35-bs576-v030", 576, 64, num_kv_heads=2, head_size=256, num_fa_layers=1,
                 num_gdn_layers=3, gdn_state_bytes=1_085_440, gdn_view="0.30",
                 description="qwen35-bs576 with vLLM 0.30+'s GDN view (unpadded row, padded stride): k=9"),
        Geometry("qwen35-tp4-bs320-v030", 320, 64, num_kv_heads=1, head_size=256, num_fa_layers=1,
                 num_gdn_layers=3, gdn_state_bytes=271_360, gdn_view="0.30",
                 description="qwen35-tp4-bs320 with vLLM 0.30+'s GDN view: k=5"),
        Geometry("qwen35-fa4-bs640-v030", 640, 128, num_kv_heads=2, head_size=256, num_fa_layers=1,
                 num_gdn_layers=3, gdn_state_bytes=1_085_440, gdn_view="0.30",
                 description="qwen35-fa4-bs640 with vLLM 0.30+'s GDN view: k=5"),
        Geometry("control-k1-v030", 576, 576, num_kv_heads=2, head_size=256, num_fa_layers=1, num_gdn_layers=3,
                 gdn_state_bytes=1_085_440, gdn_view="0.30",
                 description="k=1 control (FlashAttention) with vLLM 0.30+'s GDN view: 576/576"),
    )
}

# Presets a cell names on purpose and no matrix iterates (PRESETS and every gate's "all" stay what
# the recorded evidence has): pure attention under FlashAttention (the cross-version gate's k = 1
# attention, sharing pure-attn-bs128's block size), and at FlashInfer's --block-size 256 over
# 64-slot pages.
ON_REQUEST: dict[str, Geometry] = {
    g.name: g
    for g in (
        Geometry("pure-attn-k1", 128, 128, num_kv_heads=8, head_size=128, num_fa_layers=2, num_gdn_layers=0,
                 description="pure attention under FlashAttention (no sub-paging): 128/128, k=1"),
        Geometry("pure-attn-bs256", 256, 64, num_kv_heads=8, head_size=128, num_fa_layers=2, num_gdn_layers=0,
                 description="pure attention, FlashInfer with --block-size 256: 256/64, k=4, no GDN layers"),
    )
}

# The presets of the original (vLLM 0.27.1) matrix, and the vLLM 0.28-0.33 ones.
BASE_PRESETS = ("qwen35-0.8b", "gdn-27b", "pure-attn-bs128", "control-k1")
NEW_PRESETS = tuple(name for name in PRESETS if name not in BASE_PRESETS)


def preset(name: str) -> Geometry:
    """Look a preset up; ``NAME@dtype`` selects another dtype (e.g. ``qwen35-0.8b@float16``)."""
    base, _, dtype = name.partition("@")
    known = {**PRESETS, **ON_REQUEST}
    if base not in known:
        raise KeyError(f"unknown geometry preset {base!r}; known: {', '.join(known)}")
    geo = known[base]
    return geo.with_dtype(dtype) if dtype else geo


@dataclass
class KVCaches:
    """Registered tensors plus what the caller needs to address them."""

    geometry: Geometry
    num_logical_blocks: int
    tensors: list  # list[torch.Tensor], in layer order (post-edit views)
    raw: list  # list[torch.Tensor], the vLLM-shaped tensors (pre-edit views of the same memory)
    layer_kinds: list[str] = field(default_factory=list)
    # What vLLM hands the connector, per layer; None = ``raw`` (vLLM <= 0.29).
    # Differs from ``raw`` only for gdn_view "0.30" GDN layers, whose ``raw``
    # is the whole padded page so the harness can compare memory.
    registered: list | None = None

    def vllm_tensors(self) -> list:
        return self.registered if self.registered is not None else self.raw

    def fa_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == "fa"]

    def gdn_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_kinds) if kind == "gdn"]


def build_kv_caches(geo: Geometry, num_logical_blocks: int, *, fill: int | None = None, seed: int | None = None,
                    device: str = "cpu", pad_fill: int | None = None) -> KVCaches:
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
    ``pad_fill`` (``gdn_view="0.30"`` with ``seed``): the byte the GDN page
    padding past the state holds (the harness passes its poison byte).
    """
    import torch  # noqa: PLC0415 - only inside the target environment

    if (fill is None) == (seed is None):
        raise ValueError("give exactly one of fill= or seed=")
    dtype = getattr(torch, geo.dtype)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tensors, raw, registered = [], [], []
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
            registered.append(t)
        elif geo.gdn_view == "0.30":
            page, content = geo.gdn_block_bytes, geo.gdn_content_bytes
            t = buf.view(torch.int8).view(num_logical_blocks, 1, 1, page)
            if gen is not None and pad_fill is not None:
                # The padding is no state: vLLM never reads it.  A source whose
                # padding holds the destination's poison byte makes the harness
                # count only state bytes as restored (and any write of other
                # bytes into the padding as misplaced).
                buf.view(num_logical_blocks, page)[:, content:].fill_(pad_fill)
            raw.append(t)
            view = torch.as_strided(t, (num_logical_blocks, 1, 1, content), (page, content, content, 1),
                                    t.storage_offset())
            registered.append(view)
            tensors.append(connector_mamba_edit(geo, view))
        else:
            t = buf.view(torch.int8).view(num_logical_blocks, 1, 1, geo.gdn_block_bytes)
            raw.append(t)
            registered.append(t)
            # LMCache 0.5.3's _MambaUnifiedViewEdit (HND): (nb, 1, N, row // N).
            tensors.append(t.view(num_logical_blocks, 1, geo.tokens_per_block, -1))
    return KVCaches(geo, num_logical_blocks, tensors, raw, list(geo.layer_kinds), registered)


def connector_mamba_edit(geo: Geometry, view, layout: str = "HND"):
    """The installed LMCache connector's own GDN re-view of vLLM's tensor.

    Runs ``_MambaUnifiedViewEdit.apply`` from ``lmcache.integration.vllm.
    kv_cache_group_edits`` (a stub vLLM interface is installed when vLLM is
    absent).  Without that module, 0.5.3's ``.view(nb, 1, N, -1)``.  Raises
    what the real edit raises: that is the registration failing.
    """
    from types import SimpleNamespace  # noqa: PLC0415

    try:
        from gate.vllm_stub import ensure_vllm_interface  # noqa: PLC0415 - only inside the target environment

        ensure_vllm_interface()
        import vllm.v1.kv_cache_interface as kci  # noqa: PLC0415
        from lmcache.integration.vllm import kv_cache_group_edits as edits  # noqa: PLC0415
    except ImportError:
        return view.view(view.shape[0], 1, geo.tokens_per_block, -1)
    spec = SimpleNamespace(kind=kci.KVCacheSpecKind.MAMBA, block_size=geo.tokens_per_block,
                           page_size_bytes=geo.gdn_block_bytes, mamba_cache_mode="align")
    return edits._MambaUnifiedViewEdit().apply(spec, view, {"kv_layout": layout})


def block_bytes(caches: KVCaches, layer: int, logical_id: int):
    """The bytes of one logical block of one layer, as a uint8 tensor view."""
    import torch  # noqa: PLC0415

    t = caches.raw[layer]
    flat = t.view(-1).view(torch.uint8) if t.dtype != torch.int8 else t.view(-1).view(torch.uint8)
    size = flat.numel() // caches.num_logical_blocks
    return flat[logical_id * size:(logical_id + 1) * size]


# How the connector sets the cross-chunk window of a group (``sw_size_tokens``),
# per LMCache generation.  "connector": ask the installed LMCache's own
# ``lmcache.integration.vllm.kv_cache_groups`` helpers (feature-detected, see
# :func:`connector_group_fields`); "none": no window on any group (0.5.3's
# connector: only sliding-window attention gets one); "end": align-mode Mamba
# gets ``sw_size_tokens = N`` and ``recurrent_state = True`` where the field
# exists (0.5.4's ``_is_mamba_align_spec``, 0.5.5+'s ``_is_cachable_mamba_spec``).
WINDOW_RULES = ("connector", "none", "end")


def _fake_vllm_groups(geo: Geometry) -> tuple[list, dict[str, int]]:
    """vLLM ``KVCacheGroupSpec``-like objects for ``geo`` (GDN: align-mode Mamba).

    The connector's helpers recognise specs by class name in the MRO
    (``MambaSpec``, ``SlidingWindowSpec``, ``AttentionSpec``) and read
    ``block_size``, ``mamba_cache_mode`` and ``sliding_window``, so plain
    classes with those names are what vLLM 0.27.1's specs look like to them.
    """
    from types import SimpleNamespace  # noqa: PLC0415

    class AttentionSpec:  # noqa: D401 - name-matched by the connector
        pass

    class FullAttentionSpec(AttentionSpec):
        def __init__(self, block_size: int) -> None:
            self.block_size = block_size

    class MambaSpec:
        def __init__(self, block_size: int) -> None:
            self.block_size = block_size
            self.mamba_cache_mode = "align"

    kinds = geo.layer_kinds
    names = {i: f"model.layers.{i}.{'linear_attn' if k == 'gdn' else 'self_attn'}" for i, k in enumerate(kinds)}
    groups = []
    for kind in (["gdn", "fa"] if geo.gdn_first else ["fa", "gdn"]):
        layers = [i for i, k in enumerate(kinds) if k == kind]
        if layers:
            spec = MambaSpec(geo.tokens_per_block) if kind == "gdn" else FullAttentionSpec(geo.tokens_per_block)
            groups.append(SimpleNamespace(kv_cache_spec=spec, layer_names=[names[i] for i in layers]))
    return groups, {name: i for i, name in names.items()}


def engine_info_fields() -> tuple[str, ...] | None:
    """The fields of the installed ``EngineGroupInfo`` (None: LMCache not importable)."""
    try:
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo  # noqa: PLC0415
    except ImportError:
        return None
    fields = getattr(EngineGroupInfo, "__struct_fields__", None)  # a msgspec.Struct
    if fields is None:
        import dataclasses  # noqa: PLC0415

        fields = tuple(f.name for f in dataclasses.fields(EngineGroupInfo))
    return tuple(fields)


def installed_server_module() -> Any:
    """The installed lmcache's LMCache-driven transfer module (None: not importable)."""
    try:
        import lmcache.v1.multiprocess.modules.lmcache_driven_transfer as ldt  # noqa: PLC0415
    except ImportError:
        return None
    return ldt


def server_separates_state_groups() -> bool:
    """Whether the installed lmcache's server writes a Mamba/GDN model's groups
    as separate objects with a one-chunk state window (the hybrid-fa series'
    part 06 declares it with ``SEPARATES_STATE_GROUPS``): a retrieve then
    restores the state of the last chunk only, and an all-null state chunk
    stores no state object."""
    return bool(getattr(installed_server_module(), "SEPARATES_STATE_GROUPS", False))


def connector_group_fields(geo: Geometry, rule: str = "connector") -> dict[str, dict[str, Any]]:
    """Per kind (``"gdn"``, ``"fa"``): the window fields the connector sets.

    ``rule="connector"`` runs the installed LMCache's own
    ``_resolve_per_layer_sw_sizes`` / ``_merge_layer_sw_sizes`` (and
    ``_resolve_per_layer_recurrent`` / ``_merge_layer_recurrent`` where they
    exist, 0.5.5+) on vLLM-like specs: 0.5.3's helper gives the GDN group no
    window, 0.5.4+'s gives it ``sw_size_tokens = N``.  Fields the installed
    ``EngineGroupInfo`` lacks are left out.  Without LMCache (the CLI) the
    result is ``{}`` per kind, plus ``"source"``.
    """
    if rule not in WINDOW_RULES:
        raise ValueError(f"window rule {rule!r}: one of {', '.join(WINDOW_RULES)}")
    fields = engine_info_fields()
    kinds = [k for k in ("gdn", "fa") if k in geo.layer_kinds]
    out: dict[str, dict[str, Any]] = {k: {} for k in kinds}
    if rule == "none":
        for k in kinds:
            if fields is None or "sw_size_tokens" in fields:
                out[k]["sw_size_tokens"] = -1
        return out
    if rule == "end":
        for k in kinds:
            if fields is None or "sw_size_tokens" in fields:
                out[k]["sw_size_tokens"] = geo.tokens_per_block if k == "gdn" else -1
            if fields is not None and "recurrent_state" in fields:
                out[k]["recurrent_state"] = k == "gdn"
        return out
    if fields is None:
        raise ImportError("window rule 'connector' needs LMCache importable (run inside the target env)")
    from lmcache.integration.vllm import kv_cache_groups as kcg  # noqa: PLC0415

    groups, layer_to_idx = _fake_vllm_groups(geo)
    nl = len(geo.layer_kinds)
    sw = kcg._resolve_per_layer_sw_sizes(groups, layer_to_idx, nl) \
        if hasattr(kcg, "_resolve_per_layer_sw_sizes") else None
    rec = kcg._resolve_per_layer_recurrent(groups, layer_to_idx, nl) \
        if hasattr(kcg, "_resolve_per_layer_recurrent") else None
    for k in kinds:
        idx = [i for i, x in enumerate(geo.layer_kinds) if x == k]
        if sw is not None and "sw_size_tokens" in fields:
            out[k]["sw_size_tokens"] = kcg._merge_layer_sw_sizes(sw, idx)
        if rec is not None and "recurrent_state" in fields:
            out[k]["recurrent_state"] = kcg._merge_layer_recurrent(rec, idx)
    return out


def engine_group_infos(geo: Geometry, rule: str = "connector") -> list[dict[str, Any]]:
    """EngineGroupInfo fields, in kernel-group order (sorted by first layer).

    GDN layers form engine group 0 when present, FA layers the next one; both
    declare ``tokens_per_block = N`` exactly as ``create_engine_group_infos_from_vllm``
    does from vLLM's specs.  The window fields (``sw_size_tokens``, and
    ``recurrent_state`` where the installed ``EngineGroupInfo`` has it) are
    what the installed connector sets (:func:`connector_group_fields`); with
    LMCache not importable (the CLI) ``rule="connector"`` leaves them out.
    """
    if rule == "connector" and engine_info_fields() is None:
        extra: dict[str, dict[str, Any]] = {"gdn": {}, "fa": {}}
    else:
        extra = connector_group_fields(geo, rule)
    infos: list[dict[str, Any]] = []
    kinds = geo.layer_kinds
    order = ["gdn", "fa"] if geo.gdn_first else ["fa", "gdn"]
    for kind in order:
        layers = tuple(i for i, k in enumerate(kinds) if k == kind)
        if layers:
            info = {"engine_group_id": len(infos), "layer_indices": layers,
                    "tokens_per_block": geo.tokens_per_block, "kind": kind}
            info.update(extra.get(kind, {}))
            infos.append(info)
    return infos


def make_engine_group_infos(infos: list[dict[str, Any]]) -> list:
    """The installed ``EngineGroupInfo`` objects for :func:`engine_group_infos` dicts."""
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo  # noqa: PLC0415

    fields = set(engine_info_fields() or ())
    return [EngineGroupInfo(**{k: (tuple(v) if k == "layer_indices" else v) for k, v in i.items() if k in fields})
            for i in infos]


def kept_blocks_per_chunk(info: dict[str, Any], chunk_blocks: int) -> int:
    """Blocks of one chunk the server stores and restores for a group.

    The server keeps the last ``min(C, sw_size_tokens)`` tokens of each chunk
    for a windowed group (``downsample_and_stage_block_ids``); ``-1`` or a
    window of at least the chunk keeps every block.
    """
    sw = info.get("sw_size_tokens", -1)
    n = info["tokens_per_block"]
    if sw is None or sw < 0 or sw >= chunk_blocks * n:
        return chunk_blocks
    return max(1, sw // n)


def kept_positions(info: dict[str, Any], chunk_blocks: int, positions) -> list[int]:
    """Which of ``positions`` (block positions in the request) the server stores."""
    keep = kept_blocks_per_chunk(info, chunk_blocks)
    return [p for p in positions if p % chunk_blocks >= chunk_blocks - keep]
