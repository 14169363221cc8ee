"""The engine shim's import hook and bench/engine_trace.py in a real interpreter start-up
(no vLLM: stand-in modules under the names the shim and the trace look for).

The shim fixes llvmlite's ``_lib_wrapper`` when it is imported; with
LMCACHE_PATCHTOOL_ENGINE_TRACE naming bench/engine_trace.py and a trace folder set, the
scheduler's calls are recorded, one JSON line each, with the request id where the call
has one; without the variable nothing is recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "gate" / "engine_shim"
TRACE = REPO / "bench" / "engine_trace.py"

STANDINS = {
    "llvmlite/__init__.py": "",
    "llvmlite/binding/__init__.py": "",
    "llvmlite/binding/ffi.py": ("class _lib_wrapper:\n    __slots__ = (\"_lib\",)\n"
                                "    def __getattr__(self, name):\n        return name\n"),
    "vllm/__init__.py": "", "vllm/v1/__init__.py": "", "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/sched/__init__.py": "",
    "vllm/v1/core/sched/scheduler.py": (
        "class Scheduler:\n"
        "    def add_request(self, request):\n        return request.request_id\n"
        "    def schedule(self):\n        return 'out'\n"),
    # a module-level function the trace wraps (the engine-driven scatter)
    "lmcache/__init__.py": "", "lmcache/v1/__init__.py": "", "lmcache/v1/multiprocess/__init__.py": "",
    "lmcache/v1/multiprocess/object_group_transfer.py": (
        "def transfer_kv_per_object_group(*args, **kwargs):\n        return 'scattered'\n"),
}

PROGRAM = """
import types
import llvmlite.binding.ffi as ffi
from vllm.v1.core.sched.scheduler import Scheduler
lib = ffi._lib_wrapper()
try:
    lib.__dict__
    print("dunder resolved")
except AttributeError:
    print("dunder refused")
print(lib.LLVMPY_Version)
s = Scheduler()
print(s.add_request(types.SimpleNamespace(request_id="req-7")), s.schedule())
from lmcache.v1.multiprocess import object_group_transfer as ogt
print(ogt.transfer_kv_per_object_group(1, 2, direction="H2D"))
"""


def _run(tmp_path: Path, trace: bool) -> tuple[list[str], list[dict]]:
    for name, text in STANDINS.items():
        (tmp_path / "mods" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "mods" / name).write_text(text)
    out_dir = tmp_path / "trace"
    out_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_PATCHTOOL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(tmp_path / "mods")])
    if trace:
        env.update(LMCACHE_PATCHTOOL_ENGINE_TRACE=str(TRACE), LMCACHE_PATCHTOOL_TRACE_DIR=str(out_dir))
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True)
    events = [json.loads(line) for f in sorted(out_dir.glob("trace-*.jsonl")) for line in f.read_text().splitlines()]
    return proc.stdout.split("\n"), events


def test_trace_records_each_call_with_its_request(tmp_path):
    out, events = _run(tmp_path, trace=True)
    assert out[:4] == ["dunder refused", "LLVMPY_Version", "req-7 out", "scattered"]  # the shim's fix, the results
    assert [(e["f"], e["r"]) for e in events] == [("Scheduler.add_request", "req-7"), ("Scheduler.schedule", None),
                                                  ("transfer_kv_per_object_group", None)]
    assert all(e["t1"] >= e["t0"] for e in events)


def test_without_the_variable_nothing_is_wrapped(tmp_path):
    out, events = _run(tmp_path, trace=False)
    assert out[:4] == ["dunder refused", "LLVMPY_Version", "req-7 out", "scattered"]
    assert events == []
