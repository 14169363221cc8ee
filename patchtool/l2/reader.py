"""Which disk-tier names an install looks up (the *reader* an ``l2`` scan
judges a tier for), and what that install *is*, so that a killed quarantine
is resumed only for the same target however its path was typed.

The reader comes from a classified install (``patchtool status``'s
:class:`~patchtool.classify.Status`) or from ``--assume``.  Only states whose
keys are known are answered; the state names compared here are the public
ones (docs/reference.md, "States")."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import fsio
from ..errors import NotInstalled, Refusal
from ..exitcodes import ExitCode
from .names import SetKey

# Installs that write LMCache's own (plain) names.
_PLAIN_STATES = ("pristine", "unsupported-version", "fixed-upstream")
# Installs that may write either: refused, the tool will not guess.
_UNKNOWN_STATES = ("patched-older-revision", "partially-patched", "drifted")
_HINT = "pass --assume pristine|kvlN to scan without a target"


@dataclass(frozen=True)
class TierReader:
    """Which names an install looks up: plain names always, and
    ``+kvl<F>-*`` names when ``layout_format`` is F."""

    layout_format: int | None
    source: str  # "assume" or "install"
    detail: str  # for people; never compared (a path in it is spelled as typed)
    # What the reader is, for the journal: ``{"assume": "kvl1"}``, or the
    # install's resolved site dir, dist-info and hashes (:func:`reader_for`).
    identity: dict[str, Any] = field(default_factory=dict, compare=False)

    def reads(self, key: SetKey) -> bool:
        return key.layout_format is None or key.layout_format == self.layout_format


def parse_assume(value: str) -> TierReader:
    """``--assume pristine`` or ``--assume kvlN``."""
    if value == "pristine":
        return TierReader(None, "assume", "--assume pristine: reads plain names only",
                          {"assume": value})
    if value.startswith("kvl") and value[3:].isdigit() and int(value[3:]) > 0:
        n = int(value[3:])
        return TierReader(n, "assume", f"--assume {value}: reads plain names and +kvl{n}-* "
                          "names", {"assume": f"kvl{n}"})
    raise Refusal("--assume", f"{value!r} is neither 'pristine' nor 'kvlN' (N >= 1)",
                  ExitCode.USAGE)


def reader_for(st, l2_format: int | None) -> TierReader:
    """What a classified install reads.

    Pristine installs (and versions this tool has no series for, or that need
    none) write plain names, and so does a current-revision patched install
    whose manifest has no ``l2_format``.  An older revision, a partial series
    or drifted files may write either."""
    what = f"lmcache {st.lmcache_version} ({st.site})"
    if st.state == "not-installed":
        where = st.python or (st.site_dirs[0] if st.site_dirs else "?")
        raise NotInstalled(where, f"lmcache is not installed (searched: "
                           f"{', '.join(st.site_dirs)}); {_HINT}")
    if st.state in _UNKNOWN_STATES:
        raise Refusal(st.dist_info, f"install is {st.state}: which disk-tier names it reads is "
                      f"not known (apply the current revision, or {_HINT})")
    if st.state in _PLAIN_STATES:
        fmt, detail = None, f"{st.state} {what}: reads plain names only"
    else:
        assert st.state == "patched", st.state
        series = f"{st.patch_set} revision {st.revision}"
        fmt = l2_format
        detail = (f"{what} patched with {series}, which writes pristine keys only: reads "
                  "plain names only" if fmt is None else
                  f"{what} patched with {series}: reads plain names and +kvl{fmt}-* names")
    return TierReader(fmt, "install", detail, install_identity(st, fmt))


def install_identity(st, layout_format: int | None) -> dict[str, Any]:
    """The install as it is, not as its path was typed: the resolved site
    dir, the dist-info, the sha256 of its RECORD and of the hashes of the
    files the patch set covers, its state and series, and the names it reads.
    Another copy of the same wheel is another target (another site dir)."""
    record = fsio.read_file(Path(st.dist_info) / "RECORD")
    files = sorted([f.path, f.hash] for f in st.files)
    return {"site": os.path.realpath(st.site), "dist_info": os.path.basename(st.dist_info),
            "record_sha256": None if record is None else hashlib.sha256(record).hexdigest(),
            "files_sha256": hashlib.sha256(json.dumps(files).encode()).hexdigest(),
            "lmcache_version": st.lmcache_version, "state": str(st.state),
            "patch_set": st.patch_set, "revision": st.revision, "layout_format": layout_format}
