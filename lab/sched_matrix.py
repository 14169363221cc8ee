#!/usr/bin/env python3
"""Run :mod:`sched_sim` over LMCache versions x vLLM versions x builds; print one
table and write the machine-readable evidence.

This runs from the checkout with any Python 3.11.  Per (LMCache V, vLLM X) it
provisions (or reuses) V's runtime venv, the vLLM X layer for V
(``lab/provision_vllm.py``: ``vllm_layer(V, vllm=X)``) and the lmcache
overlay (``lab/provision.py``), then runs the simulation in that venv, one
process per (V, X, build), with vLLM X's own scheduler features on (0.33+:
prefill checkpoint blocks, N = 576; see docs/scheduler-sim.md)::

    # the committed evidence, about 6 min on 2 cores once the layers exist
    python lab/sched_matrix.py \\
        --vllm 0.27.1,0.28.0,0.30.0,0.33.0 --json lab/evidence/sched-vllm-matrix.json
    python lab/sched_matrix.py --scenario ci --markdown   # 0.27.1 only
    python lab/sched_matrix.py --scenario all --versions 0.5.6 --vllm 0.33.0

Builds: ``pristine`` (the wheel), ``patched`` (the hybrid-fa patches git tracks),
``worktree`` (every ``*.patch`` in the working tree, e.g. a revision in progress).

Evidence schema (``--json FILE``; ``schema`` = :data:`SCHEMA`)::

    {
      "schema": "lmcache-patchtool/sched-vllm-matrix/1",
      "command": "<the command line that wrote it>",
      "scenario_set": "ci" | "all" | "<names>",
      "git_head": "<commit of the checkout>",
      "cells": [                        # one per (lmcache, vllm, build)
        {
          "lmcache": "0.5.6", "vllm": "0.33.0", "build": "pristine" | "patched" | "worktree",
          "torch": {"pin": "2.14.0", "used": "2.13.0", "cpu_build_of_pin": false, "why": "..."},
                                        # from the vLLM layer's stamp: the torch vLLM pins and
                                        # the CPU torch the run used (nearest when no CPU wheel)
          "features": {"checkpoint_blocks": true, "kv_connector_block_state": true,
                       "bind_kv_cache_manager": true, "has_checkpoint_blocks": true},
                                        # what that vLLM has and what the run turned on
          "block_size": 576,            # logical block N of the run
          "patches": ["01-...patch", ...] | null,
          "series_sha256": "<sha256 of those patch files, in order>" | null,
                                        # equal to lab/vllm_cells.series_sha256 when the
                                        # build is the whole series directory
          "constructed": true | false,  # the connector (scheduler role) was built on this vLLM
                                        # for at least one scenario
          "not_constructed_reason": null | "<one line>",
          "scenarios_run": [...],       # constructed and run to completion
          "scenarios_refused": [...],   # the connector refuses the config by design
                                        # (pristine 0.5.3, and its series before part 19:
                                        # one block per prefill step)
          "divergences": 0,             # steps x requests where the block ids the connector
                                        # tracks differ from vLLM's (KVCacheManager lists, and
                                        # on 0.30+ kv_connector_block_state), first runs and
                                        # restarted runs together
          "divergence_compared": 1234,  # (step, request) pairs compared
          "wrong_block_stores": 0,      # committed chunk writes holding a wrong block
          "wrong_state_hits": 0,        # stored-prefix hits whose boundary SSM state is wrong
          "wrong_state_restores": 0,    # restarted vLLM starts from a wrong SSM state
          "wrong_state_restores_known": 0,  # of those: the full-prompt hit of 0.5.3-0.5.5
                                        # without part 07 (pinned strict xfail in tests/sched)
          "model_inconsistencies": 0,   # truth-model self-check failures (must be 0)
          "restore_errors": 0,
          "hit_tokens": 123, "ideal_tokens": 123,
          "hit_share": 1.0 | null,      # hit_tokens / ideal_tokens over the second requests
          "checkpoint_writes": 12,      # checkpoint states the worker wrote (0.33+)
          "bug_applies": true | false,  # some scenario with multi-block prefill steps ran
          "pristine_fails_where_bug_applies": true | false | null,
                                        # the pristine build of this (lmcache, vllm) stores a
                                        # wrong block, hits or restores a wrong state in a
                                        # multi-block scenario; null when no such scenario
                                        # runs (pristine 0.5.3) or pristine was not in the run
          "sim_passes": true | false,   # patched/worktree: constructed, 0 divergences,
                                        # 0 wrong stores/hits, 0 restores from a wrong state
                                        # beyond the known ones, 0 inconsistencies/errors;
                                        # pristine: null
          "reconstruction_disagreements": 0 | null,
                                        # part 08 on vLLM 0.30+: part 03's reconstruction run
                                        # alongside (LMCACHE_PATCHTOOL_RESYNC_CHECK=count)
                                        # vs vLLM's lists; null when the build has no check
          "resync_source_steps": {"block_state": n, "reconstruction": m},
                                        # where the patched connector took its ids per step
          "reason", "wrong_stores", "bug_shows":
                                        # aliases of not_constructed_reason,
                                        # wrong_block_stores and
                                        # pristine_fails_where_bug_applies (bug_shows only
                                        # where the bug applies), as lab/vllm_cells.py
                                        # reads them
          "seconds": 12.3,              # wall time of the cell's process
          "scenarios": [{"name": ..., "constructed": ..., "steps": ..., "divergences": ...,
                         "wrong_block_stores": ..., "wrong_state_hits": ...,
                         "wrong_state_restores": ..., "hit_tokens": ..., "ideal_tokens": ...,
                         "checkpoint_writes": ..., "error": ...}, ...]
        }, ...
      ]
    }
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VERSIONS = ("0.5.3", "0.5.4", "0.5.5", "0.5.6")
VLLM_VERSIONS = ("0.27.1", "0.28.0", "0.30.0", "0.33.0")
BUILDS = ("pristine", "patched", "worktree")
SCHEMA = "lmcache-patchtool/sched-vllm-matrix/1"
# LMCache versions whose connector looks up the whole prompt (no
# reserve_last_token) unless the series carries part 07: the full-prompt hit
# restores a wrong state (tests/sched FULL_PROMPT_RESTORE_BROKEN).
FULL_PROMPT_RESTORE_BROKEN = {"0.5.3", "0.5.4", "0.5.5"}


def series(version: str, build: str) -> list[Path] | None:
    rel = f"patches/hybrid-fa/{version}"
    if build == "pristine":
        return None
    if build == "worktree":
        return sorted((REPO / rel).glob("*.patch"))
    out = subprocess.run(["git", "ls-files", "--", f"{rel}/*.patch"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return sorted(REPO / p for p in out)


def series_sha256(patches: list[Path]) -> str:
    """The fingerprint lab/vllm_cells.py compares with the shipped series."""
    _scripts()
    from lab import vllm_cells  # noqa: PLC0415

    return vllm_cells.patches_sha256(patches)


def _scripts() -> tuple[Any, Any]:
    from lab import provision  # noqa: PLC0415
    from lab import provision_vllm  # noqa: PLC0415

    return provision, provision_vllm


def layer_info(version: str, vllm: str) -> tuple[Path, Path, dict[str, Any]]:
    """(vLLM layer, runtime venv python, the layer's stamp)."""
    provision, provision_vllm = _scripts()
    layer = provision_vllm.vllm_layer(version, vllm=vllm)
    stamp = json.loads((layer / provision.STAMP).read_text())
    runtime = Path(stamp.get("runtime_env") or provision.runtime_env(version))
    if "torch" not in stamp:  # a layer built before the torch choice was recorded
        meta = next(layer.glob(f"vllm-{vllm}.dist-info"), None)
        pin = provision_vllm.torch_pin((meta / "METADATA").read_text()) if meta else None
        used = provision.TORCH_VERSION
        stamp["torch"] = {"pin": pin, "used": used, "cpu_build_of_pin": pin == used,
                          "why": "from the layer's vLLM METADATA (the stamp predates "
                                 "torch recording); the runtime env's CPU torch"}
    return layer, runtime / "bin" / "python", stamp


def run(version: str, build: str, scenarios: list[str], objects: str,
        vllm: str = "0.27.1", extra: list[str] | None = None) -> list[dict[str, Any]]:
    """One sched_sim process for (version, vllm, build) -> its results."""
    provision, _ = _scripts()
    overlay = provision.overlay(version, series(version, build))
    layer, python, _stamp = layer_info(version, vllm)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "res.json"
        env = dict(os.environ, PYTHONPATH=f"{overlay}:{layer}:{REPO}",
                   LMCACHE_DISABLE_BANNER="1")
        args = [a for s in scenarios for a in ("--scenario", s)]
        proc = subprocess.run([str(python), "-m", "lab.sched_sim", *args,
                               "--objects", objects, "--version", version, "--build", build,
                               *(extra or []), "--out", str(out)],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{version} vLLM {vllm} {build}: exit {proc.returncode}\n"
                             f"{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def _multi_block(r: dict[str, Any]) -> bool:
    return r["max_num_batched_tokens"] >= 2 * r["block_size"]


def cell(version: str, vllm: str, build: str, results: list[dict[str, Any]],
         stamp: dict[str, Any], patches: list[Path] | None) -> dict[str, Any]:
    """Summarise one (lmcache, vllm, build) run into an evidence cell."""
    ran = [r for r in results if r.get("constructed")]
    refused = [r for r in results if not r.get("constructed") and r.get("refuses_config")]
    broken = [r for r in results if not r.get("constructed") and not r.get("refuses_config")]
    reason = None
    crashed = [r for r in results if r.get("crashed")]
    if not ran and broken:
        e = broken[0]
        reason = f"{e['error'].splitlines()[0][:300]} ({e.get('error_at', '?')})"
        if e.get("crashed"):
            reason = f"raises at step {e['crashed_at_step']}: {reason}"
    has_07 = any(p.name.startswith("07-") for p in patches or ())
    known_broken = version in FULL_PROMPT_RESTORE_BROKEN and not has_07

    def restores_wrong(r: dict[str, Any], skip_known: bool) -> int:
        return sum(s.get("restore", {}).get("restored_state_ok") is False
                   for k, s in r["second"].items() if not (skip_known and k == "a"
                                                           and known_broken))

    sec = [s for r in ran for s in r["second"].values()]
    hit = sum(s["hit_tokens"] for s in sec)
    ideal = sum(s["ideal_tokens"] for s in sec)
    # The two-request scenarios: what LMCache holds after A then B, vs the ideal.
    two = [r["two_request"] for r in ran if r.get("two_request")]
    rows = []
    for r in results:
        row = {"name": r["scenario"], "constructed": bool(r.get("constructed"))}
        if r.get("constructed"):
            row.update(steps=r["steps"],
                       divergences=r["divergences"] + r.get("restore_divergences", 0),
                       wrong_block_stores=r["wrong_block_stores"],
                       wrong_state_hits=r["wrong_state_hits"],
                       wrong_state_restores=r["wrong_state_restores"],
                       hit_tokens=sum(s["hit_tokens"] for s in r["second"].values()),
                       ideal_tokens=sum(s["ideal_tokens"] for s in r["second"].values()),
                       checkpoint_writes=r.get("checkpoint_writes", 0),
                       prefill_steps=r["prefill_steps"])
        else:
            row["error"] = r.get("error", "").splitlines()[0][:300] if r.get("error") else None
            if r.get("crashed"):
                row.update(crashed_at_step=r["crashed_at_step"], error_at=r.get("error_at"))
        rows.append(row)
    multi = [r for r in ran if _multi_block(r)]
    out = {
        "lmcache": version, "vllm": vllm, "build": build,
        "torch": stamp.get("torch") or {"pin": None, "used": "2.13.0",
                                        "why": "layer stamp predates torch recording"},
        "features": (ran or results or [{}])[0].get("features"),
        "block_size": (results or [{}])[0].get("block_size"),
        "patches": [p.name for p in patches] if patches is not None else None,
        "series_sha256": series_sha256(patches) if patches is not None else None,
        "constructed": bool(ran), "not_constructed_reason": reason,
        "scenarios_run": [r["scenario"] for r in ran],
        "scenarios_refused": [r["scenario"] for r in refused],
        "scenarios_not_constructed": [r["scenario"] for r in broken],
        # raised inside the scheduler's step (a running engine's core dies)
        "scenarios_crashed": [r["scenario"] for r in crashed],
        "divergences": sum(r["divergences"] + r.get("restore_divergences", 0) for r in ran),
        "divergence_compared": sum(r["divergence_compared"] for r in ran),
        # part 08 on 0.30+: part 03's reconstruction, run alongside, vs vLLM's lists
        "reconstruction_disagreements": (
            sum(r.get("reconstruction_disagreements", 0)
                + r.get("restore_reconstruction_disagreements", 0) for r in ran)
            if any("reconstruction_check" in r for r in ran) else None),
        "resync_source_steps": {k: sum(r.get("resync_source_steps", {}).get(k, 0) for r in ran)
                                for k in ("block_state", "reconstruction")},
        "divergence_compared_block_state": sum(r["divergence_compared_block_state"]
                                               for r in ran),
        "wrong_block_stores": sum(r["wrong_block_stores"] for r in ran),
        "wrong_state_hits": sum(r["wrong_state_hits"] for r in ran),
        "wrong_state_restores": sum(restores_wrong(r, False) for r in ran),
        "wrong_state_restores_known": sum(restores_wrong(r, False) - restores_wrong(r, True)
                                          for r in ran),
        "model_inconsistencies": sum(r["num_model_inconsistencies"] for r in ran)
        + sum(len(s.get("restore", {}).get("model_inconsistencies") or ()) for s in sec),
        "restore_errors": sum(r["restore_errors"] for r in ran),
        "hit_tokens": hit, "ideal_tokens": ideal,
        "hit_share": round(hit / ideal, 4) if ideal else None,
        "followup_stored_tokens": sum(t["stored_tokens"] for t in two),
        "followup_ideal_tokens": sum(t["ideal_tokens"] for t in two),
        "resumes": sum(r.get("resumes", 0) for r in ran),
        "checkpoint_writes": sum(r.get("checkpoint_writes", 0) for r in ran),
        "bug_applies": bool(multi),
        "pristine_fails_where_bug_applies": (
            bool(crashed) or any(r["wrong_block_stores"] or r["wrong_state_hits"]
                                 or r["wrong_state_restores"] for r in multi)
            if build == "pristine" and (multi or crashed) else None),
        "scenarios": rows,
    }
    out["sim_passes"] = None if build == "pristine" else bool(
        ran and not broken and out["divergences"] == 0 and out["wrong_block_stores"] == 0
        and not out["reconstruction_disagreements"]
        and out["wrong_state_hits"] == 0 and out["model_inconsistencies"] == 0
        and out["restore_errors"] == 0
        and out["wrong_state_restores"] == out["wrong_state_restores_known"])
    return out


# The extended sets (docs/scheduler-sim.md, "vLLM 0.34"): async scheduling on
# the hybrid at the run's N, and pure attention at the blocks operators pass
# to FlashInfer / FlashAttention.  Each is one more sched_sim process per
# (LMCache, vLLM, build), summarised like a cell under ``extended``.
ATTENTION_BLOCKS = (64, 128, 256)
MIN_SHARE = 0.95  # stored or hit tokens against the ideal, per extended set


def extended_sets() -> list[tuple[str, list[str], list[str]]]:
    """(name, scenarios, extra sched_sim arguments) of each extended set."""
    return [("async", ["async"], [])] + [
        (f"attention-{n}", ["attn"], ["--block-size", str(n)]) for n in ATTENTION_BLOCKS]


def extended_verdict(sub: dict[str, Any], build: str) -> tuple[bool | None, bool | None]:
    """(passes, useful) of one extended set.  passes: the sim passes (0 divergences, 0 wrong
    stores or states, no error) and no scenario raised; useful: what it holds reaches MIN_SHARE of
    the ideal (the second requests' hits and, for the two-request scenarios, what LMCache holds
    after B).  Pristine: (None, None).  The support table reads ``passes`` (correctness, as for
    every vLLM); usefulness is reported beside it (0.5.3 refused some chunks by design before its
    part 19)."""
    if build == "pristine":
        return None, None
    shares = [(sub["hit_tokens"], sub["ideal_tokens"]),
              (sub["followup_stored_tokens"], sub["followup_ideal_tokens"])]
    useful = all(ideal == 0 or got >= MIN_SHARE * ideal for got, ideal in shares)
    return bool(sub["sim_passes"] and not sub["scenarios_crashed"]), useful


def finish_extended(c: dict[str, Any]) -> None:
    """Verdicts of a cell's extended sets, and the cell's summary of them."""
    build = c["build"]
    for sub in c["extended"].values():
        sub["passes"], sub["useful"] = extended_verdict(sub, build)
    c["extended_passes"] = None if build == "pristine" else all(
        x["passes"] for x in c["extended"].values())
    c["extended_useful"] = None if build == "pristine" else all(
        x["useful"] for x in c["extended"].values())
    # pristine: the sets in which it raises inside the scheduler's step
    c["extended_crashes"] = sorted(k for k, x in c["extended"].items() if x["scenarios_crashed"])


def fill_pristine_verdict(cells: list[dict[str, Any]]) -> None:
    """Every cell of a (lmcache, vllm) pair carries the pristine verdict."""
    verdict = {(c["lmcache"], c["vllm"]): c["pristine_fails_where_bug_applies"]
               for c in cells if c["build"] == "pristine"}
    for c in cells:
        if c["build"] != "pristine":
            c["pristine_fails_where_bug_applies"] = verdict.get((c["lmcache"], c["vllm"]))


def cells_markdown(cells: list[dict[str, Any]]) -> str:
    head = ("| LMCache | vLLM | torch used (pin) | build | N | checkpoint blocks | constructed "
            "| scenarios run / refused | divergences | wrong stores | wrong-state hits "
            "/ restores | hit / ideal | pristine fails where bug applies | sim passes |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for c in cells:
        t = c["torch"] or {}
        feats = c["features"] or {}
        cons = "yes" if c["constructed"] else f"no: {c['not_constructed_reason']}"
        share = f" ({c['hit_share']:.0%})" if c["hit_share"] is not None else ""
        known = (f" ({c['wrong_state_restores_known']} known)"
                 if c["wrong_state_restores_known"] else "")
        pf = c["pristine_fails_where_bug_applies"]
        rows.append("| " + " | ".join([
            c["lmcache"], c["vllm"], f"{t.get('used')} ({t.get('pin')})", c["build"],
            str(c["block_size"]), "on" if feats.get("checkpoint_blocks") else "off", cons,
            f"{len(c['scenarios_run'])} / {len(c['scenarios_refused'])}",
            str(c["divergences"]), str(c["wrong_block_stores"]),
            f"{c['wrong_state_hits']} / {c['wrong_state_restores']}{known}",
            f"{c['hit_tokens']} / {c['ideal_tokens']}{share}",
            "n/a" if pf is None else ("yes" if pf else "no"),
            "-" if c["sim_passes"] is None else ("yes" if c["sim_passes"] else "NO"),
        ]) + " |")
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", default=",".join(VERSIONS), help="LMCache versions")
    ap.add_argument("--vllm", default="0.27.1",
                    help=f"vLLM versions, comma-separated (the evidence: {','.join(VLLM_VERSIONS)})")
    ap.add_argument("--builds", default="pristine,patched")
    ap.add_argument("--scenario", action="append", default=[],
                    help="as sched_sim's (repeatable; default 'ci')")
    ap.add_argument("--objects", choices=("auto", "merged", "separate"), default="auto")
    ap.add_argument("--checkpoint-blocks", choices=("auto", "on", "off"), default="auto",
                    help="passed to sched_sim (auto: each vLLM's own default)")
    ap.add_argument("--json", metavar="FILE", nargs="?", const="-",
                    help="write the evidence (schema above) to FILE ('-' or no value: stdout)")
    ap.add_argument("--markdown", action="store_true",
                    help="print the per-scenario table (sched_sim's) as well as the cell table")
    ap.add_argument("--out", help="write the raw per-scenario JSON results here")
    ap.add_argument("--merge", action="store_true",
                    help="with --json FILE: replace only the cells run now in FILE, keep the others")
    ap.add_argument("--extended", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the extended sets per cell: async scheduling, pure attention "
                         f"at blocks {', '.join(map(str, ATTENTION_BLOCKS))} (default on)")
    ap.add_argument("--from-evidence", metavar="FILE",
                    help="print the cell table of an evidence file (runs nothing)")
    args = ap.parse_args(argv)
    if args.from_evidence:
        print(cells_markdown(json.loads(Path(args.from_evidence).read_text())["cells"]))
        return 0
    builds = args.builds.split(",")
    if unknown := set(builds) - set(BUILDS):
        ap.error(f"unknown builds {sorted(unknown)}")
    results: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = []
    extra = ["--checkpoint-blocks", args.checkpoint_blocks]
    started = time.monotonic()
    for version in args.versions.split(","):
        for vllm in args.vllm.split(","):
            _, _, stamp = layer_info(version, vllm)
            for build in builds:
                t0 = time.monotonic()
                print(f"=== LMCache {version} vLLM {vllm} {build}", file=sys.stderr, flush=True)
                res = run(version, build, args.scenario or ["ci"], args.objects, vllm, extra)
                for r in res:
                    r["vllm"] = vllm
                results += res
                c = cell(version, vllm, build, res, stamp, series(version, build))
                if args.extended:
                    c["extended"] = {}
                    for name, scen, more in extended_sets():
                        sub_res = run(version, build, scen, args.objects, vllm, extra + more)
                        c["extended"][name] = cell(version, vllm, build, sub_res, stamp,
                                                   series(version, build))
                    finish_extended(c)
                c["seconds"] = round(time.monotonic() - t0, 1)
                cells.append(c)
    if args.merge and args.json not in (None, "-") and Path(args.json).exists():
        # The pristine verdict of a kept pair is recomputed over the union.
        previous = json.loads(Path(args.json).read_text())
        ran = {(c["lmcache"], c["vllm"], c["build"]) for c in cells}
        cells_all = cells + [c for c in previous["cells"]
                             if (c["lmcache"], c["vllm"], c["build"]) not in ran]
        fill_pristine_verdict(cells_all)
    else:
        previous = None
        fill_pristine_verdict(cells)
    for c in cells:
        # Aliases under the names lab/vllm_cells.py reads.
        c["reason"] = c["not_constructed_reason"]
        c["wrong_stores"] = c["wrong_block_stores"]
        if c["pristine_fails_where_bug_applies"] is not None:
            c["bug_shows"] = c["pristine_fails_where_bug_applies"]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.json:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
        doc = {"schema": SCHEMA,
               "command": "python lab/sched_matrix.py "
                          + " ".join(argv if argv is not None else sys.argv[1:]),
               "scenario_set": ",".join(args.scenario or ["ci"]), "git_head": head,
               "seconds": round(time.monotonic() - started, 1), "cells": cells}
        if previous is not None:
            from lab import evidence_merge  # noqa: PLC0415 - only when merging

            doc = evidence_merge.merge(previous, doc, ("lmcache", "vllm", "build"))
        text = json.dumps(doc, indent=1) + "\n"
        if args.json == "-":
            print(text)
        else:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text)
    if args.markdown:
        from lab.sched_sim import markdown  # noqa: PLC0415

        print(markdown(results))
    if args.json != "-":
        print(cells_markdown(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
