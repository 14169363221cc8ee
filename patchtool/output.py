"""The one formatting layer: logic returns dataclasses, this renders them as
JSON (``--json``) or as rich tables for people.  rich is imported only on the
human path, so ``--json`` stays fast.

Formatters return strings (:func:`format_human`, :func:`capture` for the
``l2`` commands' :mod:`patchtool.l2.render`); the ``emit_*`` functions here
are the only places that write a result to stdout."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from .errors import Refusal


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def emit_json(kind: str, obj: Any, exit_code: int = 0) -> None:
    payload = {"command": kind, "exit_code": int(exit_code), "result": to_jsonable(obj)}
    sys.stdout.write(json.dumps(payload, indent=2) + "\n")


def refusal(exc: Refusal, as_json: bool) -> None:
    # Exactly one line on stderr, whatever the mode; JSON adds a stdout object.
    sys.stderr.write(f"patchtool: {exc.file}: {exc.reason}\n")
    if as_json:
        sys.stdout.write(json.dumps({"error": {"file": exc.file, "reason": exc.reason,
                                               "exit_code": int(exc.code)}}, indent=2) + "\n")


# The width of output that goes to a pipe or a log file: wide enough that no
# line is wrapped and no table cell is cut (rich assumes 80 columns there).
_UNWRAPPED = 100_000


def console():
    """A console for people: a terminal's width (COLUMNS if set); for a pipe
    or a log without COLUMNS, lines and table rows whole."""
    from rich.console import Console  # lazy: rich is for the human path only

    con = Console(highlight=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con = Console(highlight=False, width=_UNWRAPPED)
    return con


def capture(render: Callable[[Any], None], **options: Any) -> str:
    """What ``render(console)`` prints, as a string: a console of
    :func:`console`'s width that writes to memory, with the terminal's
    colours when stdout is one (and none for a pipe or under NO_COLOR)."""
    import io  # noqa: PLC0415 - lazy with rich: the human path only

    from rich.console import Console  # lazy: rich is for the human path only

    real = console()
    buf = io.StringIO()
    con = Console(file=buf, width=real.width, force_terminal=real.is_terminal,
                  color_system=real.color_system, highlight=False, **options)
    render(con)
    return buf.getvalue()


def format_human(kind: str, obj: Any, exit_code: int = 0) -> str:
    """People's form of a command's result (and its exit code when not 0)."""
    render = _RENDERERS[kind]

    def draw(con) -> None:
        render(con, obj)
        if exit_code:
            con.print(f"exit code {int(exit_code)}")

    return capture(draw)


def emit_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def emit_human(kind: str, obj: Any, exit_code: int = 0) -> None:
    emit_text(format_human(kind, obj, exit_code))


_STYLE = {"pristine": "yellow", "patched": "green", "drifted": "red", "missing": "red",
          "partial": "yellow", "patched-older-revision": "yellow", "applies": "cyan",
          "already-applied": "green", "conflict": "red", "ok": "green", "mismatch": "red"}


def _styled(word: str | None) -> str:
    if word is None:
        return ""
    style = _STYLE.get(word)
    return f"[{style}]{word}[/]" if style else word


def _plain(text: str) -> str:
    """Text shown as is: a note may hold brackets (``[vLLM]``) that rich
    would otherwise take for markup and drop."""
    from rich.markup import escape  # lazy: rich is for the human path only

    return escape(text)


def _table(*cols: str):
    from rich.table import Table  # lazy: rich is for the human path only

    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for c in cols:
        # fold, never an ellipsis: two paths that share a prefix must not print the same
        table.add_column(c, overflow="fold")
    return table


def _status_header(console, st) -> None:
    console.print(f"interpreter : {st.python or '-'} ({st.python_version or '-'})")
    console.print(f"site dir    : {st.site or ', '.join(st.site_dirs) or '-'}")
    if st.lmcache_version:
        console.print(f"lmcache     : {st.lmcache_version} (installer: {st.installer or '?'}, "
                      f"source: {st.install_source})")
    if st.vllm_version:
        console.print(f"vllm        : {st.vllm_version} (from its dist-info, not imported)")
    if st.patch_set:
        vllm = ", ".join(st.vllm_versions) or "-"
        console.print(f"patch set   : {st.patch_set} revision {st.revision} (vLLM verified: {vllm})")
    if len(st.sets) > 1:  # a stack: every set's own state, lowest first
        for s in st.sets:
            console.print(f"set         : {s.name} revision {s.revision}: {_styled(s.state)}")


def _render_status(console, st) -> None:
    _status_header(console, st)
    if st.recovered_files:
        console.print(f"[yellow]recovered an interrupted run: {st.recovered_files} file(s) "
                      "rolled back[/]")
    if st.files:
        t = _table("file", "state", "sha256 (RECORD form)", "RECORD row")
        for f in st.files:
            state = f.state + (f" ({f.step})" if f.step else "") + \
                (f" (rev {f.revision})" if f.revision is not None else "")
            t.add_row(f.path, _styled(f.state).replace(f.state, state), f.hash or "-",
                      _styled(f.record_row))
        console.print(t)
    if st.record is not None:
        scope = "all rows" if st.record.deep else "target rows (--deep: all rows)"
        console.print(f"RECORD      : {st.record.checked} checked, {st.record.mismatches} "
                      f"mismatched ({scope}; {st.record.rows} rows)")
    console.print(f"state       : [bold]{_styled(st.state)}[/] - {st.detail}")
    if st.disk_tier_keys:
        console.print(f"disk keys   : {st.disk_tier_keys}")
    if st.next_command:
        console.print(f"next        : [bold]{st.next_command}[/]")
    if st.leftover_state:
        lo = st.leftover_state
        console.print(f"[yellow]leftover[/]    : {lo.describe()} in {lo.dir}; apply or revert "
                      "removes them")
    for note in st.notes:
        console.print(f"[yellow]note[/]        : {_plain(note)}")


def _render_hunks(console, hunks) -> None:
    t = _table("patch", "file", "hunk", "line", "result", "detail")
    for fr in hunks:
        if not fr.hunks:
            t.add_row(fr.patch, fr.path, "-", "-", _styled(fr.status), "")
        for h in fr.hunks:
            t.add_row(fr.patch, fr.path, f"#{h.index} {h.header}", str(h.line),
                      _styled(h.status), h.detail)
    console.print(t)


def _render_apply(console, r) -> None:
    _render_hunks(console, r.hunks)
    files = ", ".join(r.changed_files) or "none"
    verb = {"applied": "applied", "dry-run": "would change", "no-op": "nothing to do"}[r.action]
    if len(r.sets) > 1:  # a stack, in one transaction: what each set changes
        for s in r.sets:
            console.print(f"set         : {s['name']} revision {s['revision']} through "
                          f"{s['through']}: {len(s['changed_files'])} file(s)")
    console.print(f"{r.patch_set} revision {r.revision} through {r.through} on lmcache "
                  f"{r.lmcache_version}: {verb} ({files})")
    if r.removed_pyc:
        console.print(f"{_removed(r.action)} {len(r.removed_pyc)} stale .pyc file(s)")
    _render_leftover(console, r)
    if r.state_after:
        console.print(f"state       : [bold]{_styled(r.state_after)}[/]")
    for note in r.notes:
        console.print(f"[yellow]note[/]        : {_plain(note)}")


def _removed(action: str) -> str:
    return "would remove" if action == "dry-run" else "removed"


def _render_leftover(console, r) -> None:
    if r.leftover_state:
        lo = r.leftover_state
        console.print(f"{_removed(r.action)} {lo.describe()} ({lo.dir})")


def _render_revert(console, r) -> None:
    if r.restored_files:
        verb = "would restore" if r.action == "dry-run" else "restored"
        console.print(f"lmcache {r.lmcache_version}: {verb} ({', '.join(r.restored_files)}) "
                      f"from {r.source}")
    else:
        console.print(f"lmcache {r.lmcache_version}: nothing to revert ({r.state_before})")
    if len(r.sets) + len(r.remaining) > 1 and r.action != "no-op":  # a stack
        left = ", ".join(r.remaining) or "none"
        console.print(f"sets        : peeled {', '.join(r.sets)}; still applied: {left}")
    _render_leftover(console, r)
    if r.state_after:
        console.print(f"state       : [bold]{_styled(r.state_after)}[/]")


def _render_verify(console, r) -> None:
    _render_status(console, r.status)
    t = _table("check", "result", "detail")
    words = {"pass": "[green]ok[/]", "fail": "[red]FAILED[/]", "error": "[red]ERROR[/]",
             "skipped": "[yellow]skipped[/]"}
    for c in r.checks:
        t.add_row(c.name, words[c.outcome], c.detail)
    if r.checks:
        console.print(t)
    console.print(f"verify      : [bold]{'OK' if r.ok else 'NOT OK'}[/] ({r.verdict})")


def _render_list(console, rows) -> None:
    t = _table("set", "lmcache", "revision", "state", "patches", "vLLM verified", "dir")
    for r in rows:
        name = r.set + (f" (on {', '.join(r.requires)})" if r.requires else "")
        t.add_row(name, r.lmcache_version, str(r.revision if r.revision is not None else "-"),
                  r.state, str(r.patches), ", ".join(r.vllm_versions) or "-", r.path)
    console.print(t)


def _render_manifest(console, r) -> None:
    console.print(f"wrote {r.path}: lmcache {r.lmcache_version}, {r.state}, revision "
                  f"{r.revision}, {r.patches} patch(es), {r.files} file(s)")


def _render_wheel(console, r) -> None:
    src = r.source
    console.print(f"source      : {src['filename']} (sha256 {src['sha256']}; verified by "
                  f"{src['verified_by']})")
    console.print(f"patch set   : {r.patch_set} revision {r.revision}, {len(r.files)} file(s) "
                  "patched")
    for w in r.warnings:
        console.print(f"[yellow]warning[/]     : {w}")
    console.print(f"wrote       : {r.path}")
    console.print(f"version     : {r.version}")
    console.print(f"sha256      : {r.sha256}")
    console.print(f"pin         : {r.requirement}")


_CI_STYLE = {"pass": "green", "warn": "yellow", "fail": "red", "error": "red",
             "skipped": "dim"}


def _render_ci(console, r) -> None:
    t = _table("phase", "result", "seconds", "detail")
    for p in r.phases:
        style = _CI_STYLE.get(p.result, "")
        code = f" (exit {p.exit_code})" if p.exit_code else ""
        t.add_row(p.phase, f"[{style}]{p.result}[/]{code}",
                  f"{p.seconds:.1f}" if p.result != "skipped" else "-", p.detail)
    console.print(t)
    for w in r.warnings:
        console.print(f"[yellow]warning[/]: {w}")
    if r.wheel:
        console.print(f"wheel       : {r.wheel.get('path') or r.wheel['filename']}")
        console.print(f"pin         : {r.wheel['requirement']}")
    if r.work_dir:
        console.print(f"work dir    : {r.work_dir}")
    ok = "[green]PASS[/]" if r.ok else "[red]FAIL[/]"
    why = "" if r.verdict == "pass" else f" ({r.verdict})"
    console.print(f"ci          : [bold]{ok}[/]{why} in {r.total_seconds:.1f} s")


_RENDERERS = {"status": _render_status, "apply": _render_apply, "revert": _render_revert,
              "verify": _render_verify, "list": _render_list, "manifest": _render_manifest,
              "wheel": _render_wheel, "ci": _render_ci}
