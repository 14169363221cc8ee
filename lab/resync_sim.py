#!/usr/bin/env python3
"""Drive LMCache's scheduler-side connector with vLLM's REAL block
management (0.27.1, or the layer's vLLM) and compare block ids after every step.

Run in the vLLM test env (``lab/provision_vllm.py``) with
``PYTHONPATH=<lmcache overlay>:<vllm target>``; the overlay decides whether
pristine or patched lmcache is exercised.  Only the GPU and the LMCache
server are fake: blocks come from vLLM's ``KVCacheManager`` (``BlockPool`` +
``HybridKVCacheCoordinator`` + ``MambaManager`` in ``align`` mode with
speculative blocks + ``FullAttentionManager``), and the connector is
``LMCacheMPConnector`` built through its own ``__init__`` (scheduler role).

The scheduling loop mirrors ``vllm.v1.core.sched.scheduler.Scheduler``
(0.27.1) for what matters to block ids: running requests first, then waiting
ones; ``allocate_slots`` with lookahead; ``update_state_after_alloc`` with
``get_blocks``; ``NewRequestData``/``CachedRequestData`` as the scheduler
builds them; ``_update_after_schedule``; draft rejection rolling back
``num_computed_tokens``; preemption; ``_connector_finished`` on finish.
It is synchronous scheduling (no async placeholders), prefill chunks are one
Mamba block (what LMCache's ``validate_mamba_step_alignment`` enforces), and
blocks of finished requests are freed at once (no delayed free).

Output (``--out``, JSON): per step, the divergences between each tracker's lists
and ``kv_cache_manager.get_block_ids(req)``, and every STORE LMCache planned
with what vLLM's lists say about its slots at that moment.

The vLLM version is the layer's (``lab/provision_vllm.py --vllm X``); the
block management and ``SchedulerOutput`` are that version's own.  On vLLM
0.30+ the ``SchedulerOutput`` also carries ``kv_connector_block_state``, built
here exactly as ``Scheduler.schedule`` builds it (scheduled requests plus
boundary-state hand-offs, ids resolved on access through
``KVCacheManager.get_block_ids``), and the connector is bound with
``bind_kv_cache_manager`` as the Scheduler does.  The scheduling loop stays
0.27.1's (see above).

Part 08 of the hybrid-fa series (0.30+: the connector takes its lists from
that block state) is observed through the connector's ``_resync``: per
scenario, ``resync.source_steps`` (steps that used vLLM's block state vs the
reconstruction) and, with ``--check``
(``LMCACHE_PATCHTOOL_RESYNC_CHECK=count``), ``resync.agreement``: the part-03
reconstruction run alongside and compared with vLLM's lists for every
scheduled request.

Faults, to show the tests can fail and that part 08 refuses what it cannot
trust (a batch scenario ``NAME@FAULT`` runs ``NAME`` with one fault; ``--break
KIND`` breaks every scenario):

* ``break-reconstruction``: the connector's running-delta update appends
  without the align move rule (as pristine does);
* ``break-block-state``: the connector reads vLLM's block state one step
  late (each request's lists as resolved at its previous step);
* ``vllm-missing-request``: vLLM's block state leaves request A out;
* ``vllm-group-count``: vLLM's block state has one list fewer than the groups;
* ``vllm-no-state``: ``kv_connector_block_state`` is None on a 0.30+ vLLM.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import types
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched import output as sched_output
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus

import lmcache.integration.vllm.lmcache_mp_connector as mpc
from gate import geometry
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole


# Whether the installed lmcache is the series with part 06: its connector sends
# a Mamba slot as null when no state may be stored for it, and its server
# (same install) keeps a hybrid's groups in separate objects and skips an
# all-null state chunk.  Pristine builds and the series without 06 store the
# null block's bytes as the state of such a chunk (merged objects).
SERVER_SKIPS_NULL_STATE = geometry.server_separates_state_groups()

# vLLM 0.30+: SchedulerOutput.kv_connector_block_state (the Scheduler fills it
# whenever a connector is configured; no opt-in).
VLLM_HAS_BLOCK_STATE = "kv_connector_block_state" in getattr(
    SchedulerOutput, "__dataclass_fields__", {})
CHECK_ENV = "LMCACHE_PATCHTOOL_RESYNC_CHECK"  # read by part 08 at construction
BREAKS = ("reconstruction", "block-state")
VLLM_FAULTS = ("vllm-missing-request", "vllm-group-count", "vllm-no-state")
FAULTS = tuple(f"break-{b}" for b in BREAKS) + VLLM_FAULTS
_FAULT: dict[str, str | None] = {"vllm": None}  # set by run_scenario, read by Sim


def _vllm_version() -> str:
    try:
        from importlib.metadata import version
        return version("vllm")
    except Exception:  # noqa: BLE001
        return "unknown"


def inject_break(kind: str):
    """Fault injection for the tests (``--break``): returns a function that
    undoes it, or None if the installed connector lacks the code path."""
    if kind == "reconstruction":
        tracker = mpc.LMCacheMPRequestTracker
        original = tracker.__dict__.get("apply_block_id_delta")
        if original is None:
            return None

        def append_only(self, new_block_ids, null_block_id):  # noqa: ARG001
            for g, ids in enumerate(new_block_ids):
                if ids:
                    self.allocated_block_ids.setdefault(g, []).extend(ids)

        tracker.apply_block_id_delta = append_only
        return lambda: setattr(tracker, "apply_block_id_delta", original)
    if kind == "block-state":
        resync = getattr(mpc, "_BlockIdResync", None)
        original = getattr(resync, "resync_block_state", None)
        if original is None:
            return None

        previous: dict[str, tuple] = {}

        def one_step_late(self, scheduler_output, get_tracker, trackers):
            state = scheduler_output.kv_connector_block_state
            if state is not None:
                resolve = state.resolve_block_ids

                def stale(rid):
                    now = tuple(list(ids) for ids in resolve(rid))
                    return previous.get(rid, now), previous.__setitem__(rid, now)

                scheduler_output = copy.copy(scheduler_output)
                scheduler_output.kv_connector_block_state = dataclasses.replace(
                    state, resolve_block_ids=lambda rid: stale(rid)[0])
            return original(self, scheduler_output, get_tracker, trackers)

        resync.resync_block_state = one_step_late
        return lambda: setattr(resync, "resync_block_state", original)
    raise ValueError(kind)


class FakeSchedulerAdapter:
    """Stands in for the ZMQ client to the LMCache server: no hits."""

    def __init__(self, *, lmcache_tokens_per_chunk: int, **_: Any):
        self.lmcache_tokens_per_chunk = lmcache_tokens_per_chunk

    def maybe_submit_lookup_request(self, *a, **k): ...
    def check_lookup_result(self, request_id):  # noqa: ARG002
        return 0
    def cleanup_lookup_result(self, *a, **k): ...
    def free_lookup_locks(self, *a, **k): ...
    def report_block_allocations(self, *a, **k): ...
    def end_session(self, *a, **k): ...
    def shutdown(self): ...


def make_connector(kv_cache_config, block_size: int, num_spec: int, chunk: int,
                   groups_kind: str, dcp: int = 1):
    mpc.LMCacheMPSchedulerAdapter = lambda **kw: FakeSchedulerAdapter(  # type: ignore[assignment]
        lmcache_tokens_per_chunk=chunk, **kw)
    # Keys only later versions read (0.5.3 ignores both): 0.5.6 stores only
    # prompt chunks unless save_decode_cache is set; the decode-phase stores
    # are the ones the resync must guard, so they stay on in every version.
    extra: dict[str, Any] = {"lmcache.mp.save_decode_cache": True}
    ktc = types.SimpleNamespace(
        kv_connector_extra_config=extra,
        get_from_extra_config=lambda key, default: extra.get(key, default),
        is_kv_producer=True,  # 0.5.6: only producers store
    )
    vllm_config = types.SimpleNamespace(
        kv_transfer_config=ktc,
        # decode_context_parallel_size: read from 0.5.5 on (getattr, default 1);
        # dcp ranks are tensor-parallel ranks, so world/tp grow with it.
        parallel_config=types.SimpleNamespace(
            world_size=dcp, rank=0, tensor_parallel_size=dcp, pipeline_parallel_size=1,
            data_parallel_size=1, decode_context_parallel_size=dcp),
        model_config=types.SimpleNamespace(model="sim", use_mla=False,
                                           is_hybrid=groups_kind == "hybrid"),
        cache_config=types.SimpleNamespace(
            block_size=block_size,
            mamba_cache_mode="align" if groups_kind == "hybrid" else "none"),
        # LMCache requires block_size <= max_num_batched_tokens < 2*block_size
        # for align mode; the loop below schedules prefill in such chunks.
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=block_size),
        speculative_config=(types.SimpleNamespace(num_speculative_tokens=num_spec)
                            if num_spec else None),
    )
    return mpc.LMCacheMPConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


class Sim:
    def __init__(self, *, block_size: int, num_spec: int, chunk: int, num_blocks: int,
                 groups_kind: str = "hybrid", bind_pool: bool = True, dcp: int = 1):
        init_none_hash(sha256)
        self.L, self.S, self.C = block_size, num_spec, chunk
        fa = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                               dtype=torch.float16)
        groups = [KVCacheGroupSpec(["attn0"], fa)]
        if groups_kind == "hybrid":
            mb = MambaSpec(block_size=block_size, shapes=((16,),), dtypes=(torch.float16,),
                           mamba_cache_mode="align", num_speculative_blocks=num_spec)
            # Qwen3.5-like: Mamba groups first, one attention group; all share
            # one BlockPool, so a freed Mamba id can come back in any group.
            groups = [KVCacheGroupSpec(["ssm0"], mb), KVCacheGroupSpec(["ssm1"], mb)] + groups
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=groups)
        self.G = len(groups)
        self.mamba_groups = [i for i, g in enumerate(groups)
                             if isinstance(g.kv_cache_spec, MambaSpec)]
        self.mgr = KVCacheManager(self.kv_cache_config, max_model_len=4096,
                                  scheduler_block_size=block_size, hash_block_size=block_size,
                                  enable_caching=True, use_eagle=False)
        self.conn = make_connector(self.kv_cache_config, block_size, num_spec, chunk,
                                   groups_kind, dcp=dcp)
        if bind_pool:
            if hasattr(self.conn, "bind_kv_cache_manager"):
                # vLLM 0.30+: what Scheduler.__init__ calls (the base class
                # binds the pool through bind_gpu_block_pool).
                self.conn.bind_kv_cache_manager(self.mgr)
            else:
                self.conn.bind_gpu_block_pool(self.mgr.block_pool)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.max_tokens: dict[str, int] = {}
        self.step_no = 0
        self.log: list[dict] = []
        self._token = 50_000
        self.finished_ids: set[str] = set()
        self.vllm_fault: str | None = _FAULT["vllm"]  # one of VLLM_FAULTS (tests)

    # ---- requests -------------------------------------------------------
    def add(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        base = 1000 * (len(self.requests) + 1)  # distinct prompts: no cross hits
        req = Request(rid, list(range(base, base + prompt_len)),
                      SamplingParams(max_tokens=max_tokens), None,
                      block_hasher=self.hasher)
        self.requests[rid] = req
        self.max_tokens[rid] = max_tokens
        self.waiting.append(req)

    def _chunk_len(self, req: Request, num_new: int) -> int:
        # Scheduler._mamba_block_aligned_split: prefill chunks end on block
        # boundaries (one block per step, as LMCache's validation requires).
        start = req.num_computed_tokens
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if start >= prefill_end:
            return num_new
        return min(num_new, self.L - start % self.L, prefill_end - start)

    # ---- one scheduler step -----------------------------------------------
    def step(self, accept: dict[str, int] | None = None,
             preempt: tuple[str, ...] = ()) -> dict:
        accept = accept or {}
        self.step_no += 1
        self.mgr.new_step_starts()
        events: list[str] = []
        preempted: set[str] = set()
        for rid in preempt:  # what Scheduler._preempt_request does
            req = self.requests[rid]
            self.running.remove(req)
            self.mgr.free(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.spec_token_ids = []
            req.num_preemptions += 1
            self.waiting.insert(0, req)
            preempted.add(rid)
            events.append(f"preempt {rid}")

        sched_running: list[Request] = []
        sched_new: list[Request] = []
        sched_resumed: list[Request] = []
        new_blocks: dict[str, Any] = {}
        num_sched: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        for req in list(self.running):
            num_new = req.num_tokens_with_spec - req.num_computed_tokens
            num_new = self._chunk_len(req, num_new)
            blocks = self.mgr.allocate_slots(req, num_new, num_lookahead_tokens=self.S)
            assert blocks is not None, f"pool too small at step {self.step_no}"
            sched_running.append(req)
            new_blocks[req.request_id] = blocks
            num_sched[req.request_id] = num_new
            if req.spec_token_ids:
                n_spec = num_new + req.num_computed_tokens - req.num_tokens
                if n_spec > 0:
                    spec[req.request_id] = req.spec_token_ids[:n_spec]
                req.spec_token_ids = []
        for req in list(self.waiting):
            if req.request_id in preempted:
                continue  # not in the same step it was preempted
            comp_blocks, num_local, *_ = self.mgr.get_computed_blocks(req)
            ext, load_async = self.conn.get_num_new_matched_tokens(req, num_local)
            assert not ext and not load_async
            req.num_computed_tokens = num_local
            num_new = self._chunk_len(req, req.num_tokens - num_local)
            blocks = self.mgr.allocate_slots(req, num_new, num_new_computed_tokens=num_local,
                                             new_computed_blocks=comp_blocks,
                                             num_lookahead_tokens=self.S)
            assert blocks is not None, f"pool too small at step {self.step_no}"
            self.conn.update_state_after_alloc(req, self.mgr.get_blocks(req.request_id), 0)
            self.waiting.remove(req)
            self.running.append(req)
            (sched_new if req.status == RequestStatus.WAITING else sched_resumed).append(req)
            events.append(("admit " if req.status == RequestStatus.WAITING else "resume ")
                          + f"{req.request_id} (prefix hit {num_local})")
            req.status = RequestStatus.RUNNING
            new_blocks[req.request_id] = self.mgr.get_blocks(req.request_id)
            num_sched[req.request_id] = num_new

        # SchedulerOutput exactly as Scheduler.schedule (MRV1) fills it.
        new_reqs = [NewRequestData.from_request(r, new_blocks[r.request_id].get_block_ids())
                    for r in sched_new]
        chain = sched_running + sched_resumed
        cached = CachedRequestData(
            req_ids=[r.request_id for r in chain],
            resumed_req_ids={r.request_id for r in sched_resumed},
            new_token_ids=[], all_token_ids={},
            new_block_ids=[new_blocks[r.request_id].get_block_ids(allow_none=True)
                           for r in chain],
            num_computed_tokens=[r.num_computed_tokens for r in chain],
            num_output_tokens=[r.num_output_tokens for r in chain],
        )
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched, total_num_scheduled_tokens=sum(num_sched.values()),
            scheduled_spec_decode_tokens=spec, scheduled_encoder_inputs={},
            num_common_prefix_blocks=[0] * self.G, finished_req_ids=set(self.finished_ids),
            free_encoder_mm_hashes=[], preempted_req_ids=preempted)
        self.finished_ids = set()
        if VLLM_HAS_BLOCK_STATE:
            # Scheduler.schedule (0.30+): scheduled requests plus those with a
            # boundary-state hand-off; ids resolved when the connector asks.
            offloads = self.mgr.take_boundary_state_offloads()
            ids = set(num_sched)
            ids.update(rid for rid in offloads if rid in self.requests
                       and not self.requests[rid].is_finished())
            resolve = self.mgr.get_block_ids
            if self.vllm_fault == "vllm-missing-request":
                ids.discard("A")
            elif self.vllm_fault == "vllm-group-count":
                resolve = lambda rid: self.mgr.get_block_ids(rid)[:-1]  # noqa: E731
            out.kv_connector_block_state = sched_output.KVConnectorBlockState(
                req_ids=ids, resolve_block_ids=resolve,
                boundary_state_offloads=offloads)
            if self.vllm_fault == "vllm-no-state":
                out.kv_connector_block_state = None
        meta = self.conn.build_connector_meta(out)
        if VLLM_HAS_BLOCK_STATE:
            out.kv_connector_block_state = None  # as the Scheduler does
        record = self._check(meta, events, spec)

        # _update_after_schedule, then the model "runs" and update_from_output.
        for rid, n in num_sched.items():
            self.requests[rid].num_computed_tokens += n
        for rid, n in num_sched.items():
            req = self.requests[rid]
            if req.num_computed_tokens < req.num_tokens:
                continue  # mid-prefill chunk: nothing sampled
            drafts = spec.get(rid, [])
            ok = min(accept.get(rid, 0), len(drafts))
            req.num_computed_tokens -= len(drafts) - ok  # rejected drafts roll back
            if drafts:
                events.append(f"{rid}: {ok}/{len(drafts)} drafts accepted")
            for _ in range(ok + 1):
                self._token += 1
                req.append_output_token_ids(self._token)
            if req.num_output_tokens >= self.max_tokens[rid]:
                self._finish(req)
                events.append(f"finish {rid}")
            elif self.S:
                req.spec_token_ids = [self._token + 1 + i for i in range(self.S)]
        return record

    def _finish(self, req: Request) -> None:
        # Scheduler._connector_finished, then the blocks are freed.
        rid = req.request_id
        self.mgr.remove_skipped_blocks(rid, req.num_computed_tokens,
                                       num_prompt_tokens=req.num_prompt_tokens)
        block_ids = self.mgr.get_block_ids_for_computed_tokens(rid, req.num_computed_tokens)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.conn.request_finished_all_groups(req, block_ids)
        self.mgr.free(req)
        self.running.remove(req)
        self.finished_ids.add(rid)

    # ---- comparison -----------------------------------------------------
    def _vllm_lists(self, rid: str) -> list[list[int]]:
        req = self.requests[rid]
        if req.status in (RequestStatus.PREEMPTED,) or req.is_finished():
            return [[] for _ in range(self.G)]
        return [list(x) for x in self.mgr.get_block_ids(rid)]

    def _check(self, meta, events: list[str], spec: dict) -> dict:
        pool = self.mgr.block_pool
        owners: dict[int, list[str]] = {}
        for rid, req in self.requests.items():
            for g, ids in enumerate(self._vllm_lists(rid)):
                for slot, b in enumerate(ids):
                    if b:
                        owners.setdefault(b, []).append(f"{rid}/g{g}/slot{slot}")
        divergence = []
        for rid, tracker in self.conn.request_trackers.items():
            tracked = [list(tracker.allocated_block_ids.get(g, [])) for g in range(self.G)]
            truth = self._vllm_lists(rid)
            if tracked != truth:
                divergence.append({"req": rid, "tracked": tracked, "vllm": truth})
        stores = []
        for m in meta.requests:
            if m.direction != "STORE":
                continue
            op = m.op
            truth = self._vllm_lists(m.request_id)
            problems = []
            for g, ids in enumerate(op.block_ids):
                tpb = self.L
                first = op.start // tpb
                for k, b in enumerate(ids):
                    slot = first + k
                    if b == 0 and g in self.mamba_groups and SERVER_SKIPS_NULL_STATE:
                        # The series' part 06 sends a Mamba slot as null where no
                        # state of this chunk may be stored (non-end slots, lost
                        # states) and its server then skips the chunk's state
                        # object: nothing is read from the null block.
                        continue
                    want = truth[g][slot] if slot < len(truth[g]) else None
                    if b != want:
                        problems.append(f"g{g} slot{slot}: reads block {b}, vLLM has {want}"
                                        + (f" (block {b} now at {owners.get(b)})"
                                           if owners.get(b) else ""))
                    if b == 0:
                        problems.append(f"g{g} slot{slot}: null block")
                    elif pool.blocks[b].ref_cnt == 0:
                        problems.append(f"g{g} slot{slot}: block {b} is free")
                    if g in self.mamba_groups and slot >= len(truth[g]) - self.S:
                        problems.append(f"g{g} slot{slot}: speculative slot")
            stores.append({"req": m.request_id, "start": op.start, "end": op.end,
                           "block_ids": op.block_ids, "problems": problems})
        rec = {"step": self.step_no, "events": events, "divergence": divergence,
               "stores": stores, "drafts": {k: len(v) for k, v in spec.items()}}
        self.log.append(rec)
        return rec


def scenario_hybrid(bind_pool: bool = True, chunk: int = 4) -> Sim:
    """Chunked prefill, decode with accepted/rejected drafts (which relocates
    speculative Mamba blocks when a step spans two blocks), in-place frees,
    ids reused by the same and by other requests/groups, preemption and
    resume, finish, and a late request that receives recycled ids."""
    sim = Sim(block_size=2, num_spec=2, chunk=chunk, num_blocks=48, bind_pool=bind_pool)
    sim.add("A", prompt_len=7, max_tokens=14)
    sim.add("B", prompt_len=5, max_tokens=40)
    for _ in range(4):                          # chunked prefill (2 tokens/step)
        sim.step()
    plan = [{"A": 2, "B": 0}, {"A": 0, "B": 2}, {"A": 1, "B": 1}, {"A": 2, "B": 2},
            {"A": 2, "B": 0}, {"A": 0, "B": 2}]
    for acc in plan:                             # decode with drafts
        sim.step(acc)
    sim.step({"A": 2}, preempt=("B",))           # B preempted: all its blocks freed
    sim.add("C", prompt_len=6, max_tokens=8)      # C gets recycled ids
    for acc in [{"A": 2, "C": 1}, {"A": 1, "C": 2}, {"A": 2, "C": 0}]:
        sim.step(acc)
    for acc in [{"A": 2, "B": 2, "C": 2}, {"A": 0, "B": 1, "C": 2}, {"A": 2, "B": 2, "C": 1},
                {"A": 2, "B": 0, "C": 2}, {"A": 1, "B": 2, "C": 2}, {"B": 2, "C": 0},
                {"B": 1, "C": 2}, {"B": 2}, {"B": 0}, {"B": 2}]:
        if not sim.running and not sim.waiting:
            break
        sim.step(acc)
    return sim


def scenario_plain(num_spec: int) -> Sim:
    """Non-hybrid (single full-attention group), with or without drafts."""
    sim = Sim(block_size=2, num_spec=num_spec, chunk=4, num_blocks=64, groups_kind="plain")
    sim.add("A", prompt_len=7, max_tokens=10)
    sim.add("B", prompt_len=9, max_tokens=12)
    for _ in range(5):
        sim.step()
    for acc in [{"A": 2, "B": 0}, {"A": 0, "B": 2}, {"A": 1, "B": 1}]:
        sim.step(acc)
    sim.step({"A": 2}, preempt=("B",))
    for acc in [{"A": 2, "B": 1}] * 8:
        if not sim.running and not sim.waiting:
            break
        sim.step(acc)
    return sim


def resync_summary(sim: Sim) -> dict | None:
    """What part 08 recorded (None for connectors without it)."""
    resync = getattr(sim.conn, "_resync", None)
    if resync is None or not hasattr(resync, "source_steps"):
        return None
    return {"source_steps": dict(resync.source_steps),
            "agreement": copy.deepcopy(resync.agreement)}


def run_scenario(spec: str) -> dict:
    """``NAME`` or ``NAME@FAULT`` (see the module docstring)."""
    name, _, fault = spec.partition("@")
    undo, applied = None, None
    if fault.startswith("break-"):
        undo = inject_break(fault[len("break-"):])
        applied = undo is not None
    elif fault:
        if fault not in VLLM_FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        applied = VLLM_HAS_BLOCK_STATE
    _FAULT["vllm"] = fault if fault in VLLM_FAULTS else None
    try:
        sim = SCENARIOS[name]()
    finally:
        _FAULT["vllm"] = None
        if undo is not None:
            undo()
    return {"scenario": spec, "steps": sim.log, "patched": hasattr(mpc, "_BlockIdResync"),
            "resync": resync_summary(sim), "fault": fault or None, "fault_applied": applied}


SCENARIOS = {
    "hybrid": lambda: scenario_hybrid(True),
    "hybrid-nopool": lambda: scenario_hybrid(False),
    # One Mamba block per LMCache chunk: decode-phase chunks are storable.
    "hybrid-c1": lambda: scenario_hybrid(True, chunk=2),
    "plain-spec": lambda: scenario_plain(2),
    "plain": lambda: scenario_plain(0),
}


def construct_only(dcp: int) -> dict:
    """Build the hybrid sim's connector (scheduler role) with decode context
    parallelism ``dcp`` and report whether construction succeeded; the DCP
    guard (hybrid-fa 0.5.5+) must refuse ``dcp > 1`` here."""
    try:
        Sim(block_size=2, num_spec=2, chunk=4, num_blocks=48, dcp=dcp)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"dcp": dcp, "constructed": False,
                "error": f"{type(exc).__name__}: {exc}"}
    return {"dcp": dcp, "constructed": True, "error": None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=sorted(SCENARIOS) + ["construct", "batch"],
                    help="one scenario; 'construct' only builds the connector (with "
                    "--dcp); 'batch' runs --scenarios and --construct-dcp in one "
                    "process (one import of vLLM/lmcache instead of one per run)")
    ap.add_argument("--out", required=True, help="JSON result file (vLLM logs to stdout)")
    ap.add_argument("--dcp", type=int, default=1,
                    help="decode_context_parallel_size (scenario 'construct' only)")
    ap.add_argument("--scenarios", default="",
                    help="batch: comma-separated scenario names")
    ap.add_argument("--construct-dcp", default="",
                    help="batch: comma-separated dcp sizes to try constructing with")
    ap.add_argument("--check", action="store_true",
                    help=f"set {CHECK_ENV}=count: part 08 runs the reconstruction "
                    "alongside vLLM's block state and counts disagreements")
    ap.add_argument("--break", dest="breaks", action="append", default=[], choices=BREAKS,
                    help="inject a fault (tests only; see the module docstring)")
    args = ap.parse_args()
    patched = hasattr(mpc, "_BlockIdResync")
    if args.check:
        os.environ[CHECK_ENV] = "count"
    applied = {kind: inject_break(kind) is not None for kind in args.breaks}
    env = {"vllm": _vllm_version(), "vllm_has_block_state": VLLM_HAS_BLOCK_STATE,
           "check": args.check, "breaks": applied}
    if args.scenario == "batch":
        names = [n for n in args.scenarios.split(",") if n]
        unknown = sorted({n for n in names if n.partition("@")[0] not in SCENARIOS
                          or n.partition("@")[2] not in ("",) + FAULTS})
        if unknown:
            ap.error(f"unknown scenarios {unknown}")
        result: dict[str, Any] = {"patched": patched, "scenarios": {}, "construct": [],
                                  **env}
        for name in names:
            print(f"=== scenario {name}", file=sys.stderr, flush=True)
            result["scenarios"][name] = run_scenario(name)
        for dcp in (int(d) for d in args.construct_dcp.split(",") if d):
            print(f"=== construct dcp={dcp}", file=sys.stderr, flush=True)
            result["construct"].append(construct_only(dcp))
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        return 0
    if args.scenario == "construct":
        with open(args.out, "w") as fh:
            json.dump(dict(construct_only(args.dcp), patched=patched, **env), fh, indent=1)
        return 0
    with open(args.out, "w") as fh:
        json.dump({**run_scenario(args.scenario), **env}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
