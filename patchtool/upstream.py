"""Which of this project's upstream proposals an installed LMCache already
contains (``patchtool status``: "fixed upstream").

A proposal (``upstream/NNNN-*.patch``, a ``git format-patch`` file against
LMCache's source) fixes upstream what one of this project's patch parts fixes
in a released wheel; ``upstream/parts.json`` names that part. When a later
LMCache release ships the proposal, its installed files contain every code
hunk's post-image (context and added lines, in order, contiguous), and status
says so, naming the part.

The check is exact on purpose: a release that fixes the bug differently is
not recognised (status then says nothing about that part, rather than claim
a fix it cannot see). Pure reading: the installed files through
:class:`~patchtool.fsio.Reader`, nothing imported, no patch parser
(``unidiff`` is the slowest import and status never parses a patch series).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import Refusal
from .fsio import Reader
from .resources import upstream_root

PARTS_FILE = "parts.json"
_PROPOSAL = re.compile(r"^\d{4}-.+\.patch$")
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_SUBJECT = re.compile(r"^Subject: (?:\[PATCH[^\]]*\]\s*)?(.*(?:\n [^\n]*)*)", re.MULTILINE)


@dataclass(frozen=True)
class Hunk:
    path: str
    post_image: tuple[str, ...]  # the lines the hunk leaves in the file, in order


@dataclass(frozen=True)
class Proposal:
    name: str  # file stem, e.g. "0003-vllm034-scheduler-output"
    subject: str
    parts: tuple[str, ...]  # this project's parts it corresponds to ("hybrid-fa/15-...")
    hunks: tuple[Hunk, ...]  # code hunks only (tests/ files are new upstream files)

    def as_dict(self) -> dict:
        return {"proposal": self.name, "subject": self.subject, "parts": list(self.parts)}


def parse_hunks(text: str, origin: Path) -> tuple[Hunk, ...]:
    """The post-images of a unified diff's hunks, counted by their headers (so
    a format-patch signature line ``-- `` after the last hunk is never read
    as a removed line)."""
    hunks: list[Hunk] = []
    lines = text.splitlines()
    path: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            target = line[4:].split("\t")[0]
            path = None if target == "/dev/null" else target.removeprefix("b/")
        m = _HUNK.match(line)
        if m is None:
            i += 1
            continue
        if path is None:
            raise Refusal(origin, f"line {i + 1}: a hunk before any '+++' file header")
        old_left = int(m.group(1) or 1)
        new_left = int(m.group(2) or 1)
        post: list[str] = []
        i += 1
        while old_left > 0 or new_left > 0:
            if i >= len(lines):
                raise Refusal(origin, f"hunk for {path} ends early (line {i})")
            body = lines[i]
            i += 1
            if body.startswith("\\"):  # "\ No newline at end of file"
                continue
            tag, content = body[:1], body[1:]
            if tag in (" ", ""):
                post.append(content)
                old_left -= 1
                new_left -= 1
            elif tag == "+":
                post.append(content)
                new_left -= 1
            elif tag == "-":
                old_left -= 1
            else:
                raise Refusal(origin, f"line {i}: not a hunk line in {path}")
        hunks.append(Hunk(path, tuple(post)))
    return tuple(hunks)


def subject_of(text: str) -> str:
    """A format-patch's ``Subject:``, unfolded, without the ``[PATCH]`` tag ("" if none)."""
    m = _SUBJECT.search(text)
    return " ".join(s.strip() for s in m.group(1).splitlines()) if m else ""


def load(root: Path | None = None) -> list[Proposal]:
    """Every proposal under ``root`` (default: the shipped ``upstream/``), in
    file order; none when the folder is absent."""
    root = upstream_root() if root is None else root
    if not root.is_dir():
        return []
    parts_file = root / PARTS_FILE
    try:
        parts = json.loads(parts_file.read_text()) if parts_file.is_file() else {}
    except (OSError, ValueError) as exc:
        raise Refusal(parts_file, f"is not readable JSON ({exc})") from None
    out = []
    for path in sorted(p for p in root.iterdir() if _PROPOSAL.match(p.name)):
        text = path.read_text()
        code = tuple(h for h in parse_hunks(text, path) if not h.path.startswith("tests/"))
        out.append(Proposal(path.stem, subject_of(text), tuple(parts.get(path.stem, ())), code))
    return out


def _contains(haystack: list[str], needle: tuple[str, ...]) -> bool:
    if not needle:
        return True
    first, n = needle[0], len(needle)
    return any(haystack[i:i + n] == list(needle)
               for i, line in enumerate(haystack[:len(haystack) - n + 1]) if line == first)


def contained(proposal: Proposal, site: Path, reader: Reader) -> bool:
    """Whether every code hunk's post-image is in the installed file."""
    if not proposal.hunks:
        return False
    files: dict[str, list[str] | None] = {}
    for hunk in proposal.hunks:
        if hunk.path not in files:
            data = reader.read(site / hunk.path)
            files[hunk.path] = None if data is None else data.decode("utf-8", "replace").splitlines()
        lines = files[hunk.path]
        if lines is None or not _contains(lines, hunk.post_image):
            return False
    return True


def fixed_upstream(site: Path, reader: Reader, proposals: list[Proposal] | None = None) -> list[Proposal]:
    """The proposals the install at ``site`` already contains."""
    return [p for p in (load() if proposals is None else proposals) if contained(p, site, reader)]


def note(lmcache_version: str | None, proposal: Proposal) -> str:
    parts = ", ".join(proposal.parts) or "no part of this project"
    return (f"lmcache {lmcache_version or '?'} contains this project's upstream proposal "
            f"{proposal.name} ({proposal.subject}): what {parts} fixes is fixed upstream "
            "in this release")
