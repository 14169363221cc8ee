"""``patchtool l2 scan DIR --quarantine DEST``: move the objects a scan
flagged out of the tier, crash-safely.

Moves are ``rename`` (atomic per object: after each move the object is in
exactly one place) under a journal in DEST; a killed run is finished by
re-running the same command (see :func:`quarantine`).  Nothing is ever
deleted or overwritten.  The scan itself is ``patchtool.l2scan``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from . import fsio
from .errors import Refusal, WriteRefusal
from .exitcodes import ExitCode
from .l2names import OBJECT_RE
from .l2scan import CATEGORIES, Plan, TierReader, dir_entries

JOURNAL = "quarantine.jsonl"
REFUSED_LISTED = 100
# Names journaled per fsync: one fsync per object would make a million moves
# take hours on a disk; the journal is a record of intent, the filesystem
# (where each name is) is the truth, so a batch loses nothing on a crash.
BATCH = 512
MAX_PASSES = 10


@dataclass
class QuarantineResult:
    dest: str
    journal: str
    only: list[str]
    run: str | None  # None when nothing was selected (nothing written)
    resumed: bool  # finished an unfinished run recorded in the journal
    moved: int
    moved_bytes: int
    moved_by_category: dict[str, int]
    refused: int  # flagged, but DEST already holds that name: left in DIR
    refused_names: list[str]
    passes: int




def parse_only(value: str | None) -> list[str]:
    if value is None:
        return list(CATEGORIES)
    chosen = [c.strip() for c in value.split(",") if c.strip()]
    bad = [c for c in chosen if c not in CATEGORIES]
    if bad or not chosen:
        raise Refusal("--only", f"{value!r}: choose from {','.join(CATEGORIES)}",
                      ExitCode.USAGE)
    return [c for c in CATEGORIES if c in chosen]


def check_dest(src: Path, dest: Path) -> bool:
    """Refuse a DEST a rename cannot reach, or one the adapter could write
    into; returns whether DEST must be created.  Writes nothing."""
    src_real, dest_real = os.path.realpath(src), os.path.realpath(dest)
    if dest_real == src_real:
        raise Refusal(dest, "is DIR itself", ExitCode.USAGE)
    if dest_real.startswith(src_real.rstrip(os.sep) + os.sep):
        # The adapter's tmp dir is a subdirectory of base_path and holds
        # files named like objects, which it renames into base_path.
        raise Refusal(dest, f"is inside DIR ({src}): the adapter writes and renames files in "
                      "DIR's subdirectories; choose a directory outside it", ExitCode.USAGE)
    create = not os.path.lexists(dest)
    probe = dest.parent if create else dest
    try:
        st_dest = os.stat(probe)
    except FileNotFoundError:
        raise Refusal(probe, "no such directory (DEST's parent must exist)") from None
    except OSError as exc:
        raise fsio.refusal_for(probe, exc, "stat it") from None
    if not os.path.isdir(probe):
        raise Refusal(probe, "is not a directory")
    st_src = os.stat(src)
    if st_dest.st_dev != st_src.st_dev:
        raise Refusal(dest, f"is on another filesystem than {src} (st_dev {st_dest.st_dev} != "
                      f"{st_src.st_dev}): a move must be a rename, which is atomic only within "
                      "one filesystem; choose a DEST on DIR's filesystem")
    return create


def _read_journal(path: Path) -> list[dict]:
    """Every complete record; a torn last line (a kill mid-append) is ignored."""
    data = fsio.read_file(path)
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


def _unfinished(records: list[dict]) -> dict | None:
    ended = {r.get("run") for r in records if r.get("event") == "end"}
    begun = [r for r in records if r.get("event") == "begin" and r.get("run") not in ended]
    return begun[-1] if begun else None


class _Journal:
    """Append-only JSON lines in DEST, each append fsynced and counted by
    the fault hook (fsio), like every other write of the tool."""

    def __init__(self, path: Path) -> None:
        self.path = path

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

        _write(self.path, write)


def _write(path: Path, op) -> None:
    try:
        fsio._counted(path, op)  # the tool's one fault-hook counter
    except OSError as exc:
        raise WriteRefusal(exc.filename or path, f"cannot write: {fsio.describe(exc)}; every "
                           "object is in exactly one place, re-run to finish") from None


def _plan_records(plan: Plan, only: list[str]) -> list[list]:
    return [[p, s, c, k] for p, by in plan.items() for s, (c, k) in by.items() if c in only]


def quarantine(src: Path, dest: Path, plan: Plan, only: list[str], reader: TierReader,
               create: bool) -> QuarantineResult:
    """Move every object the plan selects from ``src`` to ``dest``.

    Protocol (each step is one counted write; a kill between any two loses
    nothing):

    1. ``begin`` (the plan: set prefix, size, category) is appended to
       ``DEST/quarantine.jsonl`` and fsynced; the plan is kept because a
       re-run cannot recompute it once evidence (e.g. a namespaced set) moved;
    2. per batch of up to :data:`BATCH` objects, their names are appended
       (``move``) and fsynced, then each is renamed into DEST: an object is
       in exactly one place after every rename;
    3. passes repeat until one moves nothing (a directory changed while it is
       read may hide entries), at most :data:`MAX_PASSES`; both directories
       are fsynced; ``end``.

    A re-run of the same command finds the unfinished ``begin`` and finishes
    its plan; objects already in DEST are no longer in DIR, so nothing moves
    twice.  A name DEST already holds is never overwritten: that object stays
    in DIR and is reported as refused."""
    from .transaction import Lock

    journal = _Journal(dest / JOURNAL)
    records = _read_journal(journal.path) if not create else []
    open_run = _unfinished(records)
    src_real = os.path.realpath(src)
    if open_run is not None:
        if (open_run.get("dir"), open_run.get("only"), open_run.get("reader")) != \
                (src_real, only, reader.detail):
            raise Refusal(journal.path, f"holds an unfinished quarantine of "
                          f"{open_run.get('dir')} (--only {','.join(open_run.get('only', []))}; "
                          f"reader: {open_run.get('reader')}): re-run that command to finish "
                          "it first")
        todo = {(p, s): (c, k) for p, s, c, k in open_run["plan"]}
        run, resumed = str(open_run["run"]), True
    else:
        todo = {(p, s): (c, k) for p, s, c, k in _plan_records(plan, only)}
        run, resumed = uuid.uuid4().hex[:12], False
    res = QuarantineResult(str(dest), str(journal.path), only, None, resumed, 0, 0,
                           {c: 0 for c in only}, 0, [], 0)
    if not todo:
        return res  # nothing selected: nothing written, not even DEST
    res.run = run
    if create:
        _write(dest, lambda: os.mkdir(dest))
    by_prefix: dict[str, dict] = {}
    for (p, s), ck in todo.items():
        by_prefix.setdefault(p, {})[s] = ck
    with Lock(dest):
        if not resumed:
            journal.append([{"event": "begin", "run": run, "dir": src_real, "only": only,
                             "reader": reader.detail, "time": _now(),
                             "plan": [[p, s, c, k] for (p, s), (c, k) in sorted(
                                 todo.items(), key=lambda i: (i[0][0], i[0][1] or -1))]}])
        refused: set[str] = set()
        # Another pass only after one that moved something; capped, so a
        # live writer still storing wrong-layout objects is not chased
        # forever (what it adds later stays flagged for the next run).
        while res.passes < MAX_PASSES:
            res.passes += 1
            if not _one_pass(src, dest, journal, run, by_prefix, refused, res):
                break
        for d in (dest, src):
            fsio.fsync_dir(d)
        res.refused = len(refused)
        res.refused_names = sorted(refused)[:REFUSED_LISTED]
        journal.append([{"event": "end", "run": run, "time": _now(), "moved": res.moved,
                         "refused": res.refused}])
    return res


def _one_pass(src: Path, dest: Path, journal: _Journal, run: str, by_prefix: dict,
              refused: set[str], res: QuarantineResult) -> int:
    match = OBJECT_RE.fullmatch
    batch: list[tuple[str, int, str]] = []
    moved = 0
    with dir_entries(src) as it:
        for entry in it:
            name = entry.name
            m = match(name)
            if m is None or name in refused or not entry.is_file(follow_symlinks=False):
                continue
            by = by_prefix.get(name[:m.end(3)])
            if by is None:
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            ck = by.get(None) or by.get(size)
            if ck is None:
                continue
            batch.append((name, size, ck[0]))
            if len(batch) >= BATCH:
                moved += _move_batch(src, dest, journal, run, batch, refused, res)
                batch = []
    if batch:
        moved += _move_batch(src, dest, journal, run, batch, refused, res)
    return moved


def _move_batch(src: Path, dest: Path, journal: _Journal, run: str,
                batch: list[tuple[str, int, str]], refused: set[str],
                res: QuarantineResult) -> int:
    # DEST is locked, so nothing else adds names to it between this check
    # and the rename; a rename would replace an existing file silently.
    go = []
    for item in batch:
        if os.path.lexists(dest / item[0]):
            refused.add(item[0])
        else:
            go.append(item)
    if not go:
        return 0
    journal.append([{"event": "move", "run": run, "name": n, "size": s, "category": c}
                    for n, s, c in go])
    moved = 0
    for name, size, cat in go:
        a, b = src / name, dest / name
        try:
            _write(b, lambda: os.rename(a, b))
        except WriteRefusal:
            if not os.path.lexists(a):
                continue  # gone meanwhile (evicted by the server): nothing to move
            raise
        moved += 1
        res.moved += 1
        res.moved_bytes += size
        res.moved_by_category[cat] += 1
    return moved


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


