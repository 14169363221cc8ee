"""Pre-release LMCache builds (``0.5.7rc2``): the one-line note ``status`` adds.

A patch set for a pre-release is matched like any other: by the exact version
string, then by the sha256 pins of every file it touches.  So an rc install is
never served a final's series (or the reverse) by its version alone; the note
tells the operator that the set is bound to that one build.  Stdlib only
(``status --json`` runs without this tool's dependencies, so no ``packaging``).
"""

from __future__ import annotations

import re

# PEP 440 pre-release and development segments: 1.0a1, 1.0b2, 1.0rc1, 1.0.dev3
# (also the spellings 1.0-rc1, 1.0.rc1 that pip normalises).
_PRE = re.compile(r"^\s*v?\d+(\.\d+)*[-_.]?(a|alpha|b|beta|c|rc|pre|preview|dev)\d*", re.IGNORECASE)

PRERELEASE_NOTE = (
    "lmcache {version} is a pre-release: this set is pinned to that build's files (sha256) and "
    "applies to no other build, the final release included; move with the release's own set"
)


def is_prerelease(version: str | None) -> bool:
    """Whether ``version`` is a PEP 440 pre-release or development version."""
    return bool(version and _PRE.match(version.split("+", 1)[0]))


def prerelease_note(version: str | None) -> str | None:
    """The note for a pre-release install, else None."""
    return PRERELEASE_NOTE.format(version=version) if is_prerelease(version) else None
