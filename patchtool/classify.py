"""Classify an install against its patch set's manifest (``patchtool status``).

Per target file: pristine, patched, partial (series applied up to some
patch), patched-older-revision, drifted or missing, by sha256 against the
manifest (whose pre-images come from the wheel).  Overall: one
:class:`~patchtool.states.State`.  Pure reading: nothing here writes.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import __version__
from . import stack as S
from .distinfo import installed_version
from .states import F_DRIFTED, F_MISSING, F_OLDER, F_PARTIAL, F_PATCHED, F_PRISTINE, State
from .manifest import STATE_FIXED_UPSTREAM, FileHash, Manifest, PatchSetDir
from .errors import Refusal
from .fsio import Reader
from .provenance import read_provenance, split_local, wheel_build_info
from .record import Record, check_rows
from .state import STATE_FILE, InstallState, Leftover, find_leftover
from .target import Discovery, Target
from .prerelease import prerelease_note
from .vllm_compat import carries_sched_output_fix, vllm_notes
from . import upstream

@dataclass
class FileStatus:
    path: str
    state: str
    hash: str | None
    size: int | None
    pristine_hash: str
    patched_hash: str
    step: str | None = None  # last applied patch id, for "partial"
    revision: int | None = None  # for "patched" / "patched-older-revision"
    record_row: str = ""  # RECORD row vs file on disk: ok | mismatch | missing | absent


@dataclass
class RecordSummary:
    rows: int
    checked: int
    mismatches: int
    deep: bool  # every row checked (else only the target files' rows)
    mismatched: list[str] = field(default_factory=list)  # first few paths
    # Rows outside the site dir ("../../bin/x") whose file is absent: normal
    # for `pip install --target`, which records scripts where it staged them.
    external_missing: int = 0


@dataclass
class Status:
    state: State
    detail: str
    tool_version: str
    python: str | None
    python_version: str | None
    site_dirs: list[str]
    site: str | None = None
    dist_info: str | None = None
    lmcache_version: str | None = None
    installer: str | None = None
    install_source: str | None = None  # "index" or direct_url.json's url
    patch_set: str | None = None
    patch_set_dir: str | None = None
    revision: int | None = None  # the shipped (current) revision
    applied_through: str | None = None  # last patch applied, when partially patched
    vllm_versions: list[str] = field(default_factory=list)
    files: list[FileStatus] = field(default_factory=list)
    record: RecordSummary | None = None
    recovered_files: int = 0  # restored from an interrupted run's journal
    # Set when the install came from a wheel built by `patchtool wheel`: its
    # provenance file (or, without one, what the local version says).  Such
    # an install is patched at build time; apply/revert do not act on it.
    wheel_build: dict | None = None
    # Things the operator must know about this install: the manifest's notes
    # for the version, the disk-tier warning once it is patched, and what the
    # installed vLLM means for it (patchtool/vllm_compat.py).
    notes: list[str] = field(default_factory=list)
    # The vLLM found in the same site dirs (its dist-info METADATA; never imported).
    vllm_version: str | None = None
    # How the installed build keys disk-tier objects: "pristine" (LMCache's
    # own keys) or "kvl<N>" (layout-namespaced, EXPLAINER "Disk-tier keys").
    disk_tier_keys: str | None = None
    # The one command that brings this install to the shipped revision, when
    # there is one to run (after `pip install -U lmcache`, or an older revision).
    next_command: str | None = None
    # Each patch set of the stack, lowest first ({name, revision, state,
    # detail, applied_through, requires}); one entry for an unstacked set.
    # The fields above describe the selected (top) set.
    sets: list = field(default_factory=list)
    # Why a stacked install is refused (half-stacked, or a drifted file
    # named with the image it should have had): {file, reason}.
    problem: dict | None = None
    # Files of the state dir no record of this install names: another
    # lmcache version's state after `pip install lmcache==X`, or orphaned
    # saved files.  apply and revert remove them.
    leftover_state: Leftover | None = None
    # This project's upstream proposals the installed LMCache already contains
    # ({proposal, subject, parts}; patchtool/upstream.py): those parts are
    # fixed upstream in this release.
    fixed_upstream: list = field(default_factory=list)


# Why: without layout-namespaced keys (revision 1 of the series) objects in a
# persistent L2 tier carry no layout fingerprint. Those written by an
# unpatched build hold 1/k of the FA bytes (the wrong pages), and a patched ->
# pristine downgrade reads patched objects as valid hits.
DISK_TIER_WARNING = (
    "disk-tier data written before this patch, or by another LMCache version "
    "or layout, must be discarded: wipe the L2 tier (for the fs adapter, its "
    "base_path directory) or change the model alias / cache_salt before serving "
    "from it; never point an unpatched build at a tier a patched build wrote"
)

# With layout-namespaced keys the tier is safe across builds by construction;
# what is left is upstream's own layout change between pristine 0.5.3 and
# 0.5.4+ (the Mamba/GDN state of chunks of several blocks), which no key a
# patched build chooses can fence off (EXPLAINER "Disk-tier keys").
DISK_TIER_NAMESPACED = (
    "disk-tier keys kvl{fmt}: objects whose bytes another LMCache build writes "
    "differently are stored as <model>+kvl{fmt}-<digest> (the server logs "
    "\"keys objects as\" per object group at registration), so no other build "
    "reads them and this build reads no other build's; the tier survives patching, "
    "reverting and upgrading. Upstream exception: a hybrid-model tier written by "
    "PRISTINE 0.5.3 with chunks of more than one block must be discarded before "
    "a 0.5.4+ build serves from it. `patchtool l2 scan DIR` lists what this "
    "install never reads"
)


# Policy for a RECORD row that disagrees with its file (the install was edited
# or half-reinstalled): status reports it, apply refuses it as drifted unless
# --accept-record-mismatch, and revert puts back the row as it was.
RECORD_MISMATCH_NOTE = (
    "RECORD's row for {path} does not match the file: the install is inconsistent. "
    "apply refuses it; reinstall lmcache, or pass --accept-record-mismatch to patch it "
    "anyway"
)


def disk_tier_note(m: Manifest, fmt: int | None = None) -> str:
    """The disk-tier note for an install patched with manifest ``m`` (``fmt``:
    the key format of its whole stack, when a lower set declares it)."""
    fmt = m.l2_format if fmt is None else fmt
    if fmt is not None:
        return DISK_TIER_NAMESPACED.format(fmt=fmt)
    return DISK_TIER_WARNING


def apply_command(target: Target, set_name: str | None = None) -> str:
    """The exact command that patches this install: what `status` and `verify`
    tell an operator after `pip install -U lmcache` or a revision bump
    (``--set`` for a stacked set, which is never the default)."""
    where = (f"--python {shlex.quote(target.python)}" if target.python
             else f"--site-packages {shlex.quote(str(target.site))}")
    return f"patchtool apply {where}" + (f" --set {shlex.quote(set_name)}" if set_name else "")


def patch_set_key(target: Target) -> tuple[str, str | None]:
    """(version, set name) to look the patch set up with: a patched wheel's
    ``0.5.3+hybridfa.r1`` is still lmcache 0.5.3, of the set its provenance names;
    an install patched in place with a stack, the top set its state records."""
    public, tag, _ = split_local(target.version)
    prov = read_provenance(target.dist_info) if tag is not None else None
    if prov is not None:
        return public, prov.get("patch_set")
    names = recorded_sets(target)
    return public, names[-1] if len(names) > 1 else None


def recorded_sets(target: Target) -> list[str]:
    """The sets this install says it carries, lowest first: a patched wheel's
    provenance, else the tool's state (empty when neither says)."""
    prov = read_provenance(target.dist_info)
    if prov is not None:
        return [str(s["patch_set"]) for s in prov.get("sets", [])] or \
            ([str(prov["patch_set"])] if prov.get("patch_set") else [])
    path = target.state_dir / STATE_FILE
    try:
        data = Reader().read(path)
        state = None if data is None else InstallState.parse(data, path)
    except Refusal:
        return []  # apply/revert report a bad state; guessing a set from it helps nobody
    if state is None or state.lmcache_version != target.version:
        return []
    return state.set_names()


@dataclass
class Assessment:
    """One classification of an install, kept whole for the command that
    acts on it: apply and revert plan from it instead of classifying again."""

    status: Status  # what status prints: the selected set, with its stack
    # Each layer's own state through its view, lowest first (unstacked:
    # ``[status]``).  How planning sees a layer before changing it.
    layers: list[Status]
    record: Record | None  # RECORD as read, parsed once (None: not installed)


class _OneRecord:
    """RECORD read and parsed at most once per classification, when first
    needed (so refusals keep their order)."""

    def __init__(self, target: Target, reader: Reader) -> None:
        self.target, self.reader = target, reader
        self.record: Record | None = None

    def get(self) -> Record:
        if self.record is None:
            self.record = Record.read(self.target.record_path, self.reader.read)
        return self.record


def classify(discovery: Discovery, pset: PatchSetDir | None, *, deep: bool = False,
             set_name: str | None = None, reader: Reader | None = None,
             stack: list[PatchSetDir] | None = None) -> Status:
    """Classify the install against ``pset``; with ``stack`` (its layers,
    lowest first, ``pset`` among them, maybe applied layers above it), against
    every layer (:mod:`patchtool.stack`)."""
    return assess(discovery, pset, deep=deep, set_name=set_name, reader=reader,
                  stack=stack).status


def assess(discovery: Discovery, pset: PatchSetDir | None, *, deep: bool = False,
           set_name: str | None = None, reader: Reader | None = None,
           stack: list[PatchSetDir] | None = None) -> Assessment:
    """:func:`classify`, keeping each layer's status and the parsed RECORD."""
    reader = reader or Reader()
    t = discovery.target
    record = _OneRecord(t, reader) if t is not None else None
    if stack and len(stack) > 1 and pset is not None and t is not None:
        st, layers = _classify_stack(discovery, stack, [p.name for p in stack].index(pset.name),
                                     deep=deep, set_name=set_name, reader=reader, record=record)
    else:
        st = _classify(discovery, pset, deep=deep, set_name=set_name, reader=reader,
                       record=record)
        layers = [st]
        if pset is not None:
            st.sets = [_set_state(pset, st)]
    if t is not None:
        st.vllm_version = installed_version(discovery.site_dirs, "vllm")
        pre = prerelease_note(st.lmcache_version)
        st.notes += [pre] if pre and pre not in st.notes else []
        layers_sets = [s for s in (stack or [pset]) if s is not None]
        st.notes += vllm_notes(st.vllm_version, st.vllm_versions if st.patch_set else None,
                               lmcache=st.lmcache_version, state=st.state.value if st.state else None,
                               carries_sched_fix=carries_sched_output_fix(layers_sets) if layers_sets else None)
        st.leftover_state = _leftover(t, reader)
        fixes = upstream.fixed_upstream(t.site, reader)
        st.fixed_upstream = [p.as_dict() for p in fixes]
        st.notes += [upstream.note(st.lmcache_version, p) for p in fixes]
    return Assessment(st, layers, record.record if record is not None else None)


def layer_statuses(discovery: Discovery, layers: list[PatchSetDir], reader: Reader,
                   record: Record) -> list[Status]:
    """Each of ``layers``' own status through its view of the stack they form."""
    t = discovery.target
    assert t is not None
    once = _OneRecord(t, reader)
    once.record = record
    return _views_classified(discovery, layers, deep=False, set_name=None, reader=reader,
                             record=once)


def _leftover(t: Target, reader: Reader) -> Leftover | None:
    path = t.state_dir / STATE_FILE
    try:
        data = reader.read(path)
        state = None if data is None else InstallState.parse(data, path)
        return find_leftover(t.state_dir, state, t.version, reader)
    except Refusal:
        return None  # a damaged state dir: apply and revert refuse it in one line


def _set_state(pset: PatchSetDir, st: Status) -> S.SetState:
    return S.SetState(pset.name, pset.manifest.revision, str(st.state), st.detail,
                    st.applied_through, list(pset.manifest.requires))


def _classify_stack(discovery: Discovery, layers: list[PatchSetDir], sel: int, *, deep: bool,
                    set_name: str | None, reader: Reader, record: _OneRecord
                    ) -> tuple[Status, list[Status]]:
    """Each layer judged through its view; the selected layer's status
    carries the stack: every file up to it, each set's state, and DRIFTED with
    a ``problem`` when the layers do not form a consistent stack.  Returns it
    and each layer's own status (as judged before the stack was summed up)."""
    t = discovery.target
    assert t is not None
    statuses = _views_classified(discovery, layers, deep=deep, set_name=set_name,
                                 reader=reader, record=record)
    own = [replace(s) for s in statuses]
    st = statuses[sel]
    st.sets = [_set_state(layer, s) for layer, s in zip(layers, statuses)]
    if st.state in (State.UNSUPPORTED, State.FIXED_UPSTREAM):
        return st, own
    below = statuses[:sel + 1]
    by_path = {f.path: f for s in below for f in s.files}  # the highest layer's view wins
    st.files = [by_path[p] for p in S.all_files(layers[:sel + 1])]
    notes: list[str] = []
    for s in below:
        notes += [n for n in s.notes if n not in notes]
    st.notes = notes
    st.record = _record_summary(t.site, record.get().rows, set(by_path), deep)
    problem = S.half_stacked(layers, statuses)
    names = " + ".join(f"{p.name} revision {p.manifest.revision}" for p in layers[:sel + 1])
    if problem is not None:
        st.state, st.detail = State.DRIFTED, f"{problem[0]}: {problem[1]}"
        st.problem = {"file": problem[0], "reason": problem[1]}
        st.next_command = None
    elif st.state == State.PRISTINE and any(s.state != State.PRISTINE for s in statuses[:sel]):
        done = ", ".join(f"{layers[i].name} {s.state}" for i, s in enumerate(statuses[:sel]))
        st.state = State.PARTIAL
        st.detail = f"{layers[sel].name} is not applied ({done})"
        st.next_command = apply_command(t, layers[sel].name) if st.wheel_build is None else None
    elif st.state == State.PATCHED:
        st.detail = f"patched with {names}" + (
            f" (installed from the patched wheel, lmcache {t.version})" if st.wheel_build else "")
    elif st.next_command is not None:
        st.next_command = apply_command(t, layers[sel].name)
    fmt = S.l2_format(layers[:sel + 1])
    if st.state == State.PATCHED and fmt is not None:  # keys of the whole stack's build
        st.disk_tier_keys = f"kvl{fmt}"
        st.notes = [n for n in st.notes if n != DISK_TIER_WARNING]
        note = disk_tier_note(layers[sel].manifest, fmt)
        st.notes += [note] if note not in st.notes else []
    return st, own


def _views_classified(discovery: Discovery, layers: list[PatchSetDir], *, deep: bool,
                      set_name: str | None, reader: Reader, record: _OneRecord) -> list[Status]:
    """Each layer's status through its view (:func:`patchtool.stack.views`)."""
    t = discovery.target
    assert t is not None
    actual: dict[str, FileHash | None] = {}
    for path in S.all_files(layers):
        link = reader.link_on(t.site, path)
        if link is not None:
            raise Refusal(link, f"is a symbolic link (on the path of {path}); patchtool "
                          "classifies and edits only regular files inside site-packages")
        data = reader.read(t.site / path)
        actual[path] = None if data is None else FileHash.of(data)
    vs = S.views(layers, actual)
    return [_classify(discovery, layer, deep=deep, set_name=set_name, reader=reader,
                      record=record, view=vs[i]) for i, layer in enumerate(layers)]


def _classify(discovery: Discovery, pset: PatchSetDir | None, *, deep: bool,
              set_name: str | None, reader: Reader, record: _OneRecord | None,
              view: dict[str, FileHash] | None = None) -> Status:
    t = discovery.target
    st = Status(State.NOT_INSTALLED, "lmcache is not installed", __version__, discovery.python,
                discovery.python_version, discovery.site_dirs)
    if t is None:
        return st
    st.site, st.dist_info = str(t.site), str(t.dist_info)
    st.lmcache_version, st.installer = t.version, t.installer
    st.install_source = (t.direct_url or {}).get("url", "index") if t.direct_url else "index"
    st.wheel_build = wheel_build_info(t)

    assert record is not None
    record_rows = record.get().rows
    if pset is None:
        st.state = State.UNSUPPORTED
        st.detail = (f"no patch set{' ' + set_name if set_name else ''} for lmcache {t.version}")
        st.record = _record_summary(t.site, record_rows, set(), deep)
        return st

    m = pset.manifest
    st.patch_set, st.patch_set_dir = pset.name, str(pset.path)
    st.notes = list(m.notes)
    st.revision, st.vllm_versions = m.revision, m.vllm_versions
    if m.state == STATE_FIXED_UPSTREAM:
        st.state, st.detail = State.FIXED_UPSTREAM, m.reason or "fixed upstream"
        st.record = _record_summary(t.site, record_rows, set(), deep)
        return st

    n = len(m.patches)
    ids = m.step_ids()
    by_path = {r.path: r for r in record_rows}
    common_steps: set[int] | None = None
    older_ok = {p.revision: True for p in m.previous_revisions}
    any_missing_or_drift = False
    for path in m.files:
        link = reader.link_on(t.site, path)
        if link is not None:
            raise Refusal(link, f"is a symbolic link (on the path of {path}); patchtool "
                          "classifies and edits only regular files inside site-packages")
        data = reader.read(t.site / path)
        pre, post = m.hash_after(path, 0), m.hash_after(path, n)
        fs = FileStatus(path, F_MISSING, None, None, pre.hash, post.hash)
        st.files.append(fs)
        row = by_path.get(path)
        if data is None:
            fs.record_row = "absent" if row is None else "missing"
            any_missing_or_drift = True
            common_steps = set()
            continue
        fh = FileHash.of(data)
        fs.hash, fs.size = fh.hash, fh.size
        fs.record_row = ("absent" if row is None else
                         "ok" if (row.hash, row.size) == (fh.hash, str(fh.size)) else "mismatch")
        # A stacked layer judges the file by its view (patchtool.stack); the
        # hash shown and the RECORD row stay the file's own.
        fh = view.get(path, fh) if view is not None else fh
        steps = {k for k in range(n + 1) if m.hash_after(path, k) == fh}
        common_steps = steps if common_steps is None else common_steps & steps
        for prev in m.previous_revisions:
            if prev.files.get(path, pre) != fh:
                older_ok[prev.revision] = False
        if n in steps:
            fs.state, fs.revision = F_PATCHED, m.revision
        elif 0 in steps:
            fs.state = F_PRISTINE
        elif steps:
            fs.state, fs.step = F_PARTIAL, ids[max(steps) - 1]
        else:
            older = [p.revision for p in m.previous_revisions if p.files.get(path) == fh]
            if older:
                fs.state, fs.revision = F_OLDER, older[0]
            else:
                fs.state = F_DRIFTED
                any_missing_or_drift = True

    common_steps = common_steps or set()
    older = [r for r, ok in older_ok.items() if ok]
    if n in common_steps:
        st.state, st.detail = State.PATCHED, f"patched with {pset.name} revision {m.revision}"
        if st.wheel_build is not None:
            st.detail += f" (installed from the patched wheel, lmcache {t.version})"
    elif 0 in common_steps:
        st.state, st.detail = State.PRISTINE, "files are as the wheel installed them"
    elif older and not any_missing_or_drift:
        # Checked before "partial": a revision that appends a patch leaves the
        # previous revision's files at an intermediate step of the new series,
        # and an install that is exactly a shipped revision is that revision.
        st.state = State.PATCHED_OLDER
        st.detail = f"patched with revision {older[0]}; revision {m.revision} is shipped"
        prev = next(p for p in m.previous_revisions if p.revision == older[0])
        for fs in st.files:
            if fs.path in prev.files and fs.state != F_PATCHED:
                fs.state, fs.revision, fs.step = F_OLDER, older[0], None
    elif common_steps:
        k = max(common_steps)
        st.state, st.applied_through = State.PARTIAL, ids[k - 1]
        st.detail = f"series applied up to {ids[k - 1]} ({k} of {n})"
    else:
        bad = [f.path for f in st.files if f.state in (F_DRIFTED, F_MISSING)]
        st.state = State.DRIFTED
        st.detail = (f"{bad[0]} matches no known pristine or patched state" if bad
                     else "files are at different patch steps")
    st.disk_tier_keys = "pristine"
    if st.state == State.PATCHED and m.l2_format is not None:
        st.disk_tier_keys = f"kvl{m.l2_format}"
        st.notes.append(disk_tier_note(m))
    elif st.state in (State.PATCHED, State.PATCHED_OLDER, State.PARTIAL):
        # An older revision, or a series without namespaced keys: the
        # installed build may write pristine keys for sub-paged layouts.
        st.notes.append(DISK_TIER_WARNING)
    if st.state in (State.PRISTINE, State.PATCHED_OLDER, State.PARTIAL) and st.wheel_build is None:
        st.next_command = apply_command(t)
    inconsistent = [f.path for f in st.files if f.record_row == "mismatch"]
    if inconsistent and st.state != State.PATCHED:
        st.notes.append(RECORD_MISMATCH_NOTE.format(path=inconsistent[0]))
    st.record = _record_summary(t.site, record_rows, set(m.files), deep)
    return st


def _record_summary(site: Path, rows: list, targets: set[str], deep: bool) -> RecordSummary:
    chosen = rows if deep else [r for r in rows if r.path in targets]
    checks = [c for c in check_rows(site, chosen) if c.status != "unhashed"]
    external = [c for c in checks if c.status == "missing" and c.path.startswith("../")]
    bad = [c.path for c in checks if c.status != "ok" and c not in external]
    return RecordSummary(len(rows), len(checks) - len(external), len(bad), deep, bad[:20],
                         len(external))
