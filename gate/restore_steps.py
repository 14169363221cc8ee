"""The client side of the CPU restore gate, one preset at a time (target env:
torch + lmcache, through :mod:`.restore_client`).

Each method is one named step of ``gate/restore_gate.py``'s cycle:
:meth:`ClientSteps.prepare_source` (register vLLM-shaped caches and fill them
after registration), :meth:`~ClientSteps.store`, :meth:`~ClientSteps.restore`
(a fresh client: register, poison, look up, retrieve into other block ids,
compare) and the optional :meth:`~ClientSteps.stay_alive` arm.  Results go
into ``PresetRun.result``; :mod:`.restore_verdict` judges them.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
import uuid
from typing import Any

from gate import restore_client as gc
from gate import geometry, procs
from gate.restore_plan import GateError, PresetRun
from gate.restore_server import ServerSpec, prefetch_split
from gate.xver_state import expected_digest, regenerate_expected


class ClientSteps:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def _client(self, spec: ServerSpec, r: PresetRun, layout: Any) -> Any:
        a = self.args
        return gc.Client(spec.zmq_url, r.model, layout, mq_timeout=a.step_timeout,
                         heartbeat_interval=a.heartbeat_interval, transfer_mode=a.transfer_mode)

    # -- store ---------------------------------------------------------------
    def prepare_source(self, r: PresetRun, spec: ServerSpec) -> None:
        """The first client: vLLM-shaped caches registered, then filled (the
        server maps the same shared memory), block ids and prompt drawn."""
        args = self.args
        # The connector's EngineGroupInfo, window fields included (0.5.4+: the GDN
        # group has sw_size_tokens = N, so the server keeps only its chunk-end slot).
        r.layout = gc.Layout(r.geo, geometry.engine_group_infos(r.geo, args.window_rule))
        r.restore_layout = gc.Layout(r.geo, geometry.engine_group_infos(
            r.geo, args.restart_window_rule or args.window_rule))
        r.num_blocks = 1 + r.layout.num_groups * r.chunks * r.blocks_per_chunk + 2
        per_group = r.chunks * r.blocks_per_chunk
        r.src_ids = gc.choose_block_ids(r.layout.num_groups, per_group, r.num_blocks, r.seed)
        r.dst_ids = gc.choose_block_ids(r.layout.num_groups, per_group, r.num_blocks, r.seed + 1,
                                        differ_from=r.src_ids)
        rng = random.Random(r.seed)
        # a prompt of `chunks` full chunks plus a partial one (never stored)
        r.tokens = [rng.randrange(1, 150_000) for _ in range(r.stored_tokens + r.geo.tokens_per_block // 2)]
        t0 = time.monotonic()
        r.client1 = self._client(spec, r, r.layout)
        caches = geometry.build_kv_caches(r.geo, r.num_blocks, fill=0)
        self.connector_edits(r, caches, "store")
        r.client1.register(caches)
        r.expected = gc.fill_source(r.client1, r.src_ids, r.seed)  # AFTER registration: live shared memory
        r.result["register_seconds"] = round(time.monotonic() - t0, 3)

    def store(self, r: PresetRun) -> None:
        args = self.args
        t0 = time.monotonic()
        rid = f"gate-store-{uuid.uuid4().hex[:12]}"
        miss = r.client1.lookup(rid, r.tokens, args.step_timeout)  # vLLM looks up every new request first
        ok = r.client1.store(rid, r.tokens, r.src_ids, r.stored_tokens, args.step_timeout)
        r.client1.finish_request(rid)
        r.result["stored"] = {"ok": ok, "chunks_ok": r.chunks if ok else 0, "tokens": r.stored_tokens,
                              "lookup_before_store_hit_tokens": miss, "seconds": round(time.monotonic() - t0, 3)}

    # -- restore -------------------------------------------------------------
    def restore(self, r: PresetRun, spec: ServerSpec, server: procs.ManagedProcess) -> None:
        """A fresh client: look up (the server prefetches from L2), retrieve
        into other block ids, compare byte for byte, foreign bytes included."""
        t0 = time.monotonic()
        xver = self.args.phase == "restore"
        if r.layout is None:  # reader phase: the READER's connector sets the window fields
            r.layout = r.restore_layout = gc.Layout(r.geo, geometry.engine_group_infos(r.geo, self.args.window_rule))
        client = self._client(spec, r, r.restore_layout or r.layout)
        try:
            self._register_poisoned(r, client, xver)
            rid = f"gate-restore-{uuid.uuid4().hex[:12]}"
            hit, lookup_s = self._lookup(r, client, rid)
            found = hit // r.chunk_size
            split = self._server_split(server, rid, hit, found)
            retrieve, retrieve_s = self._retrieve(r, client, rid, hit, xver)
            client.finish_request(rid)
            t_cmp = time.monotonic()
            check = self._compare(r, client, found, retrieve, xver)
            compare_s = time.monotonic() - t_cmp
        finally:
            client.close(graceful=server.alive())
        r.result["after_restart"] = {"hit_tokens": hit, "chunks_found": found, "chunks_stored": r.chunks,
                                     "server_prefetch": split, "l2_hits": split["l2"], "l1_hits": split["l1"],
                                     "lookup_seconds": round(lookup_s, 3)}
        r.result["restored"] = {"retrieve": retrieve, "chunks_restored_exact": check["chunks_exact"],
                                "per_chunk": check["per_chunk"], "retrieve_seconds": round(retrieve_s, 3),
                                "compare_seconds": round(compare_s, 3), "seconds": round(time.monotonic() - t0, 3)}
        r.result["fidelity"] = {"fa": check["fa"], "gdn": check["gdn"]}
        r.result["foreign_writes"] = check["foreign_writes"]
        if xver:
            r.result["xver"] = {"chunks_stored": r.chunks, "chunks_hit": found, "retrieve_ok": retrieve["ok"],
                                "chunks_exact": sum(1 for c in check["per_chunk"][:found] if c["exact"]),
                                "foreign_bytes": check["foreign_writes"]["bytes"]}

    def _register_poisoned(self, r: PresetRun, client: Any, xver: bool) -> None:
        caches = geometry.build_kv_caches(r.geo, r.num_blocks, fill=gc.POISON)
        self.connector_edits(r, caches, "restore")
        client.register(caches)
        gc.poison(client)  # AFTER registration: registration re-points the storage
        if xver:
            self.regenerate_expected(r, client)

    def _lookup(self, r: PresetRun, client: Any, rid: str) -> tuple[int, float]:
        t_lookup = time.monotonic()
        hit = client.lookup(rid, r.tokens, self.args.step_timeout)
        return hit, time.monotonic() - t_lookup

    @staticmethod
    def _server_split(server: procs.ManagedProcess, rid: str, hit: int, found: int) -> dict[str, Any]:
        """The server's own L1/L2 account of the lookup's prefetch."""
        split: dict[str, Any] | None = prefetch_split(server.log_text(), rid)
        if split is None and hit:  # the line is logged before the answer; allow for a slow flush
            try:
                split = procs.wait_until(lambda: prefetch_split(server.log_text(), rid), 2.0, poll=0.05)
            except TimeoutError:
                split = None
        if split is not None:
            split["source"] = "server log"
            return split
        if hit:
            # No log line (another lmcache version?): a fresh server's L1 cannot
            # hold this model's keys before its first lookup, so hits are L2's.
            return {"keys_hit": found, "keys_requested": None, "l1": 0, "l2": found,
                    "source": "inferred: fresh server, first lookup of this model (no prefetch log line)"}
        return {"keys_hit": 0, "keys_requested": None, "l1": 0, "l2": 0,
                "source": "no hit (the server logs nothing)"}

    def _retrieve(self, r: PresetRun, client: Any, rid: str, hit: int, xver: bool) -> tuple[dict[str, Any], float]:
        retrieve: dict[str, Any] = {"ok": None, "detail": "skipped: no hit"}
        t_ret = time.monotonic()
        if hit:
            try:
                ok, detail = client.retrieve(rid, r.tokens, r.dst_ids, hit, self.args.step_timeout)
            except Exception as exc:  # noqa: BLE001
                if not xver:
                    raise
                # another build's object may be refused loudly: a miss if nothing was written
                ok, detail = False, f"raised {type(exc).__name__}: {exc}"
            retrieve = {"ok": ok, "detail": detail}
        return retrieve, time.monotonic() - t_ret

    @staticmethod
    def _compare(r: PresetRun, client: Any, found: int, retrieve: dict[str, Any], xver: bool) -> dict[str, Any]:
        check = gc.check_restore(client, r.dst_ids, r.expected, chunks=r.chunks,
                                 blocks_per_chunk=r.blocks_per_chunk, restored_chunks=found,
                                 untouched=gc.POISON)
        if xver and retrieve["ok"] is False:
            # A failed retrieve must have written nothing: every byte still poison.
            check["foreign_writes"] = gc.check_restore(
                client, r.dst_ids, r.expected, chunks=r.chunks, blocks_per_chunk=r.blocks_per_chunk,
                restored_chunks=0, untouched=gc.POISON)["foreign_writes"]
        return check

    def connector_edits(self, r: PresetRun, caches: Any, when: str) -> None:
        """--connector-edits: register what the installed connector registers.

        Runs the version's own ``apply_kv_cache_group_edits`` on vLLM's tensors
        (0.5.6 re-views a hybrid's sub-paged attention as ``(nb, 2, N, 1, hs')``;
        0.5.5+ re-views GDN with ``as_strided``).  Every edit is a contiguous view
        of the same memory, so a logical block is still one row of the registered
        tensor (checked: a copy would make the byte checks read stale memory).
        """
        if not self.args.connector_edits:
            return
        from gate import ports_edits  # noqa: PLC0415 - imports the installed connector's edits module

        info = ports_edits.apply_edits(caches, "HND")
        for layer, t in enumerate(caches.tensors):
            if not t.is_contiguous() or t.data_ptr() != caches.raw[layer].data_ptr():
                raise GateError(f"{r.geo.name}: the connector's edit of layer {layer} is not a contiguous view "
                                f"of vLLM's tensor (shape {tuple(t.shape)}): the gate's byte checks cannot follow it")
        r.result.setdefault("connector_edits", {})[when] = [
            {"layer": x["layer"], "kind": x["kind"], "edited": x["edited"], "shape": x["shape"]}
            for x in info["layers"]]

    @staticmethod
    def regenerate_expected(r: PresetRun, client: Any) -> None:
        """The writer's source bytes, from its seed, proven equal by the writer's digest."""
        rows = [client.rows(layer).shape[1] for layer in range(len(r.geo.layer_kinds))]
        r.expected = regenerate_expected(rows, client.layout.group_of_layer, r.src_ids, r.seed)
        want = r.state_entry["expected_sha256"]
        got = expected_digest(r.expected)
        if got != want:
            raise GateError(f"{r.writer}/{r.geo.name}: the source bytes regenerated from seed {r.seed} do not "
                            f"match the writer's (sha256 {got[:12]} != {want[:12]}): not deterministic across "
                            f"the two environments, refusing to judge")

    # -- the optional arm: the worker that stayed alive across the restart ----
    def stay_alive(self, r: PresetRun, server: procs.ManagedProcess, restart_window: float) -> dict[str, Any]:
        """The first client never restarted.  Report what the target does with it."""
        args, c = self.args, r.client1
        hb = args.heartbeat_interval if args.heartbeat_interval is not None else \
            getattr(c.worker, "_heartbeat_interval", None)
        out: dict[str, Any] = {"ran": True, "heartbeat_interval_s": hb, "restart_window_s": round(restart_window, 3),
                               "worker_healthy": c.worker.is_healthy, "instance_id": c.instance_id}
        if not c.worker.is_healthy and hb:
            # Degraded mode (the heartbeat saw the outage): a live vLLM keeps
            # serving, so give the heartbeat up to two intervals to recover.
            t0 = time.monotonic()
            with contextlib.suppress(TimeoutError):
                procs.wait_until(lambda: c.worker.is_healthy, min(2 * hb + 1, args.step_timeout), poll=0.05)
            out["waited_for_recovery_s"] = round(time.monotonic() - t0, 3)
        out["reregistered_with_new_server"] = f"Registered KV cache for GPU ID {c.instance_id}" in server.log_text()
        rid = f"gate-stayalive-{uuid.uuid4().hex[:12]}"
        hit = c.lookup(rid, r.tokens, args.step_timeout)
        out["lookup_hit_tokens"] = hit
        out["chunks_found"] = hit // r.chunk_size
        if hit:
            out.update(self._stay_alive_retrieve(r, rid, hit))
        c.finish_request(rid)
        out["server_had_no_layout_for_model"] = f"No GPU context found for model {r.model}" in server.log_text()
        out["worker_healthy_after"] = c.worker.is_healthy
        out["summary"] = _stay_alive_summary(r, out, hit)
        return out

    def _stay_alive_retrieve(self, r: PresetRun, rid: str, hit: int) -> dict[str, Any]:
        """Retrieve into the (poisoned) source blocks and compare."""
        c = r.client1
        blocks = {layer: r.src_ids[r.layout.group_of_layer[layer]] for layer in range(len(r.geo.layer_kinds))}
        gc.poison(c, blocks)
        ok, detail = c.retrieve(rid, r.tokens, r.src_ids, hit, self.args.step_timeout)
        check = gc.check_restore(c, r.src_ids, r.expected, chunks=r.chunks, blocks_per_chunk=r.blocks_per_chunk,
                                 restored_chunks=hit // r.chunk_size, untouched=gc.BACKGROUND)
        return {"retrieve": {"ok": ok, "detail": detail}, "chunks_restored_exact": check["chunks_exact"],
                "fidelity": {"fa": check["fa"], "gdn": check["gdn"]},
                "foreign_writes": check["foreign_writes"]["bytes"]}


def _stay_alive_summary(r: PresetRun, out: dict[str, Any], hit: int) -> str:
    if hit == 0:
        why = ("the worker never re-registered with the new server (its heartbeat saw no failure)"
               if not out["reregistered_with_new_server"] else "re-registered, but still no hit")
        if out["server_had_no_layout_for_model"]:
            why += "; the server had no KV layout for the model, so its lookup answered 0"
        return f"0 hits after the restart: {why}"
    return (f"{out['chunks_found']}/{r.chunks} chunks found, "
            f"{out.get('chunks_restored_exact', 0)} restored exactly"
            + (" (re-registered)" if out["reregistered_with_new_server"] else ""))
