"""``patchtool l2 scan DIR --quarantine DEST``: move the objects a scan's plan
selects out of the tier, crash-safely.

Moves are ``rename`` (atomic per object: after each move the object is in
exactly one place) under the journal in DEST (``patchtool.l2.journal``); a
killed run is finished by re-running the same command.  Nothing is ever
deleted or overwritten.  The undo is ``patchtool.l2.restore``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import fsio
from ..errors import Refusal, WriteRefusal
from ..exitcodes import ExitCode
from .journal import BATCH, LISTED, QUARANTINE, RESTORE, Journal, counted, kind, now, \
    unfinished
from .names import OBJECT_RE
from .reader import TierReader
from .rules import Expectations, Plan
from .tally import dir_entries
from ..transaction import Lock

MAX_PASSES = 10


@dataclass
class QuarantineResult:
    dest: str
    journal: str | None  # None: a tier whose moves keep no journal (Redis, patchtool.l2.redis_move)
    only: list[str]
    run: str | None  # None when nothing was selected (nothing written)
    resumed: bool  # finished an unfinished run recorded in the journal
    moved: int
    moved_bytes: int
    moved_by_category: dict[str, int]
    refused: int  # selected, but DEST already holds that name: left in DIR
    refused_names: list[str]
    passes: int


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
        os.stat(probe)
    except FileNotFoundError:
        raise Refusal(probe, "no such directory (DEST's parent must exist)") from None
    except OSError as exc:
        raise fsio.refusal_for(probe, exc, "stat it") from None
    if not os.path.isdir(probe):
        raise Refusal(probe, "is not a directory")
    same_filesystem(src, probe, dest)
    return create


def same_filesystem(src: Path, probe: Path, named: Path) -> None:
    """Refuse unless the directories ``src`` and ``probe`` are on one
    filesystem: a move must be a rename (or a link), atomic only within one.
    The refusal names ``named`` (DEST, or the DIR a restore goes back to)."""
    a, b = _dev(src), _dev(probe)
    if a != b:
        # Two paths in one line: the reason stays short so it fits 200 characters.
        raise Refusal(named, f"is on another filesystem than {src}: a move must be a rename")


def _dev(path: Path) -> int:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise Refusal(path, "no such directory") from None
    except OSError as exc:
        raise fsio.refusal_for(path, exc, "stat it") from None
    if not os.path.isdir(path):
        raise Refusal(path, "is not a directory")
    return st.st_dev


def resume_key(src_real: str, only: list[str], reader: TierReader,
               expect: Expectations) -> dict:
    """What a run is, for its ``begin``: a re-run resumes only the same."""
    return {"dir": src_real, "only": only, "target": reader.identity, "expect": expect}


def _differs(rec: dict, key: dict, reader: TierReader) -> list[str]:
    """The parts of the current command that differ from an unfinished run's."""
    what = [label for label, f in (("DIR", "dir"), ("--only", "only")) if rec.get(f) != key[f]]
    if "target" in rec:
        if rec["target"] != key["target"]:
            what.append("reader")
        if rec.get("expect", {}) != key["expect"]:
            what.append("--expect-size")
    elif rec.get("reader") != reader.detail:  # a journal of an earlier patchtool
        what.append("reader")
    return what


def _open_run(journal: Journal, key: dict, reader: TierReader, create: bool) -> dict | None:
    """The unfinished run this command finishes, if any; refuses another's."""
    open_run = unfinished(journal.read()) if not create else None
    if open_run is None:
        return None
    if kind(open_run) == RESTORE:
        raise Refusal(journal.path, "holds an unfinished restore: run `patchtool l2 restore "
                      "DEST` to finish it first")
    what = _differs(open_run, key, reader)
    if what:
        raise Refusal(journal.path, f"holds an unfinished quarantine with another "
                      f"{'/'.join(what)}: re-run that command to finish it first")
    return open_run


def quarantine(src: Path, dest: Path, plan: Plan, only: list[str], reader: TierReader,
               expect: Expectations, create: bool) -> tuple[QuarantineResult, Plan]:
    """Move every object ``plan`` selects (in the ``only`` categories) from
    ``src`` to ``dest``; returns the result and the plan that ran (the
    journaled one, when this finishes an interrupted run).

    Protocol (each step is one counted write; a kill between any two loses
    nothing):

    1. ``begin`` (the plan: set prefix, size, category, k; and what the run
       is: DIR, --only, the reader's identity, --expect-size) is appended and
       fsynced; the plan is kept because a re-run cannot recompute it once
       evidence (e.g. a namespaced set) moved;
    2. per batch of up to :data:`BATCH` objects, their names are appended
       (``move``) and fsynced, then each is renamed into DEST;
    3. passes repeat until one moves nothing (a directory changed while it is
       read may hide entries), at most :data:`MAX_PASSES`; both directories
       are fsynced; ``end``.

    A name DEST already holds is never overwritten: that object stays in DIR
    and is reported as refused."""
    journal = Journal(dest)
    src_real = os.path.realpath(src)
    key = resume_key(src_real, only, reader, expect)
    open_run = _open_run(journal, key, reader, create)
    if open_run is not None:
        todo, run = Plan.from_records(open_run["plan"]), str(open_run["run"])
    else:
        todo, run = Plan.from_records(plan.records(only)), os.urandom(6).hex()
    res = QuarantineResult(str(dest), str(journal.path), only, None, open_run is not None, 0,
                           0, {c: 0 for c in only}, 0, [], 0)
    if not todo.sets and not todo.names:
        return res, todo  # nothing selected: nothing written, not even DEST
    res.run = run
    if create:
        counted(dest, lambda: os.mkdir(dest))
    with Lock(dest):
        if open_run is None:
            journal.append([{"event": "begin", "kind": QUARANTINE, "run": run,
                             "reader": reader.detail, "time": now(), **key,
                             "plan": todo.records()}])
        refused: set[str] = set()
        # Another pass only after one that moved something; capped, so a
        # live writer still storing wrong-layout objects is not chased
        # forever (what it adds later is counted by the final re-scan).
        while res.passes < MAX_PASSES:
            res.passes += 1
            if not _one_pass(src, dest, journal, run, todo, refused, res):
                break
        for d in (dest, src):
            fsio.fsync_dir(d)
        res.refused = len(refused)
        res.refused_names = sorted(refused)[:LISTED]
        journal.append([{"event": "end", "kind": QUARANTINE, "run": run, "time": now(),
                         "moved": res.moved, "refused": res.refused}])
    return res, todo


def _one_pass(src: Path, dest: Path, journal: Journal, run: str, todo: Plan,
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
            prefix = name[:m.end(3)]
            if prefix not in todo.sets and name not in todo.names:
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            sel = todo.select(prefix, size, name)
            if sel is None:
                continue
            batch.append((name, size, sel[0]))
            if len(batch) >= BATCH:
                moved += _move_batch(src, dest, journal, run, batch, refused, res)
                batch = []
    if batch:
        moved += _move_batch(src, dest, journal, run, batch, refused, res)
    return moved


def _move_batch(src: Path, dest: Path, journal: Journal, run: str,
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
            counted(b, lambda: os.rename(a, b))
        except WriteRefusal:
            if not os.path.lexists(a):
                continue  # gone meanwhile (evicted by the server): nothing to move
            raise
        moved += 1
        res.moved += 1
        res.moved_bytes += size
        res.moved_by_category[cat] = res.moved_by_category.get(cat, 0) + 1
    return moved
