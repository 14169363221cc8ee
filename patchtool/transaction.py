"""All-or-nothing, crash-safe multi-file replacement under a journal and a lock.

Protocol for :func:`commit` (state dir = ``<site>/.lmcache-patchtool``):

1. the old bytes of every file are copied into ``tx/<id>/`` and fsynced;
2. ``journal.json`` (every target, its staging name, old and new sha256) is
   written, fsynced and renamed into place; from here on a crash is undone;
3. the new bytes are staged beside each target (same directory, so the rename
   cannot cross filesystems) and fsynced;
4. each target is ``os.replace``d (or unlinked, for a deletion);
5. directories are fsynced, then the journal is removed: the commit point.

:func:`recover` (run by every command before it reads anything) rolls an
interrupted commit back: each target whose bytes are the new ones gets its
old bytes back, staged copies are removed, and the journal goes last.  Roll
back rather than forward, because the old bytes are always complete on disk
while the new ones may not be.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import Refusal
from .exitcodes import ExitCode

JOURNAL = "journal.json"
# Test-only hook (documented in README): exit abruptly after N replacements,
# as a kill -9 would, so tests can check that the next command recovers.
CRASH_ENV = "LMCACHE_PATCHTOOL_CRASH_AFTER_REPLACE"
CRASH_EXIT = 86
LOCK_TIMEOUT_ENV = "LMCACHE_PATCHTOOL_LOCK_TIMEOUT"


@dataclass
class Change:
    path: Path
    new: bytes | None  # None: delete the file


def _sha(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``path`` fully and fsync it (not atomic by itself)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # umask must not change a replaced file's mode
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
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


def commit(state_dir: Path, changes: list[Change]) -> None:
    """Apply ``changes`` all-or-nothing.  Caller holds :class:`Lock`."""
    txid = f"{os.getpid()}-{time.time_ns()}"
    txdir = state_dir / "tx" / txid
    txdir.mkdir(parents=True)
    entries = []
    for i, ch in enumerate(changes):
        old = _read(ch.path)
        backup = None
        if old is not None:
            backup = txdir / f"{i}.old"
            write_durable(backup, old)
        mode = None
        if old is not None:
            mode = os.stat(ch.path).st_mode & 0o7777
        entries.append({
            "path": str(ch.path),
            "staged": None if ch.new is None else str(_staging_name(ch.path, txid)),
            "backup": None if backup is None else str(backup),
            "old_sha256": _sha(old),
            "new_sha256": _sha(ch.new),
            "mode": mode,
        })
    _fsync_dir(txdir)
    journal = state_dir / JOURNAL
    tmp = state_dir / (JOURNAL + ".tmp")
    write_durable(tmp, json.dumps({"txid": txid, "entries": entries}, indent=1).encode())
    os.replace(tmp, journal)
    _fsync_dir(state_dir)

    for ch, e in zip(changes, entries):
        if ch.new is not None:
            ch.path.parent.mkdir(parents=True, exist_ok=True)
            write_durable(Path(e["staged"]), ch.new, e["mode"])
    crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
    for n, (ch, e) in enumerate(zip(changes, entries), start=1):
        if ch.new is None:
            if ch.path.exists():
                os.unlink(ch.path)
        else:
            os.replace(e["staged"], ch.path)
        if crash_after and n >= crash_after:
            os._exit(CRASH_EXIT)
    for parent in sorted({ch.path.parent for ch in changes if ch.path.parent.exists()}):
        _fsync_dir(parent)
    os.unlink(journal)  # the commit point
    _fsync_dir(state_dir)
    shutil.rmtree(txdir, ignore_errors=True)


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
        current = _sha(_read(path))
        if current == e["old_sha256"]:
            pass  # never replaced, or already restored by an earlier recovery
        elif current == e["new_sha256"]:
            if e["backup"] is None:
                os.unlink(path)
            else:
                old = Path(e["backup"]).read_bytes()
                staged = path.with_name(path.name + ".patchtool-restore.tmp")
                write_durable(staged, old, e.get("mode"))
                os.replace(staged, path)
            restored += 1
        else:
            raise Refusal(path, "changed by something else during an interrupted patchtool "
                          "run; cannot roll back safely (journal: %s)" % journal)
        if e["staged"]:
            Path(e["staged"]).unlink(missing_ok=True)
    for parent in sorted({Path(e["path"]).parent for e in entries if Path(e["path"]).parent.exists()}):
        _fsync_dir(parent)
    os.unlink(journal)
    _fsync_dir(state_dir)
    _drop_orphans(state_dir)
    return restored


def _drop_orphans(state_dir: Path) -> None:
    # Backups of a transaction that died before its journal existed (nothing
    # was replaced then) or after its commit point.
    tx = state_dir / "tx"
    if tx.is_dir():
        for d in tx.iterdir():
            shutil.rmtree(d, ignore_errors=True)
