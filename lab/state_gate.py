#!/usr/bin/env python3
"""Null-state restore gate: a hybrid request prefilled in multi-block
steps, stored, the server SIGKILLed and restarted on the same fs L2 tier, then a
second request that shares a prefix ending INSIDE a prefill step.

Run BY PATH in the target interpreter, like ``gate/restore_gate.py`` (prepend
a patched overlay to PYTHONPATH; the server inherits it)::

    <venv>/bin/python -m lab.state_gate --json [--preset qwen35-0.8b] [--chunk-blocks 1]

What vLLM does, and what is emulated here.  In Mamba "align" mode vLLM writes
a Mamba/GDN group's state only at the end of each scheduled step, into the slot
of the step's last block; the slots inside a multi-block prefill step hold the
null block (id 0).  After each step the connector stores the chunks that step
completed with those block lists.  The gate does the same with LMCache's own
worker adapter: ``--step-blocks`` blocks per step, the Mamba ids null except at
step ends, and, where the installed connector is the series with part 06, the
ids passed through its ``_BlockIdResync.chunk_end_state_ids`` exactly as its
store path does.  Pristine builds send vLLM's lists as they are.

The second request shares ``--shared-blocks`` blocks (default: two blocks past
the first step's end, i.e. inside the second step).  Its IDEAL hit is the
longest prefix ending at a chunk boundary where the state is true: the last
step end at or before the shared prefix that is also a chunk boundary.

Verdict PASS only if: every attention page of the hit is restored exactly;
the state restored at the hit boundary is the true state there (a hit whose
boundary has no true state, e.g. the null block's bytes stored as a state, is
a WRONG-STATE hit); nothing outside the destination blocks changed; and the
hit is at least ``--min-hit-ratio`` (0.95) of the ideal.  Exit 0 pass, 1 fail,
2 error.  0.5.3 is not applicable: its connector refuses multi-block prefill
steps for hybrids at startup (``validate_mamba_step_alignment``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from gate import restore_server  # the server helpers the CPU restore gate uses
from gate import geometry, procs

SCHEMA = 1
EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


def step_end_positions(num_blocks: int, step_blocks: int) -> set[int]:
    """Block positions whose Mamba slot vLLM materializes: each step's last block."""
    ends = {p for p in range(num_blocks) if (p + 1) % step_blocks == 0}
    ends.add(num_blocks - 1)  # the prompt's last step
    return ends


def ideal_hit_blocks(shared_blocks: int, chunk_blocks: int, ends: set[int]) -> int:
    """Longest prefix (in blocks) at a chunk boundary whose last block holds a true state."""
    best = 0
    for b in range(chunk_blocks, shared_blocks + 1, chunk_blocks):
        if b - 1 in ends:
            best = b
    return best


def vllm_state_ids(ids: list[int], ends: set[int]) -> list[int]:
    """A Mamba group's block list as vLLM's align mode leaves it: null inside steps."""
    return [b if p in ends else 0 for p, b in enumerate(ids)]


def connector_store_ids(op_ids: list[list[int]], mamba_groups: list[int], chunk_blocks: int,
                        separated: bool) -> list[list[int]]:
    """What the connector sends for a store.

    Pristine (and the series before part 06) send vLLM's lists as they are.
    With part 06 the connector sends a Mamba group's chunk-end slot only
    (``_BlockIdResync.chunk_end_state_ids``; its other slots null; a freed end
    slot null too, which cannot happen here).  That code lives in the vLLM-side
    connector module, which needs vLLM to import, so it is mirrored here; the
    real function runs against vLLM's scheduler in tests/resync_ports.  The
    server tells which build this is (``SEPARATES_STATE_GROUPS``, same install).
    """
    if not separated:
        return op_ids
    out = [list(ids) for ids in op_ids]
    for g in mamba_groups:
        ids = out[g]
        for start in range(0, len(ids), chunk_blocks):
            for slot in range(start, min(start + chunk_blocks, len(ids)) - 1):
                ids[slot] = 0
    return out


class StateGate:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.report: dict[str, Any] = {"tool": "lab/state_gate.py", "schema": SCHEMA}

    def log(self, text: str) -> None:
        if not self.args.quiet:
            print(text, file=sys.stderr, flush=True)

    def run(self) -> int:
        args = self.args
        import gate.restore_client as gc  # noqa: PLC0415 - torch + lmcache

        geo = geometry.preset(args.preset)
        if not geo.num_gdn_layers:
            raise SystemExit(f"state_gate: preset {args.preset} has no GDN layers")
        n = geo.tokens_per_block
        cb = args.chunk_blocks
        blocks = args.chunks * cb
        ends = step_end_positions(blocks, args.step_blocks)
        shared = args.shared_blocks if args.shared_blocks is not None else min(blocks, args.step_blocks + 2)
        ideal = ideal_hit_blocks(shared, cb, ends)
        self.report.update(preset=geo.name, chunk_blocks=cb, chunks=args.chunks, step_blocks=args.step_blocks,
                           shared_blocks=shared, state_positions=sorted(ends), ideal_hit_tokens=ideal * n)
        layout = gc.Layout(geo, geometry.engine_group_infos(geo, "connector"))
        gdn_groups = sorted({layout.group_of_layer[i] for i, kind in enumerate(geo.layer_kinds) if kind == "gdn"})
        num_blocks = 1 + layout.num_groups * blocks + 2
        src_ids = gc.choose_block_ids(layout.num_groups, blocks, num_blocks, args.seed)
        dst_ids = gc.choose_block_ids(layout.num_groups, blocks, num_blocks, args.seed + 1, differ_from=src_ids)
        vllm_ids = [vllm_state_ids(ids, ends) if g in gdn_groups else list(ids) for g, ids in enumerate(src_ids)]
        import random  # noqa: PLC0415

        rng = random.Random(args.seed)
        tokens = [rng.randrange(1, 150_000) for _ in range(blocks * n)]
        second = tokens[:shared * n] + [rng.randrange(150_000, 200_000) for _ in range((blocks - shared) * n)]
        model = f"state-gate-{geo.name}-{uuid.uuid4().hex[:8]}"

        with procs.Supervisor() as sup, tempfile.TemporaryDirectory(prefix="lmcache-state-gate-") as tmp:
            work = Path(tmp)
            l2 = work / "l2"
            l2.mkdir()
            zmq_port, http_port = procs.free_ports(2)
            spec = restore_server.ServerSpec(zmq_port, http_port, cb * n, args.l1_size_gb, l2, work)
            server = restore_server.launch_server(sup, spec, "A")
            restore_server.await_server(server, spec, args.server_timeout)
            self.log(f"server A up (chunk {cb * n} tokens, steps of {args.step_blocks} blocks)")

            # ---- first request: prefill in steps, store after each step ----
            client = gc.Client(spec.zmq_url, model, layout, mq_timeout=args.step_timeout)
            caches = geometry.build_kv_caches(geo, num_blocks, fill=0)
            self._connector_edits(caches)
            client.register(caches)
            expected = gc.fill_source(client, src_ids, args.seed)
            rid = f"state-gate-store-{uuid.uuid4().hex[:8]}"
            client.lookup(rid, tokens, args.step_timeout)
            separated = geometry.server_separates_state_groups()
            stores = []
            for start_blk in range(0, blocks, args.step_blocks):
                end_blk = min(blocks, start_blk + args.step_blocks)
                first_chunk, last_chunk = -(-start_blk // cb), end_blk // cb  # chunks completed this step
                if last_chunk <= first_chunk:
                    continue
                start, end = first_chunk * cb * n, last_chunk * cb * n
                op_ids = layout.op_block_ids(vllm_ids, start, end)
                op_ids = connector_store_ids(op_ids, gdn_groups, cb, separated)
                ok = client.store(rid, tokens, vllm_ids, end, args.step_timeout, start=start,
                                  op_block_ids=op_ids)
                stores.append({"tokens": [start, end], "ok": ok, "block_ids": op_ids})
            client.finish_request(rid)
            self.report["stores"] = stores
            self.report["server_separates_state_groups"] = separated

            # ---- flush to L2, SIGKILL, restart on the same tier ----
            def settled() -> bool:
                a = len(restore_server.l2_objects(l2, model))
                time.sleep(0.5)
                return a > 0 and a == len(restore_server.l2_objects(l2, model))
            procs.wait_until(settled, args.step_timeout, poll=0.2)
            self.report["l2_objects"] = sorted(p.name.split("@")[0] + "@...@" + p.name.split("@")[2]
                                               for p in restore_server.l2_objects(l2, model))
            client.close()
            self.report["kill"] = restore_server.kill_server(server)
            server = restore_server.launch_server(sup, spec, "B")
            restore_server.await_server(server, spec, args.server_timeout)
            self.log("server B up on the same L2 directory")

            # ---- second request: shared prefix ending inside a step ----
            client = gc.Client(spec.zmq_url, model, layout, mq_timeout=args.step_timeout)
            try:
                caches = geometry.build_kv_caches(geo, num_blocks, fill=gc.POISON)
                self._connector_edits(caches)
                client.register(caches)
                gc.poison(client)
                rid = f"state-gate-restore-{uuid.uuid4().hex[:8]}"
                hit = client.lookup(rid, second, args.step_timeout)
                retrieve = {"ok": None, "detail": "no hit"}
                if hit:
                    ok, detail = client.retrieve(rid, second, dst_ids, hit, args.step_timeout)
                    retrieve = {"ok": ok, "detail": detail}
                client.finish_request(rid)
                hit_chunks = hit // (cb * n)
                check = gc.check_restore(client, dst_ids, expected, chunks=args.chunks, blocks_per_chunk=cb,
                                         restored_chunks=hit_chunks, untouched=gc.POISON,
                                         state_window_chunks=1)
            finally:
                client.close(graceful=server.alive())
            restore_server.kill_server(server)
        return self._verdict(hit, ideal * n, hit_chunks * cb, ends, check, retrieve)

    @staticmethod
    def _connector_edits(caches: Any) -> None:
        """Register what the installed connector registers (0.5.6 re-views a
        hybrid's sub-paged attention), as restore_gate.py --connector-edits."""
        from gate import ports_edits  # noqa: PLC0415 - target env only

        ports_edits.apply_edits(caches, "HND")
        for layer, t in enumerate(caches.tensors):
            if not t.is_contiguous() or t.data_ptr() != caches.raw[layer].data_ptr():
                raise RuntimeError(f"the connector's edit of layer {layer} is not a contiguous view")

    def _verdict(self, hit: int, ideal: int, hit_blocks: int, ends: set[int], check: dict, retrieve: dict) -> int:
        args = self.args
        boundary = hit_blocks - 1
        fa = check["fa"]
        fa_exact = fa is None or fa["pages_total"] == 0 or fa["pages_exact"] == fa["pages_total"]
        if hit == 0:
            state = "no hit"
        elif boundary not in ends:
            state = "wrong: no true state at the hit boundary"
        else:
            last = check["per_chunk"][hit_blocks // args.chunk_blocks - 1]
            state = "true" if last["gdn_blocks"] and last["gdn_exact"] else "wrong: restored state differs"
        ratio = (hit / ideal) if ideal else (1.0 if hit == 0 else None)
        reasons = []
        if not fa_exact:
            reasons.append(f"attention pages restored {fa['pages_exact']}/{fa['pages_total']}")
        if state.startswith("wrong"):
            reasons.append(f"wrong-state hit at {hit} tokens ({state})")
        if check["foreign_writes"]["bytes"]:
            reasons.append(f"{check['foreign_writes']['bytes']} bytes written wrongly (outside the destination blocks, "
                           "or as a state into a slot no stored state belongs to)")
        if ideal and (ratio or 0) < args.min_hit_ratio:
            reasons.append(f"hit {hit} tokens of an ideal {ideal} ({ratio:.2f} < {args.min_hit_ratio})")
        self.report.update(hit_tokens=hit, hit_ratio=ratio, boundary_state=state, retrieve=retrieve,
                           fidelity={"fa": check["fa"], "gdn": check["gdn"]},
                           foreign_writes=check["foreign_writes"], reasons=reasons,
                           verdict="pass" if not reasons else "fail")
        self.log(f"hit {hit} / ideal {ideal} tokens; state at the boundary: {state}; "
                 f"{'PASS' if not reasons else 'FAIL: ' + '; '.join(reasons)}")
        return EXIT_PASS if not reasons else EXIT_FAIL


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen35-0.8b", help="a hybrid geometry preset (default qwen35-0.8b)")
    ap.add_argument("--chunk-blocks", type=int, default=1, help="LMCache chunk size in logical blocks")
    ap.add_argument("--chunks", type=int, default=8, help="chunks in the first request (default 8)")
    ap.add_argument("--step-blocks", type=int, default=4,
                    help="logical blocks per prefill step (4: vLLM's 2048-token steps at N=544 round to 3-4)")
    ap.add_argument("--shared-blocks", type=int, help="blocks the second request shares (default: inside step 2)")
    ap.add_argument("--min-hit-ratio", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--l1-size-gb", type=float, default=1.0)
    ap.add_argument("--step-timeout", type=float, default=60.0)
    ap.add_argument("--server-timeout", type=float, default=120.0)
    ap.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gate = StateGate(args)
    try:
        code = gate.run()
    except Exception as exc:  # noqa: BLE001 - one line, and the report says what broke
        gate.report.update(verdict="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        print(f"state_gate: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = EXIT_ERROR
    gate.report["exit_code"] = code
    if args.json:
        print(json.dumps(gate.report, indent=1, default=str))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
