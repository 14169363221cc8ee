"""Decide what apply and revert would write: pure functions over a reader.

:func:`plan_apply` and :func:`plan_revert` read the install only through a
:class:`~patchtool.fsio.Reader` and return a :class:`Plan`: every change the
command would commit (target files, RECORD, the saved originals, state.json,
stale bytecode) and every refusal.  ``--dry-run`` shows the plan; the real
command commits that same plan (:mod:`patchtool.operations`), so the two cannot
disagree.  Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import __version__
from . import classify as C
from . import stack as S
from .applier import ALREADY, APPLIES, FileResult, Patch, apply_series, unapply_series
from .errors import Refusal, TargetStateRefusal
from .exitcodes import ExitCode
from .states import F_DRIFTED, F_MISSING, State
from .fsio import Reader
from .manifest import STATE_PATCH, FileHash, PatchSetDir
from .record import Record, RecordRow
from .state import (LAYER_ORIGINALS, ORIGINALS, STATE_FILE, InstallState, LayerState, Leftover,
                    SavedFile, find_leftover, refuse_links)
from .target import Target
from .transaction import Change


@dataclass
class ApplyResult:
    action: str  # applied | no-op | dry-run
    patch_set: str
    lmcache_version: str
    revision: int
    through: str  # id of the last patch of the applied series prefix
    state_before: str
    changed_files: list[str] = field(default_factory=list)
    hunks: list[FileResult] = field(default_factory=list)
    removed_pyc: list[str] = field(default_factory=list)
    state_after: str | None = None
    # Per set of the stack, lowest first: {name, revision, through,
    # changed_files} (one entry for an unstacked set).
    sets: list[dict] = field(default_factory=list)
    # Another version's state (or saved files no record names) removed in the
    # same transaction (a dry run: that would be).
    leftover_state: Leftover | None = None
    # What the operator must know about the disk tier once this build serves
    # (the same note `status` prints for a patched install).
    notes: list[str] = field(default_factory=list)


@dataclass
class RevertResult:
    action: str  # reverted | no-op | dry-run
    lmcache_version: str
    source: str  # saved originals | reverse patch | none
    state_before: str
    restored_files: list[str] = field(default_factory=list)
    removed_pyc: list[str] = field(default_factory=list)
    state_after: str | None = None
    # The sets peeled, top first, and those left applied (lowest first).
    sets: list[str] = field(default_factory=list)
    remaining: list[str] = field(default_factory=list)
    # As ApplyResult.leftover_state.
    leftover_state: Leftover | None = None


@dataclass
class Plan:
    """What a command would do.  ``changes`` is empty when there is nothing to
    do or when ``refusals`` is not empty; the first refusal is the one the
    command reports."""

    result: ApplyResult | RevertResult
    changes: list[Change] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)

    def refuse(self, r: Refusal) -> "Plan":
        self.refusals.append(r)
        self.changes = []
        return self

    def raise_first(self) -> None:
        if self.refusals:
            raise self.refusals[0]


def load_state(target: Target, reader: Reader) -> InstallState | None:
    path = target.state_dir / STATE_FILE
    data = reader.read(path)
    return None if data is None else InstallState.parse(data, path)


def refuse_state(status: C.Status, target: Target) -> None:
    """Raise the refusal for a state apply cannot act on."""
    if status.problem is not None:  # a drifted or half-stacked stack (patchtool.stack)
        raise TargetStateRefusal(target.site / status.problem["file"],
                                 f"{status.problem['reason']}; refusing to patch",
                                 ExitCode.DRIFTED)
    if status.state == State.UNSUPPORTED:
        raise TargetStateRefusal(target.dist_info, status.detail + " (see `patchtool list`)",
                                 ExitCode.UNSUPPORTED_VERSION)
    if status.state == State.FIXED_UPSTREAM:
        raise TargetStateRefusal(target.dist_info, f"lmcache {target.version} needs no patch: "
                                 f"{status.detail}", ExitCode.FIXED_UPSTREAM)
    if status.state == State.DRIFTED:
        bad = next((f for f in status.files if f.state in (F_DRIFTED, F_MISSING)), None)
        if bad is None:
            raise TargetStateRefusal(target.dist_info, status.detail + "; revert first",
                                     ExitCode.DRIFTED)
        what = ("is missing" if bad.state == F_MISSING else
                f"has sha256 {bad.hash} (size {bad.size}), which is neither the wheel's "
                f"pristine file ({bad.pristine_hash}) nor a patched state")
        raise TargetStateRefusal(target.site / bad.path, f"{what}; refusing to patch a drifted "
                                 f"file (reinstall lmcache=={target.version} or undo local edits)",
                                 ExitCode.DRIFTED)


def _select(pset: PatchSetDir, patch_id: str | None) -> int:
    ids = pset.manifest.step_ids()
    if patch_id is None:
        return len(ids)
    for i, pid in enumerate(ids, start=1):
        fname = pset.manifest.patches[i - 1].file
        if patch_id in (pid, fname) or pid.split("-", 1)[0] == patch_id:
            return i
    raise Refusal(patch_id, f"no such patch in {pset.name}/{pset.version} (have: {', '.join(ids)})")


def _original(target: Target, pset: PatchSetDir, state: LayerState | None, path: str,
              current: bytes, patches: list[Patch], reader: Reader) -> bytes | None:
    """Pristine bytes of ``path``: the saved copy, the file itself, or (state
    lost) the file with the series reversed; each checked against the manifest."""
    pre = pset.manifest.hash_after(path, 0)
    candidates = []
    if state and path in state.files:
        candidates.append(reader.read(target.state_dir / state.files[path].original))
    candidates.append(current)
    for data in candidates:
        if data is not None and FileHash.of(data) == pre:
            return data
    for k in range(len(patches), 0, -1):  # the file may be at any step
        rev = unapply_series(patches[:k], lambda p: current if p == path else None)
        data = rev.files.get(path)
        if rev.ok and data is not None and FileHash.of(data) == pre:
            return data
    return None


def _stale_pyc(target: Target, paths: list[str], reader: Reader) -> list[Change]:
    """Deletions of ``__pycache__/<module>.*.pyc`` of each touched module:
    hash-based pycs (PEP 552) and same-second, same-size edits would otherwise
    run the old code.  They go into the same transaction as the files."""
    out = []
    for rel in paths:
        src = target.site / rel
        if src.suffix == ".py":
            out += [Change(p, None) for p in reader.pycs(src)]
    return out


def _links(target: Target, paths: list[str], reader: Reader) -> list[Refusal]:
    """A target reached through a symbolic link would be replaced by a regular
    file (the link's other side left as it was): refuse, naming the link."""
    out = []
    for rel in paths:
        link = reader.link_on(target.site, rel)
        if link is not None:
            out.append(Refusal(link, f"is a symbolic link (on the path of {rel}); patchtool "
                               "edits only regular files inside site-packages: install lmcache "
                               "without links, or patch the link's target install"))
    return out


def _series_table(target: Target, pset: PatchSetDir, state: LayerState | None,
                  patches: list[Patch], all_patches: list[Patch],
                  current: dict[str, bytes | None], reader: Reader):
    """The per-hunk table, and the bytes after the series.  A file already at
    step ``s`` is shown from its pristine bytes, with patches up to ``s``
    marked already-applied: checked against the final file, an earlier
    patch's hunks sit where a later patch moved them and would read as
    conflicts."""
    m = pset.manifest
    at_step: dict[str, int] = {}
    inputs: dict[str, bytes | None] = dict(current)
    for path, data in current.items():
        if data is None:
            continue
        have = FileHash.of(data)
        steps = [j for j in range(1, len(patches) + 1) if m.hash_after(path, j) == have]
        if steps and m.hash_after(path, 0) != have:
            pristine = _original(target, pset, state, path, data, all_patches, reader)
            if pristine is not None:
                at_step[path], inputs[path] = max(steps), pristine
    table = apply_series(patches, lambda p: inputs.get(p))
    ids = [p.id for p in patches]
    for fr in table.results:
        if fr.path in at_step and ids.index(fr.patch) < at_step[fr.path] \
                and fr.status == APPLIES:
            fr.status = ALREADY
            for h in fr.hunks:
                h.status = ALREADY
    return table


class Overlay(Reader):
    """The install as it will be once the changes planned so far are
    committed: how a stacked layer is planned on top of the layers below it,
    in memory, before one transaction writes them all."""

    def __init__(self, base: Reader) -> None:
        self.base = base
        self.pending: dict = {}  # Path -> bytes | None

    def read(self, path):
        return self.pending[path] if path in self.pending else self.base.read(path)

    def link_on(self, base, rel):
        return self.base.link_on(base, rel)

    def pycs(self, module):
        return self.base.pycs(module)

    def entries(self, root):
        return self.base.entries(root)


def _own_statuses(assessed: C.Assessment, stack: list[PatchSetDir], layers: list[PatchSetDir],
                  discovery, reader: Reader) -> list[C.Status]:
    """Each layer of ``stack``'s own status, which planning applies it from.

    The assessment's, when it judged exactly this stack.  Applying a layer
    in memory does not change what the layers above it see: a file a lower
    layer has not finished is, through a higher layer's view, at that layer's
    pre-image, and so it is once the lower layer is done.  With sets applied
    above the selected one (``layers`` longer than ``stack``), each layer is
    judged by ``stack`` alone, as the selected set sees it."""
    if len(layers) == 1:
        return [assessed.status]
    if len(stack) == len(layers):
        return assessed.layers
    assert assessed.record is not None
    return C.layer_statuses(discovery, stack, reader, assessed.record)


@dataclass
class _Layer:
    """What applying one layer changes, in memory."""

    new_bytes: dict[str, bytes]
    entry: LayerState | None  # the layer's state record after the apply
    originals: list[Change]  # pre-images to save
    hunks: list[FileResult]


def _plan_layer(target: Target, layers: list[PatchSetDir], i: int, status: C.Status,
                reader: Reader, record: Record, saved_layer: LayerState | None, *, k: int,
                patch_id: str | None, accept_record_mismatch: bool,
                plan: Plan) -> _Layer | None:
    """Layer ``i`` of the stack applied through patch ``k`` over ``reader``
    (``record``: RECORD as the layers below leave it); None when it refused
    (the refusal is on ``plan``)."""
    pset = layers[i]
    m = pset.manifest
    state = saved_layer
    try:
        refuse_state(status, target)
    except Refusal as r:
        plan.refuse(r)
        return None
    if status.state == State.PARTIAL and status.applied_through is not None:
        done = m.step_ids().index(status.applied_through) + 1
        if done > k:
            plan.refuse(Refusal(target.dist_info, f"already patched up to "
                                f"{status.applied_through}, beyond {patch_id}; revert first"))
            return None
    if status.state == State.PATCHED and k < len(m.patches):
        plan.refuse(Refusal(target.dist_info, f"already patched with the whole series, "
                            f"beyond {patch_id}; revert first"))
        return None
    if i < len(layers) - 1 and status.state == State.PATCHED:
        # A lower layer already patched: a file a higher layer also edits holds
        # that layer's bytes, which this layer's series must not be run on.
        return _Layer({}, state, [], [])
    all_patches = pset.load_patches()  # parsed once for the table, the originals and the apply
    patches = all_patches[:k]
    current = {p: reader.read(target.site / p) for p in m.files}
    table = _series_table(target, pset, state, patches, all_patches, current, reader)

    new_bytes: dict[str, bytes] = {}
    for path in m.files:
        want = m.hash_after(path, k)
        data = current[path]
        assert data is not None  # missing files were refused as drifted
        if FileHash.of(data) == want:
            continue
        if status.state == State.PATCHED_OLDER:
            base = _original(target, pset, state, path, data, [], reader)
            if base is None:
                plan.refuse(Refusal(target.site / path, "patched with an older revision and "
                                    "its original is not saved; revert it by reinstalling "
                                    f"lmcache=={target.version}, then apply"))
                continue
            out = apply_series(patches, lambda p: base if p == path else None).files[path]
        else:
            out = table.files[path]
        if out is None or FileHash.of(out) != want:
            got = "nothing" if out is None else FileHash.of(out).hash
            plan.refuse(Refusal(target.site / path, f"applying the series gives {got}, but the "
                                f"manifest expects {want.hash}; refusing"))
            continue
        new_bytes[path] = out
    if plan.refusals:
        return None
    if not new_bytes:
        return _Layer({}, state, [], table.results)

    # RECORD rows of the touched files, and the state that revert relies on.
    for path in new_bytes:
        row = record.row(path)
        if row is None:
            plan.refuse(Refusal(target.record_path, f"has no row for {path}; the install is "
                                "not the wheel's"))
            continue
        have = FileHash.of(current[path] or b"")
        if (row.hash, row.size) != (have.hash, str(have.size)) and not accept_record_mismatch:
            plan.refuse(TargetStateRefusal(
                target.record_path, f"its row for {path} says {row.hash} size {row.size}, but "
                f"the file is {have.hash} size {have.size}: the install is inconsistent; "
                f"reinstall lmcache=={target.version}, or pass --accept-record-mismatch to "
                "patch it anyway (revert then restores this row as it is now)",
                ExitCode.DRIFTED))
    if plan.refusals:
        return None
    saved = dict(state.files) if state else {}
    originals: list[Change] = []
    for path, data in sorted(new_bytes.items()):
        if path not in saved:
            original = _original(target, pset, None, path, current[path] or b"", all_patches,
                                 reader)
            if original is None:
                plan.refuse(Refusal(target.site / path, "cannot establish its pristine bytes"))
                return None
            # The wheel's bytes keep v1's place; a pre-image that is a lower
            # layer's post-image is kept per layer.
            rel = (f"{ORIGINALS}/{path}" if S.lower_layer(layers, i, path) is None
                   else f"{LAYER_ORIGINALS}/{pset.name}/{path}")
            originals.append(Change(target.state_dir / rel, original))
            saved[path] = SavedFile(rel, m.hash_after(path, 0), record.row(path))
        saved[path] = SavedFile(saved[path].original, saved[path].pre, saved[path].record_row,
                                FileHash.of(data))
    entry = LayerState(pset.name, m.revision, m.step_ids()[k - 1], saved)
    return _Layer(new_bytes, entry, originals, table.results)


def plan_apply(target: Target, pset: PatchSetDir, assessed: C.Assessment, reader: Reader, *,
               patch_id: str | None = None, accept_record_mismatch: bool = False,
               layers: list[PatchSetDir] | None = None, discovery=None) -> Plan:
    """Apply ``pset`` and, for a stacked set, every layer below it that is not
    yet applied, lowest first, each planned over the layers below it in
    memory: one plan, so one transaction commits the whole stack.
    ``assessed``: the install as classified under the lock (nothing here
    classifies it again or re-reads RECORD)."""
    status = assessed.status
    layers = list(layers or [pset])
    sel = [p.name for p in layers].index(pset.name)
    stack = layers[:sel + 1]
    m = pset.manifest
    plan = Plan(ApplyResult("no-op", pset.name, target.version, m.revision,
                            m.step_ids()[-1] if m.patches else "", str(status.state)))
    res = plan.result
    assert isinstance(res, ApplyResult)
    try:
        refuse_state(status, target)
        k_top = _select(pset, patch_id)
    except Refusal as r:
        return plan.refuse(r)
    res.through = m.step_ids()[k_top - 1]
    for r in _links(target, S.all_files(stack) + [str(target.record_path.relative_to(target.site))],
                    reader):
        plan.refuse(r)
    if plan.refusals:
        return plan
    try:
        found = load_state(target, reader)
    except Refusal as r:
        return plan.refuse(r)
    # A state left by another lmcache version: its originals are not ours.
    state = found if found is not None and found.lmcache_version == target.version else None

    overlay = Overlay(reader)
    own = _own_statuses(assessed, stack, layers, discovery, reader)
    assert assessed.record is not None
    record = assessed.record
    entries: list[LayerState | None] = []
    originals: list[Change] = []
    changed: dict[str, bytes] = {}
    for i, layer in enumerate(stack):
        if len(stack) > 1 and layer.manifest.state != STATE_PATCH:
            entries.append(None)  # a fixed-upstream requirement: nothing to apply or record
            continue
        k = k_top if i == sel else len(layer.manifest.patches)
        saved = state.layer(layer.name) if state is not None else None
        lp = _plan_layer(target, stack, i, own[i], overlay, record, saved, k=k,
                         patch_id=patch_id, accept_record_mismatch=accept_record_mismatch,
                         plan=plan)
        if lp is None:
            res.state_after = None
            return plan
        hunks = lp.hunks
        if len(stack) > 1:  # name the set: patch ids repeat across sets
            for fr in hunks:
                fr.patch = f"{layer.name}/{fr.patch}"
        res.hunks += hunks
        res.sets.append({"name": layer.name, "revision": layer.manifest.revision,
                         "through": layer.manifest.step_ids()[k - 1] if layer.manifest.patches
                         else "", "changed_files": sorted(lp.new_bytes)})
        entries.append(lp.entry)
        originals += lp.originals
        if lp.new_bytes:
            record = record.with_rows({p: RecordRow(p, FileHash.of(b).hash, str(len(b)))
                                       for p, b in lp.new_bytes.items()})
            for p, b in lp.new_bytes.items():
                overlay.pending[target.site / p] = b
            overlay.pending[target.record_path] = record.render()
            changed.update(lp.new_bytes)
    res.changed_files = sorted(changed)
    if not changed:
        res.state_after = status.state
        return _remove_leftover(plan, target, found, reader, set())

    # A layer already patched before this run but without a record (its
    # state was lost) gets one now, or revert could not peel it.
    for i, layer in enumerate(stack):
        if entries[i] is None and layer.manifest.state == STATE_PATCH:
            return plan.refuse(Refusal(target.state_dir / STATE_FILE, f"has no record of "
                                       f"{layer.name}, which is applied under "
                                       f"{stack[-1].name}; revert or reinstall lmcache=="
                                       f"{target.version}, then apply"))
    new_state = InstallState(__version__, target.version, target.dist_info.name,
                             [e for e in entries if e is not None])
    keep = {f.original for e in new_state.layers for f in e.files.values()}
    stale: list[Change] = []
    if state is not None:  # records of sets no longer applied (their files are at pre)
        stale = [Change(target.state_dir / f.original, None) for la in state.layers
                 if la.patch_set not in new_state.set_names() for f in la.files.values()
                 if f.original not in keep]
    changes = originals + [Change(target.site / p, b) for p, b in sorted(changed.items())]
    changes.append(Change(target.record_path, overlay.pending[target.record_path]))
    changes.append(Change(target.state_dir / STATE_FILE, new_state.render()))
    pyc = _stale_pyc(target, res.changed_files, reader)
    res.removed_pyc = [str(c.path.relative_to(target.site)) for c in pyc]
    plan.changes = changes + stale + pyc
    return _remove_leftover(plan, target, found, reader, keep | {STATE_FILE})


def _remove_leftover(plan: Plan, target: Target, found: InstallState | None, reader: Reader,
                     written: set[str]) -> Plan:
    """Add the deletion of what of the state dir no record of this install
    names (another version's state, orphaned saved files: what ``status``
    reports) to ``plan``; ``written``: the state dir entries the plan itself
    writes (replaced, not deleted)."""
    try:
        left = find_leftover(target.state_dir, found, target.version, reader)
        refuse_links(target.state_dir, left, reader)
    except Refusal as r:
        return plan.refuse(r)
    plan.result.leftover_state = left
    if left is not None:
        planned = {c.path for c in plan.changes}
        plan.changes += [Change(target.state_dir / rel, None) for rel in left.files
                         if rel not in written and target.state_dir / rel not in planned]
    return plan


def plan_revert(target: Target, pset: PatchSetDir | None, assessed: C.Assessment,
                reader: Reader, *, layers: list[PatchSetDir] | None = None,
                only: str | None = None) -> Plan:
    """Peel the applied sets, top first: all of them, or with ``only`` (the
    ``--set`` given) just that one, which must be the top of the stack."""
    status = assessed.status
    plan = Plan(RevertResult("no-op", target.version, "none", str(status.state)))
    res = plan.result
    assert isinstance(res, RevertResult)
    assert assessed.record is not None
    record = assessed.record
    try:
        found = load_state(target, reader)
    except Refusal as r:
        return plan.refuse(r)
    # A state left by another lmcache version is a leftover (_remove_leftover).
    state = found if found is not None and found.lmcache_version == target.version else None
    shipped = {p.name: p for p in (layers or ([pset] if pset is not None else []))}
    restore: dict[str, bytes] = {}
    new_rows: dict[str, RecordRow] = {}
    housekeeping: list[Change] = []

    if state is not None:
        res.source = "saved originals"
        names = state.set_names()
        peel = list(reversed(state.layers))
        if only is not None:
            if only not in names:
                return plan.refuse(Refusal(target.state_dir / STATE_FILE, f"{only} is not "
                                           f"applied (applied: {', '.join(names)})"))
            if only != names[-1]:
                return plan.refuse(Refusal(target.state_dir / STATE_FILE, f"{only} is "
                                           f"required by the applied set {names[-1]}; revert "
                                           f"--set {names[-1]} first, or revert without --set "
                                           "to peel every set"))
            peel = [state.top]
        for r in _links(target, sorted({p for la in peel for p in la.files}), reader):
            plan.refuse(r)
        if plan.refusals:
            return plan
        overlay = Overlay(reader)
        for la in peel:
            ps = shipped.get(la.patch_set)
            for path, info in sorted(la.files.items()):
                data = overlay.read(target.site / path)
                if data is not None and FileHash.of(data) == info.pre:
                    continue  # this layer never changed it (or it is already back)
                known = {info.patched} if info.patched is not None else set()
                if ps is not None and path in ps.manifest.files:
                    known |= {ps.manifest.hash_after(path, k)
                              for k in range(len(ps.manifest.patches) + 1)}
                if data is None or FileHash.of(data) not in known:
                    plan.refuse(TargetStateRefusal(
                        target.site / path, "was changed after patchtool patched it; refusing to "
                        f"overwrite it (reinstall lmcache=={target.version} instead)",
                        ExitCode.DRIFTED))
                    continue
                original = reader.read(target.state_dir / info.original)
                if original is None or FileHash.of(original) != info.pre:
                    plan.refuse(Refusal(target.state_dir / info.original, "saved original is "
                                        "missing or does not match its recorded hash"))
                    continue
                overlay.pending[target.site / path] = original
                restore[path] = original
                new_rows[path] = info.record_row  # a lower layer's row, peeled later, wins
            housekeeping += [Change(target.state_dir / i.original, None)
                             for i in la.files.values()]
        res.sets = [la.patch_set for la in peel]
        left = state.layers[:len(state.layers) - len(peel)]
        res.remaining = [la.patch_set for la in left]
        if left:
            kept = InstallState(state.tool_version, state.lmcache_version, state.dist_info, left)
            housekeeping.append(Change(target.state_dir / STATE_FILE, kept.render()))
        else:
            housekeeping.append(Change(target.state_dir / STATE_FILE, None))
        # A file a peeled layer shares with a kept one: its restored bytes are
        # the kept layer's post-image, so nothing to delete for it there.
    elif layers and len(layers) > 1 and status.problem is None and \
            any(s.state in (State.PATCHED, State.PARTIAL) for s in status.sets):
        # A stack without saved state: reverse each applied layer's series,
        # top first, over the layers above it already reversed in memory.
        res.source = "reverse patch"
        err = _reverse_stack(target, layers, status, reader, only, restore, new_rows, res)
        if err is not None:
            return plan.refuse(err)
    elif status.state in (State.PATCHED, State.PARTIAL) and pset is not None and \
            not (layers and len(layers) > 1):
        # No saved state (deleted by hand): reverse the series in memory and
        # accept the result only where it reproduces the wheel's hashes.
        res.source = "reverse patch"
        res.sets = [pset.name]
        m = pset.manifest
        for r in _links(target, list(m.files), reader):
            plan.refuse(r)
        if plan.refusals:
            return plan
        out, bad = _reverse_layer(target, pset, status.state, status.applied_through,
                                  reader.read)
        for path in bad:
            plan.refuse(Refusal(target.site / path, "reversing the series does not give "
                                "the wheel's file; reinstall lmcache instead"))
        for path, data in out.items():
            pre = m.hash_after(path, 0)
            restore[path] = data
            new_rows[path] = RecordRow(path, pre.hash, str(pre.size))
    elif status.state in (State.PRISTINE, State.UNSUPPORTED, State.FIXED_UPSTREAM, State.NOT_INSTALLED):
        pass  # nothing to restore; another version's state goes as a leftover
    else:
        try:
            refuse_state(status, target)
        except Refusal as r:
            return plan.refuse(r)
        return plan.refuse(Refusal(target.dist_info, f"{status.state}: no saved originals to "
                                   f"restore; reinstall lmcache=={target.version}"))

    res.restored_files = sorted(restore)
    for path in restore:
        if record.row(path) is None:
            plan.refuse(Refusal(target.record_path, f"has no row for {path}"))
    if plan.refusals:
        return plan
    changes = [Change(target.site / p, b) for p, b in sorted(restore.items())]
    if new_rows:
        changes.append(Change(target.record_path, record.with_rows(new_rows).render()))
    pyc = _stale_pyc(target, res.restored_files, reader)
    res.removed_pyc = [str(c.path.relative_to(target.site)) for c in pyc]
    plan.changes = changes + housekeeping + pyc
    return _remove_leftover(plan, target, found, reader, set())


def _reverse_layer(target: Target, layer: PatchSetDir, state: str,
                   applied_through: str | None,
                   read: Callable[[Path], bytes | None]) -> tuple[dict[str, bytes], list[str]]:
    """Reverse ``layer``'s applied patches in memory over what ``read`` gives.
    Returns the restored bytes of every file not already at the layer's
    pre-image, and the files where reversing does not give that pre-image
    (the caller refuses those: never guess)."""
    m = layer.manifest
    k = len(m.patches) if state == State.PATCHED else m.step_ids().index(applied_through) + 1
    current = {p: read(target.site / p) for p in m.files}
    rev = unapply_series(layer.load_patches(k), lambda p: current.get(p))
    out: dict[str, bytes] = {}
    bad: list[str] = []
    for path in m.files:
        pre = m.hash_after(path, 0)
        data = current[path]
        if data is not None and FileHash.of(data) == pre:
            continue
        got = rev.files.get(path)
        if got is None or FileHash.of(got) != pre:
            bad.append(path)
        else:
            out[path] = got
    return out, bad


def _reverse_stack(target: Target, layers: list[PatchSetDir], status: C.Status, reader: Reader,
                   only: str | None, restore: dict[str, bytes], new_rows: dict[str, RecordRow],
                   res: RevertResult) -> Refusal | None:
    """Peel a stack whose state was lost: each applied layer's series is
    reversed (top first) and accepted only where it gives that layer's
    pre-images; RECORD rows are rebuilt from those hashes, as apply writes
    them.  Fills ``restore``/``new_rows``; returns the refusal, if any."""
    by_name = {s.name: s for s in status.sets}
    applied = [p for p in layers if p.manifest.state == STATE_PATCH
               and by_name[p.name].state in (State.PATCHED, State.PARTIAL)]
    peel = list(reversed(applied))
    if only is not None:
        if only not in [p.name for p in applied]:
            return Refusal(target.dist_info, f"{only} is not applied")
        if only != peel[0].name:
            return Refusal(target.dist_info, f"{only} is required by the applied set "
                           f"{peel[0].name}; revert --set {peel[0].name} first, or revert "
                           "without --set to peel every set")
        peel = peel[:1]
    for r in _links(target, sorted({f for p in peel for f in p.manifest.files}), reader):
        return r
    overlay = Overlay(reader)
    for layer in peel:
        m, st = layer.manifest, by_name[layer.name]
        out, bad = _reverse_layer(target, layer, st.state, st.applied_through, overlay.read)
        if bad:
            return Refusal(target.site / bad[0], f"reversing {layer.name} does not give its "
                           "pre-image; reinstall lmcache instead")
        for path, data in out.items():
            pre = m.hash_after(path, 0)
            overlay.pending[target.site / path] = data
            restore[path] = data
            new_rows[path] = RecordRow(path, pre.hash, str(pre.size))  # a lower layer's wins
    res.sets = [p.name for p in peel]
    res.remaining = [p.name for p in applied[:len(applied) - len(peel)]]
    return None
