#!/usr/bin/env python3
"""Generate ``lab/evidence/engine-driven-gate.json``: the CPU restore gate
in engine-driven mode (``gate/restore_gate.py --transfer-mode
engine_driven``: real ``lmcache server`` with only the engine-driven module,
fs L2, SIGKILL, restart) per LMCache version and build, and for the stacked
build the identity of its fs L2 objects with an lmcache-driven store's.
``lab/support_table.py`` renders the README's engine-driven table from it.

    python3 -m lab.engine_driven_evidence               # all versions (~20 min here)
    python3 -m lab.engine_driven_evidence --versions 0.5.6 --out /tmp/e.json

Builds: ``pristine``; ``hybrid-fa`` (the shipped series, which does not touch
the engine-driven path); ``stacked`` (hybrid-fa + engine-driven), where that
set is shipped for the version.  Presets: the gate's vLLM 0.27-view presets
plus the pure-attention k = 1 control, and vLLM 0.30+'s padded-view presets
(``*-v030``; engine-driven only: lmcache-driven on a CPU worker refuses that
view, so they have no identity comparison; ``lab/vllm_cells.py`` takes
their stacked outcome as the CPU restore gate of those geometries).

Schema (``"schema": 1``)::

    {"schema": 1, "generated": "<UTC date>", "host": {...}, "seconds": int,
     "cells": [{"lmcache": "0.5.6", "build": "pristine"|"hybrid-fa"|"stacked",
                "patches_sha256": "<vllm_cells.patches_sha256 of the patches>" | null,
                "presets": {"<preset>": {"k": int, "hybrid": bool, "gdn_view": "0.27"|"0.30",
                    "outcome": "pass"|"refused"|"wrong"|"miss"|"error",
                    "reason": "<first reason>", "reasons": ["<up to four>"],
                    "identical": bool | null}}}],
     "runs": [...]}  # with --merge: which command measured which cells

``outcome``: ``wrong`` when a restored byte differs or a byte outside the
destination changed; ``miss`` when the gate failed otherwise (chunks lost,
not stored, not served from disk): nothing wrong was restored.

``identical`` (stacked only): the preset's fs L2 objects from the
engine-driven run equal, name for name (the run's model name aside) and
byte for byte, those of an lmcache-driven run of the same build.  Both runs
pass ``--client-malloc-perturb``: the worker's new memory starts as 0xA5, the
servers' as zeros, so a byte that no transfer writes (revision 1's staging
tail of windowed groups) makes the objects differ every time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path


from lab.geometry_evidence import REPO, VERSIONS, gate_presets, gate_report, write_evidence
from lab import provision
from lab.vllm_cells import patches_sha256, stacked_patches
from gate.restore_server import l2_objects
from gate.tier_objects import has_trailer, kv_bytes
from gate import geometry
from gate.xver_outcome import preset as gate_preset
OUT = REPO / "lab" / "evidence" / "engine-driven-gate.json"
SCHEMA = 1
# vLLM 0.30+'s padded GDN view: engine-driven is the only mode that can move it
# on a CPU worker (lmcache-driven's shared-memory path refuses it, hybrid-fa
# part 09), so these run engine-driven only and have no identity comparison.
V030_PRESETS = [n for n, g in geometry.PRESETS.items() if g.gdn_view == "0.30"]
LD_PRESETS = gate_presets() + ["pure-attn-k1"]
PRESETS = LD_PRESETS + V030_PRESETS
BUILDS = ("pristine", "hybrid-fa", "stacked")


def build_patches(version: str, build: str, root: Path = REPO / "patches") -> list[Path] | None:
    """The patches of a build, lowest set first; None: not shipped for the version."""
    if build == "pristine":
        return []
    if build == "hybrid-fa":
        return sorted((root / "hybrid-fa" / version).glob("*.patch"))
    return stacked_patches(version, root)


def _log(msg: str) -> None:
    print(f"[engine-driven-evidence {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_gate(version: str, overlay: Path, mode: str, keep: bool, presets: list[str]) -> dict:
    # The client (engine-driven worker) starts new memory as 0xA5, not zeros:
    # an object byte no transfer writes cannot match the other mode by chance.
    # So do its shared-memory staging regions (revision 3), through the env.
    os.environ.setdefault("LMCACHE_PATCHTOOL_STAGING_FILL", "0xA5")
    extra = ["--step-timeout", "30", "--transfer-mode", mode, "--client-malloc-perturb", "0x5A"] + \
        (["--keep-tmp"] if keep else [])
    return gate_report(version, overlay, presets, *extra, who="engine_driven_evidence")


def outcome(p: dict) -> str:
    """One word per preset: the gate passed, refused loudly, restored wrong
    bytes or foreign writes, found nothing to restore, or reached no verdict."""
    if p["verdict"] == "pass":
        return "pass"
    if p.get("loud_refusal"):
        return "refused"
    if p["verdict"] != "fail":
        return "error"
    # wrong: a restored byte differs or a byte outside the destination changed
    # (restore_verdict's byte reasons); anything else (chunks lost, not stored,
    # not served from disk) restored nothing wrong: a miss
    wrong = any(r.startswith(("wrong ", "foreign writes")) for r in p.get("reasons") or [])
    return "wrong" if wrong else "miss"


def l2_digests(report: dict, preset: str) -> dict[str, str]:
    (p,) = [x for x in report["presets"] if x["preset"] == preset]
    # The gate runs one server pair per chunk size: the preset's own cycle.
    (cycle,) = [c for c in report["cycles"] if preset in c["presets"]]
    files = l2_objects(Path(cycle["workdir"], "l2"), p["model_name"])
    # KV bytes: a checksum trailer (hybrid-fa part 12-l2-checksum) binds the
    # file name, which holds the gate's per-run model name.
    return {f.name.replace(p["model_name"], "MODEL"): hashlib.sha256(kv_bytes(f)).hexdigest()
            + (" +trailer" if has_trailer(f) else "") for f in files}


def _cleanup(report: dict) -> None:
    for c in report.get("cycles", []):
        shutil.rmtree(c["workdir"], ignore_errors=True)
    if report.get("client_log"):
        Path(report["client_log"]).unlink(missing_ok=True)


def cell(version: str, build: str) -> dict | None:
    patches = build_patches(version, build)
    if patches is None:
        return None
    overlay = provision.overlay(version, patches or None)
    stacked = build == "stacked"
    _log(f"{version} {build}: engine-driven gate ({len(PRESETS)} presets)")
    ed = run_gate(version, overlay, "engine_driven", keep=stacked, presets=PRESETS)
    ld = None
    try:
        if stacked:
            _log(f"{version} {build}: lmcache-driven gate (object identity)")
            ld = run_gate(version, overlay, "lmcache_driven", keep=True, presets=LD_PRESETS)
        presets = {}
        for p in ed["presets"]:
            name = p["preset"]
            g = gate_preset(name)
            identical = None
            if stacked and p["verdict"] == "pass" and name in LD_PRESETS:
                mine, theirs = l2_digests(ed, name), l2_digests(ld, name)
                identical = bool(mine) and mine == theirs
            presets[name] = {"k": g.k, "hybrid": g.num_gdn_layers > 0, "gdn_view": g.gdn_view,
                             "outcome": outcome(p),
                             "reason": (p.get("reasons") or [""])[0][:300],
                             "reasons": [r[:300] for r in (p.get("reasons") or [])[:4]], "identical": identical}
    finally:
        _cleanup(ed)
        if ld is not None:
            _cleanup(ld)
    return {"lmcache": version, "build": build,
            "patches_sha256": patches_sha256(patches) if patches else None, "presets": presets}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", default=",".join(VERSIONS))
    ap.add_argument("--builds", default=",".join(BUILDS))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--merge", action="store_true",
                    help="replace only the cells run now in --out, keep the others")
    args = ap.parse_args()
    started = time.monotonic()
    cells = [c for v in args.versions.split(",") for b in args.builds.split(",")
             if (c := cell(v, b)) is not None]
    doc = write_evidence(Path(args.out), SCHEMA, cells, started, merge=args.merge)
    _log(f"wrote {args.out} ({doc['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
