"""dist-info RECORD: parse, hash, verify and rewrite rows.

RECORD is CSV with CRLF row terminators (Python's csv writer default, as in
all LMCache wheels); each row is ``path,sha256=<urlsafe-b64, no padding>,size``.
Rewriting keeps every untouched row byte-identical and in its original order
so that a revert can give back the exact original file.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path


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


def parse_record(data: bytes) -> list[RecordRow]:
    # newline="" so csv sees the CRLFs itself (the documented way to read CSV).
    reader = csv.reader(io.StringIO(data.decode("utf-8"), newline=""))
    rows = []
    for fields in reader:
        if not fields:
            continue
        fields = (fields + ["", ""])[:3]
        rows.append(RecordRow(*fields))
    return rows


def render_record(rows: list[RecordRow]) -> bytes:
    out = io.StringIO(newline="")
    writer = csv.writer(out, lineterminator="\r\n")
    for row in rows:
        writer.writerow([row.path, row.hash, row.size])
    return out.getvalue().encode("utf-8")


def replace_rows(data: bytes, new_rows: dict[str, RecordRow]) -> bytes:
    """Return RECORD bytes with the rows for ``new_rows`` keys replaced, every
    other row unchanged and in place.  Raises KeyError if a path is absent:
    the tool only patches files the wheel installed."""
    rows = parse_record(data)
    present = {r.path for r in rows}
    missing = sorted(set(new_rows) - present)
    if missing:
        raise KeyError(missing[0])
    return render_record([new_rows.get(r.path, r) for r in rows])


@dataclass
class RowCheck:
    path: str
    status: str  # "ok" | "mismatch" | "missing" | "unhashed"
    expected: str = ""
    actual: str = ""


def check_row(site: Path, row: RecordRow) -> RowCheck:
    """Verify one row against the file on disk (relative to the site dir)."""
    if not row.hash:
        return RowCheck(row.path, "unhashed")
    target = site / row.path
    try:
        data = target.read_bytes()
    except FileNotFoundError:
        return RowCheck(row.path, "missing", f"{row.hash},{row.size}")
    actual_hash = record_hash(data) if row.hash.startswith("sha256=") else _other_hash(row.hash, data)
    ok = actual_hash == row.hash and (row.size == "" or int(row.size) == len(data))
    return RowCheck(row.path, "ok" if ok else "mismatch", f"{row.hash},{row.size}",
                    f"{actual_hash},{len(data)}")


def _other_hash(spec: str, data: bytes) -> str:
    # RECORD may name any hashlib.algorithms_guaranteed algorithm; LMCache's
    # wheels only use sha256 but a reinstall by another installer might not.
    algo = spec.split("=", 1)[0]
    digest = hashlib.new(algo, data).digest()
    return algo + "=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def check_rows(site: Path, rows: list[RecordRow]) -> list[RowCheck]:
    return [check_row(site, r) for r in rows]
