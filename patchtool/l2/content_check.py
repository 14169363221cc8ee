"""``l2 scan --verify``: the ``corrupt`` category, judged per object by content.

After the size rules (``patchtool.l2.rules``), every object the reader reads
and the rules leave unflagged is read whole and its checksum trailer checked
(``patchtool.l2.checksum``).  Flagged ``corrupt``:

* an object whose trailer does not match its bytes and its name (bit rot, a
  torn or cut copy, an object renamed, swapped or copied under another key);
* an object without a valid trailer whose size is the size of verified
  objects of its set: a trailer-format object damaged at its end (the KV
  bytes of the same layout without a trailer are ``TRAILER_LEN`` shorter);
* in a namespaced set (one layout by construction: only patched builds write
  those names) whose verified objects hold ``K`` KV bytes, an object without
  a trailer of any size but ``K`` (an earlier revision's object of the same
  layout): cut short, or padded.  Its set is then not ambiguous: the
  verified trailers are the evidence of the reader's size.  A plain set gets
  no such rule: other builds legitimately write other sizes under plain
  names (docs/disk-tier.md), so there a cut object is only a size the
  ambiguity rule reports.

Not flagged, only counted: objects without a trailer (a build without the
check wrote them; a checking reader refuses them and its next store rewrites
them, a pristine reader cannot check them), trailers of an unknown version,
and objects that vanished while checked (a live tier).

Names are listed by a second pass of the tier (``TierSource.candidates``:
the first keeps no per-file state), only in this mode, which reads every
byte anyway.  The checks are the same for every tier; what a Redis tier
adds (a sealed key's promise of a trailer, the re-read of a value that
failed) is in its checker, ``patchtool.l2.redis_tier``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import checksum as ck
from .reader import TierReader
from .rules import CORRUPT, Flag, ObjectSet, Plan
from .source import TierSource

# names -> {name: (verdict, detail)}; checksum.check bound to DIR and the target
Checker = Callable[[list[str]], dict[str, tuple[str, str]]]


@dataclass
class VerifyResult:
    checked: int = 0  # objects read and checked
    # checksum verdict -> objects; a trailer-less object of a verified size counts as corrupt
    verdicts: dict[str, int] = field(default_factory=dict)
    corrupt_names: list[str] = field(default_factory=list)  # sorted, every one
    details: dict[str, str] = field(default_factory=dict)  # corrupt name -> why
    checked_with: str = ""


def verify(tier: TierSource, reader: TierReader, sets: list[ObjectSet], plan: Plan,
           check: Checker) -> VerifyResult:
    """Check every candidate (``tier.candidates``); add ``corrupt`` flags to
    ``sets`` and their names to ``plan``."""
    todo = tier.candidates(reader, plan)
    verdicts = check(sorted(todo))
    res = VerifyResult(checked=len(verdicts))
    verified_sizes: dict[str, set[int]] = {}
    namespaced = {s.set for s in sets if s.namespace}
    for name, (v, _) in verdicts.items():
        res.verdicts[v] = res.verdicts.get(v, 0) + 1
        if v == ck.OK:
            verified_sizes.setdefault(todo[name][0], set()).add(todo[name][1])
    corrupt: dict[str, str] = {}
    for name, (v, detail) in verdicts.items():
        prefix, size = todo[name]
        if v == ck.CORRUPT:
            corrupt[name] = detail
        elif v == ck.NO_TRAILER and size in verified_sizes.get(prefix, ()):
            corrupt[name] = (f"no valid trailer, yet {size} B is the size of its set's verified "
                             "objects (a trailer-format object damaged at its end)")
        elif v == ck.NO_TRAILER and prefix in namespaced and len(verified_sizes.get(prefix, ())) == 1:
            (full,) = verified_sizes[prefix]
            if size != full - ck.TRAILER_LEN:
                corrupt[name] = (f"{size} B without a trailer in a namespaced set whose verified "
                                 f"objects hold {full - ck.TRAILER_LEN} KV bytes: cut short or padded")
        if name in corrupt and v == ck.NO_TRAILER:
            res.verdicts[ck.NO_TRAILER] -= 1  # counted as what it is
            res.verdicts[ck.CORRUPT] = res.verdicts.get(ck.CORRUPT, 0) + 1
    res.verdicts = {k: n for k, n in sorted(res.verdicts.items()) if n}
    by_set = {s.set: s for s in sets}
    grouped: dict[tuple[str, int], list[str]] = {}
    for name in corrupt:
        grouped.setdefault(todo[name], []).append(name)
    for (prefix, size), names in sorted(grouped.items()):
        names.sort()
        by_set[prefix].flagged.append(Flag(CORRUPT, size, len(names), size * len(names), names[0], None))
        for n in names:
            plan.names[n] = (size, (CORRUPT, None))
    for row in sets:
        if row.ambiguous and row.set in namespaced and len(verified_sizes.get(row.set, ())) == 1:
            (full,) = verified_sizes[row.set]
            flagged = {f.size: f.objects for f in row.flagged}
            if all(flagged.get(sz, 0) == n for sz, n in row.sizes.items()
                   if sz not in (full, full - ck.TRAILER_LEN)):
                row.ambiguous = False  # every other size was a damaged object
    res.corrupt_names = sorted(corrupt)
    res.details = {n: corrupt[n] for n in res.corrupt_names}
    return res


def checker(path: Path, python: str | None, where: list[str]) -> Checker:
    """A :data:`Checker` for DIR; ``where`` receives where it ran."""
    def run(names: list[str]) -> dict[str, tuple[str, str]]:
        out, how = ck.check(path, names, python)
        where.append(how)
        return out
    return run
