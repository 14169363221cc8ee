"""Engine trace for bench/bench_engine_restore.py --trace: times the calls a restore goes
through in vLLM's processes, without editing anything installed.

The engine shim (gate/engine_shim/sitecustomize.py, which the gate puts first on the
``PYTHONPATH`` of every vLLM process, the spawned EngineCore and worker included) runs this
file at start-up when ``LMCACHE_PATCHTOOL_ENGINE_TRACE`` names it.  With
``LMCACHE_PATCHTOOL_TRACE_DIR`` set too, it wraps the methods below as their modules are
imported and appends one JSON line per call to ``<dir>/trace-<pid>.jsonl``:
``{"p": pid, "pp": parent pid, "f": name, "t0": start, "t1": end, "r": request id}``,
times from ``time.monotonic()`` (one clock for every process of the machine).  Without the
variable it does nothing.

What is wrapped (vLLM 0.32 for CPU, LMCache's multiprocess connector): the scheduler's
``add_request`` and ``schedule``, the model runner's ``execute_model`` and ``sample_tokens``,
and the connector's lookup (``get_num_new_matched_tokens``), metadata and load calls.  A
name that a version lacks is skipped.  The overhead is one ``time.monotonic()`` pair and a
buffered write per call.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

_DIR = os.environ.get("LMCACHE_PATCHTOOL_TRACE_DIR")

# module -> class -> methods; the first positional argument named in REQ carries the request
TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.v1.core.sched.scheduler": {"Scheduler": ("add_request", "schedule")},
    "vllm.v1.worker.gpu_model_runner": {"GPUModelRunner": ("execute_model", "sample_tokens")},
    "lmcache.integration.vllm.lmcache_mp_connector": {
        "LMCacheMPConnector": ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                               "start_load_kv", "wait_for_layer_load", "wait_for_save", "get_finished")},
}
REQ = {"add_request", "get_num_new_matched_tokens", "update_state_after_alloc"}
MARK = "_lmcache_patchtool_traced"

_out = None


def _emit(name: str, t0: float, t1: float, req: str | None) -> None:
    global _out
    if _out is None:
        _out = open(os.path.join(_DIR, f"trace-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
    _out.write(json.dumps({"p": os.getpid(), "pp": os.getppid(), "f": name, "t0": round(t0, 6),
                           "t1": round(t1, 6), "r": req}) + "\n")


def _wrap(cls: type, method: str) -> None:
    fn = cls.__dict__.get(method)
    if fn is None or getattr(fn, MARK, False):
        return
    name = f"{cls.__name__}.{method}"

    @functools.wraps(fn)
    def traced(self, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(self, *args, **kwargs)
        finally:
            req = getattr(args[0], "request_id", None) if method in REQ and args else None
            _emit(name, t0, time.monotonic(), req)

    setattr(traced, MARK, True)
    setattr(cls, method, traced)


def _wrap_module(module) -> None:  # noqa: ANN001
    for cls_name, methods in TARGETS[module.__name__].items():
        cls = getattr(module, cls_name, None)
        for m in methods if cls is not None else ():
            _wrap(cls, m)


if _DIR:
    # the engine shim's import hook (this file runs from the shim, which is sitecustomize)
    after_import = sys.modules["sitecustomize"].AfterImport
    sys.meta_path.insert(0, after_import({name: _wrap_module for name in TARGETS}))
