"""``patchtool l2 scan DIR``, the read-only part: one pass over the tier
(``TierSource.tally``: ``patchtool.l2.tally`` for a directory,
``patchtool.l2.redis_tier`` for Redis), judged for a reader
(``patchtool.l2.rules``), as a report; and :func:`final_state`, what the tier
holds when a command that moved objects ends.  Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .reader import TierReader
from .rules import CATEGORIES, CORRUPT, Expectations, ObjectSet, Plan, categorize
from .source import TierSource
from .tally import UNKNOWN_SIZE, Tally
from .content_check import Checker, VerifyResult, verify


def judged(sizes: bool, verified: bool) -> tuple[str, ...]:
    """The categories a scan reports: ``corrupt`` only with ``--verify``."""
    return CATEGORIES if verified else tuple(c for c in CATEGORIES if c != CORRUPT)


@dataclass
class Total:
    objects: int = 0
    bytes: int | None = 0


@dataclass
class ScanResult:
    dir: str
    reader: TierReader
    sizes_read: bool  # False: --names-only (no lstat; only never-read is judged)
    objects: int
    bytes: int | None
    tmp_files: int
    subdirs: int
    foreign: int
    foreign_names: list[str]
    vanished: int
    expect_size: Expectations  # the operator's evidence, as given
    expect_size_unmatched: list[str]  # sets it names that DIR does not hold
    sets: list[ObjectSet]
    flagged: dict[str, Total]
    flagged_objects: int
    flagged_bytes: int | None
    ambiguous_sets: int
    ambiguous_objects: int
    # --verify: every object the reader reads and the size rules leave
    # unflagged was read and its checksum trailer checked (None: not asked).
    verify: VerifyResult | None = None


@dataclass
class FinalState:
    """What DIR holds at the end of the command: flagged objects counted by
    every plan of the run and by a fresh judgement, and ambiguous sets."""

    rescanned: bool  # False: a scan that moved nothing is its own final state
    objects: int
    flagged: dict[str, Total]
    flagged_objects: int
    examples: dict[str, str] = field(default_factory=dict)  # category -> smallest name
    ambiguous_sets: int = 0


def scan(tier: TierSource, reader: TierReader, sizes: bool = True,
         expect: Expectations | None = None, check: Checker | None = None) -> tuple[ScanResult, Plan]:
    res, plan, _ = _scan(tier, reader, sizes, expect or {}, check)
    return res, plan


def _scan(tier: TierSource, reader: TierReader, sizes: bool, expect: Expectations,
          check: Checker | None = None) -> tuple[ScanResult, Plan, Tally]:
    t = tier.tally(sizes)
    sets, plan = categorize(t, reader, expect, tier.set_key)
    checked = verify(tier, reader, sets, plan, check) if check is not None else None
    flagged = {c: Total(bytes=0 if sizes else None) for c in judged(sizes, check is not None)}
    for s in sets:
        for f in s.flagged:
            flagged[f.category].objects += f.objects
            if sizes:
                flagged[f.category].bytes += f.bytes
    ambiguous = [s for s in sets if s.ambiguous]
    res = ScanResult(
        tier.where, reader, sizes, sum(s.objects for s in sets),
        sum(s.bytes for s in sets) if sizes else None, t.tmp_files, t.subdirs, t.foreign,
        t.foreign_names, t.vanished, dict(expect), sorted(set(expect) - set(t.sets)), sets,
        flagged, sum(v.objects for v in flagged.values()),
        sum(v.bytes for v in flagged.values()) if sizes else None,
        len(ambiguous), sum(s.objects for s in ambiguous), checked)
    return res, plan, t


def as_final(res: ScanResult) -> FinalState:
    """A scan that moved nothing: its report is what DIR holds."""
    examples = {}
    for s in res.sets:
        for f in s.flagged:
            if f.category not in examples or f.example < examples[f.category]:
                examples[f.category] = f.example
    return FinalState(False, res.objects, res.flagged, res.flagged_objects, examples,
                      res.ambiguous_sets)


def final_state(tier: TierSource, reader: TierReader, sizes: bool, expect: Expectations,
                plans: list[Plan], check: Checker | None = None) -> FinalState:
    """Re-scan DIR after a quarantine.  An object counts as flagged if the
    fresh judgement flags it (objects stored while the command ran) or any
    plan of the run selected it (objects ``--only`` left out, a name
    collision refused, or ones whose evidence the run itself moved away).
    With ``check`` the re-scan verifies again (what is left is read anew)."""
    res, fresh, t = _scan(tier, reader, sizes, expect, check)
    flagged = {c: Total(bytes=0 if sizes else None) for c in judged(sizes, check is not None)}
    examples: dict[str, str] = {}
    for p, hist in t.sets.items():
        for size, (n, example) in hist.items():
            sel = next((s for s in (pl.select(p, size) for pl in [fresh, *plans]) if s), None)
            if sel is None:
                continue
            tot = flagged[sel[0]]
            tot.objects += n
            if sizes and size != UNKNOWN_SIZE:
                tot.bytes += size * n
            if sel[0] not in examples or example < examples[sel[0]]:
                examples[sel[0]] = example
    # Objects selected by name (corrupt): each one still in DIR with the size
    # it was judged at, once.
    named: dict[str, tuple[int, tuple]] = {}
    for pl in [fresh, *plans]:
        for n, one in pl.names.items():
            named.setdefault(n, one)
    for n, (size, (cat, _k)) in sorted(named.items()):
        if tier.size_of(n) != size:
            continue
        tot = flagged.setdefault(cat, Total(bytes=0 if sizes else None))
        tot.objects += 1
        if sizes:
            tot.bytes += size
        examples.setdefault(cat, n)
    return FinalState(True, res.objects, flagged, sum(v.objects for v in flagged.values()),
                      examples, res.ambiguous_sets)
