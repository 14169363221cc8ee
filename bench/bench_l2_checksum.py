#!/usr/bin/env python3
"""What the fs L2 object checksum (part 12-l2-checksum) costs, side by side; or, with
``--part``, what another fs-adapter part changes (``--part 20-fs-load-jobs``: the load in one
executor job per object, issue 39).

Two long-lived workers run the REAL ``FSL2Adapter`` in a version's runtime
venv, each in its own temporary directory on the same filesystem:

* A -- the series up to 12-l2-checksum, without it (upstream's adapter: no
  trailer, no check), or up to ``--part``;
* B -- the same parts and 12-l2-checksum (blake3 trailer written on store,
  verified on load), or ``--part``.

The parts after ``--part`` are left out of both: a later part may build on it
(20-fs-load-jobs reads 12's trailer), so the series without it cannot carry them.

Each round, each worker stores one request's objects (``--chunks`` chunks of
``--sizes`` bytes, fresh keys, one store task as the server submits it),
waits for the task, then loads them back into page-aligned buffers (one load
task, as a prefetch does) and checks every bit of the load bitmap; the files
are then removed.  Rounds alternate A B / B A (ABBA) so that drift on a
shared machine hits both alike.  In the same rounds worker B also times,
over the same bytes, the blake3 digest the adapter computes
(``_object_digest``) against a plain copy (``dst[:] = src``) and against
hashlib.sha256 and zlib.crc32.

Default sizes are one chunk of ``qwen35-0.8b`` on the CPU server at one block
per chunk (GDN state 3,342,336 B, attention 1,114,112 B).  By default the
files live in the page cache (written, then read back at once): the fastest
tier there is, so the check's share of the time is the largest it can be.
``--odirect`` sets the adapter's ``use_odirect``: every byte goes to and
comes from the disk.

With ``--server N`` it also runs the CPU restore gate (``gate/restore_gate.py``:
a real ``lmcache server`` with an fs tier, store, SIGKILL, restart, restore)
N times per build, alternating, on one ``--chunks``-chunk ``qwen35-0.8b``
request, and compares what a request sees: the client's store call, the time
until every object is on disk (polled every 20 ms), the lookup after the
restart (it waits for the L2 prefetch, so it includes reading and checking
every object) and the retrieve.

Prints medians, the ratios B/A, hash/copy, and the machine's load average
before and after.  Usage:

    .venv/bin/python -m bench.bench_l2_checksum [--version 0.5.6] [--rounds 7] [--chunks 16]
                                                [--server 3] [--json]
    .venv/bin/python -m bench.bench_l2_checksum --part 20-fs-load-jobs --sizes 1310720 --chunks 26 [--busy 2]

``--busy N`` runs N processes that spin on the CPU beside the counted rounds: on
2 cores, the two engine processes a server's prefetch competes with.
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
PART = "12-l2-checksum"
DEFAULT_SIZES = (3342336, 1114112)


# ---------------------------------------------------------------------------
# worker (target interpreter, lmcache on PYTHONPATH)
# ---------------------------------------------------------------------------


class HostObject:
    """What the adapter reads of a MemoryObj: ``byte_array``, page-aligned."""

    def __init__(self, size: int) -> None:
        import mmap  # noqa: PLC0415

        self.mem = mmap.mmap(-1, size)

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.mem)


def wait_for_task(poll, task_id: int) -> Any:
    """Poll the adapter for ``task_id``'s result until it has one."""
    while True:
        got = poll(task_id)
        if got is not None:
            return got
        time.sleep(0.0002)  # polling costs both builds alike


def worker(base: Path, sizes: list[int], chunks: int, odirect: bool = False, fresh_dst: bool = False) -> None:
    import hashlib  # noqa: PLC0415
    import zlib  # noqa: PLC0415

    from lmcache.v1.distributed.api import ObjectKey  # noqa: PLC0415
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter as fsa  # noqa: PLC0415

    adapter = fsa.FSL2Adapter(fsa.FSL2AdapterConfig(str(base), use_odirect=odirect))
    src = [HostObject(size) for _ in range(chunks) for size in sizes]
    blob = os.urandom(max(sizes))
    for o in src:
        o.mem[:] = blob[:len(o.mem)]
    dst = [HostObject(len(o.mem)) for o in src]
    total = sum(len(o.mem) for o in src)
    checked = hasattr(fsa, "SUM_TRAILER_LEN")

    def keys(round_no: int) -> list[Any]:
        return [ObjectKey(chunk_hash=round_no.to_bytes(4, "big") + i.to_bytes(4, "big"), model_name="bench/m",
                          kv_rank=0x01000100, object_group_id=i % len(sizes)) for i in range(len(src))]

    def popped(task: int) -> Any:
        return adapter.pop_completed_store_tasks().get(task)

    def timed(fn, reps: int = 3) -> float:
        best = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best.append(time.perf_counter() - t0)
        return min(best)

    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "round":
            ks = keys(int(cmd[1]))
            # Wall time and this process's CPU time (every thread: the adapter's
            # event loop and executor threads): on a shared, loaded machine the
            # wall clock swings, the CPU seconds an operation costs do not.
            t0, c0 = time.perf_counter(), time.process_time()
            result = wait_for_task(popped, adapter.submit_store_task(ks, src))
            t_store, c_store = time.perf_counter() - t0, time.process_time() - c0
            if int(result) < 0:  # L2StoreResult: -1 on failure
                raise SystemExit(f"bench worker: store failed in {base}")
            # the lookup a prefetch makes first (every key's file checked), then its unlock
            t0 = time.perf_counter()
            found = wait_for_task(adapter.query_lookup_and_lock_result, adapter.submit_lookup_and_lock_task(ks, {}))
            t_lookup = time.perf_counter() - t0
            adapter.submit_unlock(ks)
            if len(found.get_indices_list()) != len(ks):
                raise SystemExit(f"bench worker: the lookup found {len(found.get_indices_list())} of {len(ks)} in {base}")
            if fresh_dst:  # never-touched buffers: the load's first write to each page faults
                dst = [HostObject(len(o.mem)) for o in src]
            t0, c0 = time.perf_counter(), time.process_time()
            bitmap = wait_for_task(adapter.query_load_result, adapter.submit_load_task(ks, dst))
            t_load, c_load = time.perf_counter() - t0, time.process_time() - c0
            if len(bitmap.get_indices_list()) != len(ks):
                raise SystemExit(f"bench worker: {len(ks) - len(bitmap.get_indices_list())} loads missed in {base}")
            for p in base.glob("*.data"):
                p.unlink()
            out: dict[str, Any] = {"store_s": t_store, "lookup_s": t_lookup, "load_s": t_load,
                                   "store_cpu_s": c_store, "load_cpu_s": c_load, "bytes": total}
            if checked:  # the hash, a copy, and two stdlib checksums over the same bytes
                views = [o.byte_array for o in src]
                out["blake3_s"] = timed(lambda: [fsa._object_digest("x", v) for v in views])
                out["copy_s"] = timed(lambda: [d.byte_array.__setitem__(slice(None), v)
                                               for d, v in zip(dst, views)])
                out["sha256_s"] = timed(lambda: [hashlib.sha256(v).digest() for v in views], 1)
                out["crc32_s"] = timed(lambda: [zlib.crc32(v) for v in views], 1)
            print(json.dumps(out), flush=True)
    adapter.close()


# ---------------------------------------------------------------------------
# orchestrator (any Python 3.11; provisions the environments)
# ---------------------------------------------------------------------------


def _series(root: Path, version: str, with_part: bool, part: str = PART) -> list[Path]:
    """The parts before ``part``, and ``part`` itself when ``with_part``."""
    patches = sorted((root / version).glob("*.patch"))
    stems = [p.stem for p in patches]
    if part not in stems:
        raise SystemExit(f"bench_l2_checksum: {root / version} has no {part}")
    return patches[:stems.index(part) + (1 if with_part else 0)]


def _start(version: str, with_part: bool, base: Path, args: argparse.Namespace) -> subprocess.Popen:
    from lab import provision  # noqa: PLC0415

    python = provision.runtime_env(version) / "bin" / "python"
    overlay = provision.overlay(version, _series(Path(args.series_root), version, with_part, args.part))
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", LMCACHE_LOG_LEVEL="WARNING")
    argv = [str(python), __file__, "--worker", str(base), "--sizes", ",".join(map(str, args.sizes)),
            "--chunks", str(args.chunks)] + (["--odirect"] if args.odirect else []) \
        + (["--fresh-dst"] if args.fresh_dst else [])
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)


def _ask(proc: subprocess.Popen, cmd: str) -> dict[str, Any]:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"bench_l2_checksum: a worker died on {cmd!r} (rc {proc.wait()})")
    return json.loads(line)


def _gate_once(version: str, with_part: bool, args: argparse.Namespace) -> dict[str, float]:
    """One restore-gate run; the request-level timings of its one preset."""
    from lab import provision  # noqa: PLC0415

    python = provision.runtime_env(version) / "bin" / "python"
    overlay = provision.overlay(version, _series(Path(args.series_root), version, with_part, args.part))
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1")
    proc = subprocess.run([str(python), str(REPO / "gate" / "restore_gate.py"), "--json", "--quiet",
                           "--preset", "qwen35-0.8b", "--chunks", str(args.chunks), "--chunk-blocks", "1",
                           "--no-stay-alive"], capture_output=True, text=True, env=env, cwd=str(REPO))
    report = json.loads(proc.stdout)
    if report["verdict"] != "pass":
        raise SystemExit(f"bench_l2_checksum: the restore gate did not pass: {report['reason']}")
    (p,) = report["presets"]
    return {"store_call_s": p["stored"]["seconds"], "flush_to_disk_s": report["timings"]["flush_to_disk"],
            "lookup_after_restart_s": p["after_restart"]["lookup_seconds"],
            "retrieve_s": p["restored"]["retrieve_seconds"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.5.6")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunks", type=int, default=16, help="chunks per request (default 16)")
    ap.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=list(DEFAULT_SIZES),
                    help="object sizes of one chunk, comma-separated (default: qwen35-0.8b, CPU, C=N)")
    ap.add_argument("--dir", help="parent of the two tiers (default $TMPDIR: a disk filesystem)")
    ap.add_argument("--series-root", default=str(REPO / "patches" / "hybrid-fa"),
                    help="where <version>/*.patch are (default: the shipped hybrid-fa set)")
    ap.add_argument("--odirect", action="store_true",
                    help="the adapter's use_odirect: reads and writes bypass the page cache (the disk's speed)")
    ap.add_argument("--server", type=int, default=0, metavar="N",
                    help="also run the CPU restore gate N times per build (alternating)")
    ap.add_argument("--fresh-dst", action="store_true",
                    help="load into new, never-touched buffers each round (as a server's first restore does)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="N processes spinning on the CPU during the counted rounds (the engine's "
                         "processes beside a server's prefetch)")
    ap.add_argument("--part", default=PART,
                    help="the part A goes without and B has (default %(default)s)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(Path(args.worker), args.sizes, args.chunks, args.odirect, args.fresh_dst)
        return 0

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-l2-checksum-", dir=args.dir) as tmp:
        bases = {"A": Path(tmp, "without"), "B": Path(tmp, "with")}
        for b in bases.values():
            b.mkdir()
        procs = {"A": _start(args.version, False, bases["A"], args), "B": _start(args.version, True, bases["B"], args)}
        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        try:
            for name in procs:  # warm-up round (imports, first files), not counted
                _ask(procs[name], "round 1000000")
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
            try:
                for r in range(args.rounds):
                    for name in ("AB" if r % 2 == 0 else "BA"):
                        runs[name].append(_ask(procs[name], f"round {r}"))
            finally:
                for b in busy:
                    b.kill()
                    b.wait()
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.stdin.write("quit\n")
                    p.stdin.flush()
                    p.wait(timeout=60)
    gate: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.server):
        for name in ("AB" if r % 2 == 0 else "BA"):
            gate[name].append(_gate_once(args.version, name == "B", args))
    load_after = os.getloadavg()

    def med(name: str, field: str) -> float:
        return statistics.median(x[field] for x in runs[name])

    total = runs["A"][0]["bytes"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    res = {"command": ["bench_l2_checksum.py", *(sys.argv[1:] if argv is None else argv)],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_head": head,
           "version": args.version, "part": args.part, "fresh_dst": args.fresh_dst, "busy": args.busy, "rounds": args.rounds, "chunks": args.chunks, "sizes": args.sizes,
           "odirect": args.odirect,
           "bytes_per_request": total, "cpus": os.cpu_count(),
           "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
           "median_s": {f"{w}_{f}": round(med(n, f), 5) for n, w in (("A", "without"), ("B", "with"))
                        for f in ("store_s", "lookup_s", "load_s", "store_cpu_s", "load_cpu_s")}}
    for f in ("blake3_s", "copy_s", "sha256_s", "crc32_s"):
        res["median_s"][f] = round(med("B", f), 5)
    # The spread matters as much as the median: a prefetch waits for its slowest object.
    res["max_s"] = {f"{w}_load_s": round(max(x["load_s"] for x in runs[n]), 5) for n, w in (("A", "without"), ("B", "with"))}
    res["ratio"] = {"store_with_over_without": round(med("B", "store_s") / med("A", "store_s"), 3),
                    "lookup_with_over_without": round(med("B", "lookup_s") / med("A", "lookup_s"), 3),
                    "load_with_over_without": round(med("B", "load_s") / med("A", "load_s"), 3),
                    "store_cpu_with_over_without": round(med("B", "store_cpu_s") / med("A", "store_cpu_s"), 3),
                    "load_cpu_with_over_without": round(med("B", "load_cpu_s") / med("A", "load_cpu_s"), 3),
                    "blake3_over_copy": round(med("B", "blake3_s") / med("B", "copy_s"), 3),
                    "sha256_over_copy": round(med("B", "sha256_s") / med("B", "copy_s"), 3),
                    "crc32_over_copy": round(med("B", "crc32_s") / med("B", "copy_s"), 3)}
    if args.server:
        res["server"] = {}
        for f in gate["A"][0]:
            a, b = (statistics.median(x[f] for x in gate[n]) for n in "AB")
            res["server"][f] = {"without": a, "with": b, "ratio": round(b / a, 3) if a else None}
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    gb = total / 1e9
    m = res["median_s"]
    print(f"lmcache {args.version}{', O_DIRECT' if args.odirect else ', page cache'}, {args.chunks} chunks x "
          f"{args.sizes} B = {total / 2**20:.1f} MiB per request, "
          f"{args.rounds} rounds (ABBA), {res['cpus']} CPUs, load average {load_before[0]:.2f} -> {load_after[0]:.2f}"
          + (f", {args.busy} spinning processes beside the rounds" if args.busy else ""))
    print(f"  A = without {args.part}, B = with it")
    print(f"  store   without {m['without_store_s'] * 1e3:8.2f} ms ({gb / m['without_store_s']:5.2f} GB/s)   "
          f"with {m['with_store_s'] * 1e3:8.2f} ms   ratio {res['ratio']['store_with_over_without']:.3f}")
    print(f"  lookup  without {m['without_lookup_s'] * 1e3:8.2f} ms                  "
          f"with {m['with_lookup_s'] * 1e3:8.2f} ms   ratio {res['ratio']['lookup_with_over_without']:.3f}")
    print(f"  load    without {m['without_load_s'] * 1e3:8.2f} ms ({gb / m['without_load_s']:5.2f} GB/s)   "
          f"with {m['with_load_s'] * 1e3:8.2f} ms   ratio {res['ratio']['load_with_over_without']:.3f}")
    print(f"  load, slowest round: without {res['max_s']['without_load_s'] * 1e3:8.2f} ms   "
          f"with {res['max_s']['with_load_s'] * 1e3:8.2f} ms")
    print(f"  CPU     store without {m['without_store_cpu_s'] * 1e3:8.2f} ms   with {m['with_store_cpu_s'] * 1e3:8.2f} ms"
          f"   ratio {res['ratio']['store_cpu_with_over_without']:.3f};   load without "
          f"{m['without_load_cpu_s'] * 1e3:8.2f} ms   with {m['with_load_cpu_s'] * 1e3:8.2f} ms   ratio "
          f"{res['ratio']['load_cpu_with_over_without']:.3f}")
    print(f"  same bytes: blake3 {m['blake3_s'] * 1e3:.2f} ms ({gb / m['blake3_s']:.2f} GB/s), plain copy "
          f"{m['copy_s'] * 1e3:.2f} ms ({gb / m['copy_s']:.2f} GB/s): blake3/copy "
          f"{res['ratio']['blake3_over_copy']:.2f}; sha256/copy {res['ratio']['sha256_over_copy']:.2f}, "
          f"crc32/copy {res['ratio']['crc32_over_copy']:.2f}")
    for f, v in res.get("server", {}).items():
        print(f"  server, {args.server} gate runs each: {f:24} without {v['without'] * 1e3:8.1f} ms   "
              f"with {v['with'] * 1e3:8.1f} ms   ratio {v['ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
