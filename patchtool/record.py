"""dist-info RECORD: parse, hash, verify and rewrite rows.

RECORD is CSV; each row is ``path,<algo>=<urlsafe-b64, no padding>,size``.
Installers disagree on the row terminator: pip (and every wheel built by
Python's csv writer) writes CRLF, uv writes LF, and a hand-made file may lack
the final newline.  :class:`Record` is the one owner of that format here: it
keeps each row's original bytes, so a rewrite changes only the rows it
replaces (rendered in that row's own line ending, with CSV quoting), and a
revert that puts the old rows back gives the exact original file.

A RECORD that is not UTF-8 or not valid CSV is refused (one line, naming the
file), never a traceback.
"""

from __future__ import annotations

import base64
import csv
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from .errors import Refusal

CRLF = "\r\n"
LF = "\n"
# The terminator given to rows of a RECORD that has no line end at all (one
# row, no final newline): Python's csv default, as in every wheel's RECORD.
_DEFAULT_NEWLINE = CRLF
# Characters that make a field need quotes (RFC 4180, csv.QUOTE_MINIMAL).
_NEEDS_QUOTES = frozenset(',"\r\n')


def record_hash(data: bytes) -> str:
    """The RECORD form of a sha256: ``sha256=`` + urlsafe base64, '=' stripped."""
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def file_record_hash(path: Path) -> tuple[str, int]:
    data = path.read_bytes()
    return record_hash(data), len(data)


@dataclass(frozen=True)
class RecordRow:
    path: str
    hash: str  # "" for RECORD's own row (and .pyc rows other installers add)
    size: str  # kept as text: "" is legal and must survive a rewrite


class RecordRowMissing(Refusal, KeyError):
    """``Record.with_rows`` was asked to replace a row the RECORD lacks.  A
    refusal (one line naming the RECORD); also a ``KeyError`` for callers of
    the old ``replace_rows``."""

    __str__ = Exception.__str__  # not KeyError's repr()-quoting

    def __init__(self, where: object, path: str) -> None:
        super().__init__(where, f"has no row for {path}")
        self.path = path


def _field(text: str) -> str:
    if any(c in _NEEDS_QUOTES for c in text):
        return '"' + text.replace('"', '""') + '"'
    return text


def render_row(row: RecordRow, newline: str) -> bytes:
    """One row as CSV (minimal quoting, like ``csv.writer``), ``newline``-terminated.
    The only place RECORD rows are rendered."""
    return (",".join(_field(f) for f in (row.path, row.hash, row.size)) + newline).encode("utf-8")


@dataclass(frozen=True)
class _Line:
    raw: bytes  # the line as it is in the file, terminator included (if it has one)
    row: RecordRow | None  # None for a blank line (kept, never a row)

    @property
    def terminator(self) -> str:
        return CRLF if self.raw.endswith(b"\r\n") else LF if self.raw.endswith(b"\n") else ""


class Record:
    """A parsed RECORD that renders back to its exact bytes.

    ``newline`` is the file's line ending (that of its first line); it is
    used for rows that are inserted.  Replaced rows keep the terminator of the
    row they replace (so a missing final newline stays missing).
    """

    __slots__ = ("_lines", "_index", "newline", "where")

    def __init__(self, lines: Sequence[_Line], newline: str, where: object = "RECORD") -> None:
        self._lines = tuple(lines)
        self._index: dict[str, RecordRow] = {}
        for ln in self._lines:
            if ln.row is not None:
                self._index.setdefault(ln.row.path, ln.row)
        self.newline = newline
        self.where = where

    # ---------------------------------------------------------------- reading

    @classmethod
    def parse(cls, data: bytes, where: object = "RECORD") -> "Record":
        """Parse RECORD bytes; ``where`` (a path) names the file in refusals."""
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            raise Refusal(where, f"not UTF-8 (byte 0x{data[exc.start]:02x} on line {line}); "
                          "a RECORD must be UTF-8 CSV") from None
        lines: list[_Line] = []
        start = 0
        line_no = 1
        while start < len(data):
            # A logical row ends at the first newline outside quotes: there
            # the number of '"' so far is even ('""' escapes come in pairs).
            end = start
            while True:
                nl = data.find(b"\n", end)
                if nl < 0:
                    end = len(data)
                    break
                end = nl + 1
                if data.count(b'"', start, end) % 2 == 0:
                    break
            raw = data[start:end]
            if data.count(b'"', start, end) % 2:
                raise Refusal(where, f"not valid CSV: unterminated quoted field on line {line_no}")
            lines.append(_Line(raw, _parse_row(raw, where, line_no)))
            line_no += raw.count(b"\n")
            start = end
        first = next((ln.terminator for ln in lines if ln.terminator), "")
        return cls(lines, first or _DEFAULT_NEWLINE, where)

    @classmethod
    def read(cls, path: Path, read: Callable[[Path], bytes | None] | None = None) -> "Record":
        """Read and parse the RECORD file at ``path`` (through ``read``, a
        :class:`~patchtool.fsio.Reader`'s, default :func:`fsio.read_file`);
        a missing file and any OS error are refusals."""
        from .fsio import read_file  # the one owner of OS errors on reads

        data = (read or read_file)(Path(path))
        if data is None:
            raise Refusal(path, "missing: without RECORD the install cannot be checked "
                          "or kept consistent")
        return cls.parse(data, path)

    @classmethod
    def from_rows(cls, rows: Iterable[RecordRow], newline: str = _DEFAULT_NEWLINE,
                  where: object = "RECORD") -> "Record":
        """A new RECORD of ``rows``, every row ``newline``-terminated."""
        return cls([_Line(render_row(r, newline), r) for r in rows], newline, where)

    # ---------------------------------------------------------------- queries

    @property
    def rows(self) -> list[RecordRow]:
        """The rows in file order (blank lines skipped)."""
        return [ln.row for ln in self._lines if ln.row is not None]

    def row(self, path: str) -> RecordRow | None:
        """The (first) row for ``path``, or None."""
        return self._index.get(path)

    def __contains__(self, path: object) -> bool:
        return path in self._index

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def final_newline(self) -> bool:
        return not self._lines or bool(self._lines[-1].terminator)

    # ---------------------------------------------------------------- editing

    def with_rows(self, new_rows: Mapping[str, RecordRow], *,
                  insert_before: Mapping[str, Sequence[RecordRow]] | None = None) -> "Record":
        """A copy with the rows of ``new_rows``' keys (current paths) replaced by
        their values (which may rename the path), and the rows of
        ``insert_before[path]`` inserted, in order, before ``path``'s row.
        Every other line keeps its exact bytes and place.  A key that has no
        row is refused (:class:`RecordRowMissing`): the tool only rewrites
        rows of files the wheel installed."""
        insert_before = insert_before or {}
        for path in sorted(set(new_rows) | set(insert_before)):
            if path not in self:
                raise RecordRowMissing(self.where, path)
        out: list[_Line] = []
        for ln in self._lines:
            row = ln.row
            if row is None:
                out.append(ln)
                continue
            for extra in insert_before.get(row.path, ()):
                out.append(_Line(render_row(extra, self.newline), extra))
            new = new_rows.get(row.path)
            if new is None or new == row:
                out.append(ln)  # untouched (or unchanged): the original bytes
            else:
                out.append(_Line(render_row(new, ln.terminator), new))
        return Record(out, self.newline, self.where)

    def render(self) -> bytes:
        return b"".join(ln.raw for ln in self._lines)


def _parse_row(raw: bytes, where: object, line_no: int) -> RecordRow | None:
    text = raw.decode("utf-8")
    body = text[:-2] if text.endswith(CRLF) else text[:-1] if text.endswith(LF) else text
    if not body:
        return None
    try:
        parsed = list(csv.reader([body], strict=True))
    except csv.Error as exc:
        raise Refusal(where, f"not valid CSV on line {line_no} ({exc})") from None
    if len(parsed) != 1:
        raise Refusal(where, f"not valid CSV on line {line_no} (a bare carriage return)")
    fields = (parsed[0] + ["", ""])[:3]
    return RecordRow(*fields)


# ---------------------------------------------------------------- old API
# Thin wrappers kept while callers move to Record.


def parse_record(data: bytes, where: object = "RECORD") -> list[RecordRow]:
    return Record.parse(data, where).rows


def render_record(rows: list[RecordRow], newline: str = _DEFAULT_NEWLINE) -> bytes:
    return Record.from_rows(rows, newline).render()


def replace_rows(data: bytes, new_rows: dict[str, RecordRow], where: object = "RECORD") -> bytes:
    """RECORD bytes with the rows for ``new_rows`` keys replaced, every other
    row byte-identical and in place.  A path without a row raises
    :class:`RecordRowMissing` (a Refusal and a KeyError)."""
    return Record.parse(data, where).with_rows(new_rows).render()


# ---------------------------------------------------------------- verifying


@dataclass
class RowCheck:
    path: str
    status: str  # "ok" | "mismatch" | "missing" | "unreadable" | "unhashed"
    expected: str = ""
    actual: str = ""


def check_row(site: Path, row: RecordRow) -> RowCheck:
    """Verify one row against the file on disk (relative to the site dir)."""
    if not row.hash:
        return RowCheck(row.path, "unhashed")
    expected = f"{row.hash},{row.size}"
    target = site / row.path
    try:
        data = target.read_bytes()
    except FileNotFoundError:
        return RowCheck(row.path, "missing", expected)
    except OSError as exc:
        return RowCheck(row.path, "unreadable", expected, exc.strerror or str(exc))
    actual_hash = record_hash(data) if row.hash.startswith("sha256=") else _other_hash(row.hash, data)
    ok = actual_hash == row.hash and (row.size == "" or _size(row.size) == len(data))
    return RowCheck(row.path, "ok" if ok else "mismatch", expected, f"{actual_hash},{len(data)}")


def _size(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _other_hash(spec: str, data: bytes) -> str:
    # RECORD may name any hashlib.algorithms_guaranteed algorithm; LMCache's
    # wheels only use sha256 but a reinstall by another installer might not.
    algo = spec.split("=", 1)[0]
    if algo not in hashlib.algorithms_guaranteed:
        return f"{algo}=<unsupported algorithm>"
    digest = hashlib.new(algo, data).digest()
    return algo + "=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def check_rows(site: Path, rows: "Record | Iterable[RecordRow]") -> list[RowCheck]:
    rows = rows.rows if isinstance(rows, Record) else rows
    return [check_row(site, r) for r in rows]
