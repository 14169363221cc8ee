"""All-or-nothing, crash-safe multi-file replacement under a journal and a lock.

Protocol for :func:`commit` (state dir = ``<site>/.lmcache-patchtool``):

1. the old bytes of every file are copied into ``tx/<id>/`` and fsynced;
2. ``journal.json`` (every target, its staging name, old and new sha256) is
   written, fsynced and renamed into place; from here on a crash is undone;
3. the new bytes are staged beside each target (same directory, so the rename
   cannot cross filesystems) and fsynced;
4. each target is ``os.replace``d (or unlinked, for a deletion);
5. directories are fsynced, then the journal is removed: the commit point.

:func:`recover` (run by every writing command before it reads anything, and
by :func:`commit` itself when the filesystem refuses a write) rolls an
interrupted commit back: each target whose bytes are the new ones gets its
old bytes back by renaming its backup into place (a rename needs no free
space, so a full disk cannot stop the rollback), staged copies are removed,
and the journal goes last.  Roll back rather than forward, because the old
bytes are always complete on disk while the new ones may not be.

Every write goes through :mod:`patchtool.fsio`, whose test-only hook can
crash or fail the tool at any one of them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import fsio
from .errors import Refusal, WriteRefusal
from .exitcodes import ExitCode

JOURNAL = "journal.json"
TX_DIR = "tx"
LOCK_TIMEOUT_ENV = "LMCACHE_PATCHTOOL_LOCK_TIMEOUT"


@dataclass
class Change:
    path: Path
    new: bytes | None  # None: delete the file


def _sha(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


class Lock:
    """Exclusive ``flock`` that keeps two patchtool processes from interleaving
    a recovery, an apply or a revert on the same site dir.

    It locks the site directory itself rather than a file in the state dir:
    taking the lock must write nothing, because a dry run or a refused apply
    leaves the install exactly as it was (no state dir appears)."""

    def __init__(self, site: Path) -> None:
        self.path = site
        self.fd: int | None = None

    def __enter__(self) -> "Lock":
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise fsio.refusal_for(self.path, exc, "open the site dir to lock it") from None
        deadline = time.monotonic() + float(os.environ.get(LOCK_TIMEOUT_ENV, "300"))
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise Refusal(self.path, "another patchtool process holds the lock",
                                  ExitCode.LOCKED) from None
                time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        assert self.fd is not None
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _staging_name(path: Path, txid: str) -> Path:
    return path.with_name(f".{path.name}.patchtool-{txid}.tmp")


class _Cursor:
    """The path the transaction is writing, so a refusal can name it."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def at(self, path: Path) -> Path:
        self.path = path
        return path


def commit(state_dir: Path, changes: list[Change]) -> None:
    """Apply ``changes`` all-or-nothing.  Caller holds :class:`Lock`.

    A write the filesystem refuses (full disk, ``ulimit -f``, read-only mount,
    I/O error) rolls the transaction back here and raises
    :class:`WriteRefusal` naming the path; if even the rollback fails, the
    journal stays and the next patchtool command finishes it."""
    txid = f"{os.getpid()}-{time.time_ns()}"
    cur = _Cursor()
    try:
        _write(state_dir, txid, changes, cur)
    except (OSError, Refusal) as exc:
        # A Refusal here is a read that failed (fsio.read_file) after the
        # plan was made: rolled back the same way, then reported as it is.
        where = cur.path or state_dir
        why = fsio.describe(exc) if isinstance(exc, OSError) else exc.reason
        try:
            if (state_dir / JOURNAL).exists():
                recover(state_dir)
            else:
                for ch in changes:
                    fsio.unlink(_staging_name(ch.path, txid))
                fsio.unlink(state_dir / (JOURNAL + ".tmp"))
                _drop_orphans(state_dir)
        except (OSError, Refusal):
            raise WriteRefusal(where, f"cannot write it: {why}; the rollback could not "
                               "finish either, and the next patchtool command will complete "
                               "it") from None
        if isinstance(exc, Refusal):
            raise
        raise WriteRefusal(where, f"cannot write it: {why}; nothing was changed") from None
    try:
        _drop_orphans(state_dir)
    except OSError:
        pass  # after the commit point: leftovers are cleared by the next command


def _write(state_dir: Path, txid: str, changes: list[Change], cur: _Cursor) -> None:
    txdir = state_dir / TX_DIR / txid
    fsio.makedirs(cur.at(txdir))
    entries = []
    for i, ch in enumerate(changes):
        old = fsio.read_file(ch.path)
        backup = None
        mode = None
        if old is not None:
            backup = txdir / f"{i}.old"
            mode = os.stat(ch.path).st_mode & 0o7777
            fsio.write_durable(cur.at(backup), old, mode)
        entries.append({
            "path": str(ch.path),
            "staged": None if ch.new is None else str(_staging_name(ch.path, txid)),
            "backup": None if backup is None else str(backup),
            "old_sha256": _sha(old),
            "new_sha256": _sha(ch.new),
            "mode": mode,
        })
    fsio.fsync_dir(txdir)
    journal = state_dir / JOURNAL
    tmp = state_dir / (JOURNAL + ".tmp")
    fsio.write_durable(cur.at(tmp), json.dumps({"txid": txid, "entries": entries},
                                               indent=1).encode())
    fsio.replace(tmp, cur.at(journal))
    fsio.fsync_dir(state_dir)

    for ch, e in zip(changes, entries):
        if ch.new is not None:
            fsio.makedirs(cur.at(ch.path.parent))
            fsio.write_durable(cur.at(Path(e["staged"])), ch.new, e["mode"])
    for ch, e in zip(changes, entries):
        if ch.new is None:
            fsio.unlink(cur.at(ch.path))
        else:
            fsio.replace(Path(e["staged"]), cur.at(ch.path))
    for parent in sorted({ch.path.parent for ch in changes if ch.path.parent.exists()}):
        fsio.fsync_dir(parent)
    fsio.unlink(cur.at(journal))  # the commit point
    fsio.fsync_dir(state_dir)


def needs_recovery(state_dir: Path) -> bool:
    """Whether an interrupted transaction left anything: a journal, a
    half-written one, or backups in ``tx/``."""
    return any((state_dir / name).exists() for name in (JOURNAL, JOURNAL + ".tmp", TX_DIR))


def recover(state_dir: Path) -> int:
    """Roll back an interrupted commit; returns how many files were restored.
    Caller holds :class:`Lock`."""
    journal = state_dir / JOURNAL
    if not journal.exists():
        _drop_orphans(state_dir)
        return 0
    try:
        data = json.loads(journal.read_text())
        entries = data["entries"]
    except (ValueError, KeyError):
        # The journal is renamed into place only once complete, so this means
        # outside damage; nothing can be inferred safely.
        raise Refusal(journal, "corrupt journal; inspect the state dir by hand") from None
    restored = 0
    for e in reversed(entries):
        path = Path(e["path"])
        current = _sha(fsio.read_file(path))
        if current == e["old_sha256"]:
            pass  # never replaced, or already restored by an earlier recovery
        elif current == e["new_sha256"]:
            if e["backup"] is None:
                fsio.unlink(path)
            else:
                backup = Path(e["backup"])
                if e.get("mode") is not None:
                    fsio.chmod(backup, e["mode"])
                fsio.replace(backup, path)  # a rename: no free space needed
            restored += 1
        else:
            raise Refusal(path, "changed by something else during an interrupted patchtool "
                          "run; cannot roll back safely (journal: %s)" % journal)
        if e["staged"]:
            fsio.unlink(Path(e["staged"]))
    for parent in sorted({Path(e["path"]).parent for e in entries if Path(e["path"]).parent.exists()}):
        fsio.fsync_dir(parent)
    fsio.unlink(journal)
    fsio.fsync_dir(state_dir)
    _drop_orphans(state_dir)
    return restored


def _drop_orphans(state_dir: Path) -> None:
    """Remove what no open transaction needs: the backups of a transaction
    that died before its journal existed (nothing was replaced then) or after
    its commit point, a half-written journal, and then every empty directory
    of the state dir (the state dir itself too, when nothing is left)."""
    tx = state_dir / TX_DIR
    if tx.is_dir():
        for d in sorted(tx.iterdir()):
            fsio.rmtree(d)
    fsio.unlink(state_dir / (JOURNAL + ".tmp"))
    fsio.prune_empty_dirs(state_dir)
