"""Stacked patch sets: resolve a set's prerequisites into an ordered stack,
and see an install through each layer of it.

A manifest may declare ``requires: ["hybrid-fa"]``.  Its pre-images are
then the required sets' post-images (for the files they edit; the wheel's
for the rest), so the series applies only on top of them.  A *stack* is the
list of layers, lowest first, that ends with the selected set.

Classifying an install against a stack is classifying it against each
layer's manifest through a *view*: a file a higher layer has moved past its
own pre-image is, for every lower layer, at that lower layer's post-image
(its bytes are no longer the lower layer's to judge), and a file a lower
layer has not finished is, for a higher layer, at that higher layer's
pre-image (the higher layer has not started on it).  The layers' states then
say whether the stack is consistent: every layer below the highest applied
one must be fully patched, or the install is *half-stacked* and refused.

Pure reading: nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .applier import APPLIES, apply_series
from .errors import Refusal
from .states import F_DRIFTED, F_MISSING, F_PATCHED, State
from .fsio import read_file
from .manifest import (MANIFEST_NAME, STATE_PATCH, FileHash, Manifest, PatchSetDir, catalog,
                       load_manifest, open_patch_set)


# ---------------------------------------------------------------- resolving


def requirements(root: Path, version: str, names: list[str], *,
                 _seen: tuple[str, ...] = ()) -> list[PatchSetDir]:
    """The layers ``names`` stand for, with their own requirements first,
    each once, lowest first.  A missing requirement or a cycle is refused."""
    out: list[PatchSetDir] = []
    for name in names:
        if name in _seen:
            raise Refusal(root / name / version / MANIFEST_NAME,
                          f"requires itself through {' -> '.join(_seen + (name,))}")
        d = root / name / version
        if not (d / MANIFEST_NAME).exists():
            who = _seen[-1] if _seen else "the stack"
            raise Refusal(d / MANIFEST_NAME, f"missing: {who} requires patch set {name}, "
                          f"which has no lmcache {version} series")
        layer = open_patch_set(d)
        for dep in requirements(root, version, layer.manifest.requires,
                                _seen=_seen + (name,)) + [layer]:
            if all(p.name != dep.name for p in out):
                out.append(dep)
    return out


def resolve(root: Path, top: PatchSetDir) -> list[PatchSetDir]:
    """``top``'s stack, lowest layer first, ``top`` last; refuses a stacked
    manifest whose pre-images are not its requirements' post-images (it was
    built over another revision of them)."""
    layers = requirements(root, top.version, top.manifest.requires, _seen=(top.name,)) + [top]
    check_links(layers)
    return layers


def check_links(layers: list[PatchSetDir]) -> None:
    for i, layer in enumerate(layers):
        for path, entry in layer.manifest.files.items():
            below = lower_layer(layers, i, path)
            if below is None:
                continue
            want = post(below.manifest, path)
            if entry.pre != want:
                raise Refusal(layer.path / MANIFEST_NAME, f"{path}: its pre-image {entry.pre.hash} "
                              f"is not {below.name} revision {below.manifest.revision}'s "
                              f"post-image {want.hash}; rebuild it with `patchtool manifest "
                              "build` over the shipped requirement")


def lower_layer(layers: list[PatchSetDir], i: int, path: str) -> PatchSetDir | None:
    """The highest layer below ``i`` that edits ``path``."""
    return next((layers[j] for j in range(i - 1, -1, -1) if path in layers[j].manifest.files),
                None)


def post(m: Manifest, path: str) -> FileHash:
    return m.hash_after(path, len(m.patches))


def wheel_pre(layers: list[PatchSetDir], path: str) -> FileHash:
    """The wheel's hash of ``path``: the pre-image of the lowest layer editing it."""
    first = next(p for p in layers if path in p.manifest.files)
    return first.manifest.hash_after(path, 0)


def all_files(layers: list[PatchSetDir]) -> list[str]:
    """Every path the stack edits, in layer order, each once."""
    out: list[str] = []
    for layer in layers:
        out += [p for p in layer.manifest.files if p not in out]
    return out


def local_segments(layers: list[PatchSetDir]) -> list[tuple[str, int]]:
    """(set name, revision) per patching layer, lowest first: what a patched
    wheel's local version names."""
    return [(p.name, p.manifest.revision) for p in layers if p.manifest.state == STATE_PATCH]


# ---------------------------------------------------------------- applying in memory


def apply_layers(layers: list[PatchSetDir], read: Callable[[str], bytes | None],
                 refuse: Callable[[PatchSetDir, str, str], Refusal] | None = None
                 ) -> dict[str, bytes]:
    """The bytes of every file the stack edits after applying each layer's
    whole series, in order, to what ``read`` returns (the wheel's members).
    Each layer's input must be its pre-image and its output its post-image;
    otherwise ``refuse(layer, path, reason)`` is raised."""
    def default(layer: PatchSetDir, path: str, reason: str) -> Refusal:
        return Refusal(layer.path / MANIFEST_NAME, f"{path}: {reason}")

    refuse = refuse or default
    cur: dict[str, bytes] = {}

    def rd(p: str) -> bytes | None:
        return cur[p] if p in cur else read(p)

    for layer in layers:
        m = layer.manifest
        if m.state != STATE_PATCH:
            continue
        for path in m.files:
            data, pre = rd(path), m.hash_after(path, 0)
            if data is None:
                raise refuse(layer, path, "is missing")
            if FileHash.of(data) != pre:
                got = FileHash.of(data)
                raise refuse(layer, path, f"has {got.hash} (size {got.size}), not {layer.name}'s "
                             f"pre-image {pre.hash} (size {pre.size})")
        series = apply_series(layer.load_patches(), rd)
        bad = [r for r in series.results if r.status != APPLIES]
        if bad:
            raise refuse(layer, bad[0].path, f"{bad[0].patch}: {bad[0].status}")
        for path in m.files:
            out = series.files.get(path)
            if out is None or FileHash.of(out) != post(m, path):
                raise refuse(layer, path, f"applying {layer.name} does not give its post-image "
                             f"{post(m, path).hash}")
            cur[path] = out
    return cur


# ---------------------------------------------------------------- views


def _steps(m: Manifest, path: str, h: FileHash) -> set[int]:
    return {k for k in range(len(m.patches) + 1) if m.hash_after(path, k) == h}


def _older(m: Manifest, path: str, h: FileHash) -> bool:
    return any(prev.files.get(path) == h for prev in m.previous_revisions)


def view(layers: list[PatchSetDir], i: int, path: str, h: FileHash) -> FileHash:
    """The hash layer ``i`` judges ``path`` by, when the file's hash is ``h``."""
    m = layers[i].manifest
    for upper in layers[len(layers) - 1:i:-1]:
        um = upper.manifest
        if path in um.files and (any(k > 0 for k in _steps(um, path, h)) or _older(um, path, h)):
            return post(m, path)  # a higher layer has moved on: this one is done with it
    if _steps(m, path, h) or _older(m, path, h):
        return h
    for lower in layers[:i]:
        lm = lower.manifest
        if path in lm.files and (_steps(lm, path, h) or _older(lm, path, h)):
            return m.hash_after(path, 0)  # a lower layer is not done: this one has not started
    return h


def views(layers: list[PatchSetDir], actual: dict[str, FileHash | None]
          ) -> list[dict[str, FileHash]]:
    """Per layer, ``{path: hash to judge by}`` for each present file it edits."""
    out: list[dict[str, FileHash]] = []
    for i, layer in enumerate(layers):
        out.append({p: view(layers, i, p, actual[p]) for p in layer.manifest.files
                    if actual.get(p) is not None})
    return out


# ---------------------------------------------------------------- layer states


@dataclass
class SetState:
    """One layer of the stack as ``status`` reports it."""

    name: str
    revision: int
    state: str
    detail: str
    applied_through: str | None = None
    requires: list[str] | None = None


def half_stacked(layers: list[PatchSetDir], statuses: list) -> tuple[str, str] | None:
    """(file, reason) when the layers' states are not a consistent stack:
    a drifted file (named with what it should have been), or a layer applied
    over one that is not fully patched.  None when consistent."""
    for i in range(len(statuses) - 1, -1, -1):  # the highest layer that sees it drifted
        bad = next((f for f in statuses[i].files if f.state in (F_DRIFTED, F_MISSING)), None)
        if bad is None:
            continue
        if bad.state == F_MISSING:
            return bad.path, "is missing"
        images = [f"the wheel's file ({wheel_pre(layers, bad.path).hash})"] + [
            f"{p.name}'s post-image ({post(p.manifest, bad.path).hash})"
            for p in layers if bad.path in p.manifest.files]
        return bad.path, (f"has sha256 {bad.hash} (size {bad.size}), which is none of "
                          f"{', '.join(images)}, nor a step between them: drifted")
    applied = [i for i, st in enumerate(statuses) if st.state != State.PRISTINE]
    if not applied:
        return None
    top = max(applied)
    for i in range(top):
        st = statuses[i]
        if st.state == State.PATCHED or layers[i].manifest.state != STATE_PATCH:
            continue
        f = next((f for f in st.files if f.state != F_PATCHED), None)
        where = f.path if f is not None else layers[i].name
        return where, (f"{layers[i].name} is {st.state} ({f.state if f else '-'} here) under "
                       f"{layers[top].name}, which requires it patched and is {statuses[top].state}: "
                       "half-stacked install; revert, or reinstall the upstream wheel")
    return None


def l2_format(layers: list[PatchSetDir]) -> int | None:
    """The disk-tier key format the stack's build writes: the highest layer
    that declares one (a stacked set that says nothing keeps its base's)."""
    return next((p.manifest.l2_format for p in reversed(layers)
                 if p.manifest.l2_format is not None), None)


def for_install(root: Path, pset: PatchSetDir | None, recorded: list[str],
                site: Path | None = None) -> list[PatchSetDir]:
    """The layers to classify an install by: ``pset``'s stack, extended by
    the sets the install records above it (state or provenance), so that a
    lower set is judged knowing what was stacked on it.  With no record (the
    state was deleted), by a set stacked on ``pset`` whose series has visibly
    been applied to ``site``."""
    if pset is None:
        return []
    layers = resolve(root, pset)
    names = [p.name for p in layers]
    if not recorded and site is not None:
        above = _applied_above(root, layers, site)
        if above is not None:
            recorded = [p.name for p in above]
    if len(recorded) > len(layers) and recorded[:len(layers)] == names:
        try:
            d = root / recorded[-1] / pset.version
            ext = resolve(root, open_patch_set(d)) if (d / MANIFEST_NAME).exists() else None
        except Refusal:
            ext = None  # a recorded set no longer shipped: judge by what is
        if ext is not None and [p.name for p in ext[:len(layers)]] == names:
            layers = ext
    return layers


def _applied_above(root: Path, layers: list[PatchSetDir], site: Path
                   ) -> list[PatchSetDir] | None:
    """The stack of a set requiring ``layers``' top one, when one of its
    files holds a step of its series (not its pre-image); else None."""
    top = layers[-1]
    for name, version, d in catalog(root):
        if version != top.version or name == top.name or not (d / MANIFEST_NAME).exists():
            continue
        try:
            if top.name not in load_manifest(d / MANIFEST_NAME).requires:
                continue
            stack = resolve(root, open_patch_set(d))
        except Refusal:
            continue  # a broken candidate is not evidence of anything
        m = stack[-1].manifest
        for path in m.files:
            data = read_file(site / path)
            if data is not None and any(k > 0 for k in _steps(m, path, FileHash.of(data))):
                return stack
    return None
