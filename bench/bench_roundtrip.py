#!/usr/bin/env python3
"""Store+retrieve cost per FA byte: patched k=17 vs pristine k=1, same bytes.

Runs ``gate/roundtrip.py`` (guards and hashes off) as interleaved
subprocesses in the 0.5.3 runtime venv:

* A -- the PATCHED overlay, ``qwen35-0.8b`` (544/32, k=17, 3 GDN + 1 FA);
* B -- the PRISTINE overlay, ``control-k1`` (544/544, k=1): identical N, H, D,
  layer mix and dtype, so both move exactly the same FA (and GDN) bytes per
  request; B is the cost of a geometry that never had the bug.

Rounds alternate A B / B A (ABBA) to cancel drift; every subprocess does
``--reps`` store+retrieve repetitions after one warm-up repetition.  The
figure is median(store+retrieve seconds) / FA bytes per request, and the
ratio A/B is printed against the target (<= 1.25).  ``--check`` exits 1 when
the ratio misses the target.  Without a patch series A falls back to the
pristine overlay (reported, and the ratio is then meaningless).

Usage: python3 bench/bench_roundtrip.py [--rounds 3] [--reps 5] [--path python|native] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from lab import provision
HARNESS = REPO / "gate" / "roundtrip.py"
TARGET = 1.25


def _run(python: Path, overlay: Path, cell: str, reps: int, path: str) -> dict:
    # One intra-op thread: both sides run the same torch kernels, and a shared CI
    # box's thread contention otherwise dominates the variance.
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [str(python), str(HARNESS), "--json", "--no-guards", "--no-hashes", "--reps", str(reps + 1),
           "--path", path, "--cell", cell]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"harness failed:\n{proc.stderr[-4000:]}")
    (res,) = json.loads(proc.stdout)["cells"]
    if "error" in res:
        raise SystemExit(f"harness error in {cell}: {res['error']}\n{res.get('traceback', '')}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8, help="timed repetitions per subprocess (plus one warm-up)")
    ap.add_argument("--chunk-blocks", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=4, help="chunks per request (4 = one full retrieve batch)")
    ap.add_argument("--path", choices=["python", "native"], default="python")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when the ratio exceeds {TARGET}")
    args = ap.parse_args(argv)

    python = provision.runtime_env("0.5.3") / "bin" / "python"
    pristine = provision.overlay("0.5.3")
    series = sorted((REPO / "patches" / "hybrid-fa" / "0.5.3").glob("*.patch"))
    patched = provision.overlay("0.5.3", series) if series else pristine
    shape = f"chunk_blocks={args.chunk_blocks},num_chunks={args.chunks}"
    runs = {
        "A": (patched, f"preset=qwen35-0.8b,{shape}"),
        "B": (pristine, f"preset=control-k1,{shape}"),
    }
    samples: dict[str, list[float]] = {"A": [], "B": []}
    fa_bytes: dict[str, int] = {}
    verdicts: dict[str, list[bool]] = {"A": [], "B": []}
    for rnd in range(args.rounds):
        for name in ("AB" if rnd % 2 == 0 else "BA"):
            overlay, cell = runs[name]
            res = _run(python, overlay, cell, args.reps, args.path)
            t = res["timings"]["store_retrieve_s"][1:]  # drop the warm-up repetition
            samples[name] += t
            fa_bytes[name] = res["timings"]["fa_bytes_per_rep"]
            verdicts[name].append(res["verdict"]["pass"])
            print(f"round {rnd} {name}: median {statistics.median(t) * 1e3:.1f} ms "
                  f"({res['name']}, pass={res['verdict']['pass']})", file=sys.stderr)
    if fa_bytes["A"] != fa_bytes["B"]:
        raise SystemExit(f"FA bytes differ: {fa_bytes}")
    per_byte = {n: statistics.median(v) / fa_bytes[n] for n, v in samples.items()}
    ratio = per_byte["A"] / per_byte["B"]
    report = {
        "A": {"overlay": str(runs["A"][0]), "cell": runs["A"][1], "patched": bool(series),
              "median_s": statistics.median(samples["A"]), "ns_per_fa_byte": per_byte["A"] * 1e9,
              "all_pass": all(verdicts["A"])},
        "B": {"overlay": str(runs["B"][0]), "cell": runs["B"][1],
              "median_s": statistics.median(samples["B"]), "ns_per_fa_byte": per_byte["B"] * 1e9,
              "all_pass": all(verdicts["B"])},
        "fa_bytes_per_request": fa_bytes["A"], "path": args.path, "rounds": args.rounds, "reps": args.reps,
        "ratio": ratio, "target": TARGET, "meets_target": ratio <= TARGET,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        if not series:
            print("WARNING: no 0.5.3 patch series; A ran on the pristine overlay", file=sys.stderr)
        print(f"A patched k=17 : {report['A']['median_s'] * 1e3:8.1f} ms  {report['A']['ns_per_fa_byte']:.3f} ns/FA byte")
        print(f"B pristine k=1 : {report['B']['median_s'] * 1e3:8.1f} ms  {report['B']['ns_per_fa_byte']:.3f} ns/FA byte")
        print(f"ratio A/B = {ratio:.3f} (target <= {TARGET}) -> {'OK' if ratio <= TARGET else 'MISSED'}")
    return 1 if args.check and ratio > TARGET else 0


if __name__ == "__main__":
    raise SystemExit(main())
