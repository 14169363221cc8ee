"""``l2 scan redis://... --quarantine`` and ``l2 restore redis://... [KEY]``:
move keys between their live name and ``lmcptq@<live name>`` in the same
database, never overwriting and never moving what changed since it was
judged.

Every move is one ``RENAMENX`` (atomic: after it the object is under exactly
one of the two names, and it fails rather than replace an existing key).  A
quarantine's rename runs under ``WATCH``: the key's size (and, for a
``corrupt`` key, its value, checked again) is read after the ``WATCH``, and
the ``RENAMENX`` goes in a ``MULTI`` that Redis aborts if anything wrote the
key in between.  So what moves is exactly what the plan selects at the
moment it moves; a key a server rewrote meanwhile stays (``changed``), and
the final re-scan judges it afresh.

**No journal, and why.**  The fs quarantine journals into DEST
(``patchtool.l2.journal``) for three jobs, none of which a Redis tier needs:

* *Finishing a killed run.*  An fs move is a rename into another directory
  with batches of intent around it; here each move is one atomic command,
  so a kill leaves no half-done move.
* *Knowing where an object came from* for the undo: the quarantined key's
  name is its live name with a prefix, in the same database, so a restore
  reads it off the name.  What is lost is the category each key was moved
  for (``restored_by_category`` is empty).
* *Replaying a killed run's plan*, because the fs run may have moved the
  evidence part of its plan rests on (a namespaced set that proves plain
  objects ``unpatched``), and a fresh scan would then miss them.  Here the
  moves go in an order that keeps a fresh plan whole: ``unpatched`` objects,
  the only category judged on other objects' evidence, move first in each
  pass, so a kill can only interrupt them while their evidence is still in
  place; every other category is judged by the object's own name, size or
  bytes.  Re-running the command finishes the job.

A journal would also have to live outside the tier (the tool writes nothing
to Redis but these renames), on whichever machine ran the quarantine.
Two quarantines at once are safe without DEST's lock: each key is renamed
by one of them, and the other finds it gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import checksum as ck
from ..errors import Refusal, WriteRefusal
from .journal import LISTED
from .quarantine import MAX_PASSES, QuarantineResult
from .redis_tier import RedisTier, describe, key_bytes, key_name, redis_module, sealed_verdict
from .redis_keys import KEY_RE, QUARANTINE_PREFIX, is_sealed, live_name, quarantined, set_prefix
from .restore import RestoreResult
from .rules import CORRUPT, UNPATCHED, Plan

MOVED, REFUSED, CHANGED, GONE = "moved", "refused", "changed", "gone"


@dataclass
class RedisQuarantineResult(QuarantineResult):
    """The fs :class:`~patchtool.l2.quarantine.QuarantineResult` (``journal``
    and ``run`` are ``None``: no journal), plus what only a live Redis tier
    shows."""

    prefix: str = QUARANTINE_PREFIX
    changed: int = 0  # selected, but written after its judgement: left, judged again
    vanished: int = 0  # selected, but gone before its move


@dataclass
class RedisRestoreResult(RestoreResult):
    restored_names: list[str] = field(default_factory=list)  # the first LISTED, sorted


def quarantine(tier: RedisTier, plan: Plan, only: list[str],
               digester: ck.Digester | None) -> tuple[RedisQuarantineResult, Plan]:
    """Rename every key ``plan`` selects (in the ``only`` categories) to
    ``lmcptq@<key>``; returns the result and the plan that ran.  Passes
    repeat while one moves something (a live keyspace may hide keys from one
    ``SCAN``), at most :data:`MAX_PASSES`.  ``digester`` re-checks a corrupt
    key's value under ``WATCH`` (``None`` only when nothing is corrupt)."""
    todo = Plan.from_records(plan.records(only))
    res = RedisQuarantineResult(f"{QUARANTINE_PREFIX}<key> in {tier.where}", None, only, None,
                                False, 0, 0, {c: 0 for c in only}, 0, [], 0)
    if not todo.sets and not todo.names:
        return res, todo
    refused: set[str] = set()
    left: set[str] = set()  # changed or gone since judged: the final re-scan judges them
    while res.passes < MAX_PASSES:
        res.passes += 1
        if not _one_pass(tier, todo, refused, left, res, digester):
            break
    res.refused = len(refused)
    res.refused_names = sorted(refused)[:LISTED]
    return res, todo


def _selected(tier: RedisTier, todo: Plan, skip: set[str]) -> list[tuple[str, str, int, str]]:
    """(name, set prefix, size, category) of every key the plan selects now,
    but those in ``skip``."""
    out = []
    for batch in tier.keys():
        keys = []
        for k in batch:
            name = key_name(k)
            if name in skip or name.startswith(QUARANTINE_PREFIX):
                continue
            m = KEY_RE.fullmatch(name)
            if m is None:
                continue
            prefix = set_prefix(m)
            if prefix in todo.sets or name in todo.names:
                keys.append((k, name, prefix))
        for (_k, name, prefix), size in zip(keys, tier.strlen([k[0] for k in keys])):
            sel = todo.select(prefix, size, name) if size >= 0 else None
            if sel is not None:
                out.append((name, prefix, size, sel[0]))
    # Evidence first: unpatched keys are judged on a namespaced set this run
    # may move (never-read); moving them first keeps a killed run resumable.
    out.sort(key=lambda s: (s[3] != UNPATCHED, s[0]))
    return out


def _one_pass(tier: RedisTier, todo: Plan, refused: set[str], left: set[str],
              res: RedisQuarantineResult, digester: ck.Digester | None) -> int:
    moved = 0
    for name, prefix, _size, cat in _selected(tier, todo, refused | left):
        outcome, size = _guarded_move(tier, name, prefix, cat, todo, digester)
        if outcome == MOVED:
            moved += 1
            res.moved += 1
            res.moved_bytes += size
            res.moved_by_category[cat] = res.moved_by_category.get(cat, 0) + 1
        elif outcome == REFUSED:
            refused.add(name)
        elif outcome == CHANGED:
            left.add(name)
            res.changed += 1
        else:
            left.add(name)
            res.vanished += 1
    return moved


def _guarded_move(tier: RedisTier, name: str, prefix: str, cat: str, todo: Plan,
                  digester: ck.Digester | None) -> tuple[str, int]:
    """One ``WATCH``-guarded ``RENAMENX``: (outcome, the size moved)."""
    redis = redis_module()
    key, dest = key_bytes(name), key_bytes(quarantined(name))
    try:
        with tier.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)
                size = _watched_size(pipe, key)
                if size is None:
                    return GONE, 0
                sel = todo.select(prefix, size, name)
                if sel is None or sel[0] != cat:
                    return CHANGED, 0
                if cat == CORRUPT and not _still_corrupt(pipe, key, name, digester):
                    return CHANGED, 0
                pipe.multi()
                pipe.renamenx(key, dest)
                (ok,) = pipe.execute()
            except redis.WatchError:
                return CHANGED, 0
            except redis.ResponseError as exc:
                if "no such key" in str(exc).lower():
                    return GONE, 0
                if "WRONGTYPE" in str(exc):
                    return CHANGED, 0
                raise
    except redis.RedisError as exc:
        raise WriteRefusal(tier.where, f"cannot rename {name[:80]!r}: {describe(exc)}; every "
                           "object is under its live or its lmcptq@ name, re-run to "
                           "finish") from None
    return (MOVED, size) if ok else (REFUSED, 0)


def _watched_size(pipe: Any, key: bytes) -> int | None:
    """The size of a watched key (immediate mode); ``None`` when it is gone."""
    size = int(pipe.strlen(key))
    if size == 0 and not pipe.exists(key):
        return None
    return size


def _still_corrupt(pipe: Any, key: bytes, name: str, digester: ck.Digester | None) -> bool:
    """A corrupt key is moved only if its value, read under ``WATCH``, still
    fails: a server that stored the key again meanwhile wrote a good one.
    One read suffices here: a write after the ``WATCH`` aborts the move."""
    m = KEY_RE.fullmatch(name)
    if m is None or not is_sealed(m) or digester is None:
        return True  # judged by evidence, not by its own bytes: the size check stands
    value = pipe.get(key)
    if value is None:
        return False
    return sealed_verdict(value, name, digester.digest)[0] == ck.CORRUPT


def restore(tier: RedisTier, keys: list[str]) -> RedisRestoreResult:
    """Rename quarantined keys back (``RENAMENX lmcptq@K K``): the ``keys``
    named (either spelling), or every ``lmcptq@`` key.  A named key whose live
    name exists is refused before anything moves (a server stored it again;
    a restore would replace it); in a restore of all, it is kept aside and
    reported, as the fs restore does."""
    res = RedisRestoreResult(tier.where, None, None, False, [tier.where])
    named = list(dict.fromkeys(live_name(k) for k in keys))
    for n in named:
        if tier.size_of(quarantined(n)) is None:
            raise Refusal(tier.where, f"no quarantined key {quarantined(n)[:120]!r}: nothing "
                          "to restore under that name")
        if tier.exists(n):
            raise Refusal(tier.where, f"a live key {n[:120]!r} exists (a server stored it "
                          "again): restoring would replace it, so nothing was moved")
    if named:
        todo = named
    else:
        todo = sorted(live_name(key_name(k)) for batch in tier.keys(QUARANTINE_PREFIX + "*")
                      for k in batch)
    restored: list[str] = []
    kept: list[str] = []
    redis = redis_module()
    for n in todo:
        src = key_bytes(quarantined(n))
        try:
            size = tier.size_of(quarantined(n))
            if size is None:
                continue  # restored meanwhile by another command
            ok = tier.client.renamenx(src, key_bytes(n))
        except redis.ResponseError as exc:
            if "no such key" in str(exc).lower():
                continue
            raise WriteRefusal(tier.where, f"cannot rename {n[:80]!r} back: {describe(exc)}; "
                               "every object is under its live or its lmcptq@ name, re-run "
                               "to finish") from None
        except redis.RedisError as exc:
            raise WriteRefusal(tier.where, f"cannot rename {n[:80]!r} back: {describe(exc)}; "
                               "every object is under its live or its lmcptq@ name, re-run "
                               "to finish") from None
        if ok:
            restored.append(n)
            res.restored += 1
            res.restored_bytes += size
        else:
            kept.append(n)
    res.restored_names = sorted(restored)[:LISTED]
    res.kept, res.kept_names = len(kept), sorted(kept)[:LISTED]
    return res
