"""``patchtool wheel``: rebuild the real lmcache wheel with the patch series
applied, as a new wheel with a PEP 440 local version (``0.5.3+hybridfa.r1``).

The source wheel is checked against the manifest first: its sha256, and in
any case every target file's pre-image hash and every member against the
wheel's own RECORD (a tampered member must not be laundered into a freshly
hashed RECORD).  The series is applied in memory by the tool's own applier;
each result must equal the manifest's post-image.  The new wheel has

* a renamed dist-info directory and ``Version:`` in METADATA,
* every RECORD row of the source, in order (renamed, the changed files' rows
  rehashed), plus a row for the provenance file, with the source's line ends,
* WHEEL kept byte for byte,
* ``<dist-info>/lmcache_patchtool.json``: what was applied to what.

Output is deterministic (see ``wheelzip``): same source wheel, same series,
same tool version give the same sha256 on any machine, so it can be pinned
with ``--hash`` in a requirements file.

The local version and the provenance file are named and read by
:mod:`patchtool.provenance` (``status`` reads them without this module).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from . import __version__, resources, wheelzip
from . import stack as S
from .applier import APPLIES, apply_series
from .distinfo import DIST, Wheel, canonical_name
from .errors import Refusal
from .exitcodes import ExitCode
from .manifest import (MANIFEST_NAME, STATE_FIXED_UPSTREAM, FileHash, catalog, find_patch_set,
                       sha256_file)
from .provenance import PROVENANCE_FILE, PROVENANCE_SCHEMA, pinned_set, split_local, stack_tag
from .record import RecordRow


def parse_pin(text: str) -> tuple[str, str]:
    """``lmcache==X`` -> (X, the requirement as given).  Anything but one
    exact ``==``/``===`` pin of lmcache is refused: the gate must know which
    wheel it tests."""
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        raise Refusal(text, f"not a valid requirement ({exc})") from None
    if canonical_name(req.name) != DIST:
        raise Refusal(text, f"is a requirement of {req.name!r}, not lmcache")
    specs = list(req.specifier)
    if req.url or len(specs) != 1 or specs[0].operator not in ("==", "===") \
            or "*" in specs[0].version:
        raise Refusal(text, "needs an exact pin: lmcache==VERSION")
    return specs[0].version, text


def download(version: str, python: str, dest: Path) -> Path:
    """``pip download`` the real wheel (binary only, no deps) with ``python``'s
    pip, so the wheel's tags match that interpreter."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), f"{DIST}=={version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Refusal(f"{DIST}=={version}", f"pip download failed: {exc}",
                      ExitCode.PIP_FAILED) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Refusal(f"{DIST}=={version}", f"pip download failed: {last}", ExitCode.PIP_FAILED)
    found = sorted(dest.glob(f"{DIST}-{version}-*.whl"))
    if len(found) != 1:
        raise Refusal(dest, f"pip download left {len(found)} lmcache {version} wheels",
                      ExitCode.PIP_FAILED)
    return found[0]


@dataclass
class WheelBuild:
    path: str
    filename: str
    sha256: str
    version: str  # the new version, with the local tag
    lmcache_version: str  # upstream
    patch_set: str
    revision: int
    requirement: str  # a requirements-file line pinning the built wheel by hash
    source: dict  # {filename, sha256, verified_by}
    sets: list[dict] = field(default_factory=list)  # [{name, revision}], lowest first
    warnings: list[str] = field(default_factory=list)
    files: dict = field(default_factory=dict)  # path -> {pre, post} (RECORD-form hashes)
    members: int = 0
    record_rows: int = 0


def _read_source(whl) -> None:
    """Refuse a source wheel this tool built itself (``distinfo.Wheel`` has
    already refused anything that is not an lmcache wheel)."""
    if split_local(whl.version)[1] is not None or whl.has(f"{whl.dist_info}/{PROVENANCE_FILE}"):
        raise Refusal(whl.path, f"is already a patched wheel (lmcache {whl.version}); build from "
                      "the upstream wheel")


def check_source(whl, sha: str, manifest, pres: dict | None = None
                 ) -> tuple[str, list[str], dict]:
    """Refuse (WHEEL_MISMATCH) unless every target file is the manifest's
    pre-image (``pres``: {path: hash} of a whole stack, the wheel's file for
    each) and every member matches the wheel's RECORD.  Returns
    (verified_by, warnings, {path: pristine bytes})."""
    wheel = whl.path
    pristine: dict[str, bytes] = {}
    if pres is None:
        pres = {path: manifest.hash_after(path, 0) for path in manifest.files}
    for path, pre in pres.items():
        if not whl.has(path):
            raise Refusal(wheel, f"has no {path}, which the patch set edits",
                          ExitCode.WHEEL_MISMATCH)
        # Against the manifest first, so a changed target file is named as such.
        data = whl.read(path)
        got = FileHash.of(data)
        if got != pre:
            raise Refusal(wheel, f"{path} has {got.hash} (size {got.size}), but the manifest's "
                          f"pre-image is {pre.hash} (size {pre.size}): this is not the wheel "
                          "the patch set was built from", ExitCode.WHEEL_MISMATCH)
        pristine[path] = data
    # Every member against the wheel's own RECORD: the rebuilt RECORD keeps
    # these rows, so a member that does not match must not slip through.
    whl.check_all(ExitCode.WHEEL_MISMATCH)
    warnings = []
    if sha == manifest.wheel.get("sha256"):
        verified_by = "wheel sha256"
    else:
        verified_by = "per-file pre-images"
        warnings.append(f"wheel {wheel.name} (sha256 {sha}) is not the wheel the manifest was "
                        f"built from ({manifest.wheel.get('filename')}, sha256 "
                        f"{manifest.wheel.get('sha256')}); accepted because every target file "
                        "matches its pre-image hash")
    return verified_by, warnings, pristine


def _new_filename(wheel: Path, old_version: str, new_version: str) -> str:
    try:
        parse_wheel_filename(wheel.name)
    except InvalidWheelFilename as exc:
        raise Refusal(wheel, f"not a valid wheel file name ({exc})") from None
    parts = wheel.name[: -len(".whl")].split("-")
    if parts[1] != old_version:
        raise Refusal(wheel, f"file name says version {parts[1]}, METADATA says {old_version}")
    parts[1] = new_version
    return "-".join(parts) + ".whl"


def _metadata_with_version(data: bytes, version: str) -> bytes:
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip(b"\r"):
            break  # end of the header block: the body may say anything
        if line.lower().startswith(b"version:"):
            end = b"\r" if line.endswith(b"\r") else b""
            lines[i] = b"Version: " + version.encode() + end
            return b"\n".join(lines)
    raise Refusal("METADATA", "has no Version header")


def build(wheel: Path, pset, out_dir: Path, layers: list | None = None) -> WheelBuild:
    """Build the patched wheel of ``wheel`` with patch set ``pset`` (for a
    stacked set, ``layers``: its whole stack, lowest first, applied in order)
    into ``out_dir``; refuses (nothing written) when the wheel does not match."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise Refusal(wheel, "no such wheel file")
    layers = list(layers or [pset])
    stacked = len(layers) > 1
    m = pset.manifest
    if m.state == STATE_FIXED_UPSTREAM:
        raise Refusal(pset.path / "manifest.json", f"lmcache {pset.version} needs no patch: "
                      f"{m.reason}", ExitCode.FIXED_UPSTREAM)
    with Wheel.open(wheel) as whl, open(wheel, "rb") as raw:
        _read_source(whl)
        if whl.version != pset.version:
            raise Refusal(wheel, f"is lmcache {whl.version}, but the patch set is for "
                          f"{pset.version}")
        src_sha = sha256_file(wheel)
        pres = {p: S.wheel_pre(layers, p) for p in S.all_files(layers)} if stacked else None
        verified_by, warnings, pristine = check_source(whl, src_sha, layers[0].manifest
                                                       if stacked else m, pres)

        if stacked:  # every layer in order, each checked against its own manifest
            patched = S.apply_layers(layers, lambda p: pristine.get(p))
        else:
            series = apply_series(pset.load_patches(), lambda p: pristine.get(p))
            bad = [r for r in series.results if r.status != APPLIES]
            if bad:
                raise Refusal(pset.path / f"{bad[0].patch}.patch", f"{bad[0].path}: "
                              f"{bad[0].status} on the pristine wheel file; rebuild the manifest")
            patched = {}
            for path in m.files:
                out = series.files.get(path)
                want = m.hash_after(path, len(m.patches))
                if out is None or FileHash.of(out) != want:
                    raise Refusal(pset.path / "manifest.json", f"applying the series to {path} "
                                  f"does not give the manifest's post-image {want.hash}")
                patched[path] = out

        src_di = whl.dist_info
        segments = S.local_segments(layers)
        new_version = f"{whl.version}+{stack_tag(segments)}"
        new_di = f"{DIST}-{new_version}.dist-info"
        filename = _new_filename(wheel, whl.version, new_version)

        def rename(name: str) -> str:
            return new_di + name[len(src_di):] if name.startswith(src_di + "/") else name

        meta_name = f"{src_di}/METADATA"
        record_name = whl.record_name
        metadata = _metadata_with_version(whl.read(meta_name), new_version)
        provenance = _provenance(wheel, src_sha, pset, verified_by, new_version, pristine,
                                 patched, layers if stacked else None)
        prov_name = f"{new_di}/{PROVENANCE_FILE}"

        # RECORD: every source row in order, in the source's line ending; the
        # edited files and METADATA rehashed, the dist-info rows renamed, the
        # provenance row just before RECORD's own row.
        changed = {**patched, meta_name: metadata}
        edits: dict[str, RecordRow] = {}
        for r in whl.record.rows:
            if r.path == record_name:
                edits[r.path] = RecordRow(rename(r.path), "", "")
            elif r.path in changed:
                fh = FileHash.of(changed[r.path])
                edits[r.path] = RecordRow(rename(r.path), fh.hash, str(fh.size))
            elif rename(r.path) != r.path:
                edits[r.path] = RecordRow(rename(r.path), r.hash, r.size)
        prov_row = RecordRow(prov_name, FileHash.of(provenance).hash, str(len(provenance)))
        new_record = whl.record.with_rows(edits, insert_before={record_name: [prov_row]})
        record = new_record.render()

        members = []
        for info in whl.infolist():
            name = info.filename
            if name == record_name:
                members.append(wheelzip.stored(prov_name, provenance))
                members.append(wheelzip.stored(rename(name), record, info.external_attr))
            elif name in changed:
                members.append(wheelzip.stored(rename(name), changed[name], info.external_attr))
            else:
                members.append(wheelzip.copied(raw, info, rename(name)))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / filename
    wheelzip.write_zip(dest, members)
    check_built(dest, new_version)
    sha = sha256_file(dest)
    return WheelBuild(
        path=str(dest), filename=filename, sha256=sha, version=new_version,
        lmcache_version=pset.version, patch_set=pset.name, revision=m.revision,
        requirement=f"{DIST}=={new_version} --hash=sha256:{sha}",
        source={"filename": wheel.name, "sha256": src_sha, "verified_by": verified_by},
        sets=[{"name": p.name, "revision": p.manifest.revision} for p in layers],
        warnings=warnings,
        files={p: {"pre": FileHash.of(pristine[p]).hash, "post": FileHash.of(b).hash}
               for p, b in patched.items()},
        members=len(members), record_rows=len(new_record))


def _provenance(wheel: Path, src_sha: str, pset, verified_by: str, new_version: str,
                pristine: dict[str, bytes], patched: dict[str, bytes],
                layers: list | None = None) -> bytes:
    """The provenance file.  The top-level set fields name the top set (what
    an unstacked wheel always had); a stack adds ``sets``, lowest first."""
    m = pset.manifest
    doc = {
        "schema": PROVENANCE_SCHEMA,
        "tool": "lmcache-patchtool",
        "tool_version": __version__,
        "lmcache_version": pset.version,
        "version": new_version,
        "patch_set": pset.name,
        "revision": m.revision,
        "vllm_versions": m.vllm_versions,
        "upstream": m.upstream,
        # No paths or times of the build machine: the file is part of the
        # pinned hash.
        "source_wheel": {"filename": wheel.name, "sha256": src_sha, "verified_by": verified_by},
        "manifest_wheel": m.wheel,
        "patches": [{"id": p.id, "file": p.file, "sha256": p.sha256} for p in m.patches],
        "files": {p: {"pre": FileHash.of(pristine[p]).to_json(),
                      "post": FileHash.of(patched[p]).to_json()} for p in sorted(patched)},
    }
    if layers:  # only for a stack: an unstacked wheel's bytes (and pinned hash) are unchanged
        doc["sets"] = [{"patch_set": p.name, "revision": p.manifest.revision,
                        "patches": [{"id": e.id, "file": e.file, "sha256": e.sha256}
                                    for e in p.manifest.patches]} for p in layers]
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


def check_built(path: Path, version: str | None = None) -> None:
    """Re-read a built wheel: every CRC, its METADATA version, and every
    member against its RECORD.  A failure here is a bug in this module, so
    it is not a Refusal."""
    try:
        with Wheel.open(path) as whl:
            bad = whl.zf.testzip()
            if bad is not None:
                raise RuntimeError(f"{path}: member {bad} fails its CRC")
            if version is not None and whl.version != version:
                raise RuntimeError(f"{path}: METADATA says {whl.version}, not {version}")
            whl.check_all()
    except Refusal as exc:
        raise RuntimeError(f"built wheel {exc}") from None


def wheel_version(wheel: Path) -> str:
    """The lmcache version in a wheel's METADATA (refuses a non-lmcache wheel,
    and a wheel this tool patched)."""
    with Wheel.open(Path(wheel)) as whl:
        _read_source(whl)
        return whl.version


def locate_patch_set(root: Path, version: str, set_name: str | None):
    """The patch set for ``version``, or a refusal whose code says why there
    is none: UNSUPPORTED_VERSION when the version is older than every version
    the shipped sets cover (the code the series fixes predates it), else
    NO_PATCH_SET (a newer or in-between release: port the series, or ship a
    fixed-upstream manifest).  A fixed-upstream set is returned; callers
    decide what that means for them."""
    pset = find_patch_set(root, version, set_name)
    if pset is not None:
        return pset
    covered = []
    for s, v, d in catalog(root):
        if (set_name is None or s == set_name) and \
                ((d / MANIFEST_NAME).exists() or any(d.glob("*.patch"))):
            try:
                covered.append(Version(v))
            except InvalidVersion:
                continue
    try:
        wanted = Version(version)
    except InvalidVersion:
        raise Refusal(f"lmcache=={version}", "not a valid version") from None
    where = f" ({', '.join(str(v) for v in sorted(covered))} covered)" if covered else ""
    if covered and wanted < min(covered):
        raise Refusal(f"lmcache=={version}", f"unsupported version: older than every version "
                      f"the patch sets cover{where}", ExitCode.UNSUPPORTED_VERSION)
    raise Refusal(f"lmcache=={version}", f"no patch set for lmcache {version}{where}: port the "
                  "series to it, or ship a fixed-upstream manifest if upstream fixed the bug",
                  ExitCode.NO_PATCH_SET)


def build_requested(requirement: str | None, from_wheel: str | None, output_dir: Path,
                    python: str | None, set_name: str | None) -> WheelBuild:
    """``patchtool wheel``: the patched wheel of ``lmcache==X`` (downloaded with
    ``python``'s pip) or of a local upstream wheel.  A pin of a wheel this
    tool built names its sets: that stack is built, and only at the shipped
    revisions."""
    if not requirement and not from_wheel:
        raise Refusal("wheel", "give lmcache==VERSION, or --from FILE.whl", ExitCode.USAGE)
    root = resources.patches_root()
    version = parse_pin(requirement)[0] if requirement else None
    pinned = version
    if version is not None:
        assert requirement is not None
        version, set_name = pinned_set(root, requirement, version, set_name)
    if from_wheel:
        found = wheel_version(Path(from_wheel))
        if version is not None and found != version:
            raise Refusal(from_wheel, f"is lmcache {found}, not {version}")
        version = found
    assert version is not None
    pset = locate_patch_set(root, version, set_name)
    layers = S.resolve(root, pset)  # a stacked set builds its whole stack
    if pinned is not None and pinned != version:
        builds = f"{version}+{stack_tag([(p.name, p.manifest.revision) for p in layers])}"
        if builds != pinned:  # another revision than the shipped ones: nothing is built
            raise Refusal(requirement, f"this patchtool builds {builds}, not {pinned}: pin "
                          f"lmcache=={builds}, or use the patchtool that shipped {pinned}")
    with tempfile.TemporaryDirectory(prefix="patchtool-wheel-") as tmp:
        src = Path(from_wheel) if from_wheel else \
            download(version, python or sys.executable, Path(tmp))
        return build(src, pset, Path(output_dir), layers)
