#!/usr/bin/env python3
"""Time the CPU restore gate's phases (from its JSON report).

Runs ``gate/restore_gate.py --json`` in the runtime venv of lmcache 0.5.3
(provisioned and cached by ``lab/provision.py``), pristine or with the
hybrid-FA patch series, and prints per-cycle and total phase timings::

    python bench/bench_restore_gate.py                      # pristine, all presets
    python bench/bench_restore_gate.py --patched --repeat 3 --preset qwen35-0.8b
    python bench/bench_restore_gate.py --report saved.json  # just format a report

Exit code: that of the (last) gate run, or 0 when only formatting.
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
GATE = REPO / "gate" / "restore_gate.py"
PHASES = ["server_start_1", "register_fill", "store", "flush_to_disk", "kill", "server_start_2", "restore",
          "stay_alive", "shutdown"]


def environment(version: str, patched: bool) -> tuple[Path, Path]:
    from lab import provision  # noqa: PLC0415

    python = provision.runtime_env(version) / "bin" / "python"
    patches = sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch")) if patched else []
    if patched and not patches:
        raise SystemExit(f"no patch series for {version} under patches/hybrid-fa/{version}/")
    return python, provision.overlay(version, patches or None)


def run_once(python: Path, overlay: Path, presets: list[str], extra: list[str]) -> tuple[int, dict]:
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1")
    argv = [str(python), str(GATE), "--json", "--quiet", *[a for p in presets for a in ("--preset", p)], *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"the gate printed no JSON report (exit {proc.returncode})") from None


def table(report: dict) -> str:
    rows = []
    head = f"{'phase':16}" + "".join(f"{'cycle ' + str(c['cycle']) + ' (' + str(c['chunk_size']) + ')':>16}"
                                     for c in report["cycles"]) + f"{'total':>10}"
    rows.append(head)
    rows.append("-" * len(head))
    for phase in PHASES:
        cells = [c["timings"].get(phase) for c in report["cycles"]]
        total = report["timings"].get(phase)
        if total is None and all(v is None for v in cells):
            continue
        rows.append(f"{phase:16}" + "".join(f"{v:16.3f}" if v is not None else f"{'-':>16}" for v in cells)
                    + (f"{total:10.3f}" if total is not None else f"{'-':>10}"))
    rows.append(f"{'total (wall)':16}" + " " * (16 * len(report["cycles"])) + f"{report['timings']['total']:10.3f}")
    lines = ["\n".join(rows), ""]
    for c in report["cycles"]:
        lines.append(f"cycle {c['cycle']}: presets {', '.join(c['presets'])}; restart window "
                     f"{c.get('restart_window_s', float('nan')):.2f} s (SIGKILL to the new server's healthcheck)")
    for p in report["presets"]:
        extra = ""
        if p.get("restored"):
            r = p["restored"]
            extra = (f" restore {r['seconds']:.2f} s (retrieve {r['retrieve_seconds']:.2f}, "
                     f"compare {r['compare_seconds']:.2f}); lookup {p['after_restart']['lookup_seconds']:.2f} s")
        stored = p.get("stored", {}).get("seconds")
        lines.append(f"  {p['preset']:16} {p['verdict']:5}" + (f" store {stored:.2f} s;" if stored else "") + extra)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.5.3")
    ap.add_argument("--patched", action="store_true", help="apply patches/hybrid-fa/<version>/*.patch")
    ap.add_argument("--preset", action="append", help="preset(s); default all")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--report", type=Path, help="format an existing JSON report instead of running")
    ap.add_argument("--json", action="store_true", help="print the per-run timings as JSON too")
    ap.add_argument("gate_args", nargs=argparse.REMAINDER, help="after '--': extra restore_gate.py arguments")
    args = ap.parse_args(argv)
    if args.report:
        print(table(json.loads(args.report.read_text())))
        return 0
    python, overlay = environment(args.version, args.patched)
    extra = [a for a in args.gate_args if a != "--"]
    presets = args.preset or ["all"]
    totals, code, runs = [], 0, []
    for i in range(args.repeat):
        code, report = run_once(python, overlay, presets, extra)
        runs.append(report["timings"])
        print(f"== run {i + 1}/{args.repeat}: lmcache {report['versions'].get('lmcache')} "
              f"({'patched' if args.patched else 'pristine'}), verdict {report['verdict']} (exit {code})")
        print(table(report))
        print()
        totals.append(report["timings"]["total"])
    if args.repeat > 1:
        print(f"total wall time over {args.repeat} runs: median {statistics.median(totals):.2f} s, "
              f"min {min(totals):.2f} s, max {max(totals):.2f} s")
    if args.json:
        print(json.dumps(runs, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
