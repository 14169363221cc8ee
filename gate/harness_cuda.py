"""CUDA support for the round-trip harness (``gate/roundtrip.py --device cuda``).

On CPU the harness emulates LMCache's native plan executor
(``harness_native.py``); on CUDA it runs the REAL one.  This module holds
what differs on a GPU, and nothing that changes the CPU run:

* :func:`availability`: whether ``torch.cuda`` can be used (the CLI refuses
  ``--device cuda`` in one line when it cannot);
* :func:`local_events`: LMCache orders every transfer after a producer event
  whose IPC handle the engine sends.  In one process there is no engine and no
  point in a cross-process handle: the module's event backend is wrapped so
  that a handle made by :meth:`LocalEvents.handle` imports as the very event
  it was made from (everything else goes to the real backend);
* :func:`real_path`: selects LMCache's own transfer path for a cell --
  ``native`` (the plan executor ``execute_object_group_transfer``, every
  version), ``direct`` (0.5.6's ``cudaMemcpyBatchAsync`` path,
  ``execute_direct_copy_transfer``) or ``python`` (the per-batch Python loop)
  -- by the module flags LMCache itself reads
  (``_HAS_NATIVE_OBJECT_GROUP_TRANSFER``, ``_HAS_BATCH_MEMCPY_ASYNC``), and
  wraps the ops module in a pass-through that counts executor calls and hands
  every host window (``StagingCopy`` / ``DirectCopyObject``) to the copy
  recorder, so the guards see the native path's host side as on CPU;
* :func:`to_host`: CPU copies of the caches for the byte-exact analysis.

``--device cpu-standin`` runs this very code path on CPU tensors (LMCache's CPU
event stub, no pinning, no synchronisation; ``native`` is the emulated
executor observed through the same pass-through): the CPU tests and the
device script's ``--standin`` mode use it to check everything but the GPU.

Nothing here imports torch or lmcache at module level.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable

PATHS = ("python", "native", "direct")


def availability() -> tuple[bool, str]:
    """``(True, description)`` when CUDA tensors can be used, else ``(False, reason)``."""
    try:
        import torch  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        return False, f"torch is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        built = getattr(torch.version, "cuda", None)
        why = "torch was built without CUDA" if not built else f"no usable GPU (torch built for CUDA {built})"
        return False, f"torch.cuda is not available: {why} (torch {torch.__version__})"
    return True, f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def transfer_module():
    """The module whose globals the transfer functions read (0.5.6 moved them)."""
    try:
        from lmcache.v1.multiprocess import object_group_transfer as ogt  # noqa: PLC0415

        return ogt
    except ImportError:
        from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt  # noqa: PLC0415

        return ldt


def ops_attr(mod) -> str:
    """``lmc_ops`` (0.5.3) or ``device_ops`` (0.5.4+)."""
    return "lmc_ops" if hasattr(mod, "lmc_ops") else "device_ops"


def native_status() -> dict[str, Any]:
    """What LMCache's transfer module found at import: the executors it can call."""
    mod = transfer_module()
    ops = getattr(mod, ops_attr(mod))
    return {"module": mod.__name__, "ops": ops_attr(mod),
            "native_plan_executor": bool(getattr(mod, "_HAS_NATIVE_OBJECT_GROUP_TRANSFER", False)),
            "direct_copy": bool(getattr(mod, "_HAS_BATCH_MEMCPY_ASYNC", False)),
            "execute_object_group_transfer": hasattr(ops, "execute_object_group_transfer"),
            "execute_direct_copy_transfer": hasattr(ops, "execute_direct_copy_transfer")}


# ---------------------------------------------------------------------------
# Same-process producer events
# ---------------------------------------------------------------------------

class LocalEvents:
    """Wraps an ``EventIPCBackend``: handles made here import as their own event."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._events: dict[bytes, Any] = {}
        self.imported = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def handle(self, device: Any) -> bytes:
        """A producer event recorded on the current stream, and its handle."""
        ev = self._real.create_event(device)
        stream = None
        if str(getattr(device, "type", device)).startswith("cuda"):
            import torch  # noqa: PLC0415

            stream = torch.cuda.current_stream(device)
        self._real.record_event(ev, stream)
        handle = bytes(self._real.export_event(ev, device))
        self._events[handle] = ev
        return handle

    def import_event(self, handle: bytes, device: Any) -> Any:
        ev = self._events.pop(bytes(handle), None)
        if ev is not None:
            self.imported += 1
            return ev
        return self._real.import_event(handle, device)


@contextlib.contextmanager
def local_events():
    """Route ``register_kv_cache``'s event backend through :class:`LocalEvents`.

    Yields a callable ``handle(device) -> bytes`` for store/retrieve.
    """
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt  # noqa: PLC0415

    orig = ldt.get_event_ipc_backend
    wrapped: dict[int, LocalEvents] = {}

    def get_event_ipc_backend(device):
        real = orig(device)
        return wrapped.setdefault(id(real), LocalEvents(real))

    def handle(device) -> bytes:
        backend = get_event_ipc_backend(device)
        return backend.handle(device)

    ldt.get_event_ipc_backend = get_event_ipc_backend
    try:
        yield handle
    finally:
        ldt.get_event_ipc_backend = orig


# ---------------------------------------------------------------------------
# Path selection and the pass-through ops namespace
# ---------------------------------------------------------------------------

@dataclass
class PathStats:
    path: str
    calls: int = 0  # execute_object_group_transfer
    direct_calls: int = 0  # execute_direct_copy_transfer
    staging_copies: int = 0
    direct_objects: int = 0
    steps: int = 0
    launches: int = 0
    seen: set = field(default_factory=set)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "calls": self.calls, "direct_calls": self.direct_calls,
                "staging_copies": self.staging_copies, "direct_objects": self.direct_objects,
                "steps": self.steps, "launches": self.launches, "paths_taken": sorted(self.seen)}


def passthrough(real_ops: Any, h2d: Any, recorder: Callable[..., None] | None, stats: PathStats) -> Any:
    """``real_ops`` with its plan constructors and executors observed, not changed.

    ``StagingCopy(dst, src, size, host_offset)`` and
    ``DirectCopyObject(host_ptr, host_offset, size, chunk_idx, skip_blocks)``
    are recorded when built and handed to ``recorder`` (direction known) when
    the executor that consumes them is called.
    """
    pending: list[tuple] = []

    def staging_copy(dst, src, size, host_offset):
        pending.append(("staging", int(dst), int(src), int(size), int(host_offset)))
        return real_ops.StagingCopy(dst, src, size, host_offset)

    def direct_copy_object(host_ptr, host_offset, size, *rest):
        pending.append(("direct", int(host_ptr), int(host_offset), int(size)))
        return real_ops.DirectCopyObject(host_ptr, host_offset, size, *rest)

    def _flush(direction) -> None:
        is_h2d = int(direction) == int(h2d)
        d = "h2d" if is_h2d else "d2h"
        for rec in pending:
            if rec[0] == "staging":
                _, dst, src, size, off = rec
                host = src if is_h2d else dst
                stats.staging_copies += 1
                if recorder is not None:
                    recorder(d, "native", host, off, size, host)
            else:
                _, host, off, size = rec
                stats.direct_objects += 1
                if recorder is not None:
                    recorder(d, "direct", host, off, size, host)
        pending.clear()

    def execute_object_group_transfer(direction, device, pin_chunk_size, specs, steps, *args, **kw):
        stats.calls += 1
        stats.seen.add("native")
        stats.steps += len(steps)
        stats.launches += sum(len(getattr(s, "launches", ()) or ()) for s in steps)
        _flush(direction)
        return real_ops.execute_object_group_transfer(direction, device, pin_chunk_size, specs, steps, *args, **kw)

    def execute_direct_copy_transfer(direction, device, pin_chunk_size, specs, objects, *args, **kw):
        stats.direct_calls += 1
        stats.seen.add("direct")
        _flush(direction)
        return real_ops.execute_direct_copy_transfer(direction, device, pin_chunk_size, specs, objects, *args, **kw)

    def multi_layer_block_kv_transfer(*args, **kw):
        stats.seen.add("python")
        return real_ops.multi_layer_block_kv_transfer(*args, **kw)

    class _NS(types.SimpleNamespace):
        def __getattr__(self, name):
            return getattr(real_ops, name)

    ns = _NS(multi_layer_block_kv_transfer=multi_layer_block_kv_transfer)
    if hasattr(real_ops, "StagingCopy"):
        ns.StagingCopy = staging_copy
    if hasattr(real_ops, "execute_object_group_transfer"):
        ns.execute_object_group_transfer = execute_object_group_transfer
    if hasattr(real_ops, "DirectCopyObject"):
        ns.DirectCopyObject = direct_copy_object
    if hasattr(real_ops, "execute_direct_copy_transfer"):
        ns.execute_direct_copy_transfer = execute_direct_copy_transfer
    return ns


class PathUnavailable(RuntimeError):
    """The requested transfer path does not exist in this build."""


def select_flags(mod: Any, path: str) -> dict[str, bool]:
    """The module flags that make LMCache take ``path`` (raises when it cannot)."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r} ({'|'.join(PATHS)})")
    has_native = bool(getattr(mod, "_HAS_NATIVE_OBJECT_GROUP_TRANSFER", False))
    has_direct_flag = hasattr(mod, "_HAS_BATCH_MEMCPY_ASYNC")
    has_direct = bool(getattr(mod, "_HAS_BATCH_MEMCPY_ASYNC", False))
    flags = {"_HAS_NATIVE_OBJECT_GROUP_TRANSFER": False}
    if has_direct_flag:
        flags["_HAS_BATCH_MEMCPY_ASYNC"] = False
    if path == "native":
        if not has_native:
            raise PathUnavailable(f"the native plan executor is not available: {mod.__name__}."
                                  f"{ops_attr(mod)} has no execute_object_group_transfer "
                                  "(the compiled extension did not load?)")
        flags["_HAS_NATIVE_OBJECT_GROUP_TRANSFER"] = True
    elif path == "direct":
        if not has_direct:
            raise PathUnavailable("the direct-copy path is not available: "
                                  + ("this LMCache has none (0.5.6+)" if not has_direct_flag else
                                     "execute_direct_copy_transfer missing or cudaMemcpyBatchAsync unsupported"))
        flags["_HAS_NATIVE_OBJECT_GROUP_TRANSFER"] = has_native  # LMCache's own fallback order
        flags["_HAS_BATCH_MEMCPY_ASYNC"] = True
    return flags


@contextlib.contextmanager
def real_path(path: str, recorder: Callable[..., None] | None = None):
    """Run the REAL transfer ``path`` of the lmcache on ``sys.path``; yields :class:`PathStats`."""
    from lmcache.v1.gpu_connector import gpu_ops  # noqa: PLC0415

    mod = transfer_module()
    attr = ops_attr(mod)
    flags = select_flags(mod, path)
    real = getattr(mod, attr)
    h2d = _h2d(real)
    stats = PathStats(path)
    ns = passthrough(real, h2d, recorder, stats)
    saved_flags = {k: getattr(mod, k) for k in flags if hasattr(mod, k)}
    saved_ops = (getattr(mod, attr), getattr(gpu_ops, attr, None))
    for k, v in flags.items():
        setattr(mod, k, v)
    setattr(mod, attr, ns)
    if hasattr(gpu_ops, attr):
        setattr(gpu_ops, attr, ns)
    try:
        yield stats
    finally:
        for k, v in saved_flags.items():
            setattr(mod, k, v)
        setattr(mod, attr, saved_ops[0])
        if saved_ops[1] is not None:
            setattr(gpu_ops, attr, saved_ops[1])


def _h2d(real_ops: Any) -> Any:
    try:
        import lmcache.lmcache_native as native  # noqa: PLC0415  (0.5.4+: the enums live here)

        return native.TransferDirection.H2D
    except ImportError:
        return real_ops.TransferDirection.H2D


# ---------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------

def to_host(caches: Any) -> Any:
    """A CPU copy of a ``geometry.KVCaches`` (same logical shapes) for analysis."""
    from dataclasses import replace  # noqa: PLC0415

    return replace(caches, tensors=[t.cpu() for t in caches.tensors], raw=[t.cpu() for t in caches.raw])


def synchronize(device: str = "cuda") -> None:
    if device == "cuda":
        import torch  # noqa: PLC0415

        torch.cuda.synchronize()


@contextlib.contextmanager
def standin_native():
    """``cpu-standin``: give the transfer module an executor to run on CPU (the emulation's)."""
    from gate import harness_native as hn  # noqa: PLC0415

    with hn.native_emulation(None):
        yield
