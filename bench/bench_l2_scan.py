#!/usr/bin/env python3
"""Time ``patchtool l2 scan DIR --assume kvl1 --json`` against ``find``.

Builds a flat fs-L2-like tier (default 1,000,000 files; sizes are set with
``ftruncate``, so the files are sparse and use no data blocks) in $TMPDIR
(a disk filesystem, where an fs L2 tier lives; ``--dir /dev/shm`` for tmpfs),
mixing plain, namespaced, unpatched (1/k),
size-mismatched, never-read and salted objects plus some tmp/foreign files.
Then, as fresh processes interleaved round by round (so load drift hits all
equally; each round starts one command later), it times:

* ``find DIR -type f | wc -l``: names only (getdents, no stat);
* ``find DIR -type f -printf '%s %f\\n' | wc -l``: names and sizes, the same
  information the scan reads (one stat per file);
* the real CLI, ``python -m patchtool l2 scan DIR --assume kvl1 --json``
  (with ``--expect-size`` naming model B's size, so its 1% of other-sized
  objects are flagged rather than reported ambiguous);
* the same with ``--names-only`` (no lstat: what ``find -type f`` reads);
* with ``--compare TREE``, both scans again from another checkout of the tool
  (e.g. ``git archive <commit> patchtool | tar -x -C TREE``), run as
  ``python -m patchtool`` in TREE, in the same rounds: the ratio of the two
  trees' times says whether a change made the scan slower.

It prints the medians, rates and the ratios of each scan's rate to the find
that reads the same information (and of the full scan to the names-only
find), and the full scan's peak RSS.  With ``--quarantine`` it then times one
``--quarantine`` run (into a sibling of the tier, so it moves the flagged
31% once).  Usage:

    .venv/bin/python bench/bench_l2_scan.py [--files N] [--rounds 3] [--dir D] [--keep]
                                            [--quarantine] [--compare TREE] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from patchtool.l2.names import object_name
SCAN_EXITS = (0, 20, 21)  # clean, flagged, ambiguous

MODEL_A, MODEL_B = "Qwen/Qwen3.5-0.8B", "meta-llama/Llama-3.1-8B"
RANK = 0x01000100
NS1, NS2 = "kvl1-3f2a9c0b1d4e", "kvl2-0123456789ab"
FULL, HALF, OTHER = 4456448, 2228224, 8912896


def _spec(i: int) -> tuple[str, int]:
    """The i-th file: name and size.  Per 100 files: 40 namespaced kvl1
    (model A, read), 20 plain model A at half size (unpatched, k=2), 24 plain
    model B (1 of them a size mismatch), 10 namespaced kvl2 (never read),
    4 salted plain model B, 1 tmp, 1 foreign."""
    h, r = f"{i:016x}", i % 100
    if r < 40:
        return object_name(MODEL_A, RANK, 0, h, namespace=NS1), FULL
    if r < 60:
        return object_name(MODEL_A, RANK, 0, h), HALF
    if r < 84:
        return object_name(MODEL_B, RANK, 0, h), OTHER if r == 83 else FULL
    if r < 94:
        return object_name(MODEL_A, RANK, 0, h, namespace=NS2), FULL
    if r < 98:
        return object_name(MODEL_B, RANK, 1, h, salt=f"tenant{r}"), FULL
    if r < 99:
        return object_name(MODEL_B, RANK, 0, h)[:-5] + ".tmp", 10
    return f"foreign-{i}.bin", 10


def build(d: Path, n: int) -> float:
    t0 = time.perf_counter()
    d.mkdir(parents=True)
    (d / "tmp").mkdir()
    for i in range(n):
        fname, size = _spec(i)
        fd = os.open(d / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _run(cmd: list[str] | str, shell: bool = False,
         tree: str | None = None) -> tuple[float, int, int, str]:
    """Seconds, exit code, peak RSS (KiB) of the process, its stdout.  With
    ``tree``, ``python -m patchtool`` imports the tool from that directory
    (it is the working directory, which ``-m`` puts first on sys.path)."""
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, shell=shell, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         cwd=tree, env=env)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return dt, p.returncode, ru.ru_maxrss, out.decode()


def _pick_dir(arg: str | None, n: int) -> Path:
    base = Path(arg) if arg else Path(tempfile.gettempdir())
    vfs = os.statvfs(base)
    if vfs.f_favail and vfs.f_favail < n * 1.05 + 1000:
        sys.exit(f"bench_l2_scan: {base}: only {vfs.f_favail} free inodes for {n} files; "
                 "use --dir or a smaller --files")
    return Path(tempfile.mkdtemp(prefix="bench-l2-", dir=base)) / "tier"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to build the tier (default: $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the tier afterwards")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--quarantine", action="store_true", help="also time one --quarantine run")
    ap.add_argument("--compare", metavar="TREE", help="also time both scans from the patchtool "
                    "package in TREE (another checkout), in the same rounds")
    args = ap.parse_args()
    d = _pick_dir(args.dir, args.files)
    try:
        built = build(d, args.files)
        fs = subprocess.run(["stat", "-f", "-c", "%T", str(d)], capture_output=True,
                            text=True).stdout.strip()
        scan = [sys.executable, "-m", "patchtool", "l2", "scan", str(d), "--assume", "kvl1",
                "--json"]
        expect = ["--expect-size", f"{object_name(MODEL_B, RANK, 0, '00').rsplit('@', 1)[0]}"
                  f"={FULL}"]
        cmds = {
            "find | wc -l": (f"find '{d}' -type f | wc -l", True, None),
            "find -printf %s | wc -l": (f"find '{d}' -type f -printf '%s %f\\n' | wc -l", True,
                                        None),
            "l2 scan --json": ([*scan, *expect], False, None),
            "l2 scan --names-only": ([*scan, "--names-only"], False, None),
        }
        if args.compare:
            tree = os.path.abspath(args.compare)
            cmds["compare: l2 scan --json"] = (scan, False, tree)
            cmds["compare: l2 scan --names-only"] = ([*scan, "--names-only"], False, tree)
        times: dict[str, list[float]] = {k: [] for k in cmds}
        rss, scan_doc, names_doc = 0, None, None
        names = list(cmds)
        for r in range(args.rounds):
            # Each round starts one command later, so no command always runs
            # right after the same one (cache state and load drift even out).
            for k in names[r % len(names):] + names[:r % len(names)]:
                cmd, shell, tree = cmds[k]
                dt, rc, maxrss, out = _run(cmd, shell, tree)
                times[k].append(dt)
                if "l2 scan" in k and rc not in SCAN_EXITS:
                    sys.exit(f"bench_l2_scan: {k} exited {rc}")
                if k == "l2 scan --json":
                    rss, scan_doc = max(rss, maxrss), json.loads(out)
                elif k == "l2 scan --names-only":
                    names_doc = json.loads(out)
        med = {k: statistics.median(v) for k, v in times.items()}
        res = scan_doc["result"]
        files = args.files
        fig = {
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "files": files, "fs": fs,
            "cpus": os.cpu_count(), "rounds": args.rounds, "build_s": round(built, 1),
            "median_s": {k: round(v, 3) for k, v in med.items()},
            "rate_files_per_s": {k: round(files / v) for k, v in med.items()},
            "ratio_scan_to_find_count": round(med["find | wc -l"] / med["l2 scan --json"], 3),
            "ratio_scan_to_find_sizes": round(med["find -printf %s | wc -l"]
                                              / med["l2 scan --json"], 3),
            "ratio_names_only_to_find_count": round(med["find | wc -l"]
                                                    / med["l2 scan --names-only"], 3),
            "ratio_find_sizes_to_find_count": round(med["find | wc -l"]
                                                    / med["find -printf %s | wc -l"], 3),
            "names_only_never_read": names_doc["result"]["flagged"]["never-read"]["objects"],
            "scan_peak_rss_mib": round(rss / 1024, 1),
            "scan_objects": res["objects"], "scan_flagged": res["flagged_objects"],
            "scan_exit": scan_doc["exit_code"],
        }
        if args.compare:
            fig["compare_tree"] = args.compare
            fig["ratio_time_to_compare"] = {
                k: round(med[k] / med[f"compare: {k}"], 3)
                for k in ("l2 scan --json", "l2 scan --names-only")}
        if args.quarantine:
            dt, rc, _, out = _run([*scan, *expect, "--quarantine", str(d.parent / "quarantine")])
            q = json.loads(out)["result"]["quarantine"]
            fig["quarantine"] = {"seconds": round(dt, 3), "exit": rc, "moved": q["moved"],
                                 "passes": q["passes"]}
        if args.json:
            print(json.dumps(fig, indent=2))
        else:
            print(f"{files} files on {fs} ({fig['cpus']} CPUs), built in {built:.1f} s; "
                  f"medians of {args.rounds} interleaved rounds:")
            for k in cmds:
                print(f"  {k:<26} {med[k]:7.3f} s  {files / med[k]:>12,.0f} files/s")
            print(f"  --names-only scan / find (names only)   : "
                  f"{fig['ratio_names_only_to_find_count']:.2f}x")
            print(f"  full scan / find -printf %s (sizes)     : "
                  f"{fig['ratio_scan_to_find_sizes']:.2f}x")
            print(f"  full scan / find (names only)           : "
                  f"{fig['ratio_scan_to_find_count']:.2f}x")
            print(f"  find -printf %s / find (names only)     : "
                  f"{fig['ratio_find_sizes_to_find_count']:.2f}x  (the cost of a stat per file)")
            print(f"  scan peak RSS {fig['scan_peak_rss_mib']} MiB; {res['objects']} objects, "
                  f"{res['flagged_objects']} flagged (exit {scan_doc['exit_code']})")
            for k, v in fig.get("ratio_time_to_compare", {}).items():
                print(f"  {k}: this tree's time / {args.compare}'s : {v:.2f}x")
            if args.quarantine:
                q = fig["quarantine"]
                print(f"  --quarantine: moved {q['moved']} in {q['seconds']:.2f} s "
                      f"({q['passes']} passes over DIR, exit {q['exit']})")
    finally:
        if not args.keep:
            shutil.rmtree(d.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
