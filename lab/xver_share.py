"""How the cross-version gate puts writers' objects in front of readers, per tier.

The gate (``lab/xver_gate.py``) stores with writer builds and restores with
reader builds; this module owns what differs between tiers, so the gate's loop
is tier-blind:

* **fs** (:class:`FsShare`): each writer has its own directory; each reader
  gets a fresh directory of hard links to its writers' files, so every reader
  sees the tier exactly as the writers left it.  The fs adapter writes
  through tmp + rename, so a reader can never change a writer's inode in
  place; the fingerprint (size, mtime) proves it did not replace one either.
* **redis** (:class:`RedisShare`): every writer and every reader uses the ONE
  Redis server, as a rolling upgrade does: that shared tier is what is being
  tested.  Writers use distinct model names (the model name is a key field),
  so their keys never collide.  Readers see the same keys in turn.

A restore phase (``restore_gate.py --phase restore``) never asks its server to
store, yet a server can write: LMCache 0.5.3-0.5.5 finish a failed L2 load
with ``finish_write`` then ``delete`` of the reserved L1 buffer, and the store
controller, notified by ``finish_write``, can store that unfilled buffer to L2
under the object's key before it is deleted (a race; 0.5.6 finishes with
``finish_write_and_delete``).  So the gate never assumes a reader wrote
nothing: :meth:`reader_writes` lists every object of the reader's writers that
the reader added, replaced or removed (size, sha256, all zeros or not).  On
fs those land in the reader's own copy; on Redis :meth:`RedisShare.undo` puts
the writers' values back from server-side copies (:meth:`RedisShare.protect`)
before the next reader, so every reader meets the tier as the writers left it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Protocol

from gate.l2_tier import SEALED_KEY_PREFIX, RespTier


# Where the redis share keeps a copy of every writer object while readers run
# (never matched by a model's key patterns: no model name starts with it).
BACKUP_PREFIX = "lmcptxver-orig@"


class XverShareError(Exception):
    """The tier cannot be shared as the gate needs (no verdict)."""


class Share(Protocol):
    tier: str

    def writer_args(self, wdir: Path) -> list[str]: ...
    def protect(self, models: list[str]) -> None: ...
    def reader_args(self, rdir: Path, wdirs: list[Path]) -> list[str]: ...
    def fingerprint(self, wdir: Path, models: list[str]) -> dict[str, Any]: ...
    def reader_state(self, rdir: Path, fingerprints: dict[Any, dict[str, Any]]) -> dict[str, Any]: ...
    def reader_writes(self, rdir: Path, before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]: ...
    def undo(self, writes: list[dict[str, Any]]) -> None: ...
    def keys_summary(self, models: list[str]) -> dict[str, Any] | None: ...
    def command_counts(self) -> dict[str, int] | None: ...
    def release(self, models: list[str]) -> int: ...
    def describe(self) -> dict[str, Any]: ...


def model_of(name: str) -> str:
    """The model name an object belongs to (fs file or RESP key, sealed or
    not, namespaced or not; the gates' model names hold no '+' or '@')."""
    return name.removeprefix(SEALED_KEY_PREFIX).split("@", 1)[0].split("+", 1)[0].replace("-SEP-", "/")


def _zeros_sha(size: int) -> str:
    return hashlib.sha256(bytes(size)).hexdigest()


def write_record(name: str, before: Any, after: Any) -> dict[str, Any]:
    """One object a reader added, replaced or removed: (size, sha256) before
    and after, and whether the new value is all zeros (an unfilled buffer)."""
    return {"object": name, "model": model_of(name), "before": before, "after": after,
            "zeros": bool(after) and after[1] == _zeros_sha(after[0])}


def fingerprint_diff(before: dict[str, Any], after: dict[str, Any], limit: int = 5) -> list[str]:
    """What changed between two fingerprints, one phrase per object (at most ``limit``)."""
    out = [f"added {k}" for k in sorted(set(after) - set(before))]
    out += [f"removed {k}" for k in sorted(set(before) - set(after))]
    out += [f"changed {k} ({before[k]} -> {after[k]})" for k in sorted(set(before) & set(after))
            if before[k] != after[k]]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def command_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """Calls per command between two :meth:`RedisShare.command_counts`."""
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] != before.get(k, 0)}


def models_of(state: dict[str, Any]) -> list[str]:
    """The model names a writer phase stored under (from its state file)."""
    return [e["model"] for e in state["presets"] if e.get("model")]


class FsShare:
    """One directory per writer, hard-linked into a fresh directory per reader."""

    tier = "fs"

    def writer_args(self, wdir: Path) -> list[str]:
        (wdir / "l2").mkdir(parents=True)
        return ["--l2-dir", str(wdir / "l2")]

    def protect(self, models: list[str]) -> None:
        pass  # every reader gets its own links: nothing it does reaches a writer's inode

    def reader_args(self, rdir: Path, wdirs: list[Path]) -> list[str]:
        (rdir / "l2").mkdir(parents=True)
        for w in wdirs:
            for p in (w / "l2").iterdir():
                if p.is_file():
                    os.link(p, rdir / "l2" / p.name)
        return ["--l2-dir", str(rdir / "l2")]

    def fingerprint(self, wdir: Path, models: list[str]) -> dict[str, Any]:
        """Every file of the writer's directory: (size, mtime_ns)."""
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in (wdir / "l2").iterdir() if p.is_file()}

    def reader_state(self, rdir: Path, fingerprints: dict[Any, dict[str, Any]]) -> dict[str, Any]:
        """The reader's own copy: name -> inode (a hard link keeps the writer's inode)."""
        return {p.name: p.stat().st_ino for p in (rdir / "l2").iterdir() if p.is_file() and p.suffix != ".tmp"}

    def reader_writes(self, rdir: Path, before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
        """Files of the reader's own copy that are no longer the linked inode
        (added, or replaced through tmp + rename), or are gone.  The writers'
        directories never see them: recorded, not undone."""
        out = []
        for name in sorted(set(before) | set(after)):
            if before.get(name) == after.get(name):
                continue
            new = None
            if name in after:
                data = (rdir / "l2" / name).read_bytes()
                new = (len(data), hashlib.sha256(data).hexdigest())
            out.append(write_record(name, "linked" if name in before else None, new))
        return out

    def undo(self, writes: list[dict[str, Any]]) -> None:
        pass  # the reader's copy is its own

    def keys_summary(self, models: list[str]) -> None:
        return None  # the writer's report lists its files

    def command_counts(self) -> None:
        return None

    def release(self, models: list[str]) -> int:
        return 0  # the work directory goes with the run

    def describe(self) -> dict[str, Any]:
        return {"tier": "fs", "how": "a directory per writer, hard-linked into a fresh directory per reader"}


class RedisShare:
    """Every writer and reader on one Redis server (LMCache's ``resp`` adapter)."""

    tier = "redis"

    def __init__(self, url: str, private: bool) -> None:
        self.resp = RespTier.from_url(url)
        self.url = self.resp.url
        self.private = private
        try:
            self.resp.client().ping()
        except Exception as exc:  # noqa: BLE001 - redis-py's errors, or none installed
            raise XverShareError(f"redis tier {self.url}: {type(exc).__name__}: {exc}") from exc

    def writer_args(self, wdir: Path) -> list[str]:
        wdir.mkdir(parents=True)
        return ["--redis-url", self.url]

    def protect(self, models: list[str]) -> None:
        """Copy every key of ``models`` to :data:`BACKUP_PREFIX` + key on the
        server (``COPY``), so what a reader writes over its writers' objects
        can be put back before the next reader: every reader meets the tier
        as the writers left it, as on fs."""
        c = self.resp.client()
        for m in models:
            for k in self.resp.keys(m):
                if not c.copy(k, BACKUP_PREFIX + k, replace=True):
                    raise XverShareError(f"redis tier {self.url}: COPY {k} failed")

    def reader_args(self, rdir: Path, wdirs: list[Path]) -> list[str]:
        rdir.mkdir(parents=True)
        return ["--redis-url", self.url]

    def reader_state(self, rdir: Path, fingerprints: dict[Any, dict[str, Any]]) -> dict[str, Any]:
        """Every key of the reader's writers: the writers' fingerprints, merged."""
        return {k: v for fp in fingerprints.values() for k, v in fp.items()}

    def reader_writes(self, rdir: Path, before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
        """Keys of the reader's writers that it added, replaced or removed."""
        return [write_record(k, before.get(k), after.get(k)) for k in sorted(set(before) | set(after))
                if before.get(k) != after.get(k)]

    def undo(self, writes: list[dict[str, Any]]) -> None:
        """Put the writers' values back (an added key is deleted)."""
        c = self.resp.client()
        for w in writes:
            if w["before"] is None:
                c.delete(w["object"])
            elif not c.copy(BACKUP_PREFIX + w["object"], w["object"], replace=True):
                raise XverShareError(f"redis tier {self.url}: no copy of {w['object']} to put back")

    def fingerprint(self, wdir: Path, models: list[str]) -> dict[str, Any]:
        """Every key of ``models`` (sealed or not): (length, sha256 of the value).
        One GET at a time: values are megabytes."""
        out: dict[str, Any] = {}
        for m in models:
            for k in self.resp.keys(m):
                v = self.resp.value(k)
                out[k] = None if v is None else (len(v), hashlib.sha256(v).hexdigest())
        return out

    def keys_summary(self, models: list[str]) -> dict[str, Any]:
        """Per model: how many keys, how many carry the sealed prefix
        (``lmcptsum1@``, part 17-resp-checksum) and how many values end in the
        checksum trailer."""
        out = {}
        for m in models:
            objs = self.resp.objects(m)
            out[m] = {"keys": len(objs), "prefixed": sum(o.name.startswith(SEALED_KEY_PREFIX) for o in objs),
                      "trailers": sum(o.sealed for o in objs)}
        return out

    def command_counts(self) -> dict[str, int]:
        """Calls per command since the server started (``INFO commandstats``):
        the difference over a reader phase is what that reader's server sent
        (on a server others use too, theirs as well)."""
        stats = self.resp.client().info("commandstats")
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}

    def release(self, models: list[str]) -> int:
        """Delete the keys of ``models`` (the gate's own random model names):
        a run leaves nothing on a server it did not start, and a private one
        holds one chunk size's objects at a time."""
        keys = [k for m in models for k in self.resp.keys(m)]
        doomed = keys + [BACKUP_PREFIX + k for k in keys]
        for i in range(0, len(doomed), 500):
            self.resp.client().delete(*doomed[i:i + 500])
        return len(keys)

    def describe(self) -> dict[str, Any]:
        info = self.resp.client().info("server")
        return {"tier": "redis", "url": self.url, "private": self.private,
                "redis_version": info.get("redis_version"),
                "how": "one Redis server shared by every writer and reader (keys apart by model name)"}
