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
MODULE = ""  # a TARGETS key naming the module itself: its functions, not a class's methods

# module -> class (MODULE: the module itself) -> methods; the first positional argument named in
# REQ carries the request
TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.v1.core.sched.scheduler": {"Scheduler": ("add_request", "schedule")},
    "vllm.v1.worker.gpu_model_runner": {"GPUModelRunner": ("execute_model", "sample_tokens")},
    "lmcache.integration.vllm.lmcache_mp_connector": {
        "LMCacheMPConnector": ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                               "start_load_kv", "wait_for_layer_load", "wait_for_save", "get_finished")},
    # inside start_load_kv on the engine-driven path (patches/engine-driven): the PREPARE_RETRIEVE
    # round trip with the staging region's mapping, then the scatter into the KV cache
    "lmcache.v1.multiprocess.transfer_context.worker_transfer": {
        "EngineDrivenTransferContext": ("_retrieve_sources",)},
    "lmcache.v1.multiprocess.object_group_transfer": {MODULE: ("transfer_kv_per_object_group",)},
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


def _wrap(owner, method: str) -> None:  # noqa: ANN001 (a class, or a module for its functions)
    is_class = isinstance(owner, type)
    fn = owner.__dict__.get(method) if is_class else getattr(owner, method, None)
    if fn is None or getattr(fn, MARK, False):
        return
    name = f"{owner.__name__}.{method}" if is_class else method

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            # methods: args[0] is self, the request the first argument after it
            req = getattr(args[1], "request_id", None) if method in REQ and len(args) > 1 else None
            _emit(name, t0, time.monotonic(), req)

    setattr(traced, MARK, True)
    setattr(owner, method, traced)


def _wrap_module(module) -> None:  # noqa: ANN001
    for cls_name, methods in TARGETS[module.__name__].items():
        owner = module if cls_name == MODULE else getattr(module, cls_name, None)
        for m in methods if owner is not None else ():
            _wrap(owner, m)


if _DIR:
    # the engine shim's import hook (this file runs from the shim, which is sitecustomize)
    after_import = sys.modules["sitecustomize"].AfterImport
    sys.meta_path.insert(0, after_import({name: _wrap_module for name in TARGETS}))
