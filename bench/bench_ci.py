#!/usr/bin/env python3
"""Time ``patchtool ci`` per phase (from its JSON) in one run.

Defaults: ``--pin lmcache==0.5.3`` with the 0.5.3 runtime venv's interpreter
(provisioned and cached by ``lab/provision.py``).  When the shipped patch
set has no manifest.json yet, one is built into a scratch copy with the
tool's own ``manifest build`` and used through ``LMCACHE_PATCHTOOL_PATCHES``::

    python bench/bench_ci.py
    python bench/bench_ci.py --version 0.5.3 --preset qwen35-0.8b
    python bench/bench_ci.py --report saved.json   # just format a report

Exit code: that of ``patchtool ci`` (0 when only formatting).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def patches_env(version: str, scratch: Path) -> dict[str, str]:
    """LMCACHE_PATCHTOOL_PATCHES pointing at a root whose set has a manifest."""
    if os.environ.get("LMCACHE_PATCHTOOL_PATCHES"):
        return {}
    shipped = REPO / "patches" / "hybrid-fa" / version
    if (shipped / "manifest.json").exists():
        return {}
    from lab import provision  # noqa: PLC0415

    dest = scratch / "patches" / "hybrid-fa" / version
    dest.mkdir(parents=True)
    for p in sorted(shipped.glob("*.patch")):
        shutil.copy2(p, dest / p.name)
    subprocess.run([sys.executable, "-m", "patchtool", "manifest", "build", str(dest), "--wheel",
                    str(provision.wheel(version)), "--vllm", "0.27.1", "--json"], check=True,
                   capture_output=True, cwd=REPO)
    return {"LMCACHE_PATCHTOOL_PATCHES": str(scratch / "patches")}


def table(doc: dict) -> str:
    res = doc["result"]
    lines = [f"{'phase':10} {'result':8} {'seconds':>8}", "-" * 28]
    for p in res["phases"]:
        secs = "-" if p["result"] == "skipped" else f"{p['seconds']:8.2f}"
        lines.append(f"{p['phase']:10} {p['result']:8} {secs:>8}")
    lines.append("-" * 28)
    lines.append(f"{'total':10} {('pass' if res['ok'] else 'FAIL'):8} {res['total_seconds']:8.2f}")
    gate = next((p["data"].get("report") for p in res["phases"]
                 if p["phase"] == "restore" and p.get("data")), None)
    if gate and gate.get("timings"):
        lines.append("")
        lines.append("restore gate, inside the restore phase:")
        for k, v in gate["timings"].items():
            lines.append(f"  {k:16} {v:8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.5.3", help="lmcache version to pin (default 0.5.3)")
    ap.add_argument("--python", help="interpreter with torch (default: the runtime venv)")
    ap.add_argument("--preset", action="append", help="restore gate preset (default: all)")
    ap.add_argument("--report", help="format a saved `patchtool ci --json` report instead")
    args = ap.parse_args(argv)
    if args.report:
        print(table(json.loads(Path(args.report).read_text())))
        return 0
    python = args.python
    if python is None:
        from lab import provision  # noqa: PLC0415

        python = str(provision.runtime_env(args.version) / "bin" / "python")
    with tempfile.TemporaryDirectory(prefix="bench-ci-") as tmp:
        env = dict(os.environ, **patches_env(args.version, Path(tmp)))
        cmd = [sys.executable, "-m", "patchtool", "ci", "--pin", f"lmcache=={args.version}",
               "--python", python, "--json",
               *[a for p in args.preset or [] for a in ("--preset", p)]]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"patchtool ci printed no JSON (exit {proc.returncode})") from None
    if "error" in doc:
        raise SystemExit(f"patchtool ci refused: {doc['error']['reason']}")
    print(table(doc))
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
