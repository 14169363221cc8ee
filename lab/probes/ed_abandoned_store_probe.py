"""An engine-driven store the engine never finished: what the server serves after it.

In engine-driven mode the worker stores in three phases: ``prepare_store``
(the server reserves L1 objects, write-locked, and hands their shared-memory
slots to the worker), the copy of the KV into those slots, and
``commit_store`` (the server's ``finish_write``).  When the engine goes away
between the first and the last (killed, crashed, shut down with a store in
flight, or the copy raised), the reservation stays pending on the server.
When the server then drops the instance (UNREGISTER on a clean shutdown, or
its reaper once the heartbeat stops), ``_release_entry`` in
``engine_driven_transfer.py`` calls ``finish_write`` on those pending keys
(LMCache 0.5.3-0.5.6 alike): objects whose bytes the engine never wrote
become resident L1 objects, are stored to L2 by the store controller, and are
served to the next engine that asks for the same prefix.

This probe plays it through the real server (the restore gate's
``ServerSpec``: L1 plus an ``fs`` L2 in a temporary directory, engine-driven)
and LMCache's own adapters (``restore_client.Client``):

1. engine A registers, its store's ``prepare_store`` succeeds and then the
   engine "dies" before the copy (the probe makes the worker's
   ``prepare_store`` raise right after the server answered, in this process
   only), and A shuts down cleanly (UNREGISTER; the server's reaper, after a
   silent engine's heartbeat timeout, runs the same ``_release_entry``);
2. the probe waits until the server dropped A (its pending writes released),
   and reads ``GET /status`` and the L2 directory;
3. engine B (a new instance, its own caches) looks the prompt up and
   retrieves whatever hits into other blocks, compared byte for byte with
   what A would have stored.

A hit on any chunk is a wrong hit: A never wrote a byte.  Prints one JSON
object (the last line of stdout); exit 0 when the probe ran, 2 when it
could not.

    PYTHONPATH=<overlay>:<repo> <runtime>/bin/python -m lab.probes.ed_abandoned_store_probe \\
        [--preset qwen35-0.8b]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from typing import Any


FORMAT = 1


class EngineDied(RuntimeError):
    """Raised by the probe's ``prepare_store`` after the server answered."""


def _die_after_prepare() -> list[str]:
    """Make the worker's PREPARE_STORE raise once the server has answered it
    (this process only): the engine is gone before it copied a byte.  It is
    wrapped at the request client, where every engine-driven store path sends
    it (LMCache's SHM and pickle contexts, and the engine-driven set's
    staging regions, which reserve nothing until COMMIT_STORE)."""
    from lmcache.v1.multiprocess.transport import base  # noqa: PLC0415 - the installed tree
    from lmcache.v1.multiprocess.transport import zmq_impl  # noqa: F401, PLC0415 - installs its RPC methods on its class

    del zmq_impl  # imported for its side effect only

    def subclasses(cls: type) -> list[type]:
        return [cls, *(c for sub in cls.__subclasses__() for c in subclasses(sub))]

    wrapped = []
    # The ZMQ client gets its RPC methods installed on its own class, so each
    # class that defines prepare_store is wrapped.
    for cls in subclasses(base.RequestClient):
        original = cls.__dict__.get("prepare_store")
        if original is None:
            continue

        def prepare_then_die(self, *args, _original=original, **kwargs):
            future = _original(self, *args, **kwargs)
            future.result(timeout=30)
            raise EngineDied("probe: the engine died after PREPARE_STORE, before the copy")

        cls.prepare_store = prepare_then_die
        wrapped.append(f"{cls.__module__}.{cls.__qualname__}.prepare_store")
    return wrapped


def _transfer_kind(worker: Any) -> str:
    """The class of the worker's engine-driven context (SHM slots or pickle)."""
    for value in vars(worker).values():
        ctx = getattr(value, "_engine_driven_context", None)
        if ctx is not None:
            return type(ctx).__name__
    return "unknown"


def probe(args: argparse.Namespace) -> dict[str, Any]:
    from gate import restore_client as gc  # noqa: PLC0415 - imports torch and lmcache: the target env
    from gate import restore_env, restore_server, geometry, procs  # noqa: PLC0415
    from lab.probes.ed_lock_probe import _status, _wait  # noqa: PLC0415 - the server's own /status, read the same way
    from gate.xver_outcome import preset as gate_preset  # noqa: PLC0415

    geo = gate_preset(args.preset)
    chunk = args.chunk_blocks * geo.tokens_per_block
    end = args.chunks * chunk
    doc: dict[str, Any] = {"format": FORMAT, "preset": geo.name, "k": geo.k,
                           "chunks": args.chunks, "chunk_tokens": chunk, "versions": restore_env.versions()}
    with procs.Supervisor() as sup:
        workdir = sup.tempdir(prefix="ed-abandoned-store-")
        l2_dir = workdir / "l2"
        l2_dir.mkdir()
        zp, hp = procs.free_ports(2)
        spec = restore_server.ServerSpec(zp, hp, chunk, args.l1_size_gb, l2_dir, workdir,
                                      transfer_mode="engine_driven")
        server = restore_server.launch_server(sup, spec, "probe")
        restore_server.await_server(server, spec, args.server_timeout)
        model = f"ed-abandoned-{geo.name}-{uuid.uuid4().hex[:8]}"
        layout = gc.Layout(geo, geometry.engine_group_infos(geo, "connector"))
        per_group = args.chunks * args.chunk_blocks
        num_blocks, src, dst = gc.disjoint_store_and_restore_ids(layout.num_groups, per_group, args.seed)
        rng = random.Random(args.seed)
        tokens = [rng.randrange(1, 150_000) for _ in range(end + geo.tokens_per_block // 2)]
        a = b = None
        try:
            # 1. engine A: prepare succeeds, the copy and the commit never happen
            a = gc.Client(spec.zmq_url, model, layout, mq_timeout=args.step_timeout,
                          transfer_mode="engine_driven")
            a.register(geometry.build_kv_caches(geo, num_blocks, fill=0))
            expected = gc.fill_source(a, src, args.seed)
            doc["worker_transfer"] = _transfer_kind(a.worker)
            doc["wrapped"] = _die_after_prepare()
            rid = f"probe-a-{uuid.uuid4().hex[:10]}"
            a.lookup(rid, tokens, args.step_timeout)
            try:
                doc["a_store_confirmed"] = a.store(rid, tokens, src, end, args.step_timeout)
            except EngineDied as exc:
                doc["a_store_confirmed"] = f"raised: {exc}"
            doc["after_prepare"] = _status(spec)
            a.finish_request(rid)
            a.close(graceful=True)
            a = None
            # 2. the server drops A: no write-locked object left (released one way or the other)
            t0 = time.monotonic()
            doc["after_drop"] = _wait("the server to release engine A's pending writes",
                                      lambda: (lambda s: s if not s["write_locked_count"]
                                               and not s["staging_object_count"] else None)(_status(spec)),
                                      args.drop_timeout)
            doc["seconds_to_release"] = round(time.monotonic() - t0, 2)
            time.sleep(args.settle)  # let the store controller act on what it was told
            doc["after_settle"] = _status(spec)
            doc["l2_objects"] = len(restore_server.l2_objects(l2_dir, model))
            # 3. engine B asks for the same prompt
            b = gc.Client(spec.zmq_url, model, layout, mq_timeout=args.step_timeout,
                          transfer_mode="engine_driven")
            b.register(geometry.build_kv_caches(geo, num_blocks, fill=0))
            gc.poison(b, {layer: dst[layout.group_of_layer[layer]] for layer in range(len(geo.layer_kinds))})
            rid = f"probe-b-{uuid.uuid4().hex[:10]}"
            hit = b.lookup(rid, tokens, args.step_timeout)
            ok, detail = (False, "no hit")
            if hit:
                ok, detail = b.retrieve(rid, tokens, dst, hit, args.step_timeout)
            b.finish_request(rid)
            check = gc.check_restore(b, dst, expected, chunks=args.chunks, blocks_per_chunk=args.chunk_blocks,
                                     restored_chunks=hit // chunk, untouched=gc.POISON)
            doc["b"] = {"hit_tokens": hit, "retrieve_ok": ok, "detail": detail,
                        "chunks_exact": check["chunks_exact"]}
        finally:
            for c in (a, b):
                if c is not None:
                    c.close(graceful=server.alive())
            doc["server_log_engine_driven"] = [line for line in procs.ansi_strip(server.log_text()).splitlines()
                                               if "ngine-driven" in line or "shm" in line.lower()][:6]
            doc["server_log_errors"] = [line for line in procs.ansi_strip(server.log_text()).splitlines()
                                        if " ERROR " in line or "Traceback" in line][:10]
    hit_chunks = doc["b"]["hit_tokens"] // chunk
    doc["summary"] = {"hit_chunks": hit_chunks, "chunks_exact": doc["b"]["chunks_exact"],
                      "wrong_hit": hit_chunks > 0, "l2_objects_written": doc["l2_objects"]}
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen35-0.8b")
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--chunk-blocks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--l1-size-gb", type=float, default=0.5)
    ap.add_argument("--step-timeout", type=float, default=30.0)
    ap.add_argument("--drop-timeout", type=float, default=60.0,
                    help="how long the server may take to release engine A's pending writes")
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--server-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    from gate import restore_env  # noqa: PLC0415 - stdlib only; kept beside the probe's other lazy imports

    return restore_env.run_json_probe(lambda: probe(args), "ed-abandoned-store-probe", FORMAT)


if __name__ == "__main__":
    sys.exit(main())
