"""Client side of the CPU restore gate: vLLM's worker and scheduler, played
through LMCache's own adapter classes, plus the byte-level checks.

What vLLM's ``LMCacheMPConnector`` (lmcache 0.5.3,
``lmcache/integration/vllm/lmcache_mp_connector.py``) does, and what
:class:`Client` mirrors, call for call:

* worker role: ``LMCacheMPWorkerAdapter(server_url, zmq_ctx, model, block_size,
  ParallelStrategy, extra_config)`` then ``register_kv_caches(kv_caches,
  engine_group_infos=...)`` (``register_kv_caches``), ``submit_store_request``
  with an interprocess event recorded after the forward (``wait_for_save``),
  ``submit_retrieve_request`` (``start_load_kv``), ``get_finished``,
  ``get_block_ids_with_load_errors``, ``shutdown``;
* scheduler role: ``LMCacheMPSchedulerAdapter`` with
  ``maybe_submit_lookup_request`` + ``check_lookup_result``
  (``get_num_new_matched_tokens``: LOOKUP, i.e. prefetch into L1, then
  QUERY_PREFETCH_STATUS), ``cleanup_lookup_result``
  (``update_state_after_alloc``), ``end_session`` (``request_finished``);
  block ids per engine group are cut with LMCache's own
  ``slice_block_ids_per_group`` (``GetStoreMetadata``/``GetRetrieveMetadata``).

The transfer mode is ``lmcache_driven`` unless ``transfer_mode`` says otherwise
(the restore gate's ``--transfer-mode``; on CPU ``engine_driven`` and ``auto``
both give the worker-side gather/scatter path, docs/design/engine-driven.md).
lmcache-driven: on CPU the KV tensors are
migrated into POSIX shared memory at registration and the server maps the same
pages, as with CUDA IPC on a GPU.  Registration re-points each tensor's storage
at a fresh (zeroed) segment, so contents are written only AFTER registering.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from gate import geometry, token_form
from lmcache import torch_dev
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)
from lmcache.v1.multiprocess.group_view import EngineGroupInfo, slice_block_ids_per_group

POISON = 0xA5  # retrieve destinations before the retrieve
BACKGROUND = 0x3C  # every block of a source cache that is not stored


def layer_names(geo: geometry.Geometry) -> list[str]:
    return [f"model.layers.{i}.linear_attn" if kind == "gdn" else f"model.layers.{i}.self_attn.attn"
            for i, kind in enumerate(geo.layer_kinds)]


def block_rows(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``(num_blocks, block_bytes)`` uint8 view of a registered tensor.

    Logical block ``L`` of a sub-paged FA layer is kernel pages ``L*k..L*k+k-1``,
    contiguous in memory, so row ``L`` is exactly that logical block.  Use the
    registered tensors: ``KVCaches.raw`` of a GDN layer is a separate view that
    still points at the pre-registration memory.

    A view with a padded block stride (vLLM 0.30+'s GDN state: dim 0 steps
    over the padded page, the rest of a block is packed) has no flat view;
    its rows are each block's packed bytes, still a view of the memory (what
    the transfer moves; the padding after them is not part of any row).
    """
    if tensor.is_contiguous():
        return tensor.reshape(-1).view(torch.uint8).view(num_blocks, -1)
    rows = tensor.flatten(1)
    if rows.data_ptr() != tensor.data_ptr() or rows.stride(1) != 1 or rows.shape[0] != num_blocks:
        raise ValueError(f"registered tensor {tuple(tensor.shape)} / {tuple(tensor.stride())}: "
                         "not a block-strided view with packed blocks")
    return rows.view(torch.uint8)


@dataclass
class Layout:
    """Which engine group owns each layer, and the groups' block-id lists."""

    geo: geometry.Geometry
    infos: list[dict[str, Any]]
    group_of_layer: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.group_of_layer = [0] * len(self.geo.layer_kinds)
        for info in self.infos:
            for layer in info["layer_indices"]:
                self.group_of_layer[layer] = info["engine_group_id"]

    @property
    def num_groups(self) -> int:
        return len(self.infos)

    def engine_group_infos(self) -> list[EngineGroupInfo]:
        """What the connector registers, window fields included (``sw_size_tokens``,
        ``recurrent_state`` where the installed ``EngineGroupInfo`` has them)."""
        return geometry.make_engine_group_infos(self.infos)

    def kept_positions(self, layer: int, blocks_per_chunk: int, positions) -> list[int]:
        """Block positions of ``layer``'s group that the server stores and restores
        (all for FA; the chunk-end slot for 0.5.4+'s windowed GDN group)."""
        info = next(i for i in self.infos if i["engine_group_id"] == self.group_of_layer[layer])
        return geometry.kept_positions(info, blocks_per_chunk, positions)

    def op_block_ids(self, ids: list[list[int]], start: int, end: int) -> list[list[int]]:
        """What the scheduler puts in a ``LoadStoreOp`` for tokens ``[start, end)``."""
        return slice_block_ids_per_group({g: ids[g] for g in range(self.num_groups)},
                                         [self.geo.tokens_per_block] * self.num_groups, start, end)


class Client:
    """One vLLM instance (TP=1): a scheduler adapter and a worker adapter."""

    def __init__(self, url: str, model: str, layout: Layout, *, mq_timeout: float,
                 heartbeat_interval: float | None = None, transfer_mode: str = "lmcache_driven") -> None:
        self.url, self.model, self.layout = url, model, layout
        extra: dict[str, Any] = {"lmcache.mp.mq_timeout": mq_timeout,
                                 "lmcache.mp.mp_transfer_mode": transfer_mode}
        if heartbeat_interval is not None:
            extra["lmcache.mp.heartbeat_interval"] = heartbeat_interval
        self.extra_config = extra
        self.zmq_ctx = zmq.Context()
        strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1,
                                    pp_size=1, n_servers=1)
        block = layout.geo.tokens_per_block
        self.scheduler = LMCacheMPSchedulerAdapter(server_urls=[url], context=self.zmq_ctx, model_name=model,
                                                   vllm_block_size=block, parallel_strategy=strategy,
                                                   extra_config=extra)
        self.worker = LMCacheMPWorkerAdapter(server_url=url, context=self.zmq_ctx, model_name=model,
                                             vllm_block_size=block, parallel_strategy=strategy,
                                             extra_config=extra)
        self.chunk_size = self.worker.lmcache_tokens_per_chunk
        self.caches: geometry.KVCaches | None = None
        self._closed = False

    @property
    def instance_id(self) -> int:
        return self.worker.instance_id

    # -- registration ------------------------------------------------------
    def register(self, caches: geometry.KVCaches) -> None:
        names = layer_names(caches.geometry)
        self.caches = caches
        self.worker.register_kv_caches(dict(zip(names, caches.tensors)),
                                       engine_group_infos=self.layout.engine_group_infos())

    def rows(self, layer: int) -> torch.Tensor:
        assert self.caches is not None
        return block_rows(self.caches.tensors[layer], self.caches.num_logical_blocks)

    # -- scheduler side ----------------------------------------------------
    def lookup(self, request_id: str, token_ids: list[int], timeout: float) -> int:
        """LOOKUP (the server prefetches into L1) and poll until the hit count is final."""
        if token_form.packs_tokens(LoadStoreOp):  # 0.5.7+: the adapter takes the packed form
            self.scheduler.maybe_submit_lookup_request(request_id, packed_token_ids=token_form.pack(token_ids))
        else:
            self.scheduler.maybe_submit_lookup_request(request_id, token_ids)
        deadline = time.monotonic() + timeout
        while True:
            hit = self.scheduler.check_lookup_result(request_id)
            if hit is not None:
                return int(hit)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"lookup {request_id}: no result after {timeout:.0f} s")
            time.sleep(0.01)

    def finish_request(self, request_id: str) -> None:
        """update_state_after_alloc's cleanup, then request_finished's END_SESSION."""
        self.scheduler.cleanup_lookup_result(request_id)
        self.scheduler.end_session(request_id)

    # -- worker side -------------------------------------------------------
    def store(self, request_id: str, token_ids: list[int], ids: list[list[int]], end: int,
              timeout: float, *, start: int = 0, op_block_ids: list[list[int]] | None = None) -> bool:
        """STORE tokens ``[start, end)``; ``op_block_ids`` overrides the op's
        block lists (what a connector sends after rewriting vLLM's)."""
        block_ids = op_block_ids if op_block_ids is not None else self.layout.op_block_ids(ids, start, end)
        op = LoadStoreOp(**token_form.token_fields(LoadStoreOp, token_ids), block_ids=block_ids, start=start, end=end)
        event = torch_dev.Event(interprocess=True)
        event.record()
        self.worker.submit_store_request(request_id, op, event)
        fut = self.worker.store_futures.get(request_id)
        if fut is None:
            return False  # dropped by the adapter (unhealthy or not a KV writer)
        ok = bool(fut.result(timeout=timeout))
        self.worker.get_finished({request_id})
        return ok

    def retrieve(self, request_id: str, token_ids: list[int], ids: list[list[int]], end: int,
                 timeout: float) -> tuple[bool, str]:
        op = LoadStoreOp(**token_form.token_fields(LoadStoreOp, token_ids), block_ids=self.layout.op_block_ids(ids, 0, end), start=0, end=end,
                         skip_first_n_tokens=0)
        event = torch_dev.Event(interprocess=True)
        event.record()
        self.worker.submit_retrieve_request(request_id, op, event)
        entry = self.worker.retrieve_futures.get(request_id)
        if entry is None:
            self.worker.get_finished(set())
            return False, "dropped by the worker adapter (server marked unhealthy)"
        ok = bool(entry[0].result(timeout=timeout))
        self.worker.get_finished(set())
        errors = self.worker.get_block_ids_with_load_errors()
        if errors:
            return False, f"load errors on {len(errors)} block ids"
        return ok, "ok" if ok else "server answered retrieve=False"

    def close(self, graceful: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if graceful:
                self.worker.shutdown()  # stops the heartbeat, UNREGISTER_KV_CACHE
            else:
                hb = getattr(self.worker, "_heartbeat", None)
                if hb is not None:
                    hb.stop()
                self.worker.mq_client.close()
        finally:
            try:
                self.scheduler.shutdown()
            finally:
                self.zmq_ctx.destroy(linger=0)


# ---------------------------------------------------------------------------
# Cache contents and checks
# ---------------------------------------------------------------------------


def choose_block_ids(num_groups: int, per_group: int, num_blocks: int, seed: int,
                     differ_from: list[list[int]] | None = None) -> list[list[int]]:
    """Distinct, unsorted logical ids per engine group from one pool (id 0 is
    vLLM's null block and never handed out), as vLLM's shared BlockPool does.
    With ``differ_from`` every position gets a different id than there."""
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    pool = list(range(1, num_blocks))
    if num_groups * per_group > len(pool):
        raise ValueError("not enough blocks for the requested ids")
    for _ in range(10_000):
        rng.shuffle(pool)
        ids = [pool[g * per_group:(g + 1) * per_group] for g in range(num_groups)]
        if differ_from is None or all(a != b for g in range(num_groups) for a, b in zip(ids[g], differ_from[g])):
            return ids
    raise RuntimeError("could not choose differing block ids")


def disjoint_store_and_restore_ids(num_groups: int, per_group: int, seed: int
                                   ) -> tuple[int, list[list[int]], list[list[int]]]:
    """A pool just large enough, the ids a probe stores from, and other ids
    (none of the stored ones) it restores into: ``(num_blocks, src, dst)``."""
    import random  # noqa: PLC0415

    num_blocks = 1 + 2 * num_groups * per_group + 2
    src = choose_block_ids(num_groups, per_group, num_blocks, seed)
    used = {b for ids in src for b in ids}
    pool = [b for b in range(1, num_blocks) if b not in used]
    random.Random(seed + 1).shuffle(pool)
    return num_blocks, src, [pool[g * per_group:(g + 1) * per_group] for g in range(num_groups)]


def fill_source(client: Client, ids: list[list[int]], seed: int) -> dict[tuple[int, int], torch.Tensor]:
    """Background everywhere, deterministic random bytes in the blocks to store.

    Returns the expected bytes: ``{(layer, position): block}`` (clones)."""
    import random  # noqa: PLC0415

    assert client.caches is not None
    rng = random.Random(seed)
    expected: dict[tuple[int, int], torch.Tensor] = {}
    for layer in range(len(client.caches.tensors)):
        rows = client.rows(layer)
        rows.fill_(BACKGROUND)
        for pos, block in enumerate(ids[client.layout.group_of_layer[layer]]):
            data = torch.frombuffer(bytearray(rng.randbytes(rows.shape[1])), dtype=torch.uint8)
            rows[block].copy_(data)
            expected[(layer, pos)] = data
    return expected


def poison(client: Client, blocks_per_layer: dict[int, list[int]] | None = None) -> None:
    """Fill whole caches (or just some blocks) with the poison byte."""
    assert client.caches is not None
    for layer in range(len(client.caches.tensors)):
        rows = client.rows(layer)
        if blocks_per_layer is None:
            rows.fill_(POISON)
        else:
            for block in blocks_per_layer.get(layer, []):
                rows[block].fill_(POISON)


_LIBC: Any = None


def _memcmp_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality of two contiguous uint8 tensors via libc ``memcmp``
    (an order of magnitude faster than an element-wise torch compare here)."""
    global _LIBC
    if a.numel() != b.numel():
        return False
    if _LIBC is None:
        import ctypes  # noqa: PLC0415
        import ctypes.util  # noqa: PLC0415

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        libc.memcmp.restype = ctypes.c_int
        _LIBC = libc
    assert a.is_contiguous() and b.is_contiguous()
    return _LIBC.memcmp(a.data_ptr(), b.data_ptr(), a.numel()) == 0


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of differing bytes (0 fast when equal)."""
    if _memcmp_equal(a, b):
        return 0
    return int(torch.count_nonzero(a != b))


def check_restore(client: Client, dst_ids: list[list[int]], expected: dict[tuple[int, int], torch.Tensor],
                  *, chunks: int, blocks_per_chunk: int, restored_chunks: int, untouched: int,
                  max_listed: int = 12, state_window_chunks: int | None = None) -> dict[str, Any]:
    """Compare a retrieve destination byte for byte.

    ``state_window_chunks``: with a server that keeps the GDN state as its own
    windowed object group, only the last that many restored chunks get their
    state back (None: every restored chunk, merged objects; default: asked of
    the installed lmcache, :func:`geometry.server_separates_state_groups`).

    * positions of the first ``restored_chunks`` chunks must equal ``expected``;
    * positions of later chunks and every block that is not a destination of
      the layer's group must still hold ``untouched`` (else: a foreign write).
    """
    assert client.caches is not None
    geo, layout = client.caches.geometry, client.layout
    k = geo.k
    if state_window_chunks is None and geometry.server_separates_state_groups():
        state_window_chunks = 1
    per_chunk = [{"chunk": c, "restored": c < restored_chunks,
                  "fa_pages_exact": 0, "fa_pages": 0, "fa_bytes_equal": 0, "fa_bytes": 0,
                  "gdn_blocks_exact": 0, "gdn_blocks": 0, "gdn_bytes_equal": 0, "gdn_bytes": 0,
                  "gdn_blocks_not_restored_by_design": 0}
                 for c in range(chunks)]
    foreign = {"bytes": 0, "blocks": 0, "where": []}
    constant: dict[int, torch.Tensor] = {}

    def note_foreign(layer: int, block: int, nbytes: int, why: str) -> None:
        foreign["bytes"] += nbytes
        foreign["blocks"] += 1
        if len(foreign["where"]) < max_listed:
            foreign["where"].append({"layer": layer, "kind": geo.layer_kinds[layer], "block": block,
                                     "bytes_changed": nbytes, "why": why})

    for layer, kind in enumerate(geo.layer_kinds):
        rows = client.rows(layer)
        size = rows.shape[1]
        if size not in constant:
            constant[size] = torch.full((size,), untouched, dtype=torch.uint8)
        blank = constant[size]
        g = layout.group_of_layer[layer]
        dsts = dst_ids[g]
        kept = set(layout.kept_positions(layer, blocks_per_chunk, range(len(dsts))))
        for pos, block in enumerate(dsts):
            c = pos // blocks_per_chunk
            got = rows[block]
            stats = per_chunk[c]
            if c >= restored_chunks:
                n = _mismatches(got, blank)
                if n:
                    note_foreign(layer, block, n, f"destination of chunk {c}, which was not restored")
                continue
            want = expected[(layer, pos)]
            in_state_window = state_window_chunks is None or c >= restored_chunks - state_window_chunks
            if pos not in kept or (kind == "gdn" and not in_state_window):
                # A windowed group (0.5.4+ GDN: only the chunk-end slot is stored),
                # or a state group restored for its last chunk only (part 06):
                # the server does not restore this slot.  Untouched is right; the
                # true bytes are harmless; anything else is a wrong write.
                if kind != "gdn":
                    raise RuntimeError(f"layer {layer} ({kind}) declared a window: {layout.infos}")
                stats["gdn_blocks_not_restored_by_design"] += 1
                n = _mismatches(got, blank)
                if n and _mismatches(got, want):
                    note_foreign(layer, block, n, f"slot of chunk {c} the server does not restore, written")
                continue
            n = _mismatches(got, want)
            if kind == "fa":
                page = size // k
                exact = k if n == 0 else sum(_memcmp_equal(got[j * page:(j + 1) * page], want[j * page:(j + 1) * page])
                                             for j in range(k))
                stats["fa_pages"] += k
                stats["fa_pages_exact"] += exact
                stats["fa_bytes"] += size
                stats["fa_bytes_equal"] += size - n
            else:
                stats["gdn_blocks"] += 1
                stats["gdn_blocks_exact"] += int(n == 0)
                stats["gdn_bytes"] += size
                stats["gdn_bytes_equal"] += size - n
        dst_set = set(dsts)
        for block in range(rows.shape[0]):
            if block in dst_set:
                continue
            n = _mismatches(rows[block], blank)
            if n:
                note_foreign(layer, block, n, "not a destination block" + (" (vLLM's null block)" if block == 0 else ""))

    def fidelity(kind: str, unit: str) -> dict[str, Any]:
        exact = sum(s[f"{kind}_{unit}_exact"] for s in per_chunk if s["restored"])
        total = sum(s[f"{kind}_{unit}"] for s in per_chunk if s["restored"])
        beq = sum(s[f"{kind}_bytes_equal"] for s in per_chunk if s["restored"])
        btot = sum(s[f"{kind}_bytes"] for s in per_chunk if s["restored"])
        out = {f"{unit}_exact": exact, f"{unit}_total": total,
                f"{unit}_fraction": (exact / total) if total else None,
                "bytes_equal": beq, "bytes_total": btot, "byte_fraction": (beq / btot) if btot else None}
        if kind == "gdn":
            out["blocks_not_restored_by_design"] = sum(s["gdn_blocks_not_restored_by_design"]
                                                       for s in per_chunk if s["restored"])
        return out

    for s in per_chunk:
        s["fa_exact"] = s["restored"] and s["fa_pages_exact"] == s["fa_pages"]
        s["gdn_exact"] = s["restored"] and s["gdn_blocks_exact"] == s["gdn_blocks"]
        s["exact"] = s["fa_exact"] and s["gdn_exact"]
    return {
        "per_chunk": per_chunk,
        "chunks_exact": sum(1 for s in per_chunk if s["exact"]),
        "fa": fidelity("fa", "pages") if geo.num_fa_layers else None,
        "gdn": fidelity("gdn", "blocks") if geo.num_gdn_layers else None,
        "foreign_writes": foreign,
    }
