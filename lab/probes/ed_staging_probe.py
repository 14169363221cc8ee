"""Staging-region probe of the engine-driven transfer, through the real server.

With revision 3 of the engine-driven set, a worker and a server on the same
host move object bytes through POSIX shared-memory staging regions instead of
the message queue (``posix_shm.StagingRegion``; EXPLAINER 10.6).  They agree on
it at registration: the worker creates a one-page probe holding a nonce, and a
server that reads the nonce there answers ``staging``.  Anything else (another
host, another /dev/shm, a peer without the set's revision 3) keeps the object
bytes on the message queue, as revision 2 did.

Run in a runtime venv with the worker's overlay first on PYTHONPATH::

    PYTHONPATH=<overlay>:<repo> <runtime>/bin/python -m lab.probes.ed_staging_probe \\
        [--preset qwen35-0.8b] [--rounds 3] [--server-overlay DIR] [--probe-elsewhere]

What it does, through the real ``lmcache server`` (127.0.0.1, the restore
gate's ``ServerSpec``, ``--supported-transfer-mode engine_driven``, fs L2 in a
temporary directory) and LMCache's own adapters (``restore_client.Client``):

1. registers a CPU worker in engine-driven mode and reads which transport the
   worker context chose (``staging`` or ``mq``);
2. ``--rounds`` times: a fresh prompt, LOOKUP (a miss), STORE, END_SESSION,
   then LOOKUP, RETRIEVE into other blocks (compared byte for byte),
   END_SESSION; after each STORE and each RETRIEVE it lists the staging names
   in /dev/shm (``lmcache_ed_staging_<pid>_*`` of the worker or the server):
   a name must never outlive the RPC that handed it over;
3. records the names of the worker's store region and of the server region
   it last mapped, per round: a kept region is reused, not made per request;
4. closes the client, stops the server, lists /dev/shm once more.

``--server-overlay DIR`` runs the server from another lmcache tree (a peer
without revision 3).  ``--probe-elsewhere`` has the worker send a probe name
that does not exist here, as a server on another host would see it.

Prints one JSON object (the last line of stdout).  Exit code 0 when the probe
ran (whatever it found), 2 when it could not.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import sys
import uuid
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]  # the gate package imports from here

FORMAT = 1
SHM = Path("/dev/shm")


def staging_names(pids: list[int]) -> list[str]:
    """Staging region names in /dev/shm created by one of ``pids``."""
    prefixes = tuple(f"lmcache_ed_staging_{pid}_" for pid in pids)
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(prefixes))


def _transport(client: Any) -> dict[str, Any]:
    """Which transport the worker's engine-driven context uses, and its regions."""
    ctx = client.worker.transfer_ctx
    # 0.5.3 keeps it on its per-object-group helper, the others on the context.
    staging = getattr(ctx, "_staging", None) or getattr(getattr(ctx, "_object_groups", None), "staging", None)
    if staging is None:
        return {"transport": "mq", "store_region": None, "retrieve_region": None}
    store, retrieve = staging._store_region, staging._retrieve_region  # noqa: SLF001 - observed, not used
    return {"transport": "staging", "store_region": store.name if store else None,
            "retrieve_region": retrieve.name if retrieve else None}


def _probe_elsewhere() -> None:
    """Make the worker's probe name one that does not exist on this host."""
    from lmcache.v1.multiprocess.transfer_context import worker_transfer as wt  # noqa: PLC0415

    def elsewhere() -> tuple[None, list[str]]:
        return None, [f"lmcache_ed_staging_0_{secrets.token_hex(8)}", secrets.token_hex(16)]

    if not hasattr(wt, "staging_probe"):
        raise RuntimeError("--probe-elsewhere: this worker_transfer has no staging_probe (not revision 3)")
    wt.staging_probe = elsewhere  # the name register() calls


def probe(args: argparse.Namespace) -> dict[str, Any]:
    from gate import restore_env, restore_server  # noqa: PLC0415 - the server helpers the CPU restore gate uses

    from gate import restore_client as gc  # noqa: PLC0415
    from gate import geometry, procs  # noqa: PLC0415
    from gate.xver_outcome import preset as gate_preset  # noqa: PLC0415

    if args.probe_elsewhere:
        _probe_elsewhere()
    geo = gate_preset(args.preset)
    chunk = args.chunk_blocks * geo.tokens_per_block
    end = args.chunks * chunk
    doc: dict[str, Any] = {"format": FORMAT, "preset": geo.name, "k": geo.k, "chunks": args.chunks,
                           "chunk_tokens": chunk, "versions": restore_env.versions(), "probe_elsewhere": args.probe_elsewhere,
                           "server_overlay": str(args.server_overlay) if args.server_overlay else None}
    rounds: list[dict[str, Any]] = []
    doc["rounds"] = rounds
    with procs.Supervisor() as sup:
        workdir = sup.tempdir(prefix="ed-staging-probe-")
        l2_dir = workdir / "l2"
        l2_dir.mkdir()
        zp, hp = procs.free_ports(2)
        spec = restore_server.ServerSpec(zp, hp, chunk, args.l1_size_gb, l2_dir, workdir, transfer_mode="engine_driven")
        pythonpath = f"{args.server_overlay}:{_REPO}" if args.server_overlay else None
        server = restore_server.launch_server(sup, spec, "probe", pythonpath=pythonpath)
        restore_server.await_server(server, spec, args.server_timeout)
        pids = [os.getpid(), server.pid]
        doc["server_pid"], doc["worker_pid"] = server.pid, os.getpid()
        client = None
        try:
            model = f"ed-staging-probe-{geo.name}-{uuid.uuid4().hex[:8]}"
            layout = gc.Layout(geo, geometry.engine_group_infos(geo, "connector"))
            per_group = args.chunks * args.chunk_blocks
            num_blocks, src, dst = gc.disjoint_store_and_restore_ids(layout.num_groups, per_group, args.seed)
            client = gc.Client(spec.zmq_url, model, layout, mq_timeout=args.step_timeout,
                               transfer_mode="engine_driven")
            client.register(geometry.build_kv_caches(geo, num_blocks, fill=0))
            expected = gc.fill_source(client, src, args.seed)  # after registration
            doc["after_register"] = {**_transport(client), "shm_names": staging_names(pids)}
            rng = random.Random(args.seed)
            for rnd in range(args.rounds):
                tokens = [rng.randrange(1, 150_000) for _ in range(end + geo.tokens_per_block // 2)]
                row: dict[str, Any] = {"round": rnd}
                rid = f"probe-store-{uuid.uuid4().hex[:10]}"
                row["miss_tokens"] = client.lookup(rid, tokens, args.step_timeout)
                row["stored"] = client.store(rid, tokens, src, end, args.step_timeout)
                client.finish_request(rid)
                row["shm_names_after_store"] = staging_names(pids)
                row["after_store"] = _transport(client)
                gc.poison(client, {layer: dst[layout.group_of_layer[layer]]
                                   for layer in range(len(geo.layer_kinds))})
                rid = f"probe-retrieve-{uuid.uuid4().hex[:10]}"
                hit = client.lookup(rid, tokens, args.step_timeout)
                ok, detail = False, "no hit"
                if hit:
                    ok, detail = client.retrieve(rid, tokens, dst, hit, args.step_timeout)
                client.finish_request(rid)
                row["shm_names_after_retrieve"] = staging_names(pids)
                row["after_retrieve"] = _transport(client)
                check = gc.check_restore(client, dst, expected, chunks=args.chunks,
                                         blocks_per_chunk=args.chunk_blocks, restored_chunks=hit // chunk,
                                         untouched=gc.POISON)
                row.update(hit_tokens=hit, stored_tokens=end, retrieve_ok=ok, retrieve_detail=detail,
                           chunks_exact=check["chunks_exact"])
                rounds.append(row)
        finally:
            if client is not None:
                client.close(graceful=server.alive())
            doc["server_log_errors"] = [line for line in procs.ansi_strip(server.log_text()).splitlines()
                                        if " ERROR " in line or "Traceback" in line][:20]
            doc["server_log_staging"] = [line for line in procs.ansi_strip(server.log_text()).splitlines()
                                         if "lmcache-patchtool engine-driven" in line][:20]
    doc["shm_names_at_end"] = staging_names(pids)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen35-0.8b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--chunk-blocks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=2468)
    ap.add_argument("--l1-size-gb", type=float, default=1.0)
    ap.add_argument("--step-timeout", type=float, default=30.0)
    ap.add_argument("--server-timeout", type=float, default=120.0)
    ap.add_argument("--server-overlay", type=Path, help="run the server from this lmcache tree")
    ap.add_argument("--probe-elsewhere", action="store_true",
                    help="the worker's probe names a segment that does not exist here (another host)")
    args = ap.parse_args(argv)
    from gate import restore_env  # noqa: PLC0415 - stdlib only; kept beside the probe's other lazy imports

    return restore_env.run_json_probe(lambda: probe(args), "ed-staging-probe", FORMAT)


if __name__ == "__main__":
    sys.exit(main())
