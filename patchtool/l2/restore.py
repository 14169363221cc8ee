"""``patchtool l2 restore DEST``: undo quarantines, never overwriting.

Each object in DEST that a quarantine journaled goes back to the DIR its
latest quarantine took it from, only where DIR holds no entry of that name.
A server stores a key again once its file is gone, so after a quarantine DIR
may hold a new object under a quarantined name: that one stays, and the
quarantined one is kept aside in DEST and reported.

A move back is ``link`` then ``unlink``: ``link`` fails on an existing name
whoever created it (a check-then-rename would race the server's writes, and
a rename replaces silently).  A kill between the two leaves one inode under
both names; the re-run sees the same inode and finishes with the unlink.
The run is journaled like a quarantine (``patchtool.l2.journal``): ``begin``
(kind ``restore``), per batch the names (``back``), then the moves, ``end``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import fsio
from ..errors import Refusal, WriteRefusal
from .journal import BATCH, LISTED, RESTORE, Journal, counted, kind, now, unfinished
from .names import OBJECT_RE
from .quarantine import same_filesystem
from .tally import dir_entries
from ..transaction import Lock


@dataclass
class RestoreResult:
    dest: str
    journal: str | None  # None: a tier whose moves keep no journal (Redis, patchtool.l2.redis_move)
    run: str | None  # None when there was nothing to restore (nothing written)
    resumed: bool  # finished an unfinished restore recorded in the journal
    dirs: list[str]  # where objects went back to
    restored: int = 0
    restored_bytes: int = 0
    restored_by_category: dict[str, int] = field(default_factory=dict)
    kept: int = 0  # DIR holds an entry of that name: kept aside in DEST
    kept_names: list[str] = field(default_factory=list)
    untracked: int = 0  # objects in DEST no quarantine journaled: left alone


@dataclass(frozen=True)
class _Origin:
    dir: str
    category: str


def _origins(records: list[dict]) -> dict[str, _Origin]:
    """Per name, where its latest quarantine took it from."""
    dirs = {r.get("run"): r.get("dir") for r in records
            if r.get("event") == "begin" and kind(r) != RESTORE}
    out: dict[str, _Origin] = {}
    for r in records:
        if r.get("event") == "move" and dirs.get(r.get("run")):
            out[r["name"]] = _Origin(dirs[r["run"]], r.get("category", "?"))
    return out


def _candidates(dest: Path, origins: dict[str, _Origin]) -> tuple[list[tuple[str, int]], int]:
    """(name, size) of each journaled object in DEST, and how many objects
    DEST holds that no quarantine moved there."""
    found, untracked = [], 0
    match = OBJECT_RE.fullmatch
    with dir_entries(dest) as it:
        for entry in it:
            if match(entry.name) is None or not entry.is_file(follow_symlinks=False):
                continue
            if entry.name not in origins:
                untracked += 1
                continue
            try:
                found.append((entry.name, entry.stat(follow_symlinks=False).st_size))
            except FileNotFoundError:
                continue
    return sorted(found), untracked


def restore(dest: Path) -> RestoreResult:
    journal = Journal(dest)
    if not os.path.isdir(dest):
        raise Refusal(dest, "no such directory" if not os.path.lexists(dest)
                      else "is not a directory")
    if not os.path.lexists(journal.path):
        raise Refusal(journal.path, "no quarantine journal: nothing here was moved by "
                      "`patchtool l2 scan --quarantine`")
    with Lock(dest):
        records = journal.read()
        open_run = unfinished(records)
        if open_run is not None and kind(open_run) != RESTORE:
            raise Refusal(journal.path, "holds an unfinished quarantine: re-run that "
                          "command to finish it first")
        origins = _origins(records)
        todo, untracked = _candidates(dest, origins)
        dirs = sorted({origins[n].dir for n, _ in todo})
        for d in dirs:  # refused before the first write: a missing DIR, another filesystem
            same_filesystem(dest, Path(d), Path(d))
        res = RestoreResult(str(dest), str(journal.path), None, open_run is not None, dirs,
                            untracked=untracked)
        if not todo and open_run is None:
            return res  # nothing to restore: nothing written
        res.run = str(open_run["run"]) if open_run else os.urandom(6).hex()
        if open_run is None:
            journal.append([{"event": "begin", "kind": RESTORE, "run": res.run, "time": now(),
                             "dirs": dirs}])
        kept: list[str] = []
        for i in range(0, len(todo), BATCH):
            batch = todo[i:i + BATCH]
            journal.append([{"event": "back", "run": res.run, "name": n,
                             "dir": origins[n].dir} for n, _ in batch])
            for n, size in batch:
                outcome = _put_back(dest / n, Path(origins[n].dir) / n)
                if outcome == "kept":
                    kept.append(n)
                elif outcome == "restored":
                    res.restored += 1
                    res.restored_bytes += size
                    c = origins[n].category
                    res.restored_by_category[c] = res.restored_by_category.get(c, 0) + 1
        for d in [dest, *map(Path, dirs)]:
            fsio.fsync_dir(d)
        res.kept, res.kept_names = len(kept), kept[:LISTED]
        journal.append([{"event": "end", "kind": RESTORE, "run": res.run, "time": now(),
                         "restored": res.restored, "kept": res.kept}])
    return res


def _put_back(src: Path, dst: Path) -> str:
    """``restored``, ``kept`` (``dst`` names another entry) or ``gone``."""
    try:
        fsio._counted(dst, lambda: os.link(src, dst, follow_symlinks=False))
    except FileExistsError:
        if not _same_inode(src, dst):
            return "kept"
        # A killed run linked it and did not unlink: finish that move.
    except FileNotFoundError:
        if not os.path.lexists(src):
            return "gone"
        raise Refusal(dst.parent, "no such directory") from None
    except OSError as exc:
        raise WriteRefusal(exc.filename or dst, f"cannot write: {fsio.describe(exc)}; every "
                           "object is in DIR or DEST, re-run to finish") from None
    counted(src, lambda: os.unlink(src))
    return "restored"


def _same_inode(a: Path, b: Path) -> bool:
    try:
        return os.path.samestat(os.lstat(a), os.lstat(b))
    except FileNotFoundError:
        return False
