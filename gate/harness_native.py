"""CPU emulation of LMCache's native object-group transfer plan executor.

LMCache 0.5.3's production CUDA path (``_run_object_group_transfer_plan`` in
``lmcache_driven_transfer.py``) builds plan records (``KernelGroupSpec``,
``LaunchVar``, ``BatchStep``, ``StagingCopy``) and hands them to
``lmc_ops.execute_object_group_transfer``, which is compiled CUDA code not
shipped in the wheel.  On a CPU-only torch the ``lmcache.c_ops`` shim has no
such attribute, ``_HAS_NATIVE_OBJECT_GROUP_TRANSFER`` is False and the plan
path never runs.

This module installs a stand-in ``lmc_ops`` namespace (into
``lmcache_driven_transfer`` and ``gpu_ops`` only, restored on exit) that
forwards every existing name to the real shim and adds the plan types plus an
executor whose semantics mirror the Python path
(``transfer_kv_per_object_group``) step for step:

* the executor only receives what the CUDA executor receives: plain integers
  (pointers, counts, offsets) and the shape descriptor / format enum.  It
  rebuilds the per-layer pointer array and the staged block-id array from
  their raw pointers (``torch_ops._tensor_from_ptr``), exactly like native code
  would dereference them -- it never sees the Python tensors;
* H2D (retrieve): per ``BatchStep``, first every ``StagingCopy`` (host ->
  staging), then every ``LaunchVar`` (kernel: staging -> paged KV);
* D2H (store): per ``BatchStep``, first every ``LaunchVar`` (paged KV ->
  staging), then every ``StagingCopy`` (staging -> host);
* a launch runs the same reference kernel the Python path runs on CPU
  (``lmc_ops.multi_layer_block_kv_transfer`` -> ``torch_ops``) over
  ``block_ids[start_block_pos : start_block_pos + n_blocks]``, the first
  ``batch_len`` staging slots of the spec, ``slots_per_chunk_in_sw`` as the
  LMCache chunk size and the launch's skip -- the same arguments the Python
  path passes for the same batch;
* a staging copy is a plain ``memmove(dst, src, size)``; ``host_offset``
  (``meta.address``) only steers pinned-chunk splitting in CUDA and is
  recorded for the guard, not used for addressing;
* bounds that a native executor must respect are checked and raise
  (block-id window inside the staged array, ``batch_len`` <= staging slots).

Every staging copy is reported to an optional ``recorder`` callback so the
copy guard sees the native path's host windows too.
"""

from __future__ import annotations

import contextlib
import ctypes
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class StagingCopy:
    dst: int
    src: int
    size: int
    host_offset: int


@dataclass(frozen=True)
class LaunchVar:
    spec_idx: int
    start_block_pos: int
    n_blocks: int
    batch_len: int
    skip_blocks: int


@dataclass(frozen=True)
class BatchStep:
    staging: list
    launches: list


@dataclass(frozen=True)
class KernelGroupSpec:
    paged_ptrs: int  # address of an int64 array of per-layer KV pointers
    temp_ptrs: list  # staging slot pointers, one per batch slot
    shape_desc: Any
    slots_per_chunk_in_sw: int
    fmt: Any
    block_ids_ptr: int  # address of the staged int64 block-id array
    n_block_ids: int


@dataclass
class NativeStats:
    calls: int = 0
    steps: int = 0
    launches: int = 0
    staging_copies: int = 0
    errors: list = field(default_factory=list)


def _num_layer_ptrs(torch_ops: Any, shape_desc: Any, fmt: Any) -> int:
    """Length of the pointer array ``get_group_data_ptrs`` produced for ``fmt``."""
    if torch_ops._is_cross_layer_format(fmt):
        return 1
    if torch_ops._is_sglang_mha_format(fmt):
        return 2 * int(shape_desc.nl)
    return int(shape_desc.nl)


class NativeExecutor:
    """The emulated ``execute_object_group_transfer``: one implementation for
    every LMCache version, parameterised by what moved between them.

    ``real_ops``: the real ops module (``lmc_ops`` / ``device_ops``) whose
    ``multi_layer_block_kv_transfer`` runs a launch; ``h2d``: the
    ``TransferDirection.H2D`` value of that version; ``torch_ops``: the
    version's ``lmcache.v1.platform.torch_ops`` (``_tensor_from_ptr``);
    ``layer_ptr_count(torch_ops, shape_desc, fmt)``: length of the per-layer
    pointer array for ``fmt`` (may raise for formats it does not cover).
    """

    def __init__(self, real_ops: Any, h2d: Any, torch_ops: Any,
                 layer_ptr_count: Callable[[Any, Any, Any], int],
                 recorder: Callable[..., None] | None, stats: NativeStats) -> None:
        self.real_ops = real_ops
        self.h2d = h2d
        self.torch_ops = torch_ops
        self.layer_ptr_count = layer_ptr_count
        self.recorder = recorder
        self.stats = stats

    def __call__(self, direction, device, pin_chunk_size, specs, steps):  # noqa: ARG002
        self.stats.calls += 1
        is_h2d = int(direction) == int(self.h2d)
        for step in steps:
            self.stats.steps += 1
            if is_h2d:
                self._staging(step.staging, is_h2d)
                self._launches(step.launches, specs, direction, device)
            else:
                self._launches(step.launches, specs, direction, device)
                self._staging(step.staging, is_h2d)

    def _staging(self, copies, is_h2d):
        for c in copies:
            self.stats.staging_copies += 1
            if self.recorder is not None:
                host_ptr = c.src if is_h2d else c.dst
                self.recorder("h2d" if is_h2d else "d2h", "native", host_ptr, c.host_offset, c.size, host_ptr)
            if c.size < 0:
                raise ValueError(f"negative staging copy size {c.size}")
            ctypes.memmove(c.dst, c.src, c.size)

    def _launches(self, launches, specs, direction, device):
        torch_ops = self.torch_ops
        for lv in launches:
            self.stats.launches += 1
            spec = specs[lv.spec_idx]
            if lv.start_block_pos < 0 or lv.n_blocks < 0 or lv.start_block_pos + lv.n_blocks > spec.n_block_ids:
                raise IndexError(
                    f"launch block window [{lv.start_block_pos}, {lv.start_block_pos + lv.n_blocks}) "
                    f"outside the staged block ids (n={spec.n_block_ids})")
            if not 0 < lv.batch_len <= len(spec.temp_ptrs):
                raise IndexError(f"batch_len {lv.batch_len} outside 1..{len(spec.temp_ptrs)} staging slots")
            n_ptrs = self.layer_ptr_count(torch_ops, spec.shape_desc, spec.fmt)
            paged = torch_ops._tensor_from_ptr(spec.paged_ptrs, (n_ptrs,), torch.int64, "cpu")
            ids_all = (torch_ops._tensor_from_ptr(spec.block_ids_ptr, (spec.n_block_ids,), torch.int64, "cpu")
                       if spec.n_block_ids else torch.empty(0, dtype=torch.int64))
            ids = ids_all[lv.start_block_pos:lv.start_block_pos + lv.n_blocks]
            self.real_ops.multi_layer_block_kv_transfer(
                paged.clone(),
                list(spec.temp_ptrs[:lv.batch_len]),
                ids.clone(),
                device,
                direction,
                spec.shape_desc,
                spec.slots_per_chunk_in_sw,
                spec.fmt,
                lv.skip_blocks,
            )


def plan_namespace(real_ops: Any, execute: Callable[..., None]) -> types.SimpleNamespace:
    """A stand-in ops namespace: the plan types and ``execute``, everything
    else forwarded to ``real_ops``."""

    class _NS(types.SimpleNamespace):
        def __getattr__(self, name):  # forward everything else to the real shim
            return getattr(real_ops, name)

    return _NS(
        StagingCopy=StagingCopy,
        LaunchVar=LaunchVar,
        BatchStep=BatchStep,
        KernelGroupSpec=KernelGroupSpec,
        execute_object_group_transfer=execute,
    )


@contextlib.contextmanager
def installed(mod: Any, gpu_ops: Any, attr: str, ns: Any):
    """Bind ``ns`` as ``mod.<attr>`` and ``gpu_ops.<attr>`` and enable the
    native plan path of ``mod``; everything is restored on exit."""
    saved = (getattr(mod, attr), getattr(gpu_ops, attr), mod._HAS_NATIVE_OBJECT_GROUP_TRANSFER)
    setattr(mod, attr, ns)
    setattr(gpu_ops, attr, ns)
    mod._HAS_NATIVE_OBJECT_GROUP_TRANSFER = True
    try:
        yield ns
    finally:
        setattr(mod, attr, saved[0])
        setattr(gpu_ops, attr, saved[1])
        mod._HAS_NATIVE_OBJECT_GROUP_TRANSFER = saved[2]


def make_namespace(real_ops: Any, recorder: Callable[..., None] | None, stats: NativeStats) -> types.SimpleNamespace:
    from lmcache.v1.platform import torch_ops  # noqa: PLC0415

    executor = NativeExecutor(real_ops, real_ops.TransferDirection.H2D, torch_ops, _num_layer_ptrs, recorder, stats)
    return plan_namespace(real_ops, executor)


@contextlib.contextmanager
def native_emulation(recorder: Callable[..., None] | None = None):
    """Route LMCache's transfer through ``_run_object_group_transfer_plan``."""
    from lmcache.v1.gpu_connector import gpu_ops  # noqa: PLC0415
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt  # noqa: PLC0415

    stats = NativeStats()
    ns = make_namespace(ldt.lmc_ops, recorder, stats)
    with installed(ldt, gpu_ops, "lmc_ops", ns):
        yield stats
