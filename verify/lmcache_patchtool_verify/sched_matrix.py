#!/usr/bin/env python3
"""Run :mod:`sched_sim` for several LMCache versions and builds, and print one table.

This runs from the checkout with any Python 3.11. It provisions (or reuses) each
version's runtime venv, its vLLM 0.27.1 layer and the lmcache overlay through
``scripts/provision.py`` / ``scripts/provision_vllm.py``, then runs the simulation
in that venv (one process per version and build)::

    python -m lmcache_patchtool_verify.sched_matrix --scenario ci --markdown       # from verify/
    python verify/lmcache_patchtool_verify/sched_matrix.py --scenario all --versions 0.5.6

Builds: ``pristine`` (the wheel), ``patched`` (the hybrid-fa patches git tracks),
``worktree`` (every ``*.patch`` in the working tree, e.g. a revision in progress).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("0.5.3", "0.5.4", "0.5.5", "0.5.6")
BUILDS = ("pristine", "patched", "worktree")


def series(version: str, build: str) -> list[Path] | None:
    rel = f"patches/hybrid-fa/{version}"
    if build == "pristine":
        return None
    if build == "worktree":
        return sorted((REPO / rel).glob("*.patch"))
    out = subprocess.run(["git", "ls-files", "--", f"{rel}/*.patch"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return sorted(REPO / p for p in out)


def run(version: str, build: str, scenarios: list[str], objects: str) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO / "scripts"))
    import provision  # noqa: PLC0415
    import provision_vllm  # noqa: PLC0415

    overlay = provision.overlay(version, series(version, build))
    layer = provision_vllm.vllm_layer(version)
    python = provision.runtime_env(version) / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "res.json"
        env = dict(os.environ, PYTHONPATH=f"{overlay}:{layer}:{REPO / 'verify'}",
                   LMCACHE_DISABLE_BANNER="1")
        args = [a for s in scenarios for a in ("--scenario", s)]
        proc = subprocess.run([str(python), "-m", "lmcache_patchtool_verify.sched_sim", *args,
                               "--objects", objects, "--version", version, "--build", build,
                               "--out", str(out)], env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{version} {build}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", default=",".join(VERSIONS))
    ap.add_argument("--builds", default="pristine,patched")
    ap.add_argument("--scenario", action="append", default=[],
                    help="as sched_sim's (repeatable; default 'ci')")
    ap.add_argument("--objects", choices=("auto", "merged", "separate"), default="auto")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", help="write the combined JSON results here")
    args = ap.parse_args(argv)
    builds = args.builds.split(",")
    if unknown := set(builds) - set(BUILDS):
        ap.error(f"unknown builds {sorted(unknown)}")
    results: list[dict[str, Any]] = []
    for version in args.versions.split(","):
        for build in builds:
            print(f"=== {version} {build}", file=sys.stderr, flush=True)
            results += run(version, build, args.scenario or ["ci"], args.objects)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.json:
        print(json.dumps(results, indent=1))
    if args.markdown or not args.json:
        from lmcache_patchtool_verify.sched_sim import markdown  # noqa: PLC0415

        print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "verify"))
    raise SystemExit(main())
