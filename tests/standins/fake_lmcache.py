#!/usr/bin/env python3
"""Stand-in for ``lmcache server`` (0.5.3 MP mode) for the engine gate's CPU tests.

Accepts the real command line (``--host/--port`` for the engine channel,
``--http-host/--http-port`` for ``/healthcheck``, ``/status``, ``/metrics``,
``--chunk-size``, ``--l2-adapter '{"type":"fs","base_path":DIR}'``; unknown
options are ignored).  Instead of ZMQ the engine channel is plain HTTP
(``/fake/register``, ``/fake/lookup``, ``/fake/retrieve``, ``/fake/store``),
spoken by ``fake_vllm.py``.  "KV" is the chunk's token ids.

``--fake-mode``:

* ``patched``    stores chunks whole; logs ``group 1: sub-paged, k=K (...) [lmcache-patchtool hybrid-fa]``.
* ``pristine``   logs ``group 1: compressed (...)`` and, like the real 1-of-k bug, keeps only the
                 first kernel page of every chunk (the rest becomes token 0).
* ``nolog``      stores correctly but logs no group line.
* ``nometrics``  serves ``/metrics`` without any lmcache_mp counter.

``/metrics`` behaves like LMCache's OpenTelemetry Prometheus exporter: a
counter that was never incremented is not exported at all (a freshly started
server has no ``lmcache_mp_l2_prefetch_*`` series before its first L2 read).
``--fake-metrics zeros`` exports every counter from the start instead.
* ``noflush``    never completes L2 stores.
* ``crash``      exits with status 3 before becoming healthy.
* ``hang``       never becomes healthy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import die, log, serve
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="localhost")
    ap.add_argument("--port", type=int, default=5555)
    ap.add_argument("--http-host", default="0.0.0.0")
    ap.add_argument("--http-port", type=int, default=8080)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--l1-size-gb", type=float, required=True)
    ap.add_argument("--eviction-policy", required=True)
    ap.add_argument("--l2-adapter", action="append", default=[])
    ap.add_argument("--fake-mode", default=os.environ.get("FAKE_LMCACHE_MODE", "patched"))
    ap.add_argument("--fake-flush-delay", type=float, default=0.3)
    ap.add_argument("--fake-metrics", choices=["otel", "zeros"], default=os.environ.get("FAKE_LMCACHE_METRICS", "otel"),
                    help="otel: omit counters until their first increment (LMCache's exporter); zeros: export all")
    args, _unknown = ap.parse_known_args()
    mode = args.fake_mode

    l2_dir = None
    for spec in args.l2_adapter:
        d = json.loads(spec)
        if d.get("type") == "fs":
            l2_dir = Path(d["base_path"])
    if l2_dir is None:
        die("fake lmcache: an fs L2 adapter is required by the stand-in")
    l2_dir.mkdir(parents=True, exist_ok=True)

    log(f"LMCache (stand-in) starting, mode={mode}, chunk_size={args.chunk_size}, L2 fs at {l2_dir}")
    if mode == "crash":
        die("fake lmcache: simulated startup crash", 3)
    if mode == "hang":
        while True:
            time.sleep(1)

    lock = threading.Lock()
    l1: dict[str, list[int]] = {}
    counters = {k: 0 for k in ("l2_store_submitted", "l2_store_completed", "l2_prefetch_lookup",
                               "l2_prefetch_hit", "l2_prefetch_loaded", "chunks_loaded", "l1_write",
                               "l1_read", "lookup_hit_tokens", "lookup_requested_tokens")}
    geometry = {"page": None}

    def inc(name: str, n: int = 1) -> None:
        with lock:
            counters[name] += n

    def l2_path(h: str) -> Path:
        return l2_dir / f"{h}.json"

    def l2_write(items: list[tuple[str, list[int]]]) -> None:
        time.sleep(args.fake_flush_delay)
        if mode == "noflush":
            return
        for h, ids in items:
            # One .tmp per writer thread: two flushes of one hash must not
            # rename each other's file (LMCache's adapter is per-object too).
            tmp = l2_dir / f"{h}.{threading.get_ident()}.tmp"
            tmp.write_text(json.dumps(ids))
            tmp.rename(l2_path(h))
        inc("l2_store_completed", len(items))

    def register(_h, body):
        tpb, spb = int(body["tokens_per_block"]), int(body["slots_per_block"])
        geometry["page"] = spb
        if mode in ("patched", "nometrics", "noflush") and tpb > spb:
            k = tpb // spb
            log(f"INFO kv_layer_groups: group 1: sub-paged, k={k} (tokens_per_block={tpb}, slots_per_block={spb}): "
                f"each logical block is {k} kernel pages, all of them are transferred [lmcache-patchtool hybrid-fa]")
        elif mode == "pristine" and tpb != spb:
            log(f"INFO kv_layer_groups: group 1: compressed (tokens_per_block={tpb}, slots_per_block={spb})")
        return 200, "application/json", {"chunk_size": args.chunk_size}

    def lookup(_h, body):
        hashes = body["hashes"]
        inc("lookup_requested_tokens", len(hashes) * args.chunk_size)
        n = 0
        missing = []
        for h in hashes:
            with lock:
                in_l1 = h in l1
            if in_l1:
                n += 1
                continue
            if l2_path(h).exists():
                missing.append(h)
                n += 1
                continue
            break
        if missing:
            inc("l2_prefetch_lookup")
            inc("l2_prefetch_hit", len(missing))
            for h in missing:
                ids = json.loads(l2_path(h).read_text())
                with lock:
                    l1[h] = ids
            inc("l2_prefetch_loaded", len(missing))
        inc("lookup_hit_tokens", n * args.chunk_size)
        return 200, "application/json", {"hit_chunks": n}

    def retrieve(_h, body):
        out = []
        for h in body["hashes"]:
            with lock:
                out.append(l1.get(h))
        inc("l1_read", len(out))
        inc("chunks_loaded", len(out))
        return 200, "application/json", {"chunks": out}

    def store(_h, body):
        items = []
        for item in body["chunks"]:
            ids = list(item["ids"])
            if mode == "pristine":
                page = geometry["page"] or 32
                ids = ids[:page] + [0] * (len(ids) - page)  # 1 of k pages survives
            with lock:
                l1[item["hash"]] = ids
            items.append((item["hash"], ids))
        inc("l1_write", len(items))
        inc("l2_store_submitted", len(items))
        threading.Thread(target=l2_write, args=(items,), daemon=True).start()
        return 200, "application/json", {"stored": len(items)}

    def healthcheck(_h, _b):
        return 200, "application/json", {"status": "healthy"}

    def status(_h, _b):
        return 200, "application/json", {"is_healthy": True, "chunk_size": args.chunk_size, "counters": counters}

    def metrics(_h, _b):
        if mode == "nometrics":
            return 200, "text/plain", "# HELP process_open_fds x\n# TYPE process_open_fds gauge\nprocess_open_fds 7.0\n"
        names = {"l2_store_submitted": "lmcache_mp_l2_store_submitted_objects_chunks_total",
                 "l2_store_completed": "lmcache_mp_l2_store_completed_objects_chunks_total",
                 "l2_prefetch_lookup": "lmcache_mp_l2_prefetch_lookup_requests_total",
                 "l2_prefetch_hit": "lmcache_mp_l2_prefetch_hit_chunks_total",
                 "l2_prefetch_loaded": "lmcache_mp_l2_prefetch_load_completed_chunks_total",
                 "chunks_loaded": "lmcache_mp_num_chunks_loaded_total",
                 "l1_write": "lmcache_mp_l1_write_chunks_total", "l1_read": "lmcache_mp_l1_read_chunks_total",
                 "lookup_hit_tokens": "lmcache_mp_lookup_hit_tokens_total",
                 "lookup_requested_tokens": "lmcache_mp_lookup_requested_tokens_total"}
        lines = ['target_info{service_name="unknown_service"} 1.0']
        with lock:
            snap = dict(counters)
        for key, name in names.items():
            if args.fake_metrics == "otel" and not snap[key]:
                continue  # the OTel exporter has no data point for a counter never added to
            lines += [f"# HELP {name} ", f"# TYPE {name} counter", f'{name}{{l2_name="fs"}} {float(snap[key])}']
        return 200, "text/plain; version=0.0.4", "\n".join(lines) + "\n"

    serve(args.host, args.port, {("POST", "/fake/register"): register, ("POST", "/fake/lookup"): lookup,
                                 ("POST", "/fake/retrieve"): retrieve, ("POST", "/fake/store"): store})
    serve(args.http_host, args.http_port, {("GET", "/healthcheck"): healthcheck, ("GET", "/status"): status,
                                           ("GET", "/metrics"): metrics})
    log("LMCache HTTP server initialized (stand-in)")

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    log("Shutting down LMCache HTTP server... (stand-in)")


if __name__ == "__main__":
    main()
