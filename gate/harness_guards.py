"""Guards for the round-trip harness: frozen host-object metadata and a
recorder of every host<->staging copy.

* :class:`FrozenMeta` is a real ``MemoryObjMetadata`` whose ``__setattr__``
  raises once :meth:`FrozenMeta.freeze` ran; :class:`GuardedTensorMemoryObj` is
  a real ``TensorMemoryObj`` whose ``set_used_size`` raises and whose identity
  fields (``meta``, ``raw_data``, ``group_prefix_sum``, ``_used_size_override``)
  cannot be rebound after :meth:`GuardedTensorMemoryObj.freeze`.  A violation is
  recorded before raising, because LMCache's store/retrieve catch exceptions
  (``logger.exception``) and would otherwise hide it.  Views derived from a
  base (``dataclasses.replace(base.meta, ...)``, new ``TensorMemoryObj``) are
  unfrozen and free to be built -- only the base objects handed out by the
  storage manager are guarded.
* :class:`CopyRecorder` wraps ``lmcache_driven_transfer.lmcache_memcpy_async_d2h``
  / ``_h2d`` (Python path) and receives the native emulation's staging copies,
  recording ``(data_ptr, meta.address, get_size(), raw_tensor.data_ptr())`` per
  copy; :meth:`CopyRecorder.analyse` maps every window back to its base object
  and checks pointer/address consistency and how the windows tile the object's
  segments (once per direction).
"""

from __future__ import annotations

import contextlib
from typing import Any

from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

VIOLATIONS: list[str] = []

_OBJ_FROZEN_FIELDS = frozenset({"meta", "raw_data", "group_prefix_sum", "_used_size_override", "parent_allocator"})


class FrozenMeta(MemoryObjMetadata):
    """``MemoryObjMetadata`` that refuses any attribute write after freeze()."""

    def freeze(self) -> "FrozenMeta":
        object.__setattr__(self, "_frozen", True)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            msg = f"frozen-meta: write to meta.{name} = {value!r} (address={self.__dict__.get('address')})"
            VIOLATIONS.append(msg)
            raise AttributeError(msg)
        object.__setattr__(self, name, value)


class GuardedTensorMemoryObj(TensorMemoryObj):
    """A real ``TensorMemoryObj``; its identity cannot change after freeze()."""

    def freeze(self) -> "GuardedTensorMemoryObj":
        object.__setattr__(self, "_frozen", True)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen") and name in _OBJ_FROZEN_FIELDS:
            msg = f"frozen-obj: rebinding obj.{name} (address={self.meta.address})"
            VIOLATIONS.append(msg)
            raise AttributeError(msg)
        object.__setattr__(self, name, value)

    def set_used_size(self, n: int) -> None:
        msg = f"frozen-obj: set_used_size({n}) on base object (address={self.meta.address})"
        VIOLATIONS.append(msg)
        raise AttributeError(msg)


def snapshot(obj: TensorMemoryObj) -> tuple:
    m = obj.meta
    return (m.address, tuple(m.shape), str(m.dtype), m.phy_size,
            tuple(tuple(s) for s in (m.shapes or [])), tuple(str(d) for d in (m.dtypes or [])),
            obj.get_size(), obj.data_ptr, obj.raw_data.data_ptr(), obj.raw_data.numel(),
            obj._used_size_override, tuple(obj.group_prefix_sum))


class CopyRecorder:
    """Records the host side of every host<->staging copy."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    # (direction, path, host_ptr, host_offset(meta.address), size, raw_tensor_ptr)
    def record(self, direction: str, path: str, host_ptr: int, address: int, size: int, raw_ptr: int) -> None:
        self.records.append({"dir": direction, "path": path, "ptr": int(host_ptr), "address": int(address),
                             "size": int(size), "raw_ptr": int(raw_ptr)})

    def wrap_python_path(self):
        from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt  # noqa: PLC0415

        return self.wrap_module(ldt)

    @contextlib.contextmanager
    def wrap_module(self, mod):
        """Record every ``mod.lmcache_memcpy_async_d2h`` / ``_h2d`` call (the
        Python path's copies) while the context is active."""
        orig_d2h, orig_h2d = mod.lmcache_memcpy_async_d2h, mod.lmcache_memcpy_async_h2d

        def _raw_ptr(obj):
            t = obj.raw_tensor
            return t.data_ptr() if t is not None else 0

        def d2h(gpu_buffer, memory_obj):
            self.record("d2h", "python", memory_obj.data_ptr, memory_obj.meta.address, memory_obj.get_size(),
                        _raw_ptr(memory_obj))
            return orig_d2h(gpu_buffer, memory_obj)

        def h2d(memory_obj, gpu_buffer):
            self.record("h2d", "python", memory_obj.data_ptr, memory_obj.meta.address, memory_obj.get_size(),
                        _raw_ptr(memory_obj))
            return orig_h2d(memory_obj, gpu_buffer)

        mod.lmcache_memcpy_async_d2h, mod.lmcache_memcpy_async_h2d = d2h, h2d
        try:
            yield self
        finally:
            mod.lmcache_memcpy_async_d2h, mod.lmcache_memcpy_async_h2d = orig_d2h, orig_h2d

    def analyse(self, direction: str, objects: list[dict], fa_segment: tuple[int, int] | None,
                fa_page_bytes: int | None, k: int = 1,
                elsewhere: list[dict] | None = None) -> dict:
        """Check this direction's windows against the base objects.

        ``objects``: per chunk ``{"ptr", "address", "size", "copied"}`` (``copied``:
        whether this direction is expected to touch the object at all).
        ``fa_segment``: (offset, nbytes) of the FA kernel group inside an object.
        ``elsewhere``: the objects of the model's OTHER object groups (a server
        that writes a hybrid's groups separately); copies into them are checked
        by their own call, not reported here as outside every object.
        """
        others = elsewhere or []
        recs = [r for r in self.records if r["dir"] == direction
                and not any(o["ptr"] <= r["ptr"] < o["ptr"] + o["size"] for o in others)]
        problems: list[str] = []
        per_obj: list[list[tuple[int, int]]] = [[] for _ in objects]
        for r in recs:
            owner = None
            for i, o in enumerate(objects):
                if o["ptr"] <= r["ptr"] < o["ptr"] + o["size"]:
                    owner = i
                    break
            if owner is None:
                problems.append(f"{direction}: copy at ptr {r['ptr']:#x} size {r['size']} is outside every host object")
                continue
            o = objects[owner]
            off = r["ptr"] - o["ptr"]
            if r["address"] - o["address"] != off:
                problems.append(f"{direction}: chunk {owner}: meta.address offset {r['address'] - o['address']} "
                                f"!= data_ptr offset {off}")
            if r["path"] == "python" and r["raw_ptr"] != r["ptr"]:
                problems.append(f"{direction}: chunk {owner}: raw_tensor.data_ptr() offset "
                                f"{r['raw_ptr'] - o['ptr']} != data_ptr offset {off}")
            if off + r["size"] > o["size"]:
                problems.append(f"{direction}: chunk {owner}: window [{off}, {off + r['size']}) overruns the object "
                                f"({o['size']} bytes)")
            per_obj[owner].append((off, r["size"]))

        modes = set()
        fa_windows_all = []
        for i, (o, wins) in enumerate(zip(objects, per_obj)):
            wins.sort()
            if not o["copied"]:
                if wins:
                    problems.append(f"{direction}: chunk {i} should not be copied (skipped) but has {len(wins)} copies")
                continue
            # exact tiling of the whole object, once
            pos = 0
            for off, size in wins:
                if off != pos:
                    problems.append(f"{direction}: chunk {i}: windows do not tile the object "
                                    f"(gap/overlap at {pos} -> {off})")
                    break
                pos = off + size
            else:
                if pos != o["size"]:
                    problems.append(f"{direction}: chunk {i}: windows cover {pos} of {o['size']} bytes")
            if len(wins) == 1 and wins[0] == (0, o["size"]):
                modes.add("whole-object")
            else:
                modes.add("windowed")
            if fa_segment is not None:
                seg_off, seg_len = fa_segment
                inside = [(off - seg_off, size) for off, size in wins
                          if off >= seg_off and off + size <= seg_off + seg_len]
                straddle = [(off, size) for off, size in wins
                            if off < seg_off + seg_len and off + size > seg_off
                            and not (off >= seg_off and off + size <= seg_off + seg_len)]
                fa_windows_all.append({"inside": inside, "straddling": straddle})
        summary = {
            "copies": len(recs),
            "mode": sorted(modes),
            "problems": problems,
            "ok": not problems,
        }
        if fa_segment is not None:
            # Per-page tiling of the FA segment: k windows of one page each at j*page.
            paged = bool(fa_windows_all) and all(
                not w["straddling"] and fa_page_bytes and
                [off for off, _ in w["inside"]] == [j * fa_page_bytes for j in range(len(w["inside"]))] and
                all(size == fa_page_bytes for _, size in w["inside"]) and
                len(w["inside"]) == k and k * fa_page_bytes == fa_segment[1]
                for w in fa_windows_all)
            summary["fa_per_page_tiling"] = paged
            summary["fa_windows_per_object"] = sorted({len(w["inside"]) for w in fa_windows_all})
            summary["fa_straddling_windows"] = sum(len(w["straddling"]) for w in fa_windows_all)
        return summary
