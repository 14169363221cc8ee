"""``patchtool l2 scan DIR``: what in an fs L2 tier this install would never
read or would read wrongly, and ``--quarantine DEST`` to move it aside.

Reads names and sizes only (one ``os.scandir`` pass, one ``lstat`` per
object; no object is ever opened), so a million-file tier costs about what
``find -printf %s`` costs (bench/bench_l2_scan.py).  ``--names-only`` skips
the ``lstat``s: it then costs about what ``find -type f`` costs, and flags
only what names decide (``never-read``).  Memory is a size
histogram per *set* (model, namespace, kv_rank, object group) and one
example name per (set, size): nothing per file.

Categories (each flagged object gets exactly one, in this order):

* ``never-read``: namespaced objects the reader never looks up (a pristine
  reader, or another format number);
* ``unpatched``: for a reader of namespaced names only, plain objects whose
  size is the size of a namespaced set of the same (model, kv_rank, group)
  divided by an integer k > 1: the 1/k objects an unpatched build wrote for
  a sub-paged layout, which this reader never reads correctly (it looks the
  group up under its namespace, or reads them as a short-file miss).  For a
  pristine reader they are its own, correct objects: never flagged there;
* ``size-mismatch``: objects of a set whose size is not the set's dominant
  size.  LMCache's MP server stores complete chunks only (every 0.5.3-0.5.6
  key is built from ``compute_chunk_hashes``/``get_hashes``, which drop a
  trailing partial chunk, and each object is allocated from the group's
  per-chunk layout), so one writer layout gives a set exactly one size and
  any other size is a second writer under the same keys.

``--quarantine`` (``patchtool.l2quarantine``) moves the flagged objects
aside; this module only reads.
"""

from __future__ import annotations

import bisect
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from . import fsio
from .errors import NotInstalled, Refusal
from .exitcodes import ExitCode
from .l2names import OBJECT_RE, TMP_EXT, SetKey, prefix_key

if TYPE_CHECKING:
    from .l2quarantine import QuarantineResult

NEVER_READ, UNPATCHED, SIZE_MISMATCH = "never-read", "unpatched", "size-mismatch"
CATEGORIES = (NEVER_READ, UNPATCHED, SIZE_MISMATCH)
FOREIGN_LISTED = 100  # names listed in the report; all are counted
# The one histogram bucket of a names-only pass (no object was stat'ed).
UNKNOWN_SIZE = -1


# ---------------------------------------------------------------- the reader


@dataclass(frozen=True)
class TierReader:
    """Which names an install looks up: plain names always, and
    ``+kvl<F>-*`` names when ``layout_format`` is F."""

    layout_format: int | None
    source: str  # "assume" or "install"
    detail: str

    def reads(self, key: SetKey) -> bool:
        return key.layout_format is None or key.layout_format == self.layout_format


def parse_assume(value: str) -> TierReader:
    """``--assume pristine`` or ``--assume kvlN``."""
    if value == "pristine":
        return TierReader(None, "assume", "--assume pristine: reads plain names only")
    if value.startswith("kvl") and value[3:].isdigit() and int(value[3:]) > 0:
        n = int(value[3:])
        return TierReader(n, "assume", f"--assume {value}: reads plain names and +kvl{n}-* names")
    raise Refusal("--assume", f"{value!r} is neither 'pristine' nor 'kvlN' (N >= 1)",
                  ExitCode.USAGE)


def reader_for(st, l2_format: int | None) -> TierReader:
    """What a classified install (a :class:`patchtool.classify.Status`) reads.

    Only states whose keys are known are answered: pristine (and versions
    this tool has no series for, or that need none: upstream writes plain
    names), and the current revision patched.  An older revision, a partial
    series or drifted files may write either, so the tool will not guess."""
    from .classify import DRIFTED, FIXED_UPSTREAM, NOT_INSTALLED, PARTIAL, PATCHED, \
        PATCHED_OLDER, PRISTINE, UNSUPPORTED

    what = f"lmcache {st.lmcache_version} ({st.site})"
    hint = "pass --assume pristine|kvlN to scan without a target"
    if st.state == NOT_INSTALLED:
        where = st.python or (st.site_dirs[0] if st.site_dirs else "?")
        raise NotInstalled(where, f"lmcache is not installed (searched: "
                           f"{', '.join(st.site_dirs)}); {hint}")
    if st.state in (PRISTINE, UNSUPPORTED, FIXED_UPSTREAM):
        return TierReader(None, "install", f"{st.state} {what}: reads plain names only")
    if st.state == PATCHED:
        series = f"{st.patch_set} revision {st.revision}"
        if l2_format is None:
            return TierReader(None, "install", f"{what} patched with {series}, which writes "
                              "pristine keys only: reads plain names only")
        return TierReader(l2_format, "install", f"{what} patched with {series}: reads plain "
                          f"names and +kvl{l2_format}-* names")
    assert st.state in (PATCHED_OLDER, PARTIAL, DRIFTED), st.state
    raise Refusal(st.dist_info, f"install is {st.state}: which disk-tier names it reads is not "
                  f"known (apply the current revision, or {hint})")


# ---------------------------------------------------------------- one pass


@dataclass
class Tally:
    """The raw pass: per set prefix (the name up to the group field), per
    size, ``[count, smallest name]``."""

    sets: dict[str, dict[int, list]] = field(default_factory=dict)
    tmp_files: int = 0
    subdirs: int = 0
    foreign: int = 0
    foreign_names: list[str] = field(default_factory=list)  # the smallest, sorted
    vanished: int = 0  # listed, then gone before its lstat (a live tier)
    sizes_read: bool = True  # False: every histogram is {UNKNOWN_SIZE: ...}


@contextmanager
def dir_entries(path: Path) -> Iterator[Iterator[os.DirEntry]]:
    """``scandir`` over an fd of ``path``: each ``entry.stat()`` is then an
    ``fstatat`` of the bare name instead of a walk of the whole path (about
    12% less CPU on a million files)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise Refusal(path, "no such directory") from None
    except NotADirectoryError:
        raise Refusal(path, "is not a directory") from None
    except OSError as exc:
        raise fsio.refusal_for(path, exc, "list it") from None
    try:
        with os.scandir(fd) as it:
            yield it
    finally:
        os.close(fd)


def _foreign(t: Tally, name: str) -> None:
    t.foreign += 1
    names = t.foreign_names
    if len(names) < FOREIGN_LISTED or name < names[-1]:
        bisect.insort(names, name)
        del names[FOREIGN_LISTED:]


def tally(path: Path, sizes: bool = True) -> Tally:
    """One ``scandir`` pass.  The loop is written for speed (it runs once per
    file): one regex match, one lstat, one dict lookup; no per-file object.
    Without ``sizes`` there is no lstat: every object lands in the
    ``UNKNOWN_SIZE`` bucket of its set."""
    t = Tally(sizes_read=sizes)
    sets = t.sets
    match = OBJECT_RE.fullmatch
    with dir_entries(path) as it:
        for entry in it:
            name = entry.name
            m = match(name)
            # d_type answers is_dir/is_file without a syscall.
            if m is None or not entry.is_file(follow_symlinks=False):
                if entry.is_dir(follow_symlinks=False):
                    t.subdirs += 1  # the adapter's tmp dir, or anything else: not an object
                elif name.endswith(TMP_EXT) and m is None:
                    t.tmp_files += 1
                else:
                    _foreign(t, name)  # incl. links and special files named like objects
                continue
            if sizes:
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    t.vanished += 1
                    continue
                except OSError as exc:
                    raise fsio.refusal_for(path / name, exc, "stat it") from None
            else:
                size = UNKNOWN_SIZE
            prefix = name[:m.end(3)]
            hist = sets.get(prefix)
            if hist is None:
                hist = sets[prefix] = {}
            b = hist.get(size)
            if b is None:
                hist[size] = [1, name]
            else:
                b[0] += 1
                if name < b[1]:
                    b[1] = name
    return t


# ---------------------------------------------------------------- categories


@dataclass
class Flag:
    category: str
    size: int | None  # None: a names-only scan (the flag covers every size)
    objects: int
    bytes: int | None
    example: str
    reference_size: int | None  # the dominant size (size-mismatch) or the namespaced size
    k: int | None = None  # unpatched: reference_size // size
    namespace: str | None = None  # unpatched: the namespace whose size it divides


@dataclass
class ObjectSet:
    model: str
    namespace: str
    layout_format: int | None
    kv_rank: str
    object_group: int
    readable: bool  # the reader looks these names up
    objects: int
    bytes: int | None  # None (and no sizes, no dominant size) in a names-only scan
    dominant_size: int | None
    dominant_tied: bool  # another size has as many objects (the smaller size wins)
    sizes: dict[int, int]
    flagged: list[Flag] = field(default_factory=list)


@dataclass
class Total:
    objects: int = 0
    bytes: int | None = 0


def dominant(hist: dict[int, list]) -> tuple[int, bool]:
    """The size most objects have.  On a tie the smaller size wins, so the
    larger one is flagged: a longer file is the one a reader of the shorter
    layout takes as a hit (the fs load reads its prefix, design §2), while a
    shorter file is only ever a miss.  Quarantine keeps the bytes either way."""
    size = min(hist, key=lambda s: (-hist[s][0], s))
    top = hist[size][0]
    return size, sum(1 for b in hist.values() if b[0] == top) > 1


# plan: set prefix -> {size: (category, k), or None (every size): (category, None)}
Plan = dict[str, dict[int | None, tuple[str, int | None]]]


def categorize(t: Tally, reader: TierReader) -> tuple[list[ObjectSet], Plan]:
    if not t.sizes_read:
        return _categorize_names(t, reader)
    keys = {p: prefix_key(p) for p in t.sets}
    # Namespaced reference sizes per (model, kv_rank, group): kv_rank must
    # match, since TP sharding divides sizes by integers too.
    refs: dict[tuple, list[tuple[str, int]]] = {}
    for p, k in keys.items():
        if k.namespace:
            refs.setdefault((k.model, k.kv_rank, k.object_group), []).append(
                (k.namespace, dominant(t.sets[p])[0]))
    sets: list[ObjectSet] = []
    plan: Plan = {}
    for p in sorted(t.sets, key=lambda p: _order(keys[p])):
        k, hist = keys[p], t.sets[p]
        dom, tied = dominant(hist)
        row = ObjectSet(k.model, k.namespace, k.layout_format, k.kv_rank_hex, k.object_group,
                        reader.reads(k), sum(b[0] for b in hist.values()),
                        sum(s * b[0] for s, b in hist.items()), dom, tied,
                        {s: hist[s][0] for s in sorted(hist)})
        sets.append(row)
        if not row.readable:
            row.flagged = [Flag(NEVER_READ, s, b[0], s * b[0], b[1], dom) for s, b in
                           sorted(hist.items())]
            plan[p] = {None: (NEVER_READ, None)}
            continue
        rest = dict(hist)
        if not k.namespace and reader.layout_format is not None:
            for s in sorted(hist):
                for ns, ref in sorted(refs.get((k.model, k.kv_rank, k.object_group), []),
                                      key=lambda r: (not r[0].startswith(
                                          f"kvl{reader.layout_format}-"), r[0])):
                    if 0 < s < ref and ref % s == 0:  # an empty file is no 1/k of anything
                        b = rest.pop(s)
                        row.flagged.append(Flag(UNPATCHED, s, b[0], s * b[0], b[1], ref,
                                                ref // s, ns))
                        break
        if rest:
            # The dominant size among what the categories above did not explain.
            dom, tied = dominant(rest)
            row.dominant_size, row.dominant_tied = dom, tied
            for s in sorted(rest):
                if s != dom:
                    b = rest[s]
                    row.flagged.append(Flag(SIZE_MISMATCH, s, b[0], s * b[0], b[1], dom))
        if row.flagged:
            plan[p] = {f.size: (f.category, f.k) for f in row.flagged}
    return sets, plan


def _categorize_names(t: Tally, reader: TierReader) -> tuple[list[ObjectSet], Plan]:
    """A names-only pass decides ``never-read`` alone: ``unpatched`` and
    ``size-mismatch`` are judged by sizes, which it did not read."""
    keys = {p: prefix_key(p) for p in t.sets}
    sets: list[ObjectSet] = []
    plan: Plan = {}
    for p in sorted(t.sets, key=lambda p: _order(keys[p])):
        k, (n, example) = keys[p], t.sets[p][UNKNOWN_SIZE]
        row = ObjectSet(k.model, k.namespace, k.layout_format, k.kv_rank_hex, k.object_group,
                        reader.reads(k), n, None, None, False, {})
        sets.append(row)
        if not row.readable:
            row.flagged = [Flag(NEVER_READ, None, n, None, example, None)]
            plan[p] = {None: (NEVER_READ, None)}
    return sets, plan


def _order(k: SetKey) -> tuple:
    return (k.model, k.namespace, k.kv_rank, k.object_group)


# ---------------------------------------------------------------- the report


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
    sets: list[ObjectSet]
    flagged: dict[str, Total]
    flagged_objects: int
    flagged_bytes: int
    quarantine: "QuarantineResult | None" = None
    remaining_flagged: int = 0  # flagged objects still in DIR after the command


def scan(path: Path, reader: TierReader, sizes: bool = True) -> tuple[ScanResult, Plan]:
    t = tally(path, sizes)
    sets, plan = categorize(t, reader)
    flagged = {c: Total(bytes=0 if sizes else None) for c in CATEGORIES}
    for s in sets:
        for f in s.flagged:
            flagged[f.category].objects += f.objects
            if sizes:
                flagged[f.category].bytes += f.bytes
    n = sum(v.objects for v in flagged.values())
    total = sum(s.bytes for s in sets) if sizes else None
    flagged_bytes = sum(v.bytes for v in flagged.values()) if sizes else None
    res = ScanResult(str(path), reader, sizes, sum(s.objects for s in sets), total,
                     t.tmp_files, t.subdirs, t.foreign, t.foreign_names, t.vanished, sets,
                     flagged, n, flagged_bytes, None, n)
    return res, plan


def exit_code(res: ScanResult) -> ExitCode:
    """0 when DIR, as the command leaves it, holds nothing flagged."""
    return ExitCode.L2_FLAGGED if res.remaining_flagged else ExitCode.OK


def run(path: Path, reader: TierReader, dest: Path | None = None,
        only: list[str] | None = None, sizes: bool = True) -> ScanResult:
    """The command: scan, and with ``dest`` quarantine; every refusal comes
    before the first write.  ``sizes=False`` is ``--names-only``."""
    from .l2quarantine import check_dest, quarantine  # the quarantine builds on the scan

    if not sizes and only and set(only) - {NEVER_READ}:
        raise Refusal("--only", f"--names-only judges {NEVER_READ} only (the other categories "
                      "are decided by sizes): drop --names-only or choose --only never-read",
                      ExitCode.USAGE)
    create = check_dest(path, dest) if dest is not None else False
    res, plan = scan(path, reader, sizes)
    if dest is None:
        return res
    if only is None:
        only = list(CATEGORIES) if sizes else [NEVER_READ]
    res.quarantine = quarantine(path, dest, plan, only, reader, create)
    q = res.quarantine
    # Not selected by --only, or refused: still in DIR.  (A resumed run moves
    # its journaled plan, which may take more than this scan flags.)
    res.remaining_flagged = max(0, res.flagged_objects - q.moved)
    return res


# ---------------------------------------------------------------- human output


def render(res: ScanResult, code: int) -> None:
    """People's form: one line per set, one indented line per flag (a table
    wraps model names and namespaces into unreadable columns)."""
    from rich.console import Console

    con = Console(highlight=False, soft_wrap=True)
    con.print(f"tier        : {res.dir}")
    con.print(f"reader      : {res.reader.detail}")
    con.print(f"objects     : {res.objects} ({_size(res.bytes)}); skipped {res.tmp_files} tmp "
              f"file(s), {res.subdirs} subdir(s); {res.foreign} foreign")
    if not res.sizes_read:
        con.print(f"sizes       : not read (--names-only): only {NEVER_READ} is judged; "
                  f"{UNPATCHED} and {SIZE_MISMATCH} need a scan without --names-only")
    for s in res.sets:
        ns = s.namespace or "(plain)"
        unread = "" if s.readable else " [red](never read)[/]"
        sizes = ", ".join(f"{size} B x{n}" for size, n in s.sizes.items())
        sizes = f"; sizes {sizes}" if res.sizes_read else ""
        con.print(f"  {s.model}  {ns}{unread}  kv_rank {s.kv_rank}  group {s.object_group}: "
                  f"{s.objects} object(s), {_size(s.bytes)}{sizes}")
        for f in s.flagged:
            con.print(f"    [red]{_flag(f)}[/], e.g. {f.example}")
    for c, tot in res.flagged.items():
        if tot.objects:
            con.print(f"[red]{c:<13}[/]: {tot.objects} object(s), {_size(tot.bytes)}")
    if res.foreign:
        more = f" (first {len(res.foreign_names)})" if res.foreign > len(res.foreign_names) else ""
        con.print(f"foreign{more:<5}: " + ", ".join(res.foreign_names))
    q = res.quarantine
    if q is not None:
        how = " (finished an interrupted run)" if q.resumed else ""
        con.print(f"quarantine  : moved {q.moved} object(s), {_size(q.moved_bytes)}, to "
                  f"{q.dest}{how}; journal {q.journal}")
        if q.refused:
            con.print(f"[yellow]refused[/]     : {q.refused} object(s) left in DIR: DEST "
                      f"already holds a file of that name ({', '.join(q.refused_names[:5])})")
    if code:
        con.print(f"exit code {int(code)}: {res.remaining_flagged} flagged object(s) in "
                  f"{res.dir}")
    elif res.sizes_read:
        con.print("nothing flagged")
    else:
        con.print(f"nothing flagged by name ({UNPATCHED} and {SIZE_MISMATCH} not judged: "
                  "sizes not read)")


def _flag(f: Flag) -> str:
    if f.size is None:
        return f"{f.category}: {f.objects} object(s)"
    n = f"{f.objects} object(s) of {f.size} B"
    if f.category == UNPATCHED:
        return f"{f.category}: {n} = 1/{f.k} of {f.namespace}'s {f.reference_size} B"
    if f.category == SIZE_MISMATCH:
        return f"{f.category}: {n}, dominant {f.reference_size} B"
    return f"{f.category}: {n}"


def _size(n: int | None) -> str:
    if n is None:
        return "size not read"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
