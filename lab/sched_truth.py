"""Truth model for :mod:`sched_sim`: what every physical block of vLLM's shared
``BlockPool`` holds after each step, as the GPU worker would have written it.

No vLLM or LMCache import here: the scheduler side (real vLLM) hands in each
step's ``SchedulerOutput`` and the fake model runner's acceptance decisions;
this module replays what vLLM 0.27.1's V1 GPU worker does with them
(``gpu_model_runner._update_states``, ``mamba_utils.preprocess_mamba``, the GDN
kernels' state indices in ``gdn_attn``, ``postprocess_mamba_align_gpu``), plus
the zeroing of new attention blocks and the queued block copies, and vLLM
0.33's prefill checkpoint export (``checkpoints``: the state at the internal
checkpoint written into the block at its column).

Contents are identified by token-prefix digests (:class:`Digests`), so a block
written by one request is recognised as correct for any other request whose
tokens share that prefix, exactly as LMCache keys chunks by prefix hash.

* Full attention (FA): block ``b`` at slot ``j`` of request ``R`` holds the KV
  of positions ``[j*N, hi)`` of ``R``'s committed tokens (``FaContent``).
  Rejected draft positions are written but not valid: ``hi`` stops before them.
* Mamba (align mode): block ``b`` holds "the SSM state after exactly ``t``
  committed tokens" (the digest of that prefix), a draft state (``DraftState``)
  or garbage (``None``; the null block 0 always holds garbage).  Per step the
  worker (1) copies the previous running state into the new running slot when
  the slot moves (``preprocess_mamba``, with the accepted-token bias), (2)
  writes the state after the step's non-draft tokens into slot
  ``cdiv(c + s, N) - 1`` and, with drafts, the state after each draft token
  into the following ``num_spec`` slots, (3) with speculative decoding copies
  the state at a block boundary crossed by accepted drafts into the slot of
  the block ending there (``postprocess_mamba_fused_kernel``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

NULL_BLOCK = 0  # vLLM's BlockPool.null_block.block_id


def resumed_in_cached(so: Any) -> Any:
    """Requests a step resumes inside ``scheduled_cached_reqs`` (vLLM <= 0.33 with the V1
    runner, ``resumed_req_ids``); vLLM 0.34 has no such field: it re-sends them as new."""
    return getattr(so.scheduled_cached_reqs, "resumed_req_ids", None) or ()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Digests:
    """Rolling digests of token prefixes: ``of(key, tokens)[t]`` identifies
    ``tokens[:t]``.  Cached per key and extended as the sequence grows (vLLM
    only ever appends committed tokens)."""

    def __init__(self) -> None:
        self._cache: dict[str, list[int]] = {}

    def of(self, key: str, tokens: list[int]) -> list[int]:
        h = self._cache.setdefault(key, [0])
        for tok in tokens[len(h) - 1:]:
            h.append(hash((h[-1], tok)))  # ints hash deterministically
        return h


@dataclass(frozen=True)
class FaContent:
    """KV of positions ``[slot*N, hi)`` of request ``rid``'s committed tokens."""

    rid: str
    slot: int
    hi: int


@dataclass(frozen=True)
class DraftState:
    """SSM state after a draft token that may later be rejected."""

    rid: str
    tokens: int
    draft: tuple[int, ...]


@dataclass
class StepInput:
    """What the worker needs to know about one scheduled request this step."""

    rid: str
    computed: int  # num_computed_tokens before the step (what the worker gets)
    scheduled: int  # num_scheduled_tokens, drafts included
    drafts: list[int]  # scheduled draft token ids
    accepted: int | None  # accepted drafts; None: no token sampled (prefill chunk)


@dataclass
class Truth:
    block_size: int
    mamba_groups: list[int]
    fa_groups: list[int]
    num_spec: int
    fa: dict[int, FaContent] = field(default_factory=dict)
    mamba: dict[int, Any] = field(default_factory=dict)
    # Prefix lengths whose true Mamba state was written into a real block (for
    # the ideal hit); per request.
    materialized: dict[str, set[int]] = field(default_factory=dict)
    # States that only accepted drafts made true: the connector learns of
    # them at the next schedule(), so they count only if still there then
    # (rid, group, slot, block, tokens); see confirm_pending.
    pending: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    # The worker's view: append-only block tables, running-state slot and
    # accepted-token counts per request (gpu_model_runner / mamba_utils).
    tables: dict[str, list[list[int]]] = field(default_factory=dict)
    state_idx: dict[str, int] = field(default_factory=dict)
    num_accepted: dict[str, int] = field(default_factory=dict)
    # Model self-checks: the running state read at a step start is not the
    # true state after the request's computed tokens, or the worker touched a
    # slot whose block vLLM's scheduler does not list there.
    inconsistencies: list[str] = field(default_factory=list)
    # Requests whose prefix was loaded from LMCache, and per such request
    # whether the running state it starts from after the load is the true one.
    loaded: set[str] = field(default_factory=set)
    restored: dict[str, bool] = field(default_factory=dict)
    # vLLM 0.33+ with prefill checkpoint blocks: (seq_len, query_len) ->
    # (checkpoint position, block column), (0, -1) for none; the worker's
    # compute_mamba_prefill_checkpoints.  None: no checkpoint blocks.
    checkpoints: Callable[[int, int], tuple[int, int]] | None = None
    checkpoint_writes: int = 0  # checkpoint states written into a real block

    # ---- worker-side block maintenance (gpu_model_runner._update_states) ---
    def zero(self, block_ids: Iterable[int]) -> None:
        """``new_block_ids_to_zero``: the worker zeroes freshly allocated
        attention blocks before the step; whatever they held is gone."""
        for b in block_ids:
            self.fa.pop(b, None)
            self.mamba.pop(b, None)

    def copy(self, src: int, dst: int) -> None:
        """A ``kv_cache_block_copies`` entry (copy-on-write), run before the
        forward: every layer's bytes of ``src`` into ``dst``."""
        for store in (self.fa, self.mamba):
            if src in store:
                store[dst] = store[src]
            else:
                store.pop(dst, None)

    # ---- worker block tables (gpu_model_runner._update_states) ------------
    def update_tables(self, so: Any) -> None:
        for rid in list(so.finished_req_ids) + list(so.preempted_req_ids or ()):
            self.tables.pop(rid, None)
        # cleanup_mamba_state_idx: finished, preempted and resumed requests.
        cached = so.scheduled_cached_reqs
        resumed = set(resumed_in_cached(so))
        for rid in (set(so.finished_req_ids) | set(so.preempted_req_ids or ()) | resumed):
            self.state_idx.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.tables[nr.req_id] = [list(g) for g in nr.block_ids]
            self.num_accepted[nr.req_id] = 1
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if rid in resumed:
                self.tables[rid] = [list(g) for g in new]  # a full replacement
                self.num_accepted[rid] = 1
            elif new is not None:
                for g, ids in enumerate(new):
                    self.tables[rid][g].extend(ids)

    # ---- one step's writes ------------------------------------------------
    def apply(self, steps: Iterable[StepInput], digest: Callable[[str, int], int],
              sched_lists: Callable[[str], list[list[int]] | None]) -> None:
        """Replay the worker for this step's requests.  ``digest(rid, t)`` is
        the committed-prefix digest (tokens appended already); ``sched_lists``
        gives vLLM's scheduler-side lists (None once the request is gone)."""
        for st in steps:
            if not self.mamba_groups:
                self._judge_attention_restore(st, digest)
            self._fa_writes(st)
            if not self.mamba_groups:
                self._materialize_attention(st, sched_lists(st.rid))
            self._mamba_writes(st, digest, sched_lists(st.rid))

    # ---- pure attention (no Mamba group) ------------------------------------
    def _judge_attention_restore(self, st: StepInput, digest: Callable[[str, int], int]) -> None:
        """The first step after an LMCache load of a pure-attention request:
        the restore is right iff every block of the computed prefix holds that
        prefix's KV (there is no state to judge)."""
        if st.rid not in self.loaded or st.rid in self.restored:
            return
        n = self.block_size
        self.restored[st.rid] = all(
            self.fa_digest(self._block(st.rid, g, slot), digest) == digest(st.rid, (slot + 1) * n)
            for g in self.fa_groups for slot in range(st.computed // n))

    def _materialize_attention(self, st: StepInput, lists: list[list[int]] | None) -> None:
        """Pure attention: a prefix is storable (the ideal) once its last block
        is complete in a block vLLM's list names (no SSM state to wait for)."""
        n = self.block_size
        for g in self.fa_groups:
            for slot in range(len(self.tables[st.rid][g])):
                b = self._block(st.rid, g, slot)
                c = self.fa.get(b)
                listed = lists is None or (slot < len(lists[g]) and lists[g][slot] == b)
                if c is not None and c.rid == st.rid and c.slot == slot \
                        and c.hi >= (slot + 1) * n and listed:
                    self.materialized.setdefault(st.rid, set()).add((slot + 1) * n)

    def _block(self, rid: str, g: int, slot: int) -> int:
        table = self.tables[rid][g]
        return table[slot] if 0 <= slot < len(table) else NULL_BLOCK

    def _check_slot(self, rid: str, g: int, slot: int, lists: list[list[int]] | None,
                    what: str) -> None:
        if lists is None:
            return
        mine = self._block(rid, g, slot)
        theirs = lists[g][slot] if slot < len(lists[g]) else None
        if mine != theirs:
            self.inconsistencies.append(
                f"{rid} g{g} slot{slot}: worker {what} block {mine}, scheduler lists {theirs}")

    def _fa_writes(self, st: StepInput) -> None:
        n = self.block_size
        running = st.computed + st.scheduled - len(st.drafts)
        committed = running + (st.accepted or 0)
        end = st.computed + st.scheduled  # positions written, drafts included
        for g in self.fa_groups:
            for slot in range(st.computed // n, cdiv(end, n)):
                lo, hi = slot * n, min((slot + 1) * n, committed)
                b = self._block(st.rid, g, slot)
                if b == NULL_BLOCK:
                    continue
                old = self.fa.get(b)
                # Valid part before this step: the block's contiguous committed
                # prefix, if it already belonged to this request at this slot.
                base = old.hi if (old and old.rid == st.rid and old.slot == slot) else lo
                # A gap before this step's first position keeps the block
                # invalid past it; otherwise it is valid up to the committed
                # tokens (positions past them hold rejected drafts).
                self.fa[b] = FaContent(st.rid, slot,
                                       max(lo, hi) if base >= max(lo, st.computed) else base)

    def _write_state(self, rid: str, g: int, slot: int, content: Any, tokens: int | None,
                     lists: list[list[int]] | None, known: bool = True) -> None:
        """Write ``content`` into the worker's block at ``slot``.  ``tokens``:
        the committed prefix whose true state this is (None: not one).

        It counts as materialized (for the ideal) only where vLLM itself keeps
        it: at a block boundary, in the slot of the block ending there
        ("slot p holds the state after exactly (p + 1) * block_size tokens"),
        and in a block the scheduler's list names at that slot.  The worker's
        append-only table can still name a block the scheduler has moved away
        (a relocated speculative block): the state lands there, but no list
        names it, so no connector following vLLM's lists could store it."""
        b = self._block(rid, g, slot)
        if b == NULL_BLOCK:
            return  # writes into the null block are lost; it stays garbage
        self.mamba[b] = content
        n = self.block_size
        listed = lists is None or (slot < len(lists[g]) and lists[g][slot] == b)
        if tokens is not None and tokens % n == 0 and slot == tokens // n - 1 and listed:
            if known:
                self.materialized.setdefault(rid, set()).add(tokens)
            else:
                self.pending.append((rid, g, slot, b, tokens))

    def confirm_pending(self, lists: Callable[[str], list[list[int]] | None],
                        digest: Callable[[str, int], int]) -> None:
        """Right after the next ``schedule()`` (allocation, in-place frees and
        the connector's planning all happen inside it): a draft-made state
        counts toward the ideal only if vLLM still lists its block at its slot
        and the block still holds it.  Otherwise no scheduler-side connector
        could have stored it (it was freed before the chunk was known done)."""
        for rid, g, slot, b, t in self.pending:
            now = lists(rid)
            if (now is not None and slot < len(now[g]) and now[g][slot] == b
                    and self.mamba.get(b) == digest(rid, t)):
                self.materialized.setdefault(rid, set()).add(t)
        self.pending.clear()

    def _mamba_writes(self, st: StepInput, digest: Callable[[str, int], int],
                      lists: list[list[int]] | None) -> None:
        n, rid = self.block_size, st.rid
        d = len(st.drafts)
        running = st.computed + st.scheduled - d
        prev = self.state_idx.get(rid)
        if prev is None:
            prev = (st.computed - 1) // n  # new/resumed: -1 when nothing computed
        curr = cdiv(st.computed + st.scheduled, n) - 1
        self.state_idx[rid] = curr
        bias = self.num_accepted.get(rid, 1) - 1
        first_after_load = rid in self.loaded and rid not in self.restored
        restored_ok = True
        for g in self.mamba_groups:
            # preprocess_mamba: the running state moves to the new slot.
            if prev != -1 and prev != curr:
                self._check_slot(rid, g, prev + bias, lists, "copies from")
                src = self.mamba.get(self._block(rid, g, prev + bias))
                self._write_state(rid, g, curr, src, None, lists)
                init = src
            elif prev != -1:
                init = self.mamba.get(self._block(rid, g, curr + bias))
            else:
                init = "fresh"
            if first_after_load:
                # First step after an LMCache load: the verdict on the restore.
                restored_ok &= init == digest(rid, st.computed)
            elif st.computed > 0 and init != digest(rid, st.computed):
                self.inconsistencies.append(
                    f"{rid} g{g}: step starts at {st.computed} tokens but its running "
                    f"state is {init!r}")
            # Forward: state after the non-draft tokens, then one per draft.
            self._check_slot(rid, g, curr, lists, "writes")
            self._write_state(rid, g, curr, digest(rid, running), running, lists)
            if self.checkpoints is not None and not d:
                # vLLM 0.33+: the prefill kernel also emits the state at the
                # internal checkpoint and the exporter writes it into the
                # block at its column (a null block there drops it).
                pos, col = self.checkpoints(st.computed + st.scheduled, st.scheduled)
                if col >= 0 and self._block(rid, g, col) != NULL_BLOCK:
                    self._check_slot(rid, g, col, lists, "writes a checkpoint into")
                    self._write_state(rid, g, col, digest(rid, pos), pos, lists)
                    self.checkpoint_writes += 1
            acc = st.accepted or 0
            for j in range(1, d + 1):
                content = (digest(rid, running + j) if j <= acc
                           else DraftState(rid, running + j, tuple(st.drafts[:j])))
                self._write_state(rid, g, curr + j, content,
                                  running + j if j <= acc else None, lists, known=False)
        if first_after_load:
            self.restored[rid] = restored_ok
        if not d and st.accepted is None:
            self.num_accepted[rid] = 1
            return
        self.num_accepted[rid] = (st.accepted or 0) + 1
        if not self.num_spec:
            self.num_accepted[rid] = 1
            return
        # postprocess_mamba_fused_kernel (spec decode, align mode).
        new = running + (st.accepted or 0)
        aligned = new // n * n
        if aligned < running:
            return
        shift = aligned - running
        dest = aligned // n - 1
        if curr == dest:
            self.num_accepted[rid] = 1
            if shift == 0:
                return
        for g in self.mamba_groups:
            src = self.mamba.get(self._block(rid, g, curr + shift))
            self._write_state(rid, g, dest, src,
                              aligned if src == digest(rid, aligned) else None, lists,
                              known=aligned <= running)

    # ---- LMCache loads (the server writes stored bytes into blocks) --------
    def load_fa(self, b: int, rid: str, slot: int, hi: int) -> None:
        if b != NULL_BLOCK:
            self.fa[b] = FaContent(rid, slot, hi)

    def load_state(self, b: int, content: Any) -> None:
        if b != NULL_BLOCK:
            self.mamba[b] = content

    # ---- reading ------------------------------------------------------------
    def fa_digest(self, b: int, digest: Callable[[str, int], int]) -> int | None:
        """Digest of the prefix whose KV block ``b`` completely holds, or None."""
        c = self.fa.get(b)
        if b == NULL_BLOCK or c is None or c.hi < (c.slot + 1) * self.block_size:
            return None
        return digest(c.rid, (c.slot + 1) * self.block_size)

    def mamba_content(self, b: int) -> Any:
        return None if b == NULL_BLOCK else self.mamba.get(b)
