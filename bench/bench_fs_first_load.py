#!/usr/bin/env python3
"""A restarted server's first fs L2 lookup and load against its later ones (issue 39: the
first restore after a restart).

The REAL ``FSL2Adapter`` (the shipped hybrid-fa series of ``--version``, its runtime venv).
One process stores ``--loads`` requests of ``--chunks`` objects of ``--size`` bytes and reads
every file back, so the page cache holds them all.  Then ``--starts`` new processes, each a
server after a restart, build a new adapter and time, request after request, the lookup a
prefetch makes (every key's file checked) and the load into touched buffers (LMCache
first-touches its L1 at start).  Each request's keys are new to that process; the bytes are
in the page cache for all of them, so the first request differs from the rest only by what
the adapter and its event loop build on first use.

The starts alternate between two kinds: ``plain``, and ``prewarmed``, where the new adapter's
event loop starts its executor's threads (one sleeping job per thread) before the first
request.  If the first request's extra cost is thread creation, the prewarmed first request
does not pay it.

It prints, per kind, the medians over the processes of the first request and of the later
ones, and their ratio, with the load average before and after.  Nothing is asserted about
time.

    python -m bench.bench_fs_first_load                      # 0.5.6, 8 starts of each kind, 9 x 1.25 MiB
    python -m bench.bench_fs_first_load --json FILE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# asyncio's default executor (concurrent.futures.ThreadPoolExecutor) makes up to this many threads
EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)


def worker(base: Path, phase: str, loads: int, chunks: int, size: int, prewarm: bool) -> None:
    """Runs in the runtime venv with the overlay first on PYTHONPATH (imports lmcache)."""
    from lmcache.v1.distributed.api import ObjectKey  # noqa: PLC0415
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter as fsa  # noqa: PLC0415

    from bench.bench_l2_checksum import HostObject, wait_for_task  # noqa: PLC0415 - inside the runtime venv

    def keys(request: int) -> list[Any]:
        return [ObjectKey(chunk_hash=request.to_bytes(4, "big") + i.to_bytes(4, "big"), model_name="bench/m",
                          kv_rank=0x01000100, object_group_id=0) for i in range(chunks)]

    adapter = fsa.FSL2Adapter(fsa.FSL2AdapterConfig(str(base)))
    try:
        if phase == "store":
            src = [HostObject(size) for _ in range(chunks)]
            blob = os.urandom(size)
            for o in src:
                o.mem[:] = blob
            for r in range(loads):
                if int(wait_for_task(lambda t: adapter.pop_completed_store_tasks().get(t),
                             adapter.submit_store_task(keys(r), src))) < 0:
                    raise SystemExit(f"bench_fs_first_load: store failed in {base}")
            for p in base.iterdir():  # every file into the page cache
                p.read_bytes()
            return
        dst = [HostObject(size) for _ in range(chunks)]
        for d in dst:  # touched, as LMCache's L1 is at start
            d.mem[:] = bytes(size)
        if prewarm:
            loop = adapter._loop  # the adapter's own event loop thread
            loop.call_soon_threadsafe(lambda: [loop.run_in_executor(None, time.sleep, 0.02)
                                               for _ in range(EXECUTOR_THREADS)])
            time.sleep(0.1)
        out = []
        for r in range(loads):
            ks = keys(r)
            t0 = time.perf_counter()
            found = wait_for_task(adapter.query_lookup_and_lock_result, adapter.submit_lookup_and_lock_task(ks, {}))
            t1 = time.perf_counter()
            adapter.submit_unlock(ks)
            t2 = time.perf_counter()
            bitmap = wait_for_task(adapter.query_load_result, adapter.submit_load_task(ks, dst))
            t3 = time.perf_counter()
            if len(found.get_indices_list()) != chunks or len(bitmap.get_indices_list()) != chunks:
                raise SystemExit(f"bench_fs_first_load: request {r} missed objects in {base}")
            out.append({"lookup_s": t1 - t0, "load_s": t3 - t2})
        print(json.dumps(out), flush=True)
    finally:
        adapter.close()


def _runtime(version: str) -> tuple[Path, dict[str, str]]:
    """The runtime venv's python and an environment with the shipped hybrid-fa overlay first
    (provisioned once per run, not per worker)."""
    from lab import provision  # noqa: PLC0415

    python = provision.runtime_env(version) / "bin" / "python"
    overlay = provision.overlay(version, sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch")))
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", LMCACHE_LOG_LEVEL="WARNING", LMCACHE_DISABLE_BANNER="1")
    return python, env


def _run_worker(runtime: tuple[Path, dict[str, str]], base: Path, phase: str, args: argparse.Namespace,
                prewarm: bool = False) -> str:
    python, env = runtime
    argv = [str(python), "-m", "bench.bench_fs_first_load", "--worker", str(base), "--phase", phase,
            "--loads", str(args.loads), "--chunks", str(args.chunks), "--size", str(args.size)] \
        + (["--prewarm"] if prewarm else [])
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"bench_fs_first_load: the {phase} worker failed (rc {proc.returncode}): "
                         f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.5.6")
    ap.add_argument("--starts", type=int, default=8, help="new adapter processes (restarts) of each kind")
    ap.add_argument("--loads", type=int, default=5, help="requests per process, the first included")
    ap.add_argument("--chunks", type=int, default=9,
                    help="objects per request (default 9: the engine bench's first restore, 3,073 tokens, on a "
                         "host whose block is 384 tokens)")
    ap.add_argument("--size", type=int, default=1310720, help="bytes per object (the tiny hybrid's)")
    ap.add_argument("--prewarm", action="store_true", help=argparse.SUPPRESS)  # a worker's kind
    ap.add_argument("--json", type=Path, help="also write the figures as JSON to this file")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--phase", choices=["store", "load"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.loads < 2 or args.starts < 1:
        ap.error("--loads must be >= 2 and --starts >= 1")
    if args.worker:
        worker(args.worker, args.phase, args.loads, args.chunks, args.size, args.prewarm)
        return 0

    runtime = _runtime(args.version)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-fs-first-load-") as tmp:
        _run_worker(runtime, Path(tmp), "store", args)
        runs: dict[str, list] = {"plain": [], "prewarmed": []}
        for i in range(args.starts):  # alternating, so that drift hits both kinds alike
            for kind in (("plain", "prewarmed") if i % 2 == 0 else ("prewarmed", "plain")):
                runs[kind].append(json.loads(_run_worker(runtime, Path(tmp), "load", args, kind == "prewarmed")))
    load1 = os.getloadavg()[0]

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1000, 2)

    figures: dict[str, dict] = {}
    for kind, kruns in runs.items():
        for f in ("lookup_s", "load_s"):
            first = ms([r[0][f] for r in kruns])
            later = ms([x[f] for r in kruns for x in r[1:]])
            figures.setdefault(kind, {})[f.removesuffix("_s")] = {
                "first_ms": first, "later_ms": later, "first_over_later": round(first / later, 2)}
    print(f"fs L2, a new adapter per start ({args.starts} starts of each kind, {args.loads} requests each, "
          f"{args.chunks} x {args.size} B, page cache warm); load {load0:.2f} -> {load1:.2f}")
    for kind, kf in figures.items():
        for name, f in kf.items():
            print(f"  {kind:>9} {name:>6}: first {f['first_ms']:.2f} ms, later {f['later_ms']:.2f} ms (median), "
                  f"first/later {f['first_over_later']:.2f}x")
    if args.json:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        args.json.write_text(json.dumps({
            "command": ["bench_fs_first_load.py", *(sys.argv[1:] if argv is None else argv)],
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_head": head, "cpus": os.cpu_count(),
            "version": args.version, "starts": args.starts, "loads": args.loads,
            "chunks": args.chunks, "size": args.size, "load_average": [load0, load1], "figures": figures,
            "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
