"""``patchtool manifest build``: write a patch set's ``manifest.json`` from the
real wheel (never by hand).

Pre-images come from the wheel (each member checked against the wheel's own
RECORD), post-images and the hash after every step from applying the series
prefix by prefix with this tool's applier.  Options not given are kept from
an existing manifest, so a rebuild with no options reproduces it exactly.

A stacked set (``requires``, given or kept) is built over its required sets:
each is applied to the wheel first (checked against its own manifest), and
this series' pre-images are the result, so a file a required set edits has
that set's post-image as its pre-image.

The manifest record itself (reading, checking, finding a set) is
:mod:`patchtool.manifest`; this module only authors it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from . import __version__
from .applier import APPLIES, Patch, apply_series, parse_patch
from .distinfo import Wheel
from .errors import Refusal
from .manifest import (MANIFEST_NAME, STATE_FIXED_UPSTREAM, STATE_PATCH, FileEntry, FileHash,
                       Manifest, PatchEntry, PatchSetDir, PreviousRevision, check_gate_modes,
                       load_manifest, sha256_file)
from .stack import apply_layers, l2_format as stack_l2_format, requirements


@dataclass
class Settings:
    """What the manifest says besides its series: the options given, each
    one not given kept from the existing manifest (or its default)."""

    revision: int = 1
    vllm_versions: list[str] = field(default_factory=list)
    upstream: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)
    gate_transfer_modes: list[str] = field(default_factory=list)
    l2_format: int | None = None
    fixed_upstream: str | None = None  # the reason, for a version that needs no patch


@dataclass
class BuildSummary:
    """What ``manifest build`` prints."""

    path: str
    lmcache_version: str
    state: str
    revision: int
    patches: int
    files: int
    manifest: dict


def build_manifest(directory: Path, wheel: Path, *, revision: int | None = None,
                   vllm_versions: list[str] | None = None, upstream: list[str] | None = None,
                   fixed_upstream: str | None = None, notes: list[str] | None = None,
                   l2_format: int | None = None, requires: list[str] | None = None,
                   gate_transfer_modes: list[str] | None = None,
                   write: bool = True) -> Manifest:
    """Generate (and by default write) ``directory/manifest.json`` for the
    series in ``directory`` and the upstream ``wheel``.  Refusals come in
    the order the checks are listed here, before anything is written."""
    directory, wheel = Path(directory), Path(wheel)
    version = _wheel_version(wheel)
    existing = _existing(directory)
    given = Settings(revision, vllm_versions, upstream, notes, requires, gate_transfer_modes,
                     l2_format, fixed_upstream)
    settings = _settle(directory, existing, given)
    lower = _required_layers(directory, settings.requires)
    settings = _settle_l2_format(existing, settings, lower)
    if version != directory.name:
        raise Refusal(wheel, f"is lmcache {version}, but the patch set directory is for "
                      f"{directory.name}")
    common = dict(
        patch_set=directory.parent.name, lmcache_version=version, revision=settings.revision,
        requires=list(settings.requires), gate_transfer_modes=list(settings.gate_transfer_modes),
        vllm_versions=list(settings.vllm_versions), upstream=list(settings.upstream),
        notes=list(settings.notes), l2_format=settings.l2_format, tool_version=__version__,
        wheel={"filename": wheel.name, "sha256": sha256_file(wheel)},
        previous_revisions=_previous_revisions(directory, existing, settings.revision))
    patch_paths = sorted(directory.glob("*.patch"))
    if settings.fixed_upstream is not None:
        if patch_paths:
            raise Refusal(patch_paths[0], "a fixed-upstream patch set must not contain patches")
        manifest = Manifest(state=STATE_FIXED_UPSTREAM, reason=settings.fixed_upstream, **common)
    else:
        manifest = _series_manifest(directory, wheel, patch_paths, lower, settings.requires,
                                    common)
    if write:
        _write(directory, manifest)
    return manifest


def summary(directory: Path, m: Manifest) -> BuildSummary:
    return BuildSummary(str(Path(directory) / MANIFEST_NAME), m.lmcache_version, m.state,
                        m.revision, len(m.patches), len(m.files), m.to_json())


# ---------------------------------------------------------------- the steps


def _wheel_version(wheel: Path) -> str:
    with Wheel.open(wheel) as whl:  # refuses a missing file, a non-wheel, another project
        return whl.version


def _existing(directory: Path) -> Manifest | None:
    path = directory / MANIFEST_NAME
    return load_manifest(path) if path.exists() else None


def _settle(directory: Path, existing: Manifest | None, given: Settings) -> Settings:
    """``given`` with every option not given kept from ``existing`` (the
    disk-tier key format is settled once the required sets are known)."""
    keep = Settings() if existing is None else Settings(
        existing.revision, existing.vllm_versions, existing.upstream, existing.notes,
        existing.requires, existing.gate_transfer_modes, existing.l2_format,
        existing.reason if existing.state == STATE_FIXED_UPSTREAM else None)
    out = replace(given, **{name: getattr(keep, name) for name in
                            ("revision", "vllm_versions", "upstream", "notes", "requires",
                             "gate_transfer_modes", "fixed_upstream")
                            if getattr(given, name) is None})
    out.gate_transfer_modes = check_gate_modes(list(out.gate_transfer_modes), directory)
    return out


def _required_layers(directory: Path, requires: list[str]) -> list[PatchSetDir]:
    """The required sets' stack, lowest first, read from the same patches
    root (``<root>/<required set>/<version>/``)."""
    if not requires:
        return []
    if directory.parent.name in requires:
        raise Refusal(directory, f"{directory.parent.name} cannot require itself")
    return requirements(directory.parent.parent, directory.name, list(requires),
                        _seen=(directory.parent.name,))


def _settle_l2_format(existing: Manifest | None, settings: Settings,
                      lower: list[PatchSetDir]) -> Settings:
    """A new stacked set writes its base's disk-tier keys unless told otherwise."""
    if settings.l2_format is not None:
        return settings
    fmt = existing.l2_format if existing else (stack_l2_format(lower) if lower else None)
    return replace(settings, l2_format=fmt)


def _previous_revisions(directory: Path, existing: Manifest | None,
                        revision: int) -> list[PreviousRevision]:
    """The superseded revisions to keep.  A bump keeps the one it supersedes
    with its post-images: an install patched with it is then
    ``patched-older-revision``, not ``drifted``."""
    if existing is None:
        return []
    if revision < existing.revision:
        raise Refusal(directory / MANIFEST_NAME, f"has revision {existing.revision}; "
                      f"refusing to build an older revision {revision}")
    previous = list(existing.previous_revisions)
    if revision > existing.revision and existing.state == STATE_PATCH:
        previous.insert(0, PreviousRevision(
            existing.revision, {p.file: p.sha256 for p in existing.patches},
            {k: v.post for k, v in existing.files.items()}))
    return previous


def _series_manifest(directory: Path, wheel: Path, patch_paths: list[Path],
                     lower: list[PatchSetDir], requires: list[str], common: dict) -> Manifest:
    if not patch_paths:
        raise Refusal(directory, "contains no *.patch files (use --fixed-upstream REASON "
                      "for a version that needs none)")
    patches = [parse_patch(p) for p in patch_paths]
    onto = f"{', '.join(requires)} applied to the wheel" if lower else "the pristine wheel"
    with Wheel.open(wheel) as whl:
        read = _pre_images(whl, wheel, lower)
        pristine, steps = _step_hashes(patches, read, onto)
    files = {path: FileEntry(pristine[path], list(steps[path].values())[-1], steps[path])
             for path in sorted(steps)}
    return Manifest(
        state=STATE_PATCH,
        patches=[PatchEntry(p.id, p.file.name, p.sha256, tuple(fp.path for fp in p.files))
                 for p in patches],
        files=files, **common)


def _pre_images(whl: Wheel, wheel: Path,
                lower: list[PatchSetDir]) -> Callable[[str], bytes | None]:
    """How the series' input is read: the wheel's members as its own RECORD
    vouches for them, and for a stacked set the required sets' post-images."""

    def wheel_read(path: str) -> bytes | None:
        return whl.member(path) if whl.has(path) else None

    below: dict[str, bytes] = {}
    if lower:
        below = apply_layers(lower, wheel_read, lambda layer, path, why: Refusal(
            wheel, f"{path}: {why} (building over required set {layer.name})"))

    def read(path: str) -> bytes | None:
        return below[path] if path in below else wheel_read(path)

    return read


def _step_hashes(patches: list[Patch], read: Callable[[str], bytes | None], onto: str
                 ) -> tuple[dict[str, FileHash], dict[str, dict[str, FileHash]]]:
    """Per file, its pre-image and its hash after each patch that touches it:
    the series is applied prefix by prefix, each prefix in series order."""
    pristine: dict[str, FileHash] = {}
    steps: dict[str, dict[str, FileHash]] = {}
    for i, patch in enumerate(patches):
        result = apply_series(patches[: i + 1], read)
        bad = [r for r in result.results if r.status != APPLIES]
        if bad:
            r = bad[0]
            hunk = next((h for h in r.hunks if h.status != APPLIES), None)
            why = f"{r.path}: {r.status}" + (f" at {hunk.header}: {hunk.detail}" if hunk else "")
            raise Refusal(patches[[p.id for p in patches].index(r.patch)].file,
                          f"does not apply to {onto} in series order ({why})")
        for fp in patch.files:
            data = result.files[fp.path]
            assert data is not None
            steps.setdefault(fp.path, {})[patch.id] = FileHash.of(data)
            if fp.path not in pristine:
                pristine[fp.path] = FileHash.of(read(fp.path) or b"")
    return pristine, steps


def _write(directory: Path, manifest: Manifest) -> None:
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(manifest.dumps(), encoding="utf-8")
    os.replace(tmp, directory / MANIFEST_NAME)
