"""What a failed L2 load leaves behind, through LMCache's real StorageManager (target env).

A failed load must vanish: its L1 buffer was reserved for writing and never
filled.  LMCache 0.5.3-0.5.5 end it with ``finish_write`` then ``delete``,
and ``finish_write`` tells every L1 listener the object is complete; the
store controller is one of them, and its loop may read-lock the unfilled
buffer before the ``delete`` runs.  The delete then finds the key locked and
leaves it: an L1 object with whatever the buffer held, served as a hit and
stored to L2 as valid (sealed by the checksum parts as if right).  Part
``18-failed-load-discard`` discards it in one critical section with no
write-finished notice (what 0.5.6 does).

The probe makes a load fail deterministically and records what the L1
listeners are told, which is the precondition of that race (the race itself
is a thread interleaving, not forced here):

1. a StorageManager (real L1, real store controller, the real ``fs`` L2
   adapter of the tree on ``PYTHONPATH``) stores ``CHUNKS`` objects and
   closes once the tier holds them all;
2. the object of chunk ``DAMAGED`` is damaged on disk: one byte flipped
   (the checksum of part 12 rejects it) or, with ``--damage cut``, the file
   cut in half (upstream refuses a short read, checksum or not);
3. a second StorageManager on the same tier ("after a restart") prefetches
   all chunks with a recording listener registered on its L1 manager.

It prints one JSON document: the hit count, which chunks the listeners were
told finished writing, which are resident in L1 afterwards, and which were
deleted.

``--race`` then plays the interleaving the store controller's loop can win:
whatever the listeners were told finished writing is read-locked, as the
store loop does, before the prefetch controller's ``delete`` runs (a wrapper
around the L1 manager's ``delete``, this process only).  The probe reports
what is resident and whether its bytes are the stored ones, releases the
lock, lets the real store controller store what it was told, and a third
StorageManager ("the next restart") prefetches again: a hit on the damaged
chunk with other bytes than the writer's is the wrong hit this part prevents.
``tests/ports/test_failed_load_discard.py`` judges it.

    PYTHONPATH=<overlay>:<repo> <venv>/bin/python -m lab.probes.failed_load_probe DIR
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any

CHUNKS = 3
DAMAGED = 1
ELEMENTS = 4096  # float16 elements per object (8 KiB)
MODEL = "probe/failed-load"


class RecordingListener:
    """An L1 listener that records which keys each notification named.

    LMCache's listeners are duck-typed (a method per event), and the event
    set differs between releases, so any method is accepted and recorded.
    """

    def __init__(self) -> None:
        self.events: dict[str, list[Any]] = {}

    def __getattr__(self, name: str):
        if not name.startswith("on_"):
            raise AttributeError(name)

        def record(keys, *args, **kwargs) -> None:  # noqa: ARG001 (the signature LMCache calls)
            self.events.setdefault(name, []).extend(keys)

        return record


def _config(base: Path, policy: str):
    from lmcache.v1.distributed.config import parse_args  # noqa: PLC0415

    return parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--l2-prefetch-policy", policy,
                       "--l2-adapter", json.dumps({"type": "fs", "base_path": str(base)})])


def _keys() -> list:
    from lmcache.v1.distributed.api import ObjectKey  # noqa: PLC0415

    return [ObjectKey(chunk_hash=bytes([i + 1]) * 8, model_name=MODEL, kv_rank=0x01000100, object_group_id=0)
            for i in range(CHUNKS)]


def _layout():
    import torch  # noqa: PLC0415
    from lmcache.v1.distributed.api import MemoryLayoutDesc  # noqa: PLC0415

    return MemoryLayoutDesc(shapes=[torch.Size([ELEMENTS])], dtypes=[torch.float16])


def _object_path(base: Path, key) -> Path:
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter as fsa  # noqa: PLC0415

    return base / fsa._object_key_to_filename(key)


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError(what)


def store(base: Path, policy: str) -> None:
    """Writer: fill every chunk with its own value and wait until the tier holds it."""
    from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: PLC0415

    sm = StorageManager(_config(base, policy))
    try:
        keys = _keys()
        # 0.5.3-0.5.5 take a reservation mode; 0.5.6 reserves new objects only.
        mode = ("new",) if "mode" in inspect.signature(sm.reserve_write).parameters else ()
        reserved = sm.reserve_write(keys, _layout(), *mode)
        if len(reserved) != CHUNKS:
            raise RuntimeError(f"reserved {len(reserved)} of {CHUNKS} objects")
        for i, key in enumerate(keys):
            reserved[key].tensor.fill_(float(i + 1))
        sm.finish_write(keys)
        paths = [_object_path(base, k) for k in keys]
        _wait_for(lambda: all(p.exists() for p in paths), "the fs tier to hold every object")
        # The adapter writes to a temporary name and renames; give the last
        # rename's completion to the store controller before closing.
        time.sleep(0.5)
    finally:
        sm.close()


def damage(base: Path, how: str) -> None:
    path = _object_path(base, _keys()[DAMAGED])
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[100] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


def _prefetch(sm, keys: list) -> int:
    """Prefix hit count of one prefetch of ``keys``."""
    from lmcache.v1.distributed.api import PrefetchRequestSpec  # noqa: PLC0415

    handle = sm.submit_prefetch_task(PrefetchRequestSpec(keys=keys, group_layout_descs={0: _layout()}))
    if not sm.wait_prefetch_status(handle, 60.0):
        raise TimeoutError("the prefetch")
    found = sm.query_prefetch_status(handle)
    return found.count_leading_ones() if found is not None else 0


def _resident_right(l1, keys: list) -> dict[str, bool]:
    """For each resident chunk: does L1 hold the writer's value?"""
    out = {}
    for i, key in enumerate(keys):
        entry = l1._objects.get(key)  # noqa: SLF001
        if entry is not None:
            out[str(i)] = bool((entry.memory_obj.tensor == float(i + 1)).all())
    return out


class StoreLoopWins:
    """Read-lock what the listeners were told finished writing before each
    ``delete`` runs: the store controller's loop winning the race (its
    ``reserve_read`` between the prefetch controller's ``finish_write`` and
    ``delete``).  Installed on one L1 manager instance of this process."""

    def __init__(self, l1, listener: RecordingListener) -> None:
        self.l1 = l1
        self.listener = listener
        self.locked: list = []
        self._delete = l1.delete
        l1.delete = self.delete

    def delete(self, keys, *args, **kwargs):
        told = [k for k in self.listener.events.get("on_l1_keys_write_finished", []) if k in set(keys)]
        fresh = [k for k in told if k not in self.locked]
        if fresh:
            got = self.l1.reserve_read(fresh)
            self.locked += [k for k, (err, obj) in got.items() if obj is not None]
        return self._delete(keys, *args, **kwargs)

    def release(self) -> None:
        if self.locked:
            self.l1.finish_read(self.locked)


def restore(base: Path, race: bool, policy: str) -> dict[str, Any]:
    """Reader: a fresh StorageManager prefetches every chunk, listened to."""
    from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: PLC0415

    sm = StorageManager(_config(base, policy))
    try:
        listener = RecordingListener()
        l1 = sm._l1_manager  # noqa: SLF001 (the object the store controller listens to)
        l1.register_listener(listener)
        racer = StoreLoopWins(l1, listener) if race else None
        keys = _keys()
        hits = _prefetch(sm, keys)
        # Let the store controller's loop drain whatever it was told.
        time.sleep(0.5)
        index = {k: i for i, k in enumerate(keys)}

        def chunks(event: str) -> list[int]:
            return sorted({index[k] for k in listener.events.get(event, []) if k in index})

        doc = {"hits": hits,
               "write_finished": chunks("on_l1_keys_write_finished"),
               "deleted": chunks("on_l1_keys_deleted_by_manager"),
               "resident": sorted(index[k] for k in keys if k in l1._objects)}  # noqa: SLF001
        if racer is not None:
            doc["resident_right"] = _resident_right(l1, keys)
            racer.release()
            # The store controller was told too: give it time to store.
            time.sleep(1.5)
        return doc
    finally:
        sm.close()


def next_restart(base: Path, policy: str) -> dict[str, Any]:
    """A third StorageManager: what the tier serves now."""
    from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: PLC0415

    sm = StorageManager(_config(base, policy))
    try:
        keys = _keys()
        hits = _prefetch(sm, keys)
        return {"hits": hits, "resident_right": _resident_right(sm._l1_manager, keys)}  # noqa: SLF001
    finally:
        sm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("dir", type=Path, help="an empty directory for the fs tier")
    parser.add_argument("--damage", choices=("flip", "cut"), default="flip")
    parser.add_argument("--race", action="store_true", help="the store loop wins the race (see above)")
    parser.add_argument("--prefetch-policy", default="default",
                        help="LMCache's --l2-prefetch-policy (0.5.5's default keeps no loaded object in L1, so "
                             "the store controller is never told of one; 'retain' does)")
    args = parser.parse_args(argv)
    base = args.dir / "l2"
    base.mkdir(parents=True, exist_ok=True)
    store(base, args.prefetch_policy)
    damage(base, args.damage)
    doc = {"damaged_chunk": DAMAGED, "damage": args.damage, **restore(base, args.race, args.prefetch_policy)}
    if args.race:
        doc["next_restart"] = next_restart(base, args.prefetch_policy)
    json.dump(doc, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
