"""Strict, in-memory unified-diff applier on top of unidiff's parser.

Rules (README, "Guarantees": zero fuzz):

* a hunk applies only when its context and removed lines match the file
  byte-for-byte at exactly the line its header states: no offset search, no
  fuzz, no whitespace or line-ending normalisation;
* a file whose every hunk's post-image is present at its target position is
  "already-applied" (a no-op, not an error);
* ``\\ No newline at end of file`` is honoured on both sides and CRLF bytes
  are kept as they are, so the output is exact.

Only modifications of existing files are supported: the patch sets edit files
the wheel installed, and RECORD has a row for each of them.
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import PatchParseError

APPLIES = "applies"
ALREADY = "already-applied"
CONFLICT = "conflict"
MISSING = "missing"


@dataclass(frozen=True)
class Hunk:
    header: str
    source_start: int
    source_length: int
    target_start: int
    target_length: int
    old: tuple[bytes, ...]  # context + removed lines, with their line endings
    new: tuple[bytes, ...]  # context + added lines

    @property
    def source_pos(self) -> int:
        # "-s,0" means "insert after line s"; otherwise line s is 1-based.
        return self.source_start if self.source_length == 0 else self.source_start - 1

    @property
    def target_pos(self) -> int:
        return self.target_start if self.target_length == 0 else self.target_start - 1

    def reversed(self) -> "Hunk":
        return Hunk(self.header, self.target_start, self.target_length, self.source_start,
                    self.source_length, self.new, self.old)


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to site-packages, "/"-separated (after stripping a/ b/)
    hunks: tuple[Hunk, ...]

    def reversed(self) -> "FilePatch":
        return FilePatch(self.path, tuple(h.reversed() for h in self.hunks))


@dataclass(frozen=True)
class Patch:
    id: str  # file name without ".patch", e.g. "01-page-ratio"
    file: Path
    sha256: str  # hex, of the patch file's bytes
    files: tuple[FilePatch, ...]


@dataclass
class HunkResult:
    index: int  # 1-based within its file section
    header: str
    line: int  # the line the header names (1-based; 0 for an insert at the top)
    status: str  # applies | already-applied | conflict
    detail: str = ""


@dataclass
class FileResult:
    patch: str
    path: str
    status: str  # applies | already-applied | conflict | missing
    hunks: list[HunkResult] = field(default_factory=list)


def split_lines(data: bytes) -> list[bytes]:
    """Split after every b"\\n", keeping the terminators (and any b"\\r"), so
    ``b"".join(split_lines(d)) == d`` for every ``d``."""
    lines = data.split(b"\n")
    out = [line + b"\n" for line in lines[:-1]]
    if lines[-1]:
        out.append(lines[-1])  # a last line without a newline
    return out


def _strip_prefix(name: str, patch_file: Path) -> str:
    # patch -p1: drop the first component ("a/" or "b/").
    if "/" not in name:
        raise PatchParseError(patch_file, f"path {name!r} has no a/ or b/ prefix (expected -p1 paths)")
    rel = name.split("/", 1)[1]
    norm = posixpath.normpath(rel)
    if norm.startswith(("/", "../")) or norm == ".." or norm != rel:
        raise PatchParseError(patch_file, f"path {name!r} is not a plain path inside site-packages")
    return rel


def parse_patch(path: Path) -> Patch:
    """Parse one patch file; refuse anything but modifications of text files."""
    # lazy: status never parses a patch, and unidiff is its slowest import
    from unidiff import PatchSet
    from unidiff.errors import UnidiffParseError

    raw = path.read_bytes()
    # surrogateescape: any byte sequence round-trips to the same bytes.
    text = raw.decode("utf-8", "surrogateescape")
    try:
        parsed = PatchSet(text)
    except UnidiffParseError as exc:
        raise PatchParseError(path, f"not a valid unified diff: {exc}") from None
    if not parsed:
        raise PatchParseError(path, "contains no file diffs")
    files = []
    for pf in parsed:
        if pf.is_binary_file or pf.is_added_file or pf.is_removed_file or pf.is_rename:
            raise PatchParseError(path, f"{pf.path}: only modifications of existing text files "
                                  "are supported (no added, removed, renamed or binary files)")
        src = _strip_prefix(pf.source_file, path)
        dst = _strip_prefix(pf.target_file, path)
        if src != dst:
            raise PatchParseError(path, f"source {src!r} and target {dst!r} differ")
        files.append(FilePatch(src, tuple(_convert_hunk(h, path, src) for h in pf)))
    return Patch(path.name[: -len(".patch")] if path.name.endswith(".patch") else path.name,
                 path, hashlib.sha256(raw).hexdigest(), tuple(files))


def _convert_hunk(h, patch_file: Path, rel: str) -> Hunk:
    old: list[bytes] = []
    new: list[bytes] = []
    last: tuple[list[bytes], ...] = ()
    for line in h:
        kind = line.line_type
        value = line.value.encode("utf-8", "surrogateescape")
        if kind == " ":
            old.append(value)
            new.append(value)
            last = (old, new)
        elif kind == "-":
            old.append(value)
            last = (old,)
        elif kind == "+":
            new.append(value)
            last = (new,)
        elif kind == "\\":
            # "\ No newline at end of file" refers to the line just before it.
            for side in last:
                if side[-1].endswith(b"\n"):
                    side[-1] = side[-1][:-1]
        # unidiff's LINE_TYPE_EMPTY (blank lines after a hunk) is not content.
    header = f"@@ -{h.source_start},{h.source_length} +{h.target_start},{h.target_length} @@"
    if len(old) != h.source_length or len(new) != h.target_length:
        raise PatchParseError(patch_file, f"{rel} {header}: body does not match header counts")
    return Hunk(header, h.source_start, h.source_length, h.target_start, h.target_length,
                tuple(old), tuple(new))


def _mismatch(lines: list[bytes], pos: int, block: tuple[bytes, ...]) -> str | None:
    """None if ``block`` sits at ``pos``; else a description of the first difference."""
    if pos < 0 or pos + len(block) > len(lines):
        return f"file has {len(lines)} lines; hunk needs lines {pos + 1}-{pos + len(block)}"
    for i, expected in enumerate(block):
        found = lines[pos + i]
        if found != expected:
            return f"line {pos + i + 1}: expected {_show(expected)}, found {_show(found)}"
    return None


def _show(b: bytes) -> str:
    s = repr(b)[1:]
    return s if len(s) <= 72 else s[:69] + "..."


def apply_file(patch_id: str, fp: FilePatch, data: bytes) -> tuple[bytes, FileResult]:
    """Apply one file section to ``data``.  Returns the new bytes (``data``
    itself when already applied or in conflict) and the per-hunk result."""
    lines = split_lines(data)
    forward = [_mismatch(lines, h.source_pos, h.old) for h in fp.hunks]
    backward = [_mismatch(lines, h.target_pos, h.new) for h in fp.hunks]
    ordered = all(a.source_pos + len(a.old) <= b.source_pos for a, b in zip(fp.hunks, fp.hunks[1:]))

    # When both images are present (a pure insertion whose context reads the
    # same before and after), "already applied" wins: applying would insert
    # the lines a second time.  Installs are hash-gated anyway.
    if all(m is None for m in backward):
        status = ALREADY
    elif ordered and all(m is None for m in forward):
        status = APPLIES
    else:
        status = CONFLICT

    results = []
    for i, (h, fwd, bwd) in enumerate(zip(fp.hunks, forward, backward), start=1):
        # In a conflict, say for each hunk what it alone would do: that is
        # what a person needs to see which part of the file drifted.
        if status != CONFLICT:
            st, detail = status, ""
        elif fwd is None:
            st, detail = (APPLIES, "") if ordered else (CONFLICT, "hunks overlap or are out of order")
        elif bwd is None:
            st, detail = ALREADY, ""
        else:
            st, detail = CONFLICT, fwd
        results.append(HunkResult(i, h.header, h.source_start, st, detail))
    result = FileResult(patch_id, fp.path, status, results)
    if status != APPLIES:
        return data, result
    out = list(lines)
    for h in reversed(fp.hunks):  # back to front, so earlier positions stay valid
        out[h.source_pos: h.source_pos + len(h.old)] = list(h.new)
    return b"".join(out), result


@dataclass
class SeriesResult:
    files: dict[str, bytes | None]  # path -> bytes after the series (None: missing)
    results: list[FileResult]

    @property
    def ok(self) -> bool:
        return all(r.status in (APPLIES, ALREADY) for r in self.results)

    @property
    def changed(self) -> bool:
        return any(r.status == APPLIES for r in self.results)


def apply_series(patches: list[Patch], read: Callable[[str], bytes | None]) -> SeriesResult:
    """Apply ``patches`` in order, in memory; a file touched by several
    patches sees the previous patches' output.  ``read`` returns a file's
    current bytes or None when it does not exist."""
    current: dict[str, bytes | None] = {}
    results = []
    for patch in patches:
        for fp in patch.files:
            if fp.path not in current:
                current[fp.path] = read(fp.path)
            data = current[fp.path]
            if data is None:
                results.append(FileResult(patch.id, fp.path, MISSING))
                continue
            new, res = apply_file(patch.id, fp, data)
            current[fp.path] = new
            results.append(res)
    return SeriesResult(current, results)


def unapply_series(patches: list[Patch], read: Callable[[str], bytes | None]) -> SeriesResult:
    """Reverse ``patches`` (last first): used by revert when the saved
    originals are gone; the caller checks the result against the manifest."""
    rev = [Patch(p.id, p.file, p.sha256, tuple(fp.reversed() for fp in p.files))
           for p in reversed(patches)]
    return apply_series(rev, read)
