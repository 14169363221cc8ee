"""Version shims that let the 0.5.3 round-trip harness drive LMCache 0.5.4-0.5.6.

lmcache-patchtool hybrid-fa ports.  The round-trip harness (``harness.py``,
run by ``gate/roundtrip.py``) and its helpers (``harness_guards.py``,
``harness_native.py``) were written against 0.5.3,
where the transfer functions live in ``lmcache_driven_transfer`` and the ops
module is ``lmc_ops``.  What moved (see docs/ports.md):

* 0.5.4/0.5.5: ``lmc_ops`` became ``device_ops`` (ops, plan records) plus
  ``lmcache_native`` (enums); the native plan path reads
  ``device_ops.KernelGroupSpec/LaunchVar/BatchStep/execute_object_group_transfer``
  and ``gpu_ops.device_ops.StagingCopy``.
* 0.5.6: the transfer functions (and their ``lmcache_memcpy_async_*`` /
  ``_HAS_NATIVE_OBJECT_GROUP_TRANSFER`` globals) moved to
  ``lmcache.v1.multiprocess.object_group_transfer``; ``torch_ops`` became a
  package without ``_is_cross_layer_format``.

:func:`install` rebinds, at runtime and without touching those files:
``harness_guards.CopyRecorder.wrap_python_path``, ``harness._inject_fault``
and ``harness_native.native_emulation`` to versions that patch the module
that really owns the transfer, and gives ``lmcache_driven_transfer`` a
read-only ``_HAS_NATIVE_OBJECT_GROUP_TRANSFER`` on 0.5.6 (``_lmcache_info``
reads it).  On 0.5.3 it does nothing.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

# Which module owns the transfer (0.5.6 moved it) and its ops global's name:
# one definition, shared with the CUDA path.
from gate.harness_cuda import ops_attr, transfer_module


def lmcache_version() -> str | None:
    from pathlib import Path  # noqa: PLC0415

    import lmcache  # noqa: PLC0415

    root = Path(lmcache.__file__).resolve().parent.parent
    for dist in root.glob("lmcache-*.dist-info"):
        return dist.name[len("lmcache-"):-len(".dist-info")]
    return getattr(lmcache, "__version__", None)


# ---------------------------------------------------------------------------
# Copy recorder / fault injection on the real transfer module
# ---------------------------------------------------------------------------

def _wrap_python_path(self):
    return self.wrap_module(transfer_module())


def _inject_fault(kind: str | None):
    from gate import harness  # noqa: PLC0415

    return harness.fault_injected(kind, transfer_module)


# ---------------------------------------------------------------------------
# Native plan executor emulation for device_ops (0.5.4+)
# ---------------------------------------------------------------------------

def _per_layer_ptrs(torch_ops: Any, shape_desc: Any, fmt: Any) -> int:  # noqa: ARG001
    """Pointer-array length for 0.5.4+: per-layer (``NL_X_*``) formats only."""
    fmt_name = getattr(fmt, "name", str(fmt))
    if not fmt_name.startswith("NL_X_") or fmt_name.startswith("NL_X_TWO_X"):
        raise NotImplementedError(f"emulation covers per-layer formats only, got {fmt_name}")
    return int(shape_desc.nl)


@contextlib.contextmanager
def native_emulation(recorder: Callable[..., None] | None = None):
    """Route the transfer through ``_run_object_group_transfer_plan`` on CPU.

    The executor of ``harness_native`` (H2D: staging copies then launches per
    BatchStep; D2H: launches then staging copies), with 0.5.4+'s H2D enum
    (``lmcache_native``) and per-layer pointer arrays, installed as
    ``device_ops`` of the transfer module and of ``gpu_ops``.
    """
    from gate import harness_native as hn  # noqa: PLC0415
    from lmcache.v1.gpu_connector import gpu_ops  # noqa: PLC0415
    import lmcache.lmcache_native as lmcache_native  # noqa: PLC0415
    from lmcache.v1.platform import torch_ops  # noqa: PLC0415

    mod = transfer_module()
    attr = ops_attr(mod)
    if attr == "lmc_ops":  # 0.5.3: the original emulation applies unchanged
        with hn._orig_native_emulation(recorder) as stats:
            yield stats
        return
    real = getattr(mod, attr)
    stats = hn.NativeStats()
    executor = hn.NativeExecutor(real, lmcache_native.TransferDirection.H2D, torch_ops, _per_layer_ptrs,
                                 recorder, stats)

    def execute_object_group_transfer(direction, device, pin_chunk_size, specs, steps, **_timing):
        executor(direction, device, pin_chunk_size, specs, steps)

    with hn.installed(mod, gpu_ops, attr, hn.plan_namespace(real, execute_object_group_transfer)):
        yield stats


def _storage_manager_056(base_cls):
    """FakeStorageManager plus the 0.5.6 storage-manager surface.

    0.5.6 calls ``reserve_write(keys, layout)`` (no mode), completes writes
    with ``prepare_write_completion`` / ``finish_write_by_owner`` and reads
    with ``prepare_read_completion`` / ``unsafe_read`` / ``finish_read_by_owner``
    (``L1WriteCompletion`` = ``[(owner, [keys])]``).
    """

    class FakeStorageManager056(base_cls):
        OWNER = 1

        def reserve_write(self, keys, layout_desc, mode="new"):
            return super().reserve_write(keys, layout_desc, mode)

        def prepare_write_completion(self, objects):
            return [(self.OWNER, list(objects))]

        def finish_write_by_owner(self, completion):
            self.finish_write([k for _, keys in completion for k in keys])

        def prepare_read_completion(self, keys, l1_owners=None):  # noqa: ARG002
            return [(self.OWNER, list(keys))]

        def unsafe_read(self, keys, l1_owners=None):  # noqa: ARG002
            found = [k for k in keys if k in self.objs]
            return found, [self.objs[k] for k in found]

        def finish_read_by_owner(self, completion):
            self.finish_read_prefetched([k for _, keys in completion for k in keys])

        def finish_read_prefetched(self, keys, read_locks=1, l1_owners=None, extra_count=0):  # noqa: ARG002
            self.finish_read_calls += 1

    return FakeStorageManager056


def install() -> None:
    """Adapt the harness modules to the lmcache on ``sys.path`` (idempotent)."""
    from gate import harness, harness_guards, harness_native  # noqa: PLC0415
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt  # noqa: PLC0415

    mod = transfer_module()
    if mod is ldt and ops_attr(ldt) == "lmc_ops":
        return  # 0.5.3: nothing to adapt
    if not hasattr(harness_native, "_orig_native_emulation"):
        harness_native._orig_native_emulation = harness_native.native_emulation
    harness_native.native_emulation = native_emulation
    harness_guards.CopyRecorder.wrap_python_path = _wrap_python_path
    harness._inject_fault = _inject_fault
    if not hasattr(ldt, "_HAS_NATIVE_OBJECT_GROUP_TRANSFER"):
        ldt._HAS_NATIVE_OBJECT_GROUP_TRANSFER = mod._HAS_NATIVE_OBJECT_GROUP_TRANSFER
    if mod is not ldt and not getattr(harness, "_ports_056", False):
        # 0.5.6 server context: storage-manager completions, null block id,
        # per-request read owners and the lookup session manager.
        harness._ports_056 = True
        harness.FakeStorageManager = _storage_manager_056(harness.FakeStorageManager)
        orig_ctx = harness._fake_server_context

        def _fake_server_context(chunk_size, sm):
            ctx = orig_ctx(chunk_size, sm)
            ctx.null_block_id = 0
            ctx.get_read_owners = lambda request_id: None  # noqa: ARG005
            ctx.session_manager = types.SimpleNamespace(get=lambda request_id: None)  # noqa: ARG005
            return ctx

        harness._fake_server_context = _fake_server_context
