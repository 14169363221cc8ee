#!/usr/bin/env python3
"""What a restore pays when the engine-driven staging region is new: a fresh region against
the kept one, side by side in one run (issue 39, EXPLAINER 10.7).

An engine-driven retrieve on CPU (patches/engine-driven, part 04-staging-regions) copies
each object from the server's L1 into a POSIX shared-memory region, and the worker
scatters it from there into the KV cache.  The server keeps the region for the next
retrieve when it is big enough (a power of two up to
``LMCACHE_PATCHTOOL_ENGINE_DRIVEN_STAGING_MB``); a larger request gets a new one.  A new
region costs more than the bytes: ``posix_fallocate`` allocates (and zeroes) its tmpfs pages,
and each side's first touch of each page faults.  This bench runs the REAL ``StagingRegion``
(the stacked set's ``posix_shm.py``, in the version's runtime venv) in one process, per
round and per size:

* **fresh**: ``StagingRegion.create`` for the request, the server-side copy into it,
  ``StagingRegion.open`` of it (the worker's mapping, a second mapping with its own page
  faults), and the worker-side copy out of it into a warm buffer;
* **kept**: the same two copies through the two mappings of a region already used;
* **floor**: one ``memcpy`` of the same bytes between two warm buffers.

It prints the medians and the ratios fresh / kept and each over the floor, with the
1-minute load average before and after.  Nothing is asserted; the exit code is 1 only if a
copy came back wrong.

    python3 -m bench.bench_staging_region                       # 8 and 34 MiB, 0.5.6 stacked
    python3 -m bench.bench_staging_region --mib 34 --rounds 15 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INNER_ENV = "LMCACHE_PATCHTOOL_BENCH_STAGING_INNER"


def outer(args: argparse.Namespace, argv: list[str]) -> int:
    from lab import provision, vllm_cells  # noqa: PLC0415

    patches = vllm_cells.stacked_patches(args.version)  # hybrid-fa, then engine-driven
    if patches is None:
        raise SystemExit(f"bench_staging_region: no engine-driven set for {args.version}")
    overlay = provision.overlay(args.version, patches)
    python = provision.runtime_env(args.version) / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", **{INNER_ENV: "1"})
    return subprocess.run([str(python), str(Path(__file__).resolve()), *argv], env=env).returncode


def inner(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from lmcache.v1.multiprocess import posix_shm  # noqa: PLC0415

    torch.set_num_threads(1)  # the engine-driven transfer's own setting (part 04)
    load_before = os.getloadavg()
    rows = []
    for mib in args.mib:
        need = mib << 20
        size, _keep = posix_shm.staging_region_size(need)
        src = torch.randint(0, 256, (need,), dtype=torch.uint8)
        dst = torch.empty(need, dtype=torch.uint8)
        dst.fill_(0)  # warm: the KV cache the worker scatters into is resident
        kept_server = posix_shm.StagingRegion.create(size)
        kept_worker = posix_shm.StagingRegion.open(kept_server.name, size)
        times: dict[str, list[float]] = {"fresh": [], "kept": [], "floor": []}
        for r in range(args.rounds + 1):  # round 0 warms the kept region, not counted
            t0 = time.perf_counter()
            server = posix_shm.StagingRegion.create(size)
            server.tensor()[:need].copy_(src)
            worker = posix_shm.StagingRegion.open(server.name, size)
            server.settle()  # the server, after the RPC that handed the region over
            dst.copy_(worker.tensor()[:need])
            t1 = time.perf_counter()
            if not torch.equal(dst, src):
                print("bench_staging_region: a fresh region returned wrong bytes", file=sys.stderr)
                return 1
            del server, worker  # their mappings go with the last reference
            dst.fill_(0)
            t2 = time.perf_counter()
            kept_server.tensor()[:need].copy_(src)
            dst.copy_(kept_worker.tensor()[:need])
            t3 = time.perf_counter()
            if not torch.equal(dst, src):
                print("bench_staging_region: the kept region returned wrong bytes", file=sys.stderr)
                return 1
            t4 = time.perf_counter()
            dst.copy_(src)
            t5 = time.perf_counter()
            if r:
                times["fresh"].append(t1 - t0)
                times["kept"].append(t3 - t2)
                times["floor"].append(t5 - t4)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"mib": mib, "region_mib": size >> 20, "median_s": med,
                     "fresh_over_kept": med["fresh"] / med["kept"],
                     "fresh_over_floor": med["fresh"] / med["floor"],
                     "kept_over_floor": med["kept"] / med["floor"]})
    load_after = os.getloadavg()
    res = {"schema": "lmcache-patchtool/bench-staging-region/v1", "version": args.version,
           "rounds": args.rounds, "cpus": os.cpu_count(), "load_average": [load_before[0], load_after[0]],
           "rows": rows}
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"engine-driven staging region, lmcache {args.version} stacked (posix_shm.py), "
          f"{args.rounds} rounds, {res['cpus']} CPUs, load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    print("   MiB  region MiB   fresh ms    kept ms   floor ms  fresh/kept  fresh/floor  kept/floor")
    for row in rows:
        m = row["median_s"]
        print(f"{row['mib']:6} {row['region_mib']:11} {m['fresh'] * 1e3:10.2f} {m['kept'] * 1e3:10.2f} "
              f"{m['floor'] * 1e3:10.2f} {row['fresh_over_kept']:10.2f}x {row['fresh_over_floor']:11.2f}x "
              f"{row['kept_over_floor']:10.2f}x")
    print("fresh: create (posix_fallocate), the server's copy in, the worker's mapping, its copy out; "
          "kept: the two copies through mappings already used; floor: one memcpy")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.5.6")
    ap.add_argument("--mib", type=int, nargs="+", default=[8, 34],
                    help="bytes staged per retrieve, MiB (default: 8 and 34, the tiny hybrid's 3k and 16k)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get(INNER_ENV) == "1":
        return inner(args)
    return outer(args, argv)


if __name__ == "__main__":
    sys.exit(main())
