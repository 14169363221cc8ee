"""People's form of the ``patchtool l2`` commands (``--json`` is the
dataclasses themselves, ``patchtool.output``): :func:`format_scan` and
:func:`format_restore` return the text; the CLI prints it.

One line per set and one indented line per flag: a table wraps model names
and namespaces into unreadable columns.  Every name from the tier goes
through :func:`shown`: a model name may hold any character but ``@``, so a
newline would break a line in two and an escape sequence would drive the
terminal, and ``[...]`` would be taken for rich markup.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from ..output import capture
from .command import ScanReport
from .redis_move import RedisQuarantineResult, RedisRestoreResult
from .redis_scan import RedisScanReport
from .restore import RestoreResult
from .rules import CORRUPT, EXPECT_OPTION, NEVER_READ, SIZE_MISMATCH, UNPATCHED, Flag, ObjectSet

_SHOWN = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
CORRUPT_LISTED = 100  # corrupt objects named one per line; --json lists all


def shown(text: str) -> str:
    """``text`` as one printable, markup-free line: control characters as
    ``\\n``/``\\xNN`` escapes, undecodable bytes (surrogate-escaped) as
    ``\\xNN``."""
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)
    return escape(text)


def _escape_char(ch: str) -> str:
    o = ord(ch)
    if ch in _SHOWN:
        return _SHOWN[ch]
    if 0xDC80 <= o <= 0xDCFF:  # os.fsdecode's stand-in for a byte that is not UTF-8
        return f"\\x{o - 0xDC00:02x}"
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def format_scan(res: ScanReport, code: int) -> str:
    """``patchtool l2 scan``'s report for people."""
    return capture(lambda con: _render_scan(con, res, code), soft_wrap=True)


def format_restore(res: RestoreResult, code: int) -> str:
    """``patchtool l2 restore``'s report for people."""
    return capture(lambda con: _render_restore(con, res, code), soft_wrap=True)


def _render_scan(con: Console, res: ScanReport, code: int) -> None:
    if isinstance(res, RedisScanReport) and res.redis is not None:
        _redis_head(con, res)
    else:
        con.print(f"tier        : {shown(res.dir)}")
        con.print(f"reader      : {shown(res.reader.detail)}")
        con.print(f"objects     : {res.objects} ({_size(res.bytes)}); skipped {res.tmp_files} tmp "
                  f"file(s), {res.subdirs} subdir(s); {res.foreign} foreign")
    if not res.sizes_read:
        con.print(f"sizes       : not read (--names-only): only {NEVER_READ} is judged; "
                  f"{UNPATCHED}, {SIZE_MISMATCH} and ambiguity need a scan without "
                  "--names-only")
    for p in res.expect_size_unmatched:
        con.print(f"[yellow]note[/]        : {EXPECT_OPTION} {shown(p)}={res.expect_size[p]} "
                  f"matched no set in {_tier_word(res)}")
    for s in res.sets:
        con.print(_set_line(s, res.sizes_read))
        for f in s.flagged:
            con.print(f"    [red]{_flag(f)}[/], e.g. {shown(f.example)}")
    for c, tot in res.flagged.items():
        if tot.objects:
            con.print(f"[red]{c:<13}[/]: {tot.objects} object(s), {_size(tot.bytes)}")
    _verify_lines(con, res)
    for s in res.sets:
        if s.ambiguous:
            con.print(_ambiguous_line(s))
    if res.foreign:
        more = f" (first {len(res.foreign_names)})" if res.foreign > len(res.foreign_names) else ""
        con.print(f"foreign{more:<5}: " + ", ".join(shown(n) for n in res.foreign_names))
    _quarantine_lines(con, res)
    _verdict(con, res, code)


def _tier_word(res: ScanReport) -> str:
    """How the lines name the tier: ``DIR`` for a directory."""
    return "the tier" if isinstance(res, RedisScanReport) else "DIR"


def _redis_head(con: Console, res: RedisScanReport) -> None:
    r = res.redis
    assert r is not None
    con.print(f"tier        : {shown(res.dir)} (Redis {shown(r.server)})")
    con.print(f"reader      : {shown(res.reader.detail)}")
    vanished = f"; {res.vanished} vanished while listed" if res.vanished else ""
    con.print(f"objects     : {res.objects} ({_size(res.bytes)}): {r.sealed} sealed "
              f"({r.seal_prefix}), {r.unsealed} unsealed; {r.quarantined} quarantined "
              f"({r.quarantine_prefix}); {res.foreign} foreign{vanished}")


def _verify_lines(con: Console, res: ScanReport) -> None:
    v = res.verify
    if v is None:
        return
    counts = ", ".join(f"{k} {n}" for k, n in sorted(v.verdicts.items())) or "none"
    con.print(f"verified    : {v.checked} object(s) read and checked ({counts})"
              + (f"; {shown(v.checked_with)}" if v.checked_with else ""))
    for name in v.corrupt_names[:CORRUPT_LISTED]:
        con.print(f"  [red]{CORRUPT}[/] {shown(name)}: {shown(v.details.get(name, ''))}")
    if len(v.corrupt_names) > CORRUPT_LISTED:
        con.print(f"  ... and {len(v.corrupt_names) - CORRUPT_LISTED} more (--json lists all)")


def _set_line(s: ObjectSet, sizes_read: bool) -> str:
    ns = shown(s.namespace) or "(plain)"
    unread = "" if s.readable else " [red](never read)[/]"
    sizes = ", ".join(f"{size} B x{n}" for size, n in s.sizes.items())
    sizes = f"; sizes {sizes}" if sizes_read else ""
    expected = f"; expected {s.expected_size} B ({s.expected_from})" if s.expected_size else ""
    return (f"  {shown(s.model)}  {ns}{unread}  kv_rank {s.kv_rank}  group {s.object_group}: "
            f"{s.objects} object(s), {_size(s.bytes)}{sizes}{expected}")


def _ambiguous_line(s: ObjectSet) -> str:
    """The one line an operator needs: which set, its sizes, and how to
    resolve it."""
    flagged = {f.size for f in s.flagged}
    sizes = ", ".join(f"{size} B x{n}" for size, n in s.sizes.items() if size not in flagged)
    arg = f"'{s.set}=SIZE'" if "'" not in s.set else f"{s.set}=SIZE"
    return (f"[yellow]ambiguous[/]   : {shown(s.model)} {shown(s.namespace) or '(plain)'} "
            f"kv_rank {s.kv_rank} group {s.object_group} holds {sizes}; the tier cannot tell "
            f"which size this reader writes, so none of these is flagged or moved: name it "
            f"with {EXPECT_OPTION} {shown(arg)}")


def _quarantine_lines(con: Console, res: ScanReport) -> None:
    q = res.quarantine
    if q is None:
        return
    if isinstance(q, RedisQuarantineResult):
        _redis_quarantine_lines(con, res, q)
        return
    how = " (finished an interrupted run)" if q.resumed else ""
    con.print(f"quarantine  : moved {q.moved} object(s), {_size(q.moved_bytes)}, to "
              f"{shown(q.dest)}{how}; journal {shown(q.journal)}")
    if q.refused:
        con.print(f"[yellow]refused[/]     : {q.refused} object(s) left in DIR: DEST "
                  f"already holds a file of that name "
                  f"({', '.join(shown(n) for n in q.refused_names[:5])})")
    fin = res.final
    if fin is not None and fin.flagged_objects:
        parts = ", ".join(f"{c} {t.objects}" for c, t in fin.flagged.items() if t.objects)
        example = next(iter(sorted(fin.examples.values())), "")
        con.print(f"[red]left in DIR[/] : {fin.flagged_objects} flagged object(s) after "
                  f"a re-scan ({parts}), e.g. {shown(example)}")


def _redis_quarantine_lines(con: Console, res: ScanReport, q: RedisQuarantineResult) -> None:
    con.print(f"quarantine  : moved {q.moved} object(s), {_size(q.moved_bytes)}: each key "
              f"renamed to {q.prefix}KEY in {shown(res.dir)} (undo: patchtool l2 restore "
              f"{shown(res.dir)} [KEY...])")
    if q.refused:
        con.print(f"[yellow]refused[/]     : {q.refused} object(s) left in the tier: a key "
                  f"{q.prefix}KEY already exists "
                  f"({', '.join(shown(n) for n in q.refused_names[:5])})")
    if q.changed or q.vanished:
        con.print(f"[yellow]not moved[/]   : {q.changed} object(s) written after they were "
                  f"judged, {q.vanished} gone: the re-scan judged what is there now")
    fin = res.final
    if fin is not None and fin.flagged_objects:
        parts = ", ".join(f"{c} {t.objects}" for c, t in fin.flagged.items() if t.objects)
        example = next(iter(sorted(fin.examples.values())), "")
        con.print(f"[red]left[/]        : {fin.flagged_objects} flagged object(s) in the tier "
                  f"after a re-scan ({parts}), e.g. {shown(example)}")


def _verdict(con: Console, res: ScanReport, code: int) -> None:
    fin = res.final
    if fin.flagged_objects:
        con.print(f"exit code {int(code)}: {fin.flagged_objects} flagged object(s) in "
                  f"{shown(res.dir)}")
    elif fin.ambiguous_sets:
        con.print(f"exit code {int(code)}: {fin.ambiguous_sets} ambiguous set(s) in "
                  f"{shown(res.dir)}, nothing flagged")
    elif res.sizes_read:
        where = "tier" if isinstance(res, RedisScanReport) else "DIR"
        con.print("nothing flagged" + (f" ({where} re-scanned)" if fin.rescanned else ""))
    else:
        con.print(f"nothing flagged by name ({UNPATCHED}, {SIZE_MISMATCH} and ambiguity not "
                  "judged: sizes not read)")


def _flag(f: Flag) -> str:
    if f.size is None:
        return f"{f.category}: {f.objects} object(s)"
    n = f"{f.objects} object(s) of {f.size} B"
    if f.category == UNPATCHED:
        return f"{f.category}: {n} = 1/{f.k} of {shown(f.namespace or '')}'s {f.reference_size} B"
    if f.category == SIZE_MISMATCH:
        if f.reference_size is None:
            return f"{f.category}: {n} (empty: no layout's size, a miss for every reader)"
        return f"{f.category}: {n}, expected {f.reference_size} B"
    if f.category == CORRUPT:
        return f"{f.category}: {n} whose checksum trailer does not match (not what was stored " \
               "under the name)"
    return f"{f.category}: {n}"


def _render_restore(con: Console, res: RestoreResult, code: int) -> None:
    if isinstance(res, RedisRestoreResult):
        _redis_restore(con, res, code)
        return
    con.print(f"quarantine  : {shown(res.dest)}; journal {shown(res.journal)}")
    how = " (finished an interrupted run)" if res.resumed else ""
    into = ", ".join(shown(d) for d in res.dirs) or "-"
    con.print(f"restored    : {res.restored} object(s), {_size(res.restored_bytes)}, into "
              f"{into}{how}")
    if res.kept:
        con.print(f"[yellow]kept aside[/]  : {res.kept} object(s) left in DEST: DIR holds an "
                  f"entry of that name (the server stored the key again, say), which stays: "
                  f"{', '.join(shown(n) for n in res.kept_names[:5])}")
    if res.untracked:
        con.print(f"untracked   : {res.untracked} object(s) in DEST that no quarantine moved "
                  "there: left alone")
    if code:
        con.print(f"exit code {int(code)}")


def _redis_restore(con: Console, res: RedisRestoreResult, code: int) -> None:
    con.print(f"tier        : {shown(res.dest)}")
    named = ", ".join(shown(n) for n in res.restored_names[:5])
    con.print(f"restored    : {res.restored} object(s), {_size(res.restored_bytes)}, renamed "
              f"back from lmcptq@KEY" + (f": {named}" if named else ""))
    if res.kept:
        con.print(f"[yellow]kept aside[/]  : {res.kept} object(s) left as lmcptq@KEY: a live key "
                  f"of that name exists (the server stored it again, say), which stays: "
                  f"{', '.join(shown(n) for n in res.kept_names[:5])}")
    if code:
        con.print(f"exit code {int(code)}")


def _size(n: int | None) -> str:
    if n is None:
        return "size not read"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
