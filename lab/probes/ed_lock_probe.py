"""Read-lock release probe of an engine-driven retrieve, through the real server.

docs/design/engine-driven.md, section 4: the pristine engine-driven retrieve
reads and releases object group 0's keys only
(``_resolve_single_group_obj_keys``).  Once a registration declares several
object groups, the LOOKUP read-locks every group's keys, so a retrieve that
releases group 0 only leaves groups 1..N read-locked: those L1 objects stay
pinned (eviction and deletion skip them) until the read-lock TTL (300 s by
default) runs out.

Run in a runtime venv with the overlay under test first on PYTHONPATH::

    PYTHONPATH=<overlay>:<repo> <runtime>/bin/python -m lab.probes.ed_lock_probe \\
        [--preset qwen35-0.8b] [--transfer-mode engine_driven]

What it does, all through the real ``lmcache server`` (started on 127.0.0.1
with the restore gate's ``ServerSpec``: L1 plus an ``fs`` L2 in a temporary
directory, ``--supported-transfer-mode engine_driven``) and LMCache's own
adapters (``restore_client.Client``):

1. register a hybrid's CPU KV caches in engine-driven mode, LOOKUP (a miss),
   STORE ``--chunks`` chunks, END_SESSION;
2. wait until every object is a file in the L2 directory and the L1 holds no
   staging, write-locked or read-locked object; the keys of every object
   group are read back from those file names with the installed fs adapter's
   own ``_filename_to_object_key`` (the fs adapter has no listing API);
3. LOOKUP again (the server prefetches, read-locking every object group's
   keys), RETRIEVE into other blocks (compared byte for byte afterwards),
   END_SESSION (waited for through ``GET /status``'s ``active_sessions``,
   then up to ``--settle`` seconds for the read locks to drop: a release
   may run in a host callback just after the answer; a leaked lock lasts
   the read-lock TTL);
4. observes the locks two ways, both the server's own:

   * ``GET /status`` -> ``l1_manager.read_locked_count`` (objects whose read
     lock is held) after the store, after the lookup, after the retrieve and
     after END_SESSION;
   * per object group, at the end: ``DELETE /cache/objects`` with that
     group's keys, ``tier=l1``, ``force=false``.  The server skips a key that
     is still read-locked (``skipped``) and deletes an unpinned one
     (``deleted``): the group's evictability.  ``skipped`` is the number of
     the group's keys whose read lock leaked.

Prints one JSON object (the last line of stdout).  Exit code 0 when the probe
ran (whatever it found), 2 when it could not (server, registration, store).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
import uuid
from typing import Any


FORMAT = 1


def _http(spec: Any, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{spec.host}:{spec.http_port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback only
        return json.loads(resp.read())


def _status(spec: Any) -> dict[str, Any]:
    doc = _http(spec, "GET", "/status")
    sm = doc["storage_manager"]
    l1 = sm.get("l1_manager") or next(iter(sm["l1_managers"].values()))
    sc = sm.get("store_controller") or next(iter(sm["store_controllers"].values()))
    # 0.5.5's /status has no staging_object_count (0.5.6 added it): 0 there.
    return {"read_locked_count": l1["read_locked_count"], "write_locked_count": l1["write_locked_count"],
            "staging_object_count": l1.get("staging_object_count", 0),
            "total_object_count": l1["total_object_count"], "temporary_count": l1.get("temporary_count"), "active_sessions": doc.get("active_sessions"),
            "l2_store_pending_keys": sc.get("pending_keys_count"), "l2_store_in_flight": sc.get("in_flight_task_count")}


def _wait(what: str, predicate, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def _encoded(key: Any) -> dict[str, Any]:
    return {"chunk_hash_hex": key.chunk_hash.hex(), "model_name": key.model_name, "kv_rank": key.kv_rank,
            "object_group_id": key.object_group_id, "cache_salt": key.cache_salt}


def probe(args: argparse.Namespace) -> dict[str, Any]:
    from gate import restore_env, restore_server  # noqa: PLC0415 - the server helpers the CPU restore gate uses
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter  # noqa: PLC0415

    from gate import restore_client as gc  # noqa: PLC0415
    from gate import geometry, procs  # noqa: PLC0415
    from gate.xver_outcome import preset as gate_preset  # noqa: PLC0415

    geo = gate_preset(args.preset)
    chunk = args.chunk_blocks * geo.tokens_per_block
    end = args.chunks * chunk
    doc: dict[str, Any] = {"format": FORMAT, "preset": geo.name, "k": geo.k, "transfer_mode": args.transfer_mode,
                           "chunks": args.chunks, "chunk_tokens": chunk, "versions": restore_env.versions(),
                           "observed_through": "real lmcache server: GET /status (read_locked_count) and "
                                               "DELETE /cache/objects tier=l1 force=false per object group"}
    phases: dict[str, Any] = {}
    doc["phases"] = phases
    with procs.Supervisor() as sup:
        workdir = sup.tempdir(prefix="ed-lock-probe-")
        l2_dir = workdir / "l2"
        l2_dir.mkdir()
        zp, hp = procs.free_ports(2)
        spec = restore_server.ServerSpec(zp, hp, chunk, args.l1_size_gb, l2_dir, workdir, transfer_mode=args.transfer_mode)
        server = restore_server.launch_server(sup, spec, "probe")
        restore_server.await_server(server, spec, args.server_timeout)
        doc["server_argv"] = list(server.argv)
        client = None
        try:
            model = f"ed-lock-probe-{geo.name}-{uuid.uuid4().hex[:8]}"
            layout = gc.Layout(geo, geometry.engine_group_infos(geo, "connector"))
            per_group = args.chunks * args.chunk_blocks
            num_blocks, src, dst = gc.disjoint_store_and_restore_ids(layout.num_groups, per_group, args.seed)
            client = gc.Client(spec.zmq_url, model, layout, mq_timeout=args.step_timeout,
                               transfer_mode=args.transfer_mode)
            client.register(geometry.build_kv_caches(geo, num_blocks, fill=0))
            expected = gc.fill_source(client, src, args.seed)  # after registration
            rng = random.Random(args.seed)
            tokens = [rng.randrange(1, 150_000) for _ in range(end + geo.tokens_per_block // 2)]
            doc["engine_groups"] = layout.num_groups

            # 1. store
            rid = f"probe-store-{uuid.uuid4().hex[:10]}"
            miss = client.lookup(rid, tokens, args.step_timeout)
            stored = client.store(rid, tokens, src, end, args.step_timeout)
            client.finish_request(rid)
            doc["store"] = {"lookup_before_store_hit_tokens": miss, "ok": stored}
            if not stored:
                raise RuntimeError("the server did not confirm the store")

            # 2. every object on disk, L1 quiet; the keys of every object group
            logged_groups = restore_server.object_groups(procs.ansi_strip(server.log_text()), model)
            _wait(f"{args.chunks * logged_groups} objects in the L2 directory",
                  lambda: len(restore_server.l2_objects(l2_dir, model)) >= args.chunks * logged_groups, args.step_timeout)
            phases["after_store"] = _wait(
                "the L2 writes drained and an L1 without staging, write- or read-locked objects",
                lambda: (lambda s: s if not (s["staging_object_count"] or s["write_locked_count"]
                                             or s["read_locked_count"] or s["l2_store_pending_keys"]
                                             or s["l2_store_in_flight"] or list(l2_dir.glob("*.tmp")))
                         else None)(_status(spec)),
                args.step_timeout)
            keys: dict[int, list[dict[str, Any]]] = {}
            for path in restore_server.l2_objects(l2_dir, model):
                key = fs_l2_adapter._filename_to_object_key(path.name)
                if key is not None:
                    keys.setdefault(key.object_group_id, []).append(_encoded(key))
            groups = max([logged_groups, *(g + 1 for g in keys)])
            doc["object_groups"] = groups
            doc["object_groups_logged"] = logged_groups
            doc["keys_per_group"] = {str(g): len(v) for g, v in sorted(keys.items())}

            # 3. lookup, retrieve, end the session
            gc.poison(client, {layer: dst[layout.group_of_layer[layer]] for layer in range(len(geo.layer_kinds))})
            rid = f"probe-retrieve-{uuid.uuid4().hex[:10]}"
            hit = client.lookup(rid, tokens, args.step_timeout)
            phases["after_lookup"] = _status(spec)
            ok, detail = (False, "no hit")
            if hit:
                try:
                    ok, detail = client.retrieve(rid, tokens, dst, hit, args.step_timeout)
                except Exception as exc:  # noqa: BLE001 - reported, the locks are still observed
                    ok, detail = False, f"raised {type(exc).__name__}: {exc}"
            phases["after_retrieve"] = _status(spec)
            client.finish_request(rid)
            _wait("END_SESSION of both requests (active_sessions 0)",
                  lambda: _status(spec)["active_sessions"] == 0, args.step_timeout)
            # A release may run in a host callback just after the answer (the
            # lmcache-driven retrieve does): give it --settle seconds.  A leaked
            # lock lasts the read-lock TTL (300 s by default).
            t0 = time.monotonic()
            while True:
                st = _status(spec)
                if st["read_locked_count"] == 0 or time.monotonic() - t0 > args.settle:
                    break
                time.sleep(0.05)
            st["seconds_after_session_end"] = round(time.monotonic() - t0, 3)
            phases["after_end_session"] = st
            check = gc.check_restore(client, dst, expected, chunks=args.chunks, blocks_per_chunk=args.chunk_blocks,
                                     restored_chunks=hit // chunk, untouched=gc.POISON)
            doc["retrieve"] = {"hit_tokens": hit, "stored_tokens": end, "ok": ok, "detail": detail,
                               "chunks_exact": check["chunks_exact"]}

            # 4. evictability per object group (destructive: last)
            per_group_doc = {}
            for g in range(groups):
                group_keys = keys.get(g, [])
                res = _http(spec, "DELETE", "/cache/objects",
                            {"keys": group_keys, "tier": "l1", "force": False}) if group_keys else \
                    {"deleted": 0, "skipped": 0, "ok": True}
                per_group_doc[str(g)] = {"keys": len(group_keys), "read_locked_after_end_session": res["skipped"],
                                         "evictable": res["deleted"],
                                         "not_in_l1": len(group_keys) - res["deleted"] - res["skipped"]}
            doc["groups"] = per_group_doc
            phases["after_delete"] = _status(spec)
        finally:
            if client is not None:
                client.close(graceful=server.alive())
            doc["server_log_errors"] = [line for line in procs.ansi_strip(server.log_text()).splitlines()
                                        if " ERROR " in line or "Traceback" in line][:20]
    leaked = {g: d["read_locked_after_end_session"] for g, d in doc["groups"].items()}
    doc["summary"] = {"read_locked_after_lookup": phases["after_lookup"]["read_locked_count"],
                      "read_locked_after_end_session": phases["after_end_session"]["read_locked_count"],
                      "leaked_per_group": leaked, "all_released": not any(leaked.values())
                      and phases["after_end_session"]["read_locked_count"] == 0}
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen35-0.8b")
    ap.add_argument("--transfer-mode", default="engine_driven", choices=["engine_driven", "lmcache_driven", "auto"])
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--chunk-blocks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--l1-size-gb", type=float, default=1.0)
    ap.add_argument("--step-timeout", type=float, default=30.0)
    ap.add_argument("--server-timeout", type=float, default=120.0)
    ap.add_argument("--settle", type=float, default=5.0,
                    help="seconds to let read locks drop after END_SESSION before observing (default 5)")
    args = ap.parse_args(argv)
    from gate import restore_env  # noqa: PLC0415 - stdlib only; kept beside the probe's other lazy imports

    return restore_env.run_json_probe(lambda: probe(args), "ed-lock-probe", FORMAT)


if __name__ == "__main__":
    sys.exit(main())
