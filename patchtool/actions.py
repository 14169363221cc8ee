"""apply and revert: decide what to write, then hand it to one transaction.

Everything that can refuse is checked before :func:`transaction.commit`
starts, so a refusal leaves the install untouched.  State kept in
``<site>/.lmcache-patchtool/``:

* ``state.json``     what was applied (set, revision, last patch) and, per
                     file, the original RECORD row and pristine hash;
* ``originals/...``  the pristine bytes of every patched file, so revert is
                     byte-exact whatever happened to RECORD meanwhile.

Both are written inside the same transaction as the patched files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from . import classify as C
from .applier import FileResult, Patch, apply_series, unapply_series
from .errors import Refusal, TargetStateRefusal
from .exitcodes import ExitCode
from .manifest import FileHash, PatchSetDir
from .record import RecordRow, parse_record, replace_rows
from .target import Target
from .transaction import Change, commit

STATE_FILE = "state.json"
STATE_SCHEMA = "lmcache-patchtool/state/v1"
ORIGINALS = "originals"


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


@dataclass
class RevertResult:
    action: str  # reverted | no-op | dry-run
    lmcache_version: str
    source: str  # saved originals | reverse patch | none
    state_before: str
    restored_files: list[str] = field(default_factory=list)
    removed_pyc: list[str] = field(default_factory=list)
    state_after: str | None = None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def load_state(target: Target) -> dict | None:
    data = _read(target.state_dir / STATE_FILE)
    if data is None:
        return None
    try:
        state = json.loads(data)
    except ValueError:
        raise Refusal(target.state_dir / STATE_FILE, "not valid JSON") from None
    if state.get("schema") != STATE_SCHEMA:
        raise Refusal(target.state_dir / STATE_FILE, f"unknown schema {state.get('schema')!r}")
    return state


def remove_stale_pyc(site: Path, paths: list[str]) -> list[str]:
    """Delete ``__pycache__/<module>.*.pyc`` of each touched module: hash-based
    pycs (PEP 552) and same-second, same-size edits would otherwise run the
    old code."""
    removed = []
    for rel in paths:
        src = site / rel
        if src.suffix != ".py":
            continue
        for pyc in sorted((src.parent / "__pycache__").glob(f"{src.stem}.*.pyc")):
            pyc.unlink(missing_ok=True)
            removed.append(str(pyc.relative_to(site)))
    return removed


def _refuse_state(status: C.Status, target: Target) -> None:
    if status.state == C.UNSUPPORTED:
        raise TargetStateRefusal(target.dist_info, status.detail + " (see `patchtool list`)",
                                 ExitCode.UNSUPPORTED_VERSION)
    if status.state == C.FIXED_UPSTREAM:
        raise TargetStateRefusal(target.dist_info, f"lmcache {target.version} needs no patch: "
                                 f"{status.detail}", ExitCode.FIXED_UPSTREAM)
    if status.state == C.DRIFTED:
        bad = next((f for f in status.files if f.state in (C.F_DRIFTED, C.F_MISSING)), None)
        if bad is None:
            raise TargetStateRefusal(target.dist_info, status.detail + "; revert first",
                                     ExitCode.DRIFTED)
        what = ("is missing" if bad.state == C.F_MISSING else
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
        fname = pset.manifest.patches[i - 1]["file"]
        if patch_id in (pid, fname) or pid.split("-", 1)[0] == patch_id:
            return i
    raise Refusal(patch_id, f"no such patch in {pset.name}/{pset.version} (have: {', '.join(ids)})")


def _original(target: Target, pset: PatchSetDir, state: dict | None, path: str,
              current: bytes, patches: list[Patch]) -> bytes | None:
    """Pristine bytes of ``path``: the saved copy, the file itself, or (state
    lost) the file with the series reversed; each checked against the manifest."""
    pre = pset.manifest.hash_after(path, 0)
    candidates = []
    if state and path in state.get("files", {}):
        candidates.append(_read(target.state_dir / state["files"][path]["original"]))
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


def apply(target: Target, pset: PatchSetDir, status: C.Status, *, patch_id: str | None = None,
          dry_run: bool = False) -> ApplyResult:
    _refuse_state(status, target)
    m = pset.manifest
    k = _select(pset, patch_id)
    if status.state == C.PARTIAL and status.applied_through is not None:
        done = m.step_ids().index(status.applied_through) + 1
        if done > k:
            raise Refusal(target.dist_info, f"already patched up to {status.applied_through}, "
                          f"beyond {patch_id}; revert first")
    if status.state == C.PATCHED and k < len(m.patches):
        raise Refusal(target.dist_info, f"already patched with the whole series, beyond "
                      f"{patch_id}; revert first")
    patches = pset.load_patches(k)
    result = ApplyResult("no-op", pset.name, target.version, m.revision, m.step_ids()[k - 1],
                         status.state)

    current = {p: _read(target.site / p) for p in m.files}
    table = apply_series(patches, lambda p: current.get(p))
    result.hunks = table.results
    state = load_state(target)
    if state is not None and state.get("lmcache_version") != target.version:
        state = None  # left by another lmcache version; its originals are not ours

    new_bytes: dict[str, bytes] = {}
    for path in m.files:
        want = m.hash_after(path, k)
        data = current[path]
        assert data is not None  # missing files were refused as drifted
        if FileHash.of(data) == want:
            continue
        if status.state == C.PATCHED_OLDER:
            base = _original(target, pset, state, path, data, [])
            if base is None:
                raise Refusal(target.site / path, "patched with an older revision and its "
                              "original is not saved; revert it by reinstalling "
                              f"lmcache=={target.version}, then apply")
            out = apply_series(patches, lambda p: base if p == path else None).files[path]
        else:
            out = table.files[path]
        if out is None or FileHash.of(out) != want:
            got = "nothing" if out is None else FileHash.of(out).hash
            raise Refusal(target.site / path, f"applying the series gives {got}, but the manifest "
                          f"expects {want.hash}; refusing")
        new_bytes[path] = out
    result.changed_files = sorted(new_bytes)
    if not new_bytes:
        result.state_after = status.state
        return result
    if dry_run:
        result.action = "dry-run"
        return result

    # RECORD rows of the touched files, and the state that revert relies on.
    record_bytes = target.record_path.read_bytes()
    rows = {r.path: r for r in parse_record(record_bytes)}
    for path in new_bytes:
        if path not in rows:
            raise Refusal(target.record_path, f"has no row for {path}; the install is not "
                          "the wheel's")
    new_record = replace_rows(record_bytes, {p: RecordRow(p, FileHash.of(b).hash, str(len(b)))
                                             for p, b in new_bytes.items()})
    files_state = dict(state["files"]) if state else {}
    changes: list[Change] = []
    for path, data in sorted(new_bytes.items()):
        if path not in files_state:
            original = _original(target, pset, None, path, current[path] or b"",
                                 pset.load_patches())
            if original is None:
                raise Refusal(target.site / path, "cannot establish its pristine bytes")
            saved = f"{ORIGINALS}/{path}"
            changes.append(Change(target.state_dir / saved, original))
            row = rows[path]
            files_state[path] = {"original": saved, "pre": m.hash_after(path, 0).to_json(),
                                 "record_row": [row.path, row.hash, row.size]}
        changes.append(Change(target.site / path, data))
        files_state[path]["patched"] = FileHash.of(data).to_json()
    changes.append(Change(target.record_path, new_record))
    new_state = {"schema": STATE_SCHEMA, "tool_version": __version__,
                 "lmcache_version": target.version, "dist_info": target.dist_info.name,
                 "patch_set": pset.name, "revision": m.revision,
                 "applied_through": m.step_ids()[k - 1], "files": files_state}
    changes.append(Change(target.state_dir / STATE_FILE,
                          (json.dumps(new_state, indent=2) + "\n").encode()))
    commit(target.state_dir, changes)
    result.action = "applied"
    result.removed_pyc = remove_stale_pyc(target.site, result.changed_files)
    return result


def revert(target: Target, pset: PatchSetDir | None, status: C.Status, *,
           dry_run: bool = False) -> RevertResult:
    state = load_state(target)
    result = RevertResult("no-op", target.version, "none", status.state)
    record_bytes = target.record_path.read_bytes()
    rows = {r.path: r for r in parse_record(record_bytes)}
    restore: dict[str, bytes] = {}
    new_rows: dict[str, RecordRow] = {}
    changes: list[Change] = []

    if state is not None and state.get("lmcache_version") == target.version:
        result.source = "saved originals"
        for path, info in sorted(state["files"].items()):
            data = _read(target.site / path)
            pre = FileHash(info["pre"]["hash"], int(info["pre"]["size"]))
            if data is not None and FileHash.of(data) == pre:
                continue  # already pristine
            known = {FileHash(info["patched"]["hash"], int(info["patched"]["size"]))}
            if pset is not None and path in pset.manifest.files:
                known |= {pset.manifest.hash_after(path, k)
                          for k in range(len(pset.manifest.patches) + 1)}
            if data is None or FileHash.of(data) not in known:
                raise TargetStateRefusal(target.site / path, "was changed after patchtool "
                                         "patched it; refusing to overwrite it (reinstall "
                                         f"lmcache=={target.version} instead)", ExitCode.DRIFTED)
            original = _read(target.state_dir / info["original"])
            if original is None or FileHash.of(original) != pre:
                raise Refusal(target.state_dir / info["original"], "saved original is missing "
                              "or does not match its recorded hash")
            restore[path] = original
            saved_row = info["record_row"]
            new_rows[path] = RecordRow(*saved_row)
        for info in state["files"].values():
            changes.append(Change(target.state_dir / info["original"], None))
        changes.append(Change(target.state_dir / STATE_FILE, None))
    elif status.state in (C.PATCHED, C.PARTIAL) and pset is not None:
        # No saved state (deleted by hand): reverse the series in memory and
        # accept the result only where it reproduces the wheel's hashes.
        result.source = "reverse patch"
        m = pset.manifest
        k = len(m.patches) if status.state == C.PATCHED else \
            m.step_ids().index(status.applied_through) + 1
        patches = pset.load_patches(k)
        current = {p: _read(target.site / p) for p in m.files}
        rev = unapply_series(patches, lambda p: current.get(p))
        for path in m.files:
            pre = m.hash_after(path, 0)
            data = current[path]
            if data is not None and FileHash.of(data) == pre:
                continue
            out = rev.files.get(path)
            if out is None or FileHash.of(out) != pre:
                raise Refusal(target.site / path, "reversing the series does not give the "
                              "wheel's file; reinstall lmcache instead")
            restore[path] = out
            new_rows[path] = RecordRow(path, pre.hash, str(pre.size))
    elif status.state in (C.PRISTINE, C.UNSUPPORTED, C.FIXED_UPSTREAM, C.NOT_INSTALLED):
        if state is not None:  # stale state of another lmcache version
            changes = [Change(target.state_dir / STATE_FILE, None)]
            changes += [Change(target.state_dir / i["original"], None)
                        for i in state.get("files", {}).values()]
    else:
        _refuse_state(status, target)
        raise Refusal(target.dist_info, f"{status.state}: no saved originals to restore; "
                      f"reinstall lmcache=={target.version}")

    result.restored_files = sorted(restore)
    for path in restore:
        if path not in rows:
            raise Refusal(target.record_path, f"has no row for {path}")
    if dry_run:
        result.action = "dry-run" if restore or changes else "no-op"
        return result
    if not restore and not changes:
        return result
    changes = [Change(target.site / p, b) for p, b in sorted(restore.items())] + (
        [Change(target.record_path, replace_rows(record_bytes, new_rows))] if new_rows else []
    ) + changes
    commit(target.state_dir, changes)
    result.action = "reverted" if restore else "no-op"
    result.removed_pyc = remove_stale_pyc(target.site, result.restored_files)
    return result
