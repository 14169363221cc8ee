"""The fs L2 adapter's checksum bookkeeping, driven directly (target env).

Runs the installed ``FSL2Adapter`` (a patched tree on ``PYTHONPATH``) on
real files in ``DIR`` and prints one JSON document: what a load answers for
an object without a trailer and for a corrupted one, whether the next store
rewrites each of them (upstream skips a store whose file exists), whether an
intact object's store is skipped, O_DIRECT, and what creating an
``fs_native`` adapter raises.  tests/ports/test_l2_checksum.py judges it.

    PYTHONPATH=<overlay>:<repo> <venv>/bin/python -m lab.probes.l2_checksum_probe DIR
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any

SIZE = 1 << 20  # a multiple of any filesystem block size (O_DIRECT)


class Buffer:
    """What the adapter needs of a MemoryObj: ``byte_array`` (page-aligned
    memory, as O_DIRECT requires)."""

    def __init__(self, data: bytes | None = None) -> None:
        self.mem = mmap.mmap(-1, SIZE)
        if data is not None:
            self.mem[:] = data

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.mem)


def _wait(poll, task_id: int) -> Any:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = poll(task_id)
        if got is not None:
            return got
        time.sleep(0.005)
    raise TimeoutError(f"task {task_id}")


class Probe:
    def __init__(self, base: Path, odirect: bool = False) -> None:
        from lmcache.v1.distributed.api import ObjectKey  # noqa: PLC0415
        from lmcache.v1.distributed.l2_adapters import fs_l2_adapter as fsa  # noqa: PLC0415

        base.mkdir(parents=True, exist_ok=True)
        self.fsa = fsa
        self.adapter = fsa.FSL2Adapter(fsa.FSL2AdapterConfig(str(base), use_odirect=odirect))
        self.key = ObjectKey(chunk_hash=bytes(range(8)), model_name="probe/model", kv_rank=0x01000100,
                             object_group_id=0)
        self.path = base / fsa._object_key_to_filename(self.key)
        self.kv = os.urandom(SIZE)

    def store(self) -> None:
        tid = self.adapter.submit_store_task([self.key], [Buffer(self.kv)])

        def done(t: int) -> Any:
            return self.adapter.pop_completed_store_tasks().get(t)
        _wait(done, tid)

    def load(self) -> list[int]:
        dst = Buffer()
        bitmap = _wait(self.adapter.query_load_result, self.adapter.submit_load_task([self.key], [dst]))
        hits = bitmap.get_indices_list()
        if hits and bytes(dst.mem) != self.kv:
            raise AssertionError("a hit with wrong bytes")
        return hits

    def rejected(self) -> dict[str, int]:
        return dict(self.adapter.report_status()["rejected_objects_by_reason"])

    def close(self) -> None:
        self.adapter.close()


def heal_case(base: Path, damage) -> dict[str, Any]:
    """Damage the stored object, load (a miss), store again, load again."""
    p = Probe(base)
    try:
        p.store()
        damage(p)
        stamp = p.path.stat().st_mtime_ns, p.path.stat().st_ino
        out: dict[str, Any] = {"load": p.load(), "rejected": p.rejected()}
        p.store()
        out["rewritten"] = (p.path.stat().st_mtime_ns, p.path.stat().st_ino) != stamp
        out["reload"] = p.load()
        return out
    finally:
        p.close()


def _flip(p: Probe) -> None:
    with open(p.path, "r+b") as f:
        f.seek(SIZE // 3)
        b = f.read(1)
        f.seek(SIZE // 3)
        f.write(bytes([b[0] ^ 0x01]))


def main(argv: list[str]) -> int:
    work = Path(argv[0])
    doc: dict[str, Any] = {}
    # pristine's format: the KV bytes alone
    doc["no_trailer"] = heal_case(work / "no-trailer", lambda p: p.path.write_bytes(p.kv))
    doc["corrupt"] = heal_case(work / "corrupt", _flip)

    p = Probe(work / "intact")
    try:
        p.store()
        stamp = p.path.stat().st_mtime_ns, p.path.stat().st_ino
        time.sleep(0.01)
        p.store()
        doc["intact_store_skipped"] = (p.path.stat().st_mtime_ns, p.path.stat().st_ino) == stamp
        doc["kv_prefix_exact"] = p.path.read_bytes()[:SIZE] == p.kv and \
            p.path.stat().st_size == SIZE + p.fsa.SUM_TRAILER_LEN
    finally:
        p.close()

    try:
        fd = os.open(work / "odirect-probe", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
        os.close(fd)
        p = Probe(work / "odirect", odirect=True)
        try:
            p.store()
            odirect: Any = {"stored_with_trailer": p.path.stat().st_size == SIZE + p.fsa.SUM_TRAILER_LEN}
            odirect["load"] = p.load()
            _flip(p)
            odirect["after_flip"] = p.load()
        finally:
            p.close()
    except (OSError, AttributeError) as exc:
        odirect = "unsupported here"
        print(f"O_DIRECT not tried: {exc}", file=sys.stderr)
    doc["odirect"] = odirect

    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class  # noqa: PLC0415
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry  # noqa: PLC0415

    try:
        cfg = get_l2_adapter_config_class("fs_native").from_dict({"base_path": str(work / "native")})
        create_l2_adapter_from_registry(cfg).close()
        doc["fs_native"] = "created"
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        doc["fs_native"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
