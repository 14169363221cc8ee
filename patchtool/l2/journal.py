"""The journal in a quarantine directory (``DEST/quarantine.jsonl``), shared
by the quarantine and its undo, and the counted writes both make.

One JSON object per line, each append fsynced.  A run is a ``begin`` and,
once it is done, an ``end`` with the same ``run`` id; ``kind`` says whose
(``quarantine``, the default of journals that predate the undo, or
``restore``).  The journal is a record of intent: where each file is, is the
truth, so a kill between any two writes loses nothing and the same command
finishes the run.  Both commands hold DEST's lock (``transaction.Lock``) for
the whole run, so DEST changes only under one of them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from .. import fsio
from ..errors import WriteRefusal

JOURNAL = "quarantine.jsonl"
QUARANTINE, RESTORE = "quarantine", "restore"
# Names journaled per fsync: one fsync per object would make a million moves
# take hours on a disk; the filesystem is the truth, so a batch loses nothing.
BATCH = 512
LISTED = 100  # names listed in a report (refused, kept aside); all are counted


class Journal:
    def __init__(self, dest: Path) -> None:
        self.path = dest / JOURNAL

    def read(self) -> list[dict]:
        """Every complete record; a torn last line (a kill mid-append) is ignored."""
        data = fsio.read_file(self.path)
        if data is None:
            return []
        out = []
        for line in data.split(b"\n"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def append(self, records: list[dict]) -> None:
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()

        def write() -> None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                # A torn line from a killed append must not swallow this one.
                end = os.fstat(fd).st_size
                if end and os.pread(fd, 1, end - 1) != b"\n":
                    os.write(fd, b"\n")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)

        counted(self.path, write)


def kind(rec: dict) -> str:
    return rec.get("kind", QUARANTINE)


def unfinished(records: list[dict]) -> dict | None:
    """The last ``begin`` without its ``end``, of either kind."""
    ended = {r.get("run") for r in records if r.get("event") == "end"}
    begun = [r for r in records if r.get("event") == "begin" and r.get("run") not in ended]
    return begun[-1] if begun else None


def counted(path: Path, op: Callable[[], object]) -> None:
    """One write, counted by the tool's fault hook (``LMCACHE_PATCHTOOL_FAULT``);
    a refused write is one line saying that a re-run finishes the job."""
    try:
        fsio._counted(path, op)
    except OSError as exc:
        raise WriteRefusal(exc.filename or path, f"cannot write: {fsio.describe(exc)}; every "
                           "object is in DIR or DEST, re-run to finish") from None


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
