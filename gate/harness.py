#!/usr/bin/env python3
"""In-process CPU round-trip harness for LMCache's LMCache-driven transfer path.

Runs the REAL ``LMCacheDrivenTransferModule`` (``register_kv_cache`` ->
``store`` -> ``retrieve``) of whatever lmcache is first on ``sys.path`` (the
runtime venv, or an overlay prepended to ``PYTHONPATH``) on CPU tensors laid
out exactly as vLLM 0.27.1 registers a hybrid model (``geometry.py``):

1. a source KV cache is filled with random bytes and registered as instance 1;
   a destination cache of the same geometry is filled with a poison byte and
   registered as instance 2;
2. ``store`` copies ``num_chunks`` chunks from scattered source block ids into
   host objects handed out by a fake storage manager (real ``TensorMemoryObj``
   / ``MemoryObjMetadata`` carved from one pool, so ``data_ptr - pool_base ==
   meta.address`` as with LMCache's own allocators);
3. ``retrieve`` copies them back into *different* scattered destination block
   ids, optionally skipping an already-cached prefix (``skip_first_n_tokens``),
   with LMCache's own batching (up to ``max_batch_size`` = 4 chunks per launch);
4. per group (GDN, FA) it reports the fraction of requested bytes restored
   exactly, bytes written outside the destination blocks (foreign writes),
   writes into the skipped prefix, and the host object's segment size vs the
   full size; per chunk the sha256 of every object segment.

Only what cannot run on CPU is replaced: the CUDA native plan executor is
emulated from the Python path's semantics (``--path native``, see
``harness_native.py``); events/streams are LMCache's own CPU stubs.

``--device cuda`` runs the same cells on CUDA tensors through LMCache's REAL
transfer path instead (``harness_cuda.py``): ``--path native`` is the
compiled plan executor (``execute_object_group_transfer``), ``--path direct``
0.5.6's copy-engine path (``execute_direct_copy_transfer``), ``--path python``
the per-batch Python loop over the compiled kernels.  Host objects live in
pinned memory; each store/retrieve is timed to ``torch.cuda.synchronize()``;
the analysis runs on CPU copies.  Without a usable GPU ``--device cuda`` is
refused in one line (exit 3).

Guards (on by default): frozen base-object metadata and a recorder of every
host<->staging copy (``harness_guards.py``).

Run by path in the target interpreter through ``gate/roundtrip.py``, e.g.::

    PYTHONPATH=<overlay> <venv>/bin/python -m gate.roundtrip --json --preset qwen35-0.8b
    ... gate/roundtrip.py --json --matrix fast --path native
    ... gate/roundtrip.py --json --cell preset=gdn-27b,chunk_blocks=2,num_chunks=5,skip_blocks=3

The JSON goes to stdout (LMCache's logging is moved to stderr); ``--out FILE``
writes it to a file as well.  Each finished cell prints one progress line on
stderr (``roundtrip: [3/7] FAIL <cell>: <reasons> (1.2 s)``).  Exit status: 0
when every cell ran (whether or not it passed -- pristine 0.5.3 is expected to
fail), 2 on a harness error.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from gate import geometry, token_form

POISON = 0xA5
MODEL = "roundtrip-model"
TARGET_FILES = (
    "lmcache/v1/kv_layer_groups.py",
    "lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py",
    "lmcache/v1/platform/base/cache_context.py",
    "lmcache/integration/vllm/lmcache_mp_connector.py",
)


@dataclass(frozen=True)
class Cell:
    """One harness run: a geometry, a request shape and a transfer path."""

    preset: str = "qwen35-0.8b"  # geometry preset, NAME[@dtype]
    chunk_blocks: int = 1  # C = chunk_blocks * N
    num_chunks: int = 3
    skip_blocks: int = 0  # logical blocks of already-cached prefix skipped on retrieve
    ids: str = "scattered"  # scattered | identity (store and retrieve ids 1..m)
    path: str = "python"  # python | native (CPU: emulated execute_object_group_transfer) | direct (CUDA only)
    seed: int = 1234

    @property
    def name(self) -> str:
        return (f"{self.preset}/C={self.chunk_blocks}N/x{self.num_chunks}/skip{self.skip_blocks}"
                f"/{self.ids}/{self.path}")

    @staticmethod
    def parse(text: str, **defaults: Any) -> "Cell":
        """``key=value,...`` (keys: the dataclass fields)."""
        kw: dict[str, Any] = dict(defaults)
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            key = key.strip().replace("-", "_")
            if key not in Cell.__dataclass_fields__:
                raise ValueError(f"unknown cell field {key!r}")
            kw[key] = int(value) if key in ("chunk_blocks", "num_chunks", "skip_blocks", "seed") else value
        return Cell(**kw)


# ---------------------------------------------------------------------------
# Matrices.  "fast": a few seconds in total; "full": the vLLM 0.27.1 geometry matrix;
# "vllm030": the vLLM 0.28-0.33 presets; "wide": full + vllm030.
# ---------------------------------------------------------------------------

def matrix(name: str, path: str = "python") -> list[Cell]:
    cells: list[Cell] = []
    if name == "fast":
        cells = [
            Cell("qwen35-0.8b", 1, 3, 0),
            Cell("qwen35-0.8b", 2, 5, 3),  # batched retrieve (4 + 1), skip mid-chunk
            Cell("qwen35-0.8b", 1, 2, 0, ids="identity"),  # store and retrieve into the same ids
            Cell("control-k1", 1, 3, 0),
            Cell("control-k1", 2, 5, 3),
            Cell("pure-attn-bs128", 2, 5, 2),
            Cell("gdn-27b", 1, 2, 0),
        ]
    elif name in ("full", "wide", "vllm030"):
        bases = {"full": geometry.BASE_PRESETS, "vllm030": geometry.NEW_PRESETS,
                 "wide": geometry.BASE_PRESETS + geometry.NEW_PRESETS}[name]
        for base in bases:
            for dtype in ("", "@float16"):
                heavy = base == "gdn-27b"
                shapes = [(1, 5, 0), (1, 5, 2), (2, 5, 3), (2, 3, 0)]
                if heavy:  # 6.5 MB per block and layer: fewer chunks, same coverage
                    shapes = [(1, 5, 2), (2, 3, 3)]
                for cb, nc, skip in shapes:
                    cells.append(Cell(base + dtype, cb, nc, skip))
            cells.append(Cell(base, 1, 2, 0, ids="identity"))
    else:
        raise ValueError(f"unknown matrix {name!r} (fast|full|vllm030|wide)")
    return [replace(c, path=path) for c in cells]


# ---------------------------------------------------------------------------
# Fakes for the server context (internals notes §4.3)
# ---------------------------------------------------------------------------

class _Wrapper:
    """Stands in for CudaIPCWrapper / CpuShmTensorWrapper."""

    def __init__(self, t):
        self.t = t

    def to_tensor(self):
        return self.t

    def close(self) -> None:  # LMCache's CUDA context closes its wrappers on release
        pass


class _FakeEventBus:
    def __init__(self) -> None:
        self.events: list[str] = []

    def publish(self, event) -> None:
        self.events.append(str(getattr(event, "event_type", event)))

    def publish_on_stream(self, stream, event) -> None:  # noqa: ARG002
        self.events.append(str(getattr(event, "event_type", event)))

    def has_subscribers(self, event_type) -> bool:  # noqa: ARG002
        return False


class FakeStorageManager:
    """L1 stand-in: real ``TensorMemoryObj`` carved from one uint8 pool.

    ``meta.address`` is the byte offset in the pool and ``raw_data`` the pool
    slice at that offset, as LMCache's allocators do.  Objects are separated by
    a canary gap so host-side overruns are visible.
    """

    GAP = 4096
    CANARY = 0x5A

    def __init__(self, capacity: int, guards: bool, pinned: bool = False) -> None:
        import torch  # noqa: PLC0415

        if pinned:  # CUDA: page-locked, as LMCache's own allocators are
            self.pool = torch.empty((capacity,), dtype=torch.uint8, pin_memory=True).fill_(self.CANARY)
        else:
            self.pool = torch.full((capacity,), self.CANARY, dtype=torch.uint8)
        self.guards = guards
        self.objs: dict = {}
        self.next = self.GAP
        self.reserved: list = []
        self.finish_write_calls = 0
        self.finish_read_calls = 0
        self.snapshots: dict = {}

    def reset(self) -> None:
        self.objs.clear()
        self.reserved.clear()
        self.snapshots.clear()
        self.next = self.GAP
        self.pool.fill_(self.CANARY)

    def reserve_write(self, keys, layout_desc, mode):
        import torch  # noqa: PLC0415
        from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: PLC0415

        from gate.harness_guards import FrozenMeta, GuardedTensorMemoryObj, snapshot  # noqa: PLC0415

        out = {}
        for key in keys:
            if mode == "new" and key in self.objs:
                continue
            size = sum(torch.Size(s).numel() * d.itemsize for s, d in zip(layout_desc.shapes, layout_desc.dtypes))
            addr = self.next
            if addr + size + self.GAP > self.pool.numel():
                raise MemoryError("fake storage pool exhausted")
            self.next = (addr + size + self.GAP + 255) // 256 * 256
            meta_cls = FrozenMeta if self.guards else MemoryObjMetadata
            obj_cls = GuardedTensorMemoryObj if self.guards else TensorMemoryObj
            meta = meta_cls(shape=torch.Size(layout_desc.shapes[0]), dtype=layout_desc.dtypes[0], address=addr,
                            phy_size=size, ref_count=1, shapes=[torch.Size(s) for s in layout_desc.shapes],
                            dtypes=list(layout_desc.dtypes))
            obj = obj_cls(self.pool[addr:addr + size], meta, None)
            if self.guards:
                meta.freeze()
                obj.freeze()
                self.snapshots[key] = snapshot(obj)
            self.objs[key] = obj
            self.reserved.append(key)
            out[key] = obj
        return out

    @contextlib.contextmanager
    def read_prefetched_results(self, keys):
        if all(k in self.objs for k in keys):
            yield [self.objs[k] for k in keys]
        else:
            yield None

    def finish_write(self, keys) -> None:
        self.finish_write_calls += 1

    def finish_read_prefetched(self, keys, extra_count: int = 0) -> None:  # noqa: ARG002
        self.finish_read_calls += 1

    def canary_damage(self) -> int:
        """Bytes outside every object that are no longer the canary."""
        spans = sorted((o.meta.address, o.meta.address + o.meta.phy_size) for o in self.objs.values())
        damage, pos = 0, 0
        for start, end in spans + [(self.pool.numel(), self.pool.numel())]:
            gap = self.pool[pos:start]
            if gap.numel():
                damage += int((gap != self.CANARY).count_nonzero())
            pos = max(pos, end)
        return damage


def _fake_server_context(chunk_size: int, sm: FakeStorageManager):
    from types import SimpleNamespace  # noqa: PLC0415

    from lmcache.v1.distributed.api import ObjectKey  # noqa: PLC0415
    from lmcache.v1.multiprocess.engine_context import LayoutDescRegistry  # noqa: PLC0415

    def resolve_obj_keys(key, gids):
        n = (key.end - key.start) // chunk_size
        out = []
        for g in gids:
            keys = []
            for i in range(n):
                toks = token_form.token_ids_of(key)[: key.start + (i + 1) * chunk_size]
                h = hashlib.sha256(repr(toks).encode()).digest()[:16]
                keys.append(ObjectKey(chunk_hash=h, model_name=key.model_name, kv_rank=key.worker_id or 0,
                                      object_group_id=g))
            out.append(keys)
        return out

    return SimpleNamespace(chunk_size=chunk_size, separate_object_groups=False, full_sw_kv=False,
                           storage_manager=sm, layout_desc_registry=LayoutDescRegistry(),
                           event_bus=_FakeEventBus(), resolve_obj_keys=resolve_obj_keys)


# ---------------------------------------------------------------------------
# Analysis helpers
# ---------------------------------------------------------------------------

def _rows(t, kind: str, geo):
    """uint8 view ``(pages, rows_per_page, row_bytes)`` of one registered layer."""
    import torch  # noqa: PLC0415

    u8 = t.contiguous().view(-1).view(torch.uint8)
    if kind == "fa":
        row = 2 * geo.head_size * geo.itemsize
        return u8.view(-1, geo.num_kv_heads * geo.kernel_page, row)
    row = geo.gdn_block_bytes // geo.tokens_per_block
    return u8.view(-1, geo.tokens_per_block, row)


def _wide(rows):
    """Same rows viewed as int64 words (rows are multiples of 8 bytes): 8x fewer compares."""
    import torch  # noqa: PLC0415

    return rows.view(torch.int64) if rows.shape[-1] % 8 == 0 else rows


def expected_fa_segment(src_layers, geo, block_ids, rule: str):
    """Expected FA segment bytes (uint8, flat) of one chunk under ``rule``.

    ``pass-major`` (the patched format): ``k`` page images; image ``j`` is
    ``(1, num_fa_layers, C/k, H*2D)`` holding, for every logical block ``L`` of
    the chunk in chunk order, the ``P`` slots of kernel page ``L*k + j``.
    ``pristine``: 0.5.3's 1/k object -- one image whose block ``b`` rows come
    from kernel page ``L_b`` (the logical id used as a kernel page id).
    """
    import torch  # noqa: PLC0415

    k = geo.k
    passes = range(k) if rule == "pass-major" else [None]
    images = []
    for j in passes:
        pages = [L * k + j if j is not None else L for L in block_ids]
        per_layer = []
        for t in src_layers:  # (nb*k, H, P, 2D)
            sel = t[pages]  # (b, H, P, 2D)
            per_layer.append(sel.permute(0, 2, 1, 3).reshape(len(pages) * geo.kernel_page, -1))
        images.append(torch.stack(per_layer).contiguous().view(-1).view(torch.uint8))
    return torch.cat(images)


def expected_gdn_segment(src_layers, block_ids):
    """Expected GDN segment: ``(1, nl_gdn, C, row/N)``, blocks in chunk order."""
    import torch  # noqa: PLC0415

    per_layer = [t[block_ids].reshape(-1, t.shape[-1]) for t in src_layers]  # post-edit (nb, 1, N, w)
    return torch.stack(per_layer).contiguous().view(-1).view(torch.uint8)


def _sha(t) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _lmcache_info() -> dict:
    import lmcache  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt  # noqa: PLC0415

    root = Path(lmcache.__file__).resolve().parent.parent
    files = {}
    for rel in TARGET_FILES:
        p = root / rel
        files[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None
    version = None
    for dist in root.glob("lmcache-*.dist-info"):
        version = dist.name[len("lmcache-"):-len(".dist-info")]
    return {"root": str(root), "version": version, "files_sha256": files,
            "torch": torch.__version__, "torch_device_type": getattr(lmcache, "torch_device_type", None),
            "native_object_group_transfer": bool(ldt._HAS_NATIVE_OBJECT_GROUP_TRANSFER)}


# ---------------------------------------------------------------------------
# One cell
# ---------------------------------------------------------------------------

@dataclass
class Options:
    guards: bool = True
    reps: int = 1
    hashes: bool = True
    dump_dir: str | None = None
    inject: str | None = None  # guard self-test: meta-write | used-size | address-skew
    device: str = "cpu"  # cpu | cuda (the real native path, harness_cuda.py)
    # EngineGroupInfo window fields: "connector" (the installed connector's own rule;
    # 0.5.4+: GDN sw_size_tokens = N, only the chunk-end GDN slot is stored), "none"
    # (no window, the harness before the GDN window rule), "end" (0.5.4+'s rule forced).
    window_rule: str = "connector"


def _inject_fault(kind: str | None):
    """Deliberately broken staging (Python path, D2H) to prove the guards fire.

    ``meta-write``: writes the base object's ``meta.address`` (what a naive pager
    does); ``used-size``: narrows the base with ``set_used_size``;
    ``address-skew``: hands the copy helper a view whose ``meta.address`` is 64
    bytes off its ``data_ptr`` (a pager that moved the address but not the pointer).
    """
    return fault_injected(kind, _lmcache_driven_transfer)


def _lmcache_driven_transfer():
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt  # noqa: PLC0415

    return ldt


@contextlib.contextmanager
def fault_injected(kind: str | None, module):
    """:func:`_inject_fault` on ``module()``'s ``lmcache_memcpy_async_d2h``
    (``module`` is only called when ``kind`` is set)."""
    if not kind:
        yield
        return
    import dataclasses  # noqa: PLC0415

    mod = module()
    orig = mod.lmcache_memcpy_async_d2h

    class _Skewed:
        def __init__(self, base):
            self._base = base
            self.meta = dataclasses.replace(base.meta, address=base.meta.address + 64)

        def __getattr__(self, name):
            return getattr(self._base, name)

    def d2h(gpu_buffer, memory_obj):
        if kind == "meta-write":
            memory_obj.meta.address = memory_obj.meta.address
        elif kind == "used-size":
            memory_obj.set_used_size(memory_obj.get_size())
        elif kind == "address-skew":
            memory_obj = _Skewed(memory_obj)
        else:
            raise ValueError(f"unknown fault {kind!r}")
        return orig(gpu_buffer, memory_obj)

    mod.lmcache_memcpy_async_d2h = d2h
    try:
        yield
    finally:
        mod.lmcache_memcpy_async_d2h = orig


def _pick_ids(rng: random.Random, nb: int, m: int, avoid: list[int] | None = None) -> list[int]:
    """``m`` distinct ids in random order from ``1..nb-1`` (vLLM's block 0 is its null
    block and never backs a request), differing position-wise from ``avoid``."""
    for _ in range(1000):
        ids = rng.sample(range(1, nb), m)
        if avoid is None or all(a != b for a, b in zip(ids, avoid)):
            return ids
    raise RuntimeError("could not draw distinct block ids")


@dataclass
class _CellPlan:
    """One cell's geometry and block ids, before any tensor exists."""

    cell: Cell
    opts: Options
    geo: geometry.Geometry
    on_cuda: bool  # "cuda", or "cpu-standin": the same code path on CPU tensors
    tensor_device: str
    C: int  # tokens per chunk
    m: int  # logical blocks requested
    T: int  # tokens requested
    nb: int  # logical blocks in each cache
    fa_layers: list[int]
    gdn_layers: list[int]
    present: list[str]  # the kinds the model has: "gdn" before "fa"
    src_ids: dict[str, list[int]]  # per kind: the block ids stored from
    dst_ids: dict[str, list[int]]  # per kind: the block ids retrieved into


def _plan_cell(cell: Cell, opts: Options) -> _CellPlan:
    """The geometry and block ids of ``cell`` (``ValueError`` on one it cannot run)."""
    on_cuda = opts.device != "cpu"
    tensor_device = "cpu" if opts.device == "cpu-standin" else opts.device
    geo = geometry.preset(cell.preset)
    N = geo.tokens_per_block
    C = cell.chunk_blocks * N
    m = cell.num_chunks * cell.chunk_blocks
    T = cell.num_chunks * C
    if not 0 <= cell.skip_blocks <= m:
        raise ValueError("skip_blocks out of range")
    rng = random.Random(cell.seed)

    kinds = geo.layer_kinds
    fa_layers = [i for i, x in enumerate(kinds) if x == "fa"]
    gdn_layers = [i for i, x in enumerate(kinds) if x == "gdn"]
    present = [x for x in ("gdn", "fa") if (gdn_layers if x == "gdn" else fa_layers)]

    if cell.ids == "identity":
        # The same ids on store and retrieve, in order, from 1: block 0 is
        # vLLM's null block, which never backs a request's tokens, and 0.5.4+
        # servers rightly skip storing a chunk whose ids are all 0
        # (``all_null_chunk_masks``): ids from 0 would make a one-block chunk 0
        # a hole that no engine request can produce.
        nb = m + 2
        src_ids = {x: list(range(1, m + 1)) for x in present}
        dst_ids = {x: list(range(1, m + 1)) for x in present}
    elif cell.ids == "scattered":
        nb = m + max(3, m // 2) + 1
        src_ids = {x: _pick_ids(rng, nb, m) for x in present}
        dst_ids = {x: _pick_ids(rng, nb, m, avoid=src_ids[x]) for x in present}
    else:
        raise ValueError(f"unknown ids mode {cell.ids!r}")
    return _CellPlan(cell=cell, opts=opts, geo=geo, on_cuda=on_cuda, tensor_device=tensor_device, C=C, m=m, T=T,
                     nb=nb, fa_layers=fa_layers, gdn_layers=gdn_layers, present=present, src_ids=src_ids,
                     dst_ids=dst_ids)


@dataclass
class _Caches:
    """The source (random bytes) and destination (poison) KV caches of one cell."""

    src: geometry.KVCaches
    dst: geometry.KVCaches
    src_before: list[Any]  # host copies of the source bytes: store must not change them


def _build_caches(plan: _CellPlan) -> _Caches:
    dev_kw: dict[str, Any] = {"device": plan.tensor_device} if plan.on_cuda else {}
    if plan.geo.gdn_view == "0.30":  # the page padding past the state is poison in both
        dev_kw["pad_fill"] = POISON
    src = geometry.build_kv_caches(plan.geo, plan.nb, seed=plan.cell.seed, **dev_kw)
    dev_kw.pop("pad_fill", None)
    dst = geometry.build_kv_caches(plan.geo, plan.nb, fill=POISON, **dev_kw)
    src_before = [t.cpu() for t in src.raw] if plan.on_cuda else [t.clone() for t in src.raw]
    return _Caches(src=src, dst=dst, src_before=src_before)


@dataclass
class _ObjectSizes:
    """The connector's group infos and the host-object sizes they imply."""

    info_dicts: list[dict]
    info_of: dict[str, dict]  # per kind
    keep_blocks: dict[str, int]  # per kind: blocks of a chunk the object keeps
    full_fa_seg: int
    full_gdn_seg: int
    full_obj: int
    pool_obj: int  # the most one chunk's objects may take (sizes the fake pool)


def _object_sizes(plan: _CellPlan, src: geometry.KVCaches) -> _ObjectSizes:
    geo, cell, C, N = plan.geo, plan.cell, plan.C, plan.geo.tokens_per_block
    fa_layers, gdn_layers = plan.fa_layers, plan.gdn_layers
    full_fa_seg = len(fa_layers) * C * geo.num_kv_heads * 2 * geo.head_size * geo.itemsize
    # GDN bytes per token in the object: the connector's re-view of one block
    # (the padded page under vLLM <= 0.29; >= the state under 0.30+'s view).
    gdn_token_bytes = (src.tensors[gdn_layers[0]][0].numel() * src.tensors[gdn_layers[0]].element_size() // N
                       if gdn_layers else 0)
    # The connector's EngineGroupInfo window fields (0.5.4+: GDN sw_size_tokens = N).
    # A windowed group keeps only the last min(C, window) tokens of each chunk in
    # the object (``downsample_and_stage_block_ids``): for align-mode Mamba, the
    # chunk-end GDN slot.  "full" below is what the server is meant to keep.
    info_dicts = geometry.engine_group_infos(geo, plan.opts.window_rule)
    info_of = {i["kind"]: i for i in info_dicts}
    keep_blocks = {kind: geometry.kept_blocks_per_chunk(info_of[kind], cell.chunk_blocks) for kind in plan.present}
    full_gdn_seg = len(gdn_layers) * keep_blocks.get("gdn", cell.chunk_blocks) * N * gdn_token_bytes
    full_obj = full_fa_seg + full_gdn_seg
    # The pool fits unwindowed objects too (LMCache's CPU cache context sizes the
    # object's GDN segment for the whole chunk; CUDA's for the window only).
    pool_obj = full_fa_seg + len(gdn_layers) * C * gdn_token_bytes
    return _ObjectSizes(info_dicts=info_dicts, info_of=info_of, keep_blocks=keep_blocks, full_fa_seg=full_fa_seg,
                        full_gdn_seg=full_gdn_seg, full_obj=full_obj, pool_obj=pool_obj)


@dataclass
class _Registration:
    """What LMCache made of the registered caches (instance 1's cache context)."""

    cc: Any  # the cache context
    kg_kind: list[str]  # per kernel group: "fa" | "gdn"
    og_kgs_all: list[list[int]]  # per object group: its kernel groups
    og_window: list[int]  # per object group: its window in chunks (< 1: none)
    og_of_kind: dict[str, int]  # per kind: its object group
    registry: Any  # the layout descriptor registered for the model, or None


def _register(mod: Any, ctx: Any, plan: _CellPlan, sizes: _ObjectSizes, caches: _Caches, result: dict,
              engine_type: Any) -> _Registration:
    """Register source (instance 1) and destination (instance 2); record LMCache's grouping in ``result``."""
    opts, fa_layers, gdn_layers = plan.opts, plan.fa_layers, plan.gdn_layers
    infos = geometry.make_engine_group_infos(sizes.info_dicts)
    result["engine_groups"] = [dict(i, layer_indices=list(i["layer_indices"])) for i in sizes.info_dicts]
    result["window_rule"] = opts.window_rule
    hints = {"kv_layout": "HND"}
    mod.register_kv_cache(1, [_Wrapper(t) for t in caches.src.tensors], MODEL, 1, engine_type.VLLM, hints, infos)
    mod.register_kv_cache(2, [_Wrapper(t) for t in caches.dst.tensors], MODEL, 1, engine_type.VLLM, hints, infos)
    cc = mod.context_entries_snapshot()[1].cache_context
    mgr = cc.kv_layer_groups_manager
    kg_kind = []
    kg_info = []
    for kg in mgr.kernel_groups:
        layers = list(kg.layer_indices)
        kind = "fa" if set(layers) <= set(fa_layers) else "gdn" if set(layers) <= set(gdn_layers) else "mixed"
        kg_kind.append(kind)
        kg_info.append({"kind": kind, "layers": layers, "tokens_per_block": kg.tokens_per_block,
                        "window_tokens": int(mgr.get_subchunk_sw_size_tokens(len(kg_info)))
                        if hasattr(mgr, "get_subchunk_sw_size_tokens") else None,
                        "slots_per_block": kg.slots_per_block, "bs": int(kg.shape_desc.bs),
                        "nb": int(kg.shape_desc.nb), "fmt": str(kg.engine_kv_format)})
    result["kernel_groups"] = kg_info
    if "mixed" in kg_kind:
        raise RuntimeError(f"unexpected kernel grouping: {kg_info}")
    # One object group (LMCache's default) or several: a server that writes
    # a hybrid's groups separately (0.5.4+ with the series' part 06, or
    # --separate-object-groups).  Per chunk, the objects of all groups are
    # analysed together, in object-group order, as one byte string: for a
    # merged object that is the object itself, so hashes compare across both.
    og_kgs_all = [list(og.kernel_group_indices) for og in mgr.object_groups]
    result["object_groups"] = og_kgs_all
    # A separate windowed object group (Mamba/GDN state: one chunk) is
    # retrieved only for the last ``window`` chunks of the request: the
    # state at the end of the hit is all the engine needs.  Merged objects
    # report one full-attention window.
    og_window = [int(w) for w in mgr.get_attn_desc().num_chunks_in_sw] if len(og_kgs_all) > 1 \
        else [-1]
    og_of_kind = {kg_kind[kgi]: og for og, kgs in enumerate(og_kgs_all) for kgi in kgs}
    result["object_group_windows"] = og_window
    registry = ctx.layout_desc_registry.find(MODEL, 1)
    result["registry_layout"] = {"shapes": [list(s) for s in registry.shapes],
                                 "dtypes": [str(d) for d in registry.dtypes]} if registry else None
    return _Registration(cc=cc, kg_kind=kg_kind, og_kgs_all=og_kgs_all, og_window=og_window, og_of_kind=og_of_kind,
                         registry=registry)


@dataclass
class _TransferPath:
    """How the transfer runs: the context that routes it (LMCache's real CUDA
    path, the CPU native emulation, or LMCache's own Python path), and how
    each call gets its IPC handle and is waited for."""

    context: Any
    handle: Callable[[], bytes]
    settle: Callable[[], None]


def _transfer_path(plan: _CellPlan, cc: Any, recorder: Any, stack: contextlib.ExitStack,
                   make_handle: Callable[[Any], bytes] | None, native_emulation: Callable[..., Any]) -> _TransferPath:
    cell, opts = plan.cell, plan.opts
    if plan.on_cuda:
        from gate import harness_cuda as hc  # noqa: PLC0415

        if opts.device == "cpu-standin" and cell.path == "native":
            stack.enter_context(hc.standin_native())
        path_cm = hc.real_path(cell.path, recorder.record if opts.guards else None)
        device = cc.device

        def handle() -> bytes:
            return make_handle(device)

        def settle() -> None:
            hc.synchronize(plan.tensor_device)
    else:
        path_cm = native_emulation(recorder.record if opts.guards else None) if cell.path == "native" \
            else contextlib.nullcontext()

        def handle() -> bytes:
            return b"stub_ipc_handle"

        def settle() -> None:
            pass
    return _TransferPath(context=path_cm, handle=handle, settle=settle)


@dataclass
class _Request:
    """The store and retrieve requests: keys, block-id lists per kernel group, skipped prefix."""

    store_key: Any
    retrieve_key: Any
    store_lists: list[list[int]]
    retrieve_lists: list[list[int]]
    skip_tokens: int


def _request(plan: _CellPlan, reg: _Registration, key_cls: Any) -> _Request:
    T = plan.T
    store_lists = [plan.src_ids[x] for x in reg.kg_kind]
    retrieve_lists = [plan.dst_ids[x] for x in reg.kg_kind]
    tokens = token_form.token_fields(key_cls, tuple(range(T)))
    store_key = key_cls(model_name=MODEL, world_size=1, worker_id=0, **tokens,
                        start=0, end=T, request_id="rt-store")
    retrieve_key = key_cls(model_name=MODEL, world_size=1, worker_id=0, **tokens,
                           start=0, end=T, request_id="rt-retrieve")
    skip_tokens = plan.cell.skip_blocks * plan.geo.tokens_per_block
    return _Request(store_key=store_key, retrieve_key=retrieve_key, store_lists=store_lists,
                    retrieve_lists=retrieve_lists, skip_tokens=skip_tokens)


def _native_counts(stats: Any) -> dict:
    return {"calls": stats.calls, "steps": stats.steps, "launches": stats.launches,
            "staging_copies": stats.staging_copies}


def _store_and_retrieve(mod: Any, plan: _CellPlan, req: _Request, sm: FakeStorageManager, recorder: Any,
                        path: _TransferPath, result: dict) -> tuple[list[float], list[float]]:
    """``store`` from instance 1 then ``retrieve`` into instance 2, ``opts.reps`` times (the last
    repetition's objects and bytes are what is analysed); the outcome and the path's stats go
    into ``result``.  Returns the store and retrieve times of each repetition."""
    cell, opts = plan.cell, plan.opts
    rec_cm = recorder.wrap_python_path() if opts.guards else contextlib.nullcontext()
    store_s, retrieve_s = [], []
    native_stats = None
    with path.context as native_stats, rec_cm, _inject_fault(opts.inject):
        for rep in range(max(1, opts.reps)):
            if rep:
                sm.reset()
                recorder.records.clear()
            h = path.handle()
            t0 = time.perf_counter()
            _, store_ok = mod.store(req.store_key, 1, [list(x) for x in req.store_lists], h)
            path.settle()
            t1 = time.perf_counter()
            h = path.handle()
            t1b = time.perf_counter()
            _, retrieve_ok = mod.retrieve(req.retrieve_key, 2, [list(x) for x in req.retrieve_lists], h,
                                          skip_first_n_tokens=req.skip_tokens)
            path.settle()
            t2 = time.perf_counter()
            store_s.append(t1 - t0)
            retrieve_s.append(t2 - t1b)
    result["store_ok"], result["retrieve_ok"] = bool(store_ok), bool(retrieve_ok)
    if plan.on_cuda:
        result["transfer"] = native_stats.to_json()
        result["native"] = _native_counts(native_stats) if cell.path == "native" else None
    elif native_stats is not None:
        result["native"] = _native_counts(native_stats)
    elif cell.path == "native":
        result["native"] = None
    return store_s, retrieve_s


def _pages(ids: list[int], positions: list[int], ppb: int) -> list[int]:
    """The pages (``ppb`` per logical block) behind ``positions`` of ``ids``."""
    return [ids[p] * ppb + j for p in positions for j in range(ppb)]


def _compare_layers(plan: _CellPlan, kind: str, exp_pos: list[int], off_pos: list[int], skip_pos: list[int],
                    src: geometry.KVCaches, dst: geometry.KVCaches) -> dict[str, Any]:
    """Byte counts of one kind's layers after the round trip (see :func:`_restore_groups`)."""
    import torch  # noqa: PLC0415

    geo = plan.geo
    layers = plan.fa_layers if kind == "fa" else plan.gdn_layers
    ppb = geo.k if kind == "fa" else 1
    src_ids, dst_ids = plan.src_ids[kind], plan.dst_ids[kind]
    poison_word = int.from_bytes(bytes([POISON]) * 8, "little", signed=True)
    requested = restored = foreign = skipped_written = misplaced = 0
    off_written = off_wrong = 0
    slots_exact = 0
    row_bytes = None
    for li in layers:
        s_rows = _wide(_rows(src.raw[li], kind, geo))
        d_rows = _wide(_rows(dst.raw[li], kind, geo))
        row_bytes = _rows(src.raw[li], kind, geo).shape[-1]
        pv = poison_word if d_rows.dtype == torch.int64 else POISON
        d_pages = _pages(dst_ids, exp_pos, ppb)
        s_pages = _pages(src_ids, exp_pos, ppb)
        sk_pages = _pages(dst_ids, skip_pos, ppb)
        requested += len(d_pages) * s_rows.shape[1] * row_bytes
        if d_pages:
            d_sel = d_rows[d_pages]
            eq = (d_sel == s_rows[s_pages]).all(-1)
            restored += int(eq.count_nonzero()) * row_bytes
            slots_exact += int(eq.all(-1).view(len(exp_pos), ppb).all(-1).count_nonzero())
            # written (not poison) but wrong: misplaced bytes inside the requested blocks
            misplaced += int(((d_sel != pv).any(-1) & ~eq).count_nonzero()) * row_bytes
        if off_pos:
            od = _pages(dst_ids, off_pos, ppb)
            os_ = _pages(src_ids, off_pos, ppb)
            o_sel = d_rows[od]
            o_changed = (o_sel != pv).any(-1)
            off_written += int(o_changed.count_nonzero()) * row_bytes
            o_wrong = int((o_changed & ~(o_sel == s_rows[os_]).all(-1)).count_nonzero()) * row_bytes
            off_wrong += o_wrong
            misplaced += o_wrong
        changed = (d_rows != pv).any(-1)  # (pages, rows)
        allowed = torch.zeros(d_rows.shape[0], dtype=torch.bool)
        allowed[d_pages] = True
        skipped = torch.zeros(d_rows.shape[0], dtype=torch.bool)
        if sk_pages:
            skipped[sk_pages] = True
        if off_pos:
            allowed[_pages(dst_ids, off_pos, ppb)] = True
        foreign += int(changed[~(allowed | skipped)].count_nonzero()) * row_bytes
        skipped_written += int(changed[skipped].count_nonzero()) * row_bytes
    return {"layers": layers, "ppb": ppb, "requested": requested, "restored": restored, "foreign": foreign,
            "skipped_written": skipped_written, "misplaced": misplaced, "off_written": off_written,
            "off_wrong": off_wrong, "slots_exact": slots_exact, "row_bytes": row_bytes}


def _restore_groups(plan: _CellPlan, sizes: _ObjectSizes, reg: _Registration, src: geometry.KVCaches,
                    dst: geometry.KVCaches) -> dict[str, dict]:
    """Restore / foreign-write analysis, per kind: requested bytes restored
    exactly, slots restored, bytes written outside the destination blocks or
    into the skipped prefix, and writes into slots the server does not restore."""
    cell = plan.cell
    groups: dict[str, dict] = {}
    req_pos = list(range(cell.skip_blocks, plan.m))
    skip_pos = list(range(cell.skip_blocks))
    for kind in plan.present:
        # Positions the server stores and restores: every block for FA; for a
        # windowed group (0.5.4+ GDN) only the kept tail of each chunk.  The
        # other requested positions are "not restored": poison stays there
        # (checked below: any write into them must be the true bytes).
        exp_pos = geometry.kept_positions(sizes.info_of[kind], cell.chunk_blocks, req_pos)
        window = reg.og_window[reg.og_of_kind[kind]]
        if window >= 1:
            exp_pos = [p for p in exp_pos if p // cell.chunk_blocks >= cell.num_chunks - window]
        if kind == "fa" and exp_pos != req_pos:
            raise RuntimeError(f"FA group declared a window: {sizes.info_of[kind]}")
        off_pos = [p for p in req_pos if p not in set(exp_pos)]
        n = _compare_layers(plan, kind, exp_pos, off_pos, skip_pos, src, dst)
        layers, requested = n["layers"], n["requested"]
        groups[kind] = {"k": n["ppb"], "layers": layers, "requested_bytes": requested,
                        "restored_bytes": n["restored"],
                        "fraction": (n["restored"] / requested) if requested else 1.0,
                        # slots = (layer, logical block position); "expected" = what the server stores
                        "keep_blocks_per_chunk": sizes.keep_blocks[kind],
                        "slots_requested": len(layers) * len(req_pos),
                        "slots_expected": len(layers) * len(exp_pos),
                        "slots_restored": n["slots_exact"],
                        "slots_not_restored_by_design": len(layers) * len(off_pos),
                        "not_restored_slots_written_bytes": n["off_written"],
                        "not_restored_slots_wrong_bytes": n["off_wrong"],
                        "foreign_bytes": n["foreign"], "skipped_prefix_written_bytes": n["skipped_written"],
                        "misplaced_bytes": n["misplaced"],
                        "row_bytes": n["row_bytes"]}
    return groups


def _mutated_bytes(raw: list[Any], before: list[Any]) -> int:
    """Source bytes that differ from their copies taken before the round trip."""
    import torch  # noqa: PLC0415

    return sum(0 if torch.equal(a, b) else
               int((a.view(-1).view(torch.uint8) != b.view(-1).view(torch.uint8)).count_nonzero())
               for a, b in zip(raw, before))


def _match_segment_layout(plan: _CellPlan, sizes: _ObjectSizes, seg: dict, kind: str, chunk_ids: list[int],
                          seg_bytes: Any, src: geometry.KVCaches) -> None:
    """Which independent reconstruction of the expected bytes ``seg`` matches
    (``seg["layout_matches"]``, and for a windowed GDN segment its unused tail)."""
    import torch  # noqa: PLC0415

    nbytes, full = seg["nbytes"], seg["full_nbytes"]
    if kind == "fa":
        src_fa = [src.raw[i] for i in plan.fa_layers]
        matches = []
        for rule in ("pass-major", "pristine"):
            exp = expected_fa_segment(src_fa, plan.geo, chunk_ids, rule)
            if exp.numel() == nbytes and torch.equal(exp, seg_bytes):
                matches.append(rule)
        seg["layout_matches"] = matches
        return
    kept = chunk_ids[len(chunk_ids) - sizes.keep_blocks["gdn"]:]
    exp = expected_gdn_segment([src.tensors[i] for i in plan.gdn_layers], kept)
    if exp.numel() == nbytes and torch.equal(exp, seg_bytes):
        seg["layout_matches"] = ["gdn-rows"]
    elif len(kept) < len(chunk_ids) and nbytes == sizes.full_gdn_seg * len(chunk_ids) // len(kept) \
            and torch.equal(exp, seg_bytes[:exp.numel()]):
        # LMCache's CPU cache context sizes the segment for the whole
        # chunk (``get_kernel_group_shape_dtype`` ignores the window;
        # CUDA's does not): the kept slots sit at its head, the rest
        # is never written nor read.
        seg["layout_matches"] = ["gdn-rows-window-head"]
        seg["ratio"] = exp.numel() / full if full else None
        seg["unused_tail_bytes"] = nbytes - exp.numel()
        seg["unused_tail_nonzero_bytes"] = int(seg_bytes[exp.numel():].count_nonzero())
    else:
        seg["layout_matches"] = []


def _chunk_object(plan: _CellPlan, sizes: _ObjectSizes, reg: _Registration, ci: int, parts: list[tuple[int, Any]],
                  src: geometry.KVCaches) -> tuple[dict, list[dict], tuple[int, int, int] | None]:
    """Chunk ``ci``'s objects (``(object group, obj)`` in object-group order) as
    one byte string: its description, its segments and its FA segment's
    ``(object group, offset in that object, nbytes)`` (None without one)."""
    import torch  # noqa: PLC0415

    cell, opts = plan.cell, plan.opts
    raw = torch.cat([obj.raw_data[:obj.get_size()] for _, obj in parts]) if len(parts) > 1 \
        else parts[0][1].raw_data[:parts[0][1].get_size()]
    segs = []
    fa_seg = None
    off = 0
    for og, kgi, shape, dtype in [(og, kgi, shape, dtype) for og, obj in parts
                                  for kgi, shape, dtype in zip(reg.og_kgs_all[og], obj.meta.shapes,
                                                               obj.meta.dtypes)]:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        kind = reg.kg_kind[kgi]
        full = sizes.full_fa_seg if kind == "fa" else sizes.full_gdn_seg
        seg = {"object_group": og, "kernel_group": kgi, "kind": kind, "offset": off, "nbytes": nbytes,
               "shape": list(shape),
               "dtype": str(dtype), "full_nbytes": full, "ratio": nbytes / full if full else None}
        if opts.hashes:
            seg["sha256"] = _sha(raw[off:off + nbytes])
        chunk_ids = plan.src_ids[kind][ci * cell.chunk_blocks:(ci + 1) * cell.chunk_blocks]
        seg_bytes = raw[off:off + nbytes]
        if kind == "fa":
            og_off = off - sum(o.get_size() for g, o in parts if g < og)
            fa_seg = (og, og_off, nbytes)
        _match_segment_layout(plan, sizes, seg, kind, chunk_ids, seg_bytes, src)
        segs.append(seg)
        off += nbytes
    # The bytes the server wrote and reads back: every segment, less the
    # unused tail of a windowed GDN segment (CPU cache context), whose
    # content is stale staging memory (nonzero and run-dependent on 0.5.6).
    used = [raw[sg["offset"]:sg["offset"] + sg["nbytes"] - sg.get("unused_tail_bytes", 0)] for sg in segs]
    desc = {"chunk": ci, "size": sum(o.get_size() for _, o in parts), "full_size": sizes.full_obj,
            "address": parts[0][1].meta.address,
            "object_sizes": [o.get_size() for _, o in parts],
            "sha256": _sha(raw) if opts.hashes else None,
            "sha256_used": (_sha(torch.cat(used)) if len(used) > 1 else _sha(used[0]))
            if opts.hashes and used else None,
            "unused_bytes": sum(sg.get("unused_tail_bytes", 0) for sg in segs),
            "segments": segs}
    return desc, segs, fa_seg


@dataclass
class _HostObjects:
    """The stored host objects, per chunk (None where a chunk's objects are missing)."""

    keys_per_og: list[list[Any]]  # per object group, per chunk: its ObjectKey
    objects: list[dict | None]
    seg_info: list[tuple[str, int, int]] | None  # (kind, offset, nbytes) per segment
    fa_seg: tuple[int, int, int] | None  # (object group, offset, nbytes) of the FA segment


def _host_objects(plan: _CellPlan, sizes: _ObjectSizes, reg: _Registration, ctx: Any, sm: FakeStorageManager,
                  src: geometry.KVCaches, store_key: Any) -> _HostObjects:
    n_og = len(reg.og_kgs_all)
    keys_per_og = ctx.resolve_obj_keys(store_key, list(range(n_og)))
    objects: list[dict | None] = []
    seg_info = None
    fa_seg = None
    for ci in range(len(keys_per_og[0])):
        parts = [(og, sm.objs.get(keys_per_og[og][ci])) for og in range(n_og)]
        if any(obj is None for _, obj in parts):
            objects.append(None)
            continue
        desc, segs, chunk_fa_seg = _chunk_object(plan, sizes, reg, ci, parts, src)
        if chunk_fa_seg is not None:
            fa_seg = chunk_fa_seg
        seg_info = [(s["kind"], s["offset"], s["nbytes"]) for s in segs]
        objects.append(desc)
    return _HostObjects(keys_per_og=keys_per_og, objects=objects, seg_info=seg_info, fa_seg=fa_seg)


def _object_summary(groups: dict[str, dict], ok_objs: list[dict]) -> None:
    """Per kind in ``groups``: its object segment's size, full size, ratio and matching layouts."""
    fa_segs = [s for o in ok_objs for s in o["segments"] if s["kind"] == "fa"]
    gdn_segs = [s for o in ok_objs for s in o["segments"] if s["kind"] == "gdn"]
    for kind, segs in (("fa", fa_segs), ("gdn", gdn_segs)):
        if kind in groups:
            groups[kind]["object_segment_bytes"] = segs[0]["nbytes"] if segs else None
            groups[kind]["object_full_bytes"] = segs[0]["full_nbytes"] if segs else None
            groups[kind]["object_ratio"] = segs[0]["ratio"] if segs else None
            groups[kind]["object_layouts"] = sorted({r for s in segs for r in s["layout_matches"]}) \
                if segs and all(s["layout_matches"] == segs[0]["layout_matches"] for s in segs) else \
                ["inconsistent"] if segs else []


def _copy_report(plan: _CellPlan, sizes: _ObjectSizes, reg: _Registration, sm: FakeStorageManager, host: _HostObjects,
                 recorder: Any, skip_tokens: int) -> dict:
    """The recorded host<->staging copies, per direction, against the objects
    each direction should touch (nested per object group when there are several)."""
    cell, C, k = plan.cell, plan.C, plan.geo.k
    bs = reg.cc.max_batch_size
    descs = []
    for og, og_keys in enumerate(host.keys_per_og):
        obj_desc = []
        for ci, key in enumerate(og_keys):
            obj = sm.objs.get(key)
            batch_end_tok = min((ci // bs + 1) * bs, cell.num_chunks) * C
            in_window = reg.og_window[og] < 1 or ci >= cell.num_chunks - reg.og_window[og]
            obj_desc.append({"ptr": obj.data_ptr if obj else -1,
                             "address": obj.meta.address if obj else -1,
                             "size": obj.get_size() if obj else 0, "copied": obj is not None,
                             "copied_h2d": obj is not None and batch_end_tok > skip_tokens
                             and in_window})
        descs.append(obj_desc)
    fa_seg = host.fa_seg
    page = sizes.full_fa_seg // k if fa_seg else None
    d2h, h2d = {}, {}
    for og, obj_desc in enumerate(descs):
        others = [o for g2, d in enumerate(descs) if g2 != og for o in d if o["size"]]
        og_fa = fa_seg[1:] if fa_seg and fa_seg[0] == og else None
        d2h_og = recorder.analyse("d2h", obj_desc, og_fa, page, k, elsewhere=others)
        h2d_og = recorder.analyse("h2d", [dict(o, copied=o["copied_h2d"]) for o in obj_desc], og_fa,
                                  page, k, elsewhere=others)
        if len(descs) == 1:
            d2h, h2d = d2h_og, h2d_og
        else:
            d2h[f"object_group_{og}"], h2d[f"object_group_{og}"] = d2h_og, h2d_og
    if len(descs) > 1:
        for side in (d2h, h2d):
            per_og = [v for v in side.values() if isinstance(v, dict)]
            side["ok"] = all(v["ok"] for v in per_og)
            side["problems"] = [p for v in per_og for p in v["problems"]]
            fa_side = [v for v in per_og if "fa_per_page_tiling" in v]
            if fa_side:
                side["fa_per_page_tiling"] = fa_side[0]["fa_per_page_tiling"]
    return {"d2h": d2h, "h2d": h2d, "ok": d2h["ok"] and h2d["ok"],
            "paths_seen": sorted({r["path"] for r in recorder.records})}


def _guard_report(plan: _CellPlan, sizes: _ObjectSizes, reg: _Registration, sm: FakeStorageManager,
                  host: _HostObjects, recorder: Any, skip_tokens: int, guards: Any) -> dict[str, Any]:
    g: dict[str, Any] = {"enabled": plan.opts.guards}
    if plan.opts.guards:
        snaps_equal = all(guards.snapshot(sm.objs[key]) == snap for key, snap in sm.snapshots.items())
        g["frozen_meta"] = {"violations": list(guards.VIOLATIONS), "snapshots_equal": snaps_equal,
                            "ok": not guards.VIOLATIONS and snaps_equal}
        g["copies"] = _copy_report(plan, sizes, reg, sm, host, recorder, skip_tokens)
        g["ok"] = g["frozen_meta"]["ok"] and g["copies"]["ok"]
    return g


def _verdict(plan: _CellPlan, result: dict, groups: dict[str, dict], src_mutated: int,
             g: dict[str, Any]) -> dict[str, Any]:
    cell, opts = plan.cell, plan.opts
    reasons = []
    if not result["store_ok"]:
        reasons.append("store failed")
    if not result["retrieve_ok"]:
        reasons.append("retrieve failed")
    for kind, gr in groups.items():
        if gr["fraction"] != 1.0:
            reasons.append(f"{kind}: restored {gr['fraction']:.4f} of requested bytes")
        if gr["slots_restored"] != gr["slots_expected"]:
            reasons.append(f"{kind}: {gr['slots_restored']}/{gr['slots_expected']} expected slots restored")
        if gr["not_restored_slots_wrong_bytes"]:
            reasons.append(f"{kind}: {gr['not_restored_slots_wrong_bytes']} wrong bytes written into slots "
                           "the server does not restore")
        if gr["foreign_bytes"]:
            reasons.append(f"{kind}: {gr['foreign_bytes']} foreign bytes written")
        if gr["skipped_prefix_written_bytes"]:
            reasons.append(f"{kind}: {gr['skipped_prefix_written_bytes']} bytes written into the skipped prefix")
        if gr.get("object_ratio") != 1.0:
            reasons.append(f"{kind}: host object segment is {gr.get('object_ratio')} of full size")
    if src_mutated:
        reasons.append(f"store mutated {src_mutated} source bytes")
    if plan.on_cuda:
        taken = set(result["transfer"]["paths_taken"])
        if taken != {cell.path}:
            reasons.append(f"asked for the {cell.path} path, LMCache took {sorted(taken) or 'none'}")
    if result["host_canary_damage_bytes"]:
        reasons.append(f"{result['host_canary_damage_bytes']} host bytes written outside objects")
    if opts.guards and not g["ok"]:
        reasons.append("guard failure: " + "; ".join(g["frozen_meta"]["violations"][:3] +
                                                      g["copies"]["d2h"]["problems"][:3] +
                                                      g["copies"]["h2d"]["problems"][:3]))
    return {"pass": not reasons, "reasons": reasons}


def _nbytes(shape: Any, dtype: Any) -> int:
    """Bytes of a ``shape`` x ``dtype`` tensor."""
    import torch  # noqa: PLC0415

    return torch.Size(shape).numel() * dtype.itemsize


def run_cell(cell: Cell, opts: Options) -> dict:
    """One cell: plan and build the caches, register them, store and retrieve,
    then analyse the destination, the host objects and the guards (the cell's
    JSON report, ending in its ``verdict``)."""
    from lmcache.utils import EngineType  # noqa: PLC0415
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey  # noqa: PLC0415
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (  # noqa: PLC0415
        LMCacheDrivenTransferModule,
    )

    from gate import harness_guards as guards  # noqa: PLC0415
    from gate.harness_native import native_emulation  # noqa: PLC0415

    on_cuda = opts.device != "cpu"  # "cuda", or "cpu-standin": the same code path on CPU tensors
    if on_cuda:
        from gate import harness_cuda as hc  # noqa: PLC0415
    elif cell.path == "direct":
        raise ValueError("path=direct is the CUDA copy-engine path: it needs --device cuda")
    plan = _plan_cell(cell, opts)
    caches = _build_caches(plan)
    sizes = _object_sizes(plan, caches.src)
    # (room for one object per kernel kind and chunk: a server may separate them)
    sm = FakeStorageManager(cell.num_chunks * (sizes.pool_obj + 2 * (2 * FakeStorageManager.GAP + 256))
                            + 2 * FakeStorageManager.GAP,
                            opts.guards, pinned=plan.tensor_device == "cuda")
    ctx = _fake_server_context(plan.C, sm)
    guards.VIOLATIONS.clear()
    recorder = guards.CopyRecorder()
    result: dict[str, Any] = {"cell": asdict(cell), "name": cell.name, "geometry": plan.geo.to_json(),
                              "C": plan.C, "num_logical_blocks_requested": plan.m,
                              "num_logical_blocks_cache": plan.nb,
                              "ids": {"store": plan.src_ids, "retrieve": plan.dst_ids}}
    stack = contextlib.ExitStack()
    if on_cuda:
        result["device"] = opts.device
        hc.synchronize(plan.tensor_device)  # the caches are written before anything is registered

    mod = LMCacheDrivenTransferModule(ctx)
    try:
        make_handle = stack.enter_context(hc.local_events()) if on_cuda else None
        reg = _register(mod, ctx, plan, sizes, caches, result, EngineType)
        req = _request(plan, reg, IPCCacheServerKey)
        path = _transfer_path(plan, reg.cc, recorder, stack, make_handle, native_emulation)
        store_s, retrieve_s = _store_and_retrieve(mod, plan, req, sm, recorder, path, result)
        src, dst = (hc.to_host(caches.src), hc.to_host(caches.dst)) if on_cuda else (caches.src, caches.dst)

        groups = _restore_groups(plan, sizes, reg, src, dst)
        src_mutated = _mutated_bytes(src.raw, caches.src_before)

        # ---- host objects ----
        host = _host_objects(plan, sizes, reg, ctx, sm, src, req.store_key)
        result["objects"] = host.objects
        ok_objs = [o for o in host.objects if o]
        _object_summary(groups, ok_objs)
        result["groups"] = groups
        result["object_ratio"] = (ok_objs[0]["size"] / sizes.full_obj) if ok_objs else None
        if reg.registry is not None and ok_objs:
            # the registry's descriptor is object group 0's (LMCache's ``layout_desc``)
            reg_size = sum(_nbytes(s, d) for s, d in zip(reg.registry.shapes, reg.registry.dtypes))
            result["registry_object_bytes"] = reg_size if len(reg.og_kgs_all) == 1 else None
            result["registry_object_group0_bytes"] = reg_size
        result["src_mutated_bytes"] = src_mutated
        result["host_canary_damage_bytes"] = sm.canary_damage()

        # ---- guards ----
        g = _guard_report(plan, sizes, reg, sm, host, recorder, req.skip_tokens, guards)
        result["guards"] = g
        result["segments_layout"] = host.seg_info
        fa_bytes = (sizes.full_fa_seg * cell.num_chunks)
        result["timings"] = {"store_s": store_s, "retrieve_s": retrieve_s,
                             "store_retrieve_s": [a + b for a, b in zip(store_s, retrieve_s)],
                             "fa_bytes_per_rep": fa_bytes,
                             "object_bytes_per_rep": sum(o["size"] for o in ok_objs)}

        # ---- dump for out-of-process checks ----
        if opts.dump_dir:
            _dump(Path(opts.dump_dir), cell, plan.geo, src, sm, host.keys_per_og, result)

        result["verdict"] = _verdict(plan, result, groups, src_mutated, g)
    finally:
        mod.close()
        stack.close()
    return result


def _dump(root: Path, cell: Cell, geo, src, sm, keys_per_og, result) -> None:
    """Raw bytes for out-of-process format checks (tests/gate): per chunk the
    objects of every object group, concatenated in object-group order."""
    d = root / cell.name.replace("/", "_")
    d.mkdir(parents=True, exist_ok=True)
    for li, t in enumerate(src.raw):
        (d / f"src_layer{li}.bin").write_bytes(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    for ci in range(len(keys_per_og[0])):
        objs = [sm.objs.get(keys[ci]) for keys in keys_per_og]
        if all(obj is not None for obj in objs):
            (d / f"object{ci}.bin").write_bytes(b"".join(obj.raw_data[:obj.get_size()].numpy().tobytes()
                                                         for obj in objs))
    manifest = {"cell": asdict(cell), "geometry": geo.to_json(), "layer_kinds": list(geo.layer_kinds),
                "num_logical_blocks_cache": result["num_logical_blocks_cache"], "C": result["C"],
                "ids": result["ids"], "segments": result["segments_layout"]}
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    result["dump"] = str(d)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------

def run(cells: list[Cell], opts: Options) -> dict:
    doc: dict[str, Any] = {"harness": "gate/roundtrip.py", "format": 1, "lmcache": _lmcache_info(), "cells": []}
    if opts.device != "cpu":
        from gate import harness_cuda as hc  # noqa: PLC0415

        desc = hc.availability()[1] if opts.device == "cuda" else "CPU tensors through the --device cuda code path"
        doc["device"] = {"type": opts.device, "description": desc, "transfer": hc.native_status()}
    for i, cell in enumerate(cells, 1):
        t0 = time.perf_counter()
        try:
            res = run_cell(cell, opts)
        except Exception as exc:  # a harness error is reported per cell, not hidden
            res = {"cell": asdict(cell), "name": cell.name, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc(), "verdict": {"pass": False, "reasons": ["harness error"]}}
        res["wall_s"] = time.perf_counter() - t0
        doc["cells"].append(res)
        print(progress_line(i, len(cells), res), file=sys.stderr, flush=True)
    doc["summary"] = {
        "cells": len(doc["cells"]),
        "passed": sum(1 for c in doc["cells"] if c["verdict"]["pass"]),
        "errors": sum(1 for c in doc["cells"] if "error" in c),
    }
    return doc


PROGRESS_PREFIX = "roundtrip: "


def progress_line(done: int, total: int, res: dict) -> str:
    """One stderr line per finished cell (``patchtool verify`` shows these live):
    ``roundtrip: [3/7] FAIL <cell>: <reasons> (1.2 s)``."""
    if "error" in res:
        word, why = "ERROR", f": {res['error']}"
    elif res["verdict"]["pass"]:
        word, why = "pass", ""
    else:
        word, why = "FAIL", ": " + "; ".join(res["verdict"]["reasons"])
    line = f"{PROGRESS_PREFIX}[{done}/{total}] {word} {res['name']}{why}"
    return " ".join(line.split()) + f" ({res['wall_s']:.1f} s)"


def _table(doc: dict) -> str:
    lines = [f"lmcache {doc['lmcache']['version']} at {doc['lmcache']['root']}"]
    hdr = (f"{'cell':58} {'FA frac':>8} {'FA foreign':>11} {'FA obj':>7} {'GDN frac':>8} {'GDN slots':>9} "
           f"{'guards':>6} verdict")
    lines.append(hdr)
    for c in doc["cells"]:
        if "error" in c:
            lines.append(f"{c['name']:58} ERROR {c['error']}")
            continue
        fa, gdn = c["groups"].get("fa", {}), c["groups"].get("gdn", {})
        g = c["guards"]
        lines.append(f"{c['name']:58} {fa.get('fraction', float('nan')):8.4f} {fa.get('foreign_bytes', 0):11d} "
                     f"{fa.get('object_ratio') or 0:7.4f} {gdn.get('fraction', float('nan')):8.4f} "
                     f"{(str(gdn['slots_restored']) + '/' + str(gdn['slots_expected'])) if gdn else '-':>9} "
                     f"{('ok' if g.get('ok') else 'FAIL') if g.get('enabled') else '-':>6} "
                     f"{'PASS' if c['verdict']['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prepare: Callable[[], None] | None = None) -> int:
    """The CLI.  ``prepare`` runs after the arguments are checked and before
    any cell: ``gate/roundtrip.py`` passes :func:`ports_compat.install`,
    which adapts the harness to the lmcache it finds (and needs torch, so
    ``--help`` must not reach it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    ap.add_argument("--out", help="also write the JSON report to this file")
    ap.add_argument("--matrix", choices=["fast", "full", "vllm030", "wide"], help="run a predefined matrix of cells")
    ap.add_argument("--cell", action="append", default=[], help="key=value,... (Cell fields); repeatable")
    ap.add_argument("--preset", help="geometry preset NAME[@dtype] for a single cell")
    ap.add_argument("--chunk-blocks", type=int, default=1, help="chunk size in logical blocks (C = n*N)")
    ap.add_argument("--chunks", type=int, default=3, help="chunks per request")
    ap.add_argument("--skip-blocks", type=int, default=0, help="logical blocks skipped at retrieve")
    ap.add_argument("--ids", choices=["scattered", "identity"], default="scattered")
    ap.add_argument("--path", choices=["python", "native", "direct"], default="python",
                    help="python | native (CPU: emulated; CUDA: the compiled plan executor) | direct (CUDA, 0.5.6+)")
    ap.add_argument("--device", choices=["cpu", "cuda", "cpu-standin"], default="cpu",
                    help="cpu (default) | cuda: CUDA tensors through LMCache's real native path | "
                         "cpu-standin: the cuda code path on CPU tensors (tests)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--window-rule", choices=list(geometry.WINDOW_RULES), default="connector",
                    help="EngineGroupInfo window fields: connector (the installed connector's rule, default) | "
                         "none (no window: the harness before the GDN window rule) | end (GDN sw_size_tokens = N)")
    ap.add_argument("--reps", type=int, default=1, help="store+retrieve repetitions per cell (timings)")
    ap.add_argument("--no-guards", action="store_true", help="disable guards (for timing)")
    ap.add_argument("--no-hashes", action="store_true", help="skip per-object sha256")
    ap.add_argument("--dump-dir", help="write source tensors / objects / manifest per cell here")
    ap.add_argument("--inject", choices=["meta-write", "used-size", "address-skew"],
                    help="guard self-test: break the D2H staging on purpose")
    args = ap.parse_args(argv)

    cells: list[Cell] = []
    if args.matrix:
        cells += matrix(args.matrix, args.path)
    cells += [Cell.parse(text, path=args.path, seed=args.seed) for text in args.cell]
    if args.preset or not cells:
        cells.append(Cell(args.preset or "qwen35-0.8b", args.chunk_blocks, args.chunks, args.skip_blocks,
                          ids=args.ids, path=args.path, seed=args.seed))
    if args.device != "cpu":
        from gate import harness_cuda as hc  # noqa: PLC0415

        ok, why = hc.availability() if args.device == "cuda" else (True, "")
        if not ok:
            print(f"roundtrip.py: --device cuda: {why}", file=sys.stderr)
            return 3
        if args.inject:
            print(f"roundtrip.py: --inject: not with --device {args.device} (CPU Python path only)", file=sys.stderr)
            return 3
    elif args.path == "direct" or any(c.path == "direct" for c in cells):
        print("roundtrip.py: --path direct: the copy-engine path needs --device cuda", file=sys.stderr)
        return 3
    opts = Options(guards=not args.no_guards, reps=args.reps, hashes=not args.no_hashes, dump_dir=args.dump_dir,
                   inject=args.inject, device=args.device, window_rule=args.window_rule)

    # Keep stdout clean for the JSON: everything LMCache prints goes to stderr.
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        if prepare is not None:
            prepare()
        doc = run(cells, opts)
    except Exception:
        traceback.print_exc()
        return 2
    text = json.dumps(doc, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        real_stdout.write(text + "\n")
    else:
        real_stdout.write(_table(doc) + "\n")
    real_stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
