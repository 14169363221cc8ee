#!/usr/bin/env python3
"""Generate ``lab/evidence/geometry-matrix.json``: the round-trip harness
and the CPU restore gate over every geometry preset, per LMCache version,
pristine and patched.  ``lab/support_table.py`` reads it (with the
scheduler evidence) to decide which LMCache x vLLM cells say "verified".

    python3 -m lab.geometry_evidence                 # all versions (~15 min here)
    python3 -m lab.geometry_evidence --versions 0.5.3 --out /tmp/g.json

What runs, per (version, build):

* the ports harness (``lab.ports_roundtrip --edits``:
  the installed connector's own registration edits, HND, Python path) on every
  preset of ``geometry.PRESETS``, two cells each (C = 1N x3 chunks; C = 2N x3
  skipping one block at retrieve);
* the CPU restore gate (``gate/restore_gate.py``: real ``lmcache server``,
  fs L2, SIGKILL, restart) on every preset whose registration the gate can
  drive in lmcache-driven mode (the vLLM 0.27-style GDN view; the 0.30+
  padded view is refused by that mode on a CPU worker, hybrid-fa part 09, so
  its gate runs engine-driven in ``lab/engine_driven_evidence.py``).

Schema (``"schema": 1``)::

    {"schema": 1, "generated": "<UTC date>", "host": {...},
     "cells": [{"lmcache": "0.5.3", "build": "pristine"|"patched",
                "series_sha256": "<sha256 of the patch files, in order>" | null,
                "presets": {"<preset>": {
                    "k": int, "gdn_view": "0.27"|"0.30", "hybrid": bool,
                    "harness": {"pass": bool, "cells": [{"name", "pass", "error"|null,
                                                         "reasons", "fa_fraction",
                                                         "gdn_fraction"}]},
                    "gate": {"verdict": "pass"|"fail"|"not-run", "reasons": [...]}}}}]}

``series_sha256`` lets the table refuse evidence that predates the shipped
series (a patch changed since the run).  Nothing here is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from lab import provision
from lab.vllm_cells import series_sha256
from gate import geometry
from lab import evidence_merge

VERSIONS = ("0.5.3", "0.5.4", "0.5.5", "0.5.6")
OUT = REPO / "lab" / "evidence" / "geometry-matrix.json"
SCHEMA = 1
CELLS = ((1, 0), (2, 1))  # (chunk blocks, blocks skipped at retrieve)


def series(version: str) -> list[Path]:
    return sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch"))


def _log(msg: str) -> None:
    print(f"[geometry-evidence {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_harness(version: str, overlay: Path) -> dict:
    python = provision.runtime_env(version) / "bin" / "python"
    args = [str(python), "-m", "lab.ports_roundtrip", "--json",
            "--no-hashes", "--path", "python", "--layout", "HND", "--edits"]
    for name in geometry.PRESETS:
        for cb, skip in CELLS:
            args += ["--cell", f"preset={name},chunk_blocks={cb},num_chunks=3,skip_blocks={skip}"]
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", LMCACHE_DISABLE_BANNER="1")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"geometry_evidence: harness {version} exited {proc.returncode}: "
                         f"{proc.stderr.strip().splitlines()[-1:]}")
    doc = json.loads(proc.stdout)
    if Path(doc["lmcache"]["root"]).resolve() != overlay.resolve():
        raise SystemExit(f"geometry_evidence: the harness ran {doc['lmcache']['root']}, "
                         f"not {overlay}")
    out: dict[str, list[dict]] = {}
    for c in doc["cells"]:
        preset = c["name"].split("/")[0]
        groups = c.get("groups", {})
        out.setdefault(preset, []).append({
            "name": c["name"],
            "pass": bool(c.get("verdict", {}).get("pass")) and "error" not in c,
            "error": (c.get("error") or "")[:300] or None,
            "reasons": [r[:200] for r in c.get("verdict", {}).get("reasons", [])[:3]],
            "fa_fraction": groups.get("fa", {}).get("fraction"),
            "gdn_fraction": groups.get("gdn", {}).get("fraction"),
        })
    return out


def gate_presets() -> list[str]:
    return [n for n, g in geometry.PRESETS.items() if g.gdn_view == "0.27"]


def gate_report(version: str, overlay: Path, presets: list[str], *extra: str,
                who: str = "geometry_evidence") -> dict:
    """The restore gate's JSON report for ``presets``, run by ``version``'s
    runtime interpreter with ``overlay`` on PYTHONPATH (checked: the report
    must name ``version``).  Shared with lab/engine_driven_evidence.py."""
    python = provision.runtime_env(version) / "bin" / "python"
    argv = [str(python), str(REPO / "gate" / "restore_gate.py"), "--json", "--no-stay-alive",
            "--quiet", *extra]
    for p in presets:
        argv += ["--preset", p]
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600,
                          cwd=str(REPO))
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise SystemExit(f"{who}: gate {version} {' '.join(extra)}: no JSON report (rc "
                         f"{proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}") from None
    if report["versions"]["lmcache"] != version:
        raise SystemExit(f"{who}: the gate ran lmcache {report['versions']['lmcache']}")
    return report


def run_gate(version: str, overlay: Path) -> dict:
    report = gate_report(version, overlay, gate_presets())
    return {p["preset"]: {"verdict": p["verdict"], "reasons": p.get("reasons", [])[:5]}
            for p in report["presets"]}


def cell(version: str, build: str) -> dict:
    patches = series(version) if build == "patched" else None
    overlay = provision.overlay(version, patches)
    _log(f"{version} {build}: harness ({len(geometry.PRESETS)} presets x {len(CELLS)} cells)")
    harness = run_harness(version, overlay)
    _log(f"{version} {build}: restore gate ({len(gate_presets())} presets)")
    gate = run_gate(version, overlay)
    presets = {}
    for name, g in geometry.PRESETS.items():
        cells = harness.get(name, [])
        presets[name] = {
            "k": g.k, "gdn_view": g.gdn_view, "hybrid": g.num_gdn_layers > 0,
            "harness": {"pass": bool(cells) and all(c["pass"] for c in cells), "cells": cells},
            "gate": gate.get(name, {"verdict": "not-run", "reasons": []}),
        }
    return {"lmcache": version, "build": build,
            "series_sha256": series_sha256(version) if patches else None, "presets": presets}


def write_evidence(out: Path, schema: int, cells: list[dict], started: float,
                   merge: bool = False) -> dict:
    """Write an evidence file: schema, UTC date, host, seconds since
    ``started`` (monotonic), the command, the cells.  With ``merge`` the
    cells are merged into ``out``'s (same lmcache and build replaced, the rest
    kept, ``runs`` saying which run wrote which).  Shared with
    engine_driven_evidence."""
    doc = {"schema": schema, "generated": time.strftime("%Y-%m-%d", time.gmtime()),
           "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "device": "cpu"},
           "command": " ".join(["python", *sys.argv]),
           "seconds": round(time.monotonic() - started), "cells": cells}
    if merge and out.exists():
        doc = evidence_merge.merge(json.loads(out.read_text()), doc, ("lmcache", "build"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", default=",".join(VERSIONS))
    ap.add_argument("--builds", default="pristine,patched")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--merge", action="store_true",
                    help="replace only the cells run now in --out, keep the others")
    args = ap.parse_args()
    started = time.monotonic()
    cells = [cell(v, b) for v in args.versions.split(",") for b in args.builds.split(",")]
    doc = write_evidence(Path(args.out), SCHEMA, cells, started, merge=args.merge)
    _log(f"wrote {args.out} ({doc['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
