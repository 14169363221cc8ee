"""What in a tier a reader would not serve: the categories, decided per set
from one pass's size histograms (``patchtool.l2.tally``).

The principle: flag only what the reader would not serve, from evidence;
never by a majority.  The fs adapter's load reads exactly the size of the
reader's own layout: a shorter file is a miss, a longer one a wrong hit by
its prefix, an equal one a hit (docs/design/disk-tier-keys.md §2).  So a
size is "wrong" only relative to the size the reader itself writes for the
set, and a tier does not say what that is: a name carries no size, and two
releases write different sizes for one model into one plain set, each
serving its own objects correctly (pristine 0.5.3 and 0.5.6, hybrid k=17).

Categories (each flagged object gets exactly one, in this order):

* ``never-read``: namespaced objects the reader never looks up (a pristine
  reader, or another format number).  Decided by the name alone.
* ``unpatched``: for a reader of namespaced names only, plain objects whose
  size is the size of a namespaced set of the same (model, kv_rank, group)
  divided by an integer k > 1: the 1/k objects an unpatched build wrote for
  a sub-paged layout.  The namespaced set is the evidence: a reader of that
  layout looks the group up under its namespace, and a reader of any other
  layout finds a short file (a miss).  For a pristine reader they are its
  own objects: never flagged there.
* ``size-mismatch``: an empty object (no layout's size: a miss for every
  reader), and, where the operator named the size the reader writes for the
  set (``--expect-size SET=SIZE``), every other size.
* ``corrupt`` (``--verify`` only, ``patchtool.l2.content_check``): an object whose
  checksum trailer does not match its bytes and its name: not what was
  stored under that key.  Judged per object, by content, for the objects the
  rules above leave unflagged.

Checksum trailers (hybrid-fa part 12-l2-checksum) make a patched build's
file :data:`~patchtool.l2.checksum.TRAILER_LEN` bytes longer than the KV
bytes it holds, which a pristine reader reads (a longer file fills its
buffer from the front).  So for the sizes, ``S`` and ``S + TRAILER_LEN`` are
one layout: not two sizes of an ambiguous set, and either one matches an
``--expect-size`` of ``S``; and a 1/k object divides a namespaced size with
or without its trailer.

A set that, after these, still holds more than one size is **ambiguous**:
nothing in it is flagged, it is reported with its sizes, the command exits
non-zero (``L2_AMBIGUOUS``) and a quarantine moves none of it.

A new category goes into :data:`CATEGORIES` (its place is its precedence)
and into :func:`_judge`, or, for a per-object check, into
``patchtool.l2.content_check`` (it selects objects by name: :attr:`Plan.names`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .checksum import TRAILER_LEN
from .names import SetKey, prefix_key
from .reader import TierReader
from .tally import UNKNOWN_SIZE, Tally

NEVER_READ, UNPATCHED, SIZE_MISMATCH = "never-read", "unpatched", "size-mismatch"
CORRUPT = "corrupt"
CATEGORIES = (NEVER_READ, UNPATCHED, SIZE_MISMATCH, CORRUPT)
EXPECT_OPTION = "--expect-size"

# The operator's evidence: set prefix -> the size the reader writes for it.
Expectations = dict[str, int]


@dataclass
class Flag:
    category: str
    size: int | None  # None: a names-only scan (the flag covers every size)
    objects: int
    bytes: int | None
    example: str  # the smallest name: deterministic
    reference_size: int | None  # the expected size (size-mismatch) or the namespaced size
    k: int | None = None  # unpatched: reference_size // size
    namespace: str | None = None  # unpatched: the namespace whose size it divides


@dataclass
class ObjectSet:
    set: str  # the name prefix, as --expect-size takes it
    model: str
    namespace: str
    layout_format: int | None
    kv_rank: str
    object_group: int
    readable: bool  # the reader looks these names up
    objects: int
    bytes: int | None  # None (and no sizes) in a names-only scan
    sizes: dict[int, int]
    expected_size: int | None = None  # named by the operator
    expected_from: str | None = None  # EXPECT_OPTION when named
    ambiguous: bool = False  # several sizes and nothing to tell the reader's
    flagged: list[Flag] = field(default_factory=list)


Selector = tuple[str, "int | None"]  # (category, k)


@dataclass
class Plan:
    """What a quarantine may move: per set prefix, per size (``None``: every
    size of the set), the category and k.  Kept as data because a resumed
    run replays the journaled plan: evidence it rests on (a namespaced set)
    may have moved meanwhile."""

    sets: dict[str, dict[int | None, Selector]] = field(default_factory=dict)
    # Objects selected one by one (``--verify``): name -> (the size it had
    # when judged, selector).  A file of that name and another size is a
    # new object (the server rewrote the key): not selected.
    names: dict[str, tuple[int, Selector]] = field(default_factory=dict)

    def select(self, prefix: str, size: int, name: str | None = None) -> Selector | None:
        by = self.sets.get(prefix)
        if by is not None:
            sel = by.get(None) or by.get(size)
            if sel is not None:
                return sel
        if name is not None:
            one = self.names.get(name)
            if one is not None and one[0] == size:
                return one[1]
        return None

    def records(self, only: list[str] | None = None) -> list[list]:
        """``[[prefix, size, category, k], ...]`` for sets, then
        ``[prefix, size, category, k, name]`` per named object, sorted: the
        journal's form."""
        rows = [[p, s, c, k] for p, by in self.sets.items() for s, (c, k) in by.items()
                if only is None or c in only]
        rows.sort(key=lambda r: (r[0], -1 if r[1] is None else r[1]))
        named = [[n[:n.index("@", n.index("@", n.index("@") + 1) + 1)], s, c, k, n]
                 for n, (s, (c, k)) in self.names.items() if only is None or c in only]
        return rows + sorted(named, key=lambda r: r[4])

    @classmethod
    def from_records(cls, rows: list[list]) -> "Plan":
        plan = cls()
        for row in rows:
            if len(row) == 5:
                p, s, c, k, n = row
                plan.names[n] = (s, (c, k))
            else:
                p, s, c, k = row
                plan.sets.setdefault(p, {})[s] = (c, k)
        return plan


def categorize(t: Tally, reader: TierReader, expect: Expectations | None = None,
               key_of: Callable[[str], SetKey] = prefix_key) -> tuple[list[ObjectSet], Plan]:
    """The sets of one pass, judged for ``reader``, and what a quarantine may
    move.  ``key_of`` parses a set prefix of the tier the pass read (the fs
    names by default; ``TierSource.set_key``)."""
    expect = expect or {}
    keys = {p: key_of(p) for p in t.sets}
    refs = _namespaced_sizes(t, keys) if t.sizes_read else {}
    sets: list[ObjectSet] = []
    plan = Plan()
    for p in sorted(t.sets, key=lambda p: _order(keys[p])):
        k, hist = keys[p], t.sets[p]
        row = _row(p, k, hist, reader, t.sizes_read)
        sets.append(row)
        if not row.readable:
            row.flagged = [Flag(NEVER_READ, None if s == UNKNOWN_SIZE else s, b[0],
                                None if s == UNKNOWN_SIZE else s * b[0], b[1], None)
                           for s, b in sorted(hist.items())]
            plan.sets[p] = {None: (NEVER_READ, None)}
            continue
        if not t.sizes_read:
            continue  # unpatched, size-mismatch and ambiguity are judged by sizes
        _judge(row, k, hist, reader, refs.get((k.model, k.kv_rank, k.object_group), []),
               expect.get(p))
        if row.flagged:
            plan.sets[p] = {f.size: (f.category, f.k) for f in row.flagged}
    return sets, plan


def _row(p: str, k: SetKey, hist: dict[int, list], reader: TierReader,
         sizes_read: bool) -> ObjectSet:
    n = sum(b[0] for b in hist.values())
    return ObjectSet(p, k.model, k.namespace, k.layout_format, k.kv_rank_hex, k.object_group,
                     reader.reads(k), n,
                     sum(s * b[0] for s, b in hist.items()) if sizes_read else None,
                     {s: hist[s][0] for s in sorted(hist)} if sizes_read else {})


def _namespaced_sizes(t: Tally, keys: dict[str, SetKey]) -> dict[tuple, list[tuple[str, int]]]:
    """Per (model, kv_rank, group): (namespace, size) of each namespaced set
    of exactly one (non-zero) size.  kv_rank must match, since TP sharding divides sizes
    by integers too; a namespaced set of several sizes is itself unexplained,
    so it is no evidence for anything else."""
    refs: dict[tuple, list[tuple[str, int]]] = {}
    for p, k in keys.items():
        # an empty object is nobody's layout; S and S + trailer are one layout
        sizes = _layouts([s for s in t.sets[p] if s > 0])
        if k.namespace and len(sizes) == 1:
            refs.setdefault((k.model, k.kv_rank, k.object_group), []).append(
                (k.namespace, max(sizes[0])))
    return refs


def _layouts(sizes: list[int]) -> list[list[int]]:
    """Sizes grouped into layouts: ``S`` and ``S + TRAILER_LEN`` (the same
    KV bytes without and with a checksum trailer) are one."""
    out: list[list[int]] = []
    for s in sorted(sizes):
        if out and s - out[-1][0] == TRAILER_LEN and len(out[-1]) == 1:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def _divides(ref: int, s: int) -> int | None:
    """k when ``s`` is 1/k (k > 1) of the KV bytes of a namespaced object of
    ``ref`` bytes: without a trailer, or with one (``s`` then must exceed the
    trailer: a divisor of both would divide the trailer length)."""
    if s < ref and ref % s == 0:
        return ref // s
    kv = ref - TRAILER_LEN
    if TRAILER_LEN < s < kv and kv % s == 0:
        return kv // s
    return None


def _judge(row: ObjectSet, k: SetKey, hist: dict[int, list], reader: TierReader,
           refs: list[tuple[str, int]], expected: int | None) -> None:
    """Flag what the reader would not serve; mark the set ambiguous when what
    is left cannot be decided.  ``expected`` (the operator's size) is never
    flagged: it is what the reader serves."""
    rest = dict(hist)
    # The reader's own sizes: the operator's, with or without a trailer.
    mine_sizes = () if expected is None else (expected, expected + TRAILER_LEN)
    if expected is not None:
        row.expected_size, row.expected_from = expected, EXPECT_OPTION
    if 0 in rest:
        b = rest.pop(0)
        row.flagged.append(Flag(SIZE_MISMATCH, 0, b[0], 0, b[1], None))
    if not k.namespace and reader.layout_format is not None:
        # The reader's own format first, so k and the namespace named are its.
        mine = f"kvl{reader.layout_format}-"
        ordered = sorted(refs, key=lambda r: (not r[0].startswith(mine), r[0]))
        for s in sorted(rest):
            if s in mine_sizes:
                continue
            for ns, ref in ordered:
                k_div = _divides(ref, s)
                if k_div is not None:
                    b = rest.pop(s)
                    row.flagged.append(Flag(UNPATCHED, s, b[0], s * b[0], b[1], ref,
                                            k_div, ns))
                    break
    if expected is not None:
        for s in sorted(rest):
            if s not in mine_sizes:
                b = rest[s]
                row.flagged.append(Flag(SIZE_MISMATCH, s, b[0], s * b[0], b[1], expected))
    elif len(_layouts(list(rest))) > 1:
        row.ambiguous = True
    row.flagged.sort(key=lambda f: (CATEGORIES.index(f.category), f.size))


def _order(k: SetKey) -> tuple:
    return (k.model, k.namespace, k.kv_rank, k.object_group)
