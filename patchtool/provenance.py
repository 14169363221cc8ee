"""What a wheel built by ``patchtool wheel`` says about itself: its PEP 440
local version (``0.5.3+hybridfa.r3.enginedriven.r2``: every set of the stack
and its revision, lowest first) and the provenance file in its dist-info.

``status`` reads both to tell an install of a patched wheel (patched at build
time: apply and revert do not act on it) from one patched in place, so this
module stays light: the wheel builder (:mod:`patchtool.wheelbuild`) writes
what is read here.
"""

from __future__ import annotations

import re
from pathlib import Path

from .distinfo import read_json
from .errors import Refusal
from .exitcodes import ExitCode
from .target import Target

PROVENANCE_FILE = "lmcache_patchtool.json"
PROVENANCE_SCHEMA = "lmcache-patchtool/wheel-provenance/v1"
# The local version this tool writes: "<set, alphanumerics only>.r<revision>" per
# set of the stack, lowest first ("hybridfa.r3.enginedriven.r2").
_SEGMENT = r"[a-z0-9]+\.r[0-9]+"
_LOCAL = re.compile(rf"^(?P<public>[^+]+)\+(?P<local>{_SEGMENT}(?:\.{_SEGMENT})*)$")
_PAIR = re.compile(r"([a-z0-9]+)\.r([0-9]+)")


def set_tag(set_name: str) -> str:
    """``hybrid-fa`` -> ``hybridfa``: a set's name in a local version ([a-z0-9])."""
    return re.sub(r"[^a-z0-9]", "", set_name.lower())


def local_tag(set_name: str, revision: int) -> str:
    """``hybrid-fa``, 1 -> ``hybridfa.r1`` (PEP 440 local segments: [a-z0-9])."""
    return set_tag(set_name) + f".r{revision}"


def stack_tag(segments: list[tuple[str, int]]) -> str:
    """[(``hybrid-fa``, 3), (``engine-driven``, 2)] -> ``hybridfa.r3.enginedriven.r2``:
    every set of the stack and its revision, lowest first (PEP 440 local
    segments, so pip and uv compare and install it like any local version)."""
    return ".".join(local_tag(name, rev) for name, rev in segments)


def split_stack(version: str) -> tuple[str, list[tuple[str, int]]]:
    """``0.5.3+hybridfa.r3.enginedriven.r2`` -> (``0.5.3``, [(``hybridfa``, 3),
    (``enginedriven``, 2)]); a version without this tool's tag -> (version, [])."""
    m = _LOCAL.match(version)
    if not m:
        return version, []
    return m["public"], [(t, int(r)) for t, r in _PAIR.findall(m["local"])]


def split_local(version: str) -> tuple[str, str | None, int | None]:
    """``0.5.3+hybridfa.r1`` -> (``0.5.3``, ``hybridfa``, 1); for a stack, the
    top set's tag and revision; a version without this tool's local tag ->
    (version, None, None)."""
    public, segments = split_stack(version)
    if not segments:
        return version, None, None
    return public, segments[-1][0], segments[-1][1]


def pinned_set(root: Path, pin: str, version: str, set_name: str | None) -> tuple[str, str | None]:
    """The upstream version and the patch set a pin names.  A pin of a wheel
    this tool built (``0.5.3+hybridfa.r3.enginedriven.r2``) names its top set
    by the last local segment's tag; ``--set`` (``set_name``) must then agree.
    Any other version: (version, ``set_name``).  The revisions in the pin are
    not checked here: callers compare the built wheel's version with it."""
    public, segments = split_stack(version)
    if not segments:
        return version, set_name
    tag = segments[-1][0]
    names = sorted(d.name for d in root.iterdir() if d.is_dir() and set_tag(d.name) == tag) \
        if root.is_dir() else []
    if len(names) != 1:
        raise Refusal(pin, f"names the patch set tag {tag!r}, which this patchtool does not ship"
                      if not names else f"names the patch set tag {tag!r}, which matches "
                      f"{', '.join(names)}")
    if set_name is not None and set_name != names[0]:
        raise Refusal(pin, f"pins a build of patch set {names[0]}, but --set names {set_name}",
                      ExitCode.USAGE)
    return public, names[0]


def read_provenance(dist_info: Path) -> dict | None:
    """The provenance file of an installed patched wheel, or None."""
    return read_json(Path(dist_info) / PROVENANCE_FILE)


def wheel_build_info(target: Target) -> dict | None:
    """An install of a patched wheel: its provenance file, or (without one)
    what its local version says; None for any other install."""
    prov = read_provenance(target.dist_info)
    public, tag, rev = split_local(target.version)
    if prov is not None:
        return prov
    if tag is not None:
        return {"version": target.version, "lmcache_version": public, "revision": rev}
    return None
