#!/usr/bin/env python3
"""Time ``patchtool status --json`` against ``pip show lmcache`` on one venv.

Both run as fresh processes, interleaved (A B A B ...) so drift in machine
load hits both equally; the medians and their ratio are printed (target:
status <= 0.5x pip show).  Usage:

    .venv/bin/python bench/bench_status.py [--reps 15] [--venv DIR] [--deep]

Default venv: the cached bare lmcache 0.5.3 env from lab/provision.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _time(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--venv", type=Path)
    ap.add_argument("--deep", action="store_true", help="status --deep (every RECORD row)")
    args = ap.parse_args()
    from lab import provision

    if args.venv is None:
        args.venv = provision.bare_env("0.5.3")
    # Status needs a manifest for the installed version; while the shipped
    # series has none yet, time it against a copy with one built here.
    root = Path(tempfile.mkdtemp(prefix="bench-patches-"))
    shutil.copytree(REPO / "patches", root, dirs_exist_ok=True)
    for d in root.glob("*/*"):
        if any(d.glob("*.patch")) and not (d / "manifest.json").exists():
            subprocess.run([sys.executable, "-m", "patchtool", "manifest", "build", str(d),
                            "--wheel", str(provision.wheel(d.name))], check=True,
                           stdout=subprocess.DEVNULL)
    os.environ["LMCACHE_PATCHTOOL_PATCHES"] = str(root)
    py = str(args.venv / "bin" / "python")
    status = [sys.executable, "-m", "patchtool", "status", "--json", "--python", py]
    if args.deep:
        status.append("--deep")
    pip_show = [py, "-m", "pip", "show", "lmcache"]
    _time(status), _time(pip_show)  # warm the page cache for both
    a, b = [], []
    for _ in range(args.reps):
        a.append(_time(status))
        b.append(_time(pip_show))
    ma, mb = statistics.median(a), statistics.median(b)
    print(json.dumps({"reps": args.reps, "status_median_s": round(ma, 4),
                      "pip_show_median_s": round(mb, 4), "ratio": round(ma / mb, 3),
                      "target_ratio": 0.5, "deep": args.deep}, indent=2))
    shutil.rmtree(root, ignore_errors=True)
    return 0 if ma / mb <= 0.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
