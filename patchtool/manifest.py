"""Patch-set manifests: the record, loading it, the patch-file integrity
gate, and finding the set for a version.

A patch set for one LMCache version is a directory
``<root>/<set>/<lmcache-version>/`` holding ``NN-name.patch`` files and a
``manifest.json`` produced by ``patchtool manifest build``
(:mod:`patchtool.manifest_build`, never by hand).  Field reference:
docs/reference.md ("Manifests").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .applier import Patch, parse_patch
from .errors import Refusal
from .record import record_hash

SCHEMA = "lmcache-patchtool/manifest/v1"
MANIFEST_NAME = "manifest.json"
STATE_PATCH = "patch"
STATE_FIXED_UPSTREAM = "fixed-upstream"


@dataclass(frozen=True)
class FileHash:
    hash: str  # RECORD form: "sha256=<urlsafe b64>"
    size: int

    @classmethod
    def of(cls, data: bytes) -> "FileHash":
        return cls(record_hash(data), len(data))

    def to_json(self) -> dict:
        return {"hash": self.hash, "size": self.size}


@dataclass(frozen=True)
class PatchEntry:
    """One patch of the series: its id (file name without ``.patch``), file
    name, sha256 (hex) and the files it edits."""

    id: str
    file: str
    sha256: str
    files: tuple[str, ...]

    def to_json(self) -> dict:
        return {"id": self.id, "file": self.file, "sha256": self.sha256,
                "files": list(self.files)}


@dataclass(frozen=True)
class FileEntry:
    """A target file: the wheel's bytes (``pre``), the whole series' result
    (``post``), and its hash after each patch that touches it (cumulative),
    so a series applied only up to ``--patch ID`` is recognised."""

    pre: FileHash
    post: FileHash
    steps: dict[str, FileHash]

    def to_json(self) -> dict:
        return {"pre": self.pre.to_json(), "post": self.post.to_json(),
                "steps": {k: v.to_json() for k, v in self.steps.items()}}


@dataclass(frozen=True)
class PreviousRevision:
    """A superseded revision: its patch files' sha256 and its post-images, so
    an install patched with it is ``patched-older-revision``, not drifted."""

    revision: int
    patches: dict[str, str]  # patch file name -> sha256 (hex)
    files: dict[str, FileHash]  # path -> post-image

    def to_json(self) -> dict:
        return {"revision": self.revision, "patches": self.patches,
                "files": {k: v.to_json() for k, v in self.files.items()}}


@dataclass
class Manifest:
    patch_set: str
    lmcache_version: str
    state: str  # "patch" | "fixed-upstream"
    revision: int
    vllm_versions: list[str]
    upstream: list[str]
    tool_version: str
    wheel: dict  # {"filename", "sha256" (hex)}
    reason: str = ""
    patches: list[PatchEntry] = field(default_factory=list)  # in series order
    files: dict[str, FileEntry] = field(default_factory=dict)
    previous_revisions: list[PreviousRevision] = field(default_factory=list)
    # Operator-facing notes `patchtool status` prints for this version (what
    # upstream fixed and what it did not, known limits). Omitted when empty.
    notes: list[str] = field(default_factory=list)
    # The disk-tier key namespace format this series writes (``+kvl<N>-<hex>``
    # after the model name, EXPLAINER "Disk-tier keys"); None: the series
    # writes pristine keys only.  Read by `status` and `l2 scan`.
    l2_format: int | None = None
    # The patch sets this one is stacked on, lowest first (``["hybrid-fa"]``).
    # Empty: a base set, whose pre-images are the wheel's.  A stacked set's
    # pre-image of a file a required set also edits is that set's post-image
    # (``patchtool manifest build`` applies the required sets first), so the
    # series only ever applies on top of them.  Omitted from JSON when empty,
    # so manifests written before stacking existed stay byte-identical.
    requires: list[str] = field(default_factory=list)
    # The LMCache transfer modes (``lmcache_driven``, ``engine_driven``) the
    # CPU restore gate must pass for an install whose top set is this one
    # (`verify --restore cpu`, `ci`): a set that fixes the engine-driven path
    # is proven in that mode too.  Empty: ``lmcache_driven`` alone, and the
    # field is omitted from JSON (older manifests stay byte-identical).
    gate_transfer_modes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out: dict = {
            "schema": SCHEMA,
            "patch_set": self.patch_set,
            "lmcache_version": self.lmcache_version,
            "state": self.state,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.requires:
            out["requires"] = list(self.requires)
        out.update({
            "revision": self.revision,
            "vllm_versions": self.vllm_versions,
            "upstream": self.upstream,
        })
        if self.notes:
            out["notes"] = self.notes
        if self.l2_format is not None:
            out["l2_format"] = self.l2_format
        if self.gate_transfer_modes:
            out["gate_transfer_modes"] = list(self.gate_transfer_modes)
        out.update({
            "tool_version": self.tool_version,
            "wheel": self.wheel,
            "patches": [p.to_json() for p in self.patches],
            "files": {path: entry.to_json() for path, entry in self.files.items()},
            "previous_revisions": [p.to_json() for p in self.previous_revisions],
        })
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    def step_ids(self) -> list[str]:
        return [p.id for p in self.patches]

    def hash_after(self, path: str, step: int) -> FileHash:
        """The file's expected hash after the first ``step`` patches (0 = pristine)."""
        entry = self.files[path]
        found = entry.pre
        for pid in self.step_ids()[:step]:
            found = entry.steps.get(pid, found)
        return found


def _fh(obj: dict, where: Path) -> FileHash:
    try:
        return FileHash(str(obj["hash"]), int(obj["size"]))
    except (KeyError, TypeError, ValueError):
        raise Refusal(where, f"malformed file hash entry {obj!r}") from None


def _requires(value: object, where: Path) -> list[str]:
    """``requires``: a list of distinct patch set names (not this set's own)."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) \
            or len(set(value)) != len(value):
        raise Refusal(where, f"malformed requires {value!r}: a list of distinct patch set names")
    return list(value)


GATE_TRANSFER_MODES = ("lmcache_driven", "engine_driven")


def check_gate_modes(value: object, where: Path) -> list[str]:
    """``gate_transfer_modes``: distinct names from :data:`GATE_TRANSFER_MODES`."""
    if not isinstance(value, list) or not all(v in GATE_TRANSFER_MODES for v in value) \
            or len(set(value)) != len(value):
        raise Refusal(where, f"malformed gate_transfer_modes {value!r}: distinct names from "
                      f"{', '.join(GATE_TRANSFER_MODES)}")
    return list(value)


def gate_modes(manifest: "Manifest | None") -> list[str]:
    """The transfer modes the CPU restore gate runs for an install whose top
    set has ``manifest``: its ``gate_transfer_modes``, else lmcache-driven."""
    return list(manifest.gate_transfer_modes) if manifest and manifest.gate_transfer_modes \
        else ["lmcache_driven"]


def load_manifest(path: Path) -> Manifest:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise Refusal(path, "missing: generate it with `patchtool manifest build`") from None
    except ValueError as exc:
        raise Refusal(path, f"not valid JSON ({exc})") from None
    if raw.get("schema") != SCHEMA:
        raise Refusal(path, f"unknown schema {raw.get('schema')!r} (this tool reads {SCHEMA})")
    try:
        return Manifest(
            patch_set=raw["patch_set"],
            lmcache_version=raw["lmcache_version"],
            state=raw["state"],
            reason=raw.get("reason", ""),
            revision=int(raw["revision"]),
            vllm_versions=list(raw["vllm_versions"]),
            upstream=list(raw["upstream"]),
            notes=[str(n) for n in raw.get("notes", [])],
            l2_format=None if raw.get("l2_format") is None else int(raw["l2_format"]),
            requires=_requires(raw.get("requires", []), path),
            gate_transfer_modes=check_gate_modes(raw.get("gate_transfer_modes", []), path),
            tool_version=raw["tool_version"],
            wheel=dict(raw["wheel"]),
            patches=[PatchEntry(str(p["id"]), str(p["file"]), str(p["sha256"]),
                                tuple(str(f) for f in p["files"])) for p in raw["patches"]],
            files={
                p: FileEntry(_fh(e["pre"], path), _fh(e["post"], path),
                             {k: _fh(v, path) for k, v in e["steps"].items()})
                for p, e in raw["files"].items()
            },
            previous_revisions=[
                PreviousRevision(int(p["revision"]), {str(k): str(v) for k, v in
                                                      p["patches"].items()},
                                 {k: _fh(v, path) for k, v in p["files"].items()})
                for p in raw["previous_revisions"]
            ],
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise Refusal(path, f"malformed manifest ({exc!r})") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class PatchSetDir:
    """One ``<set>/<version>`` directory with its verified manifest."""

    name: str
    version: str
    path: Path
    manifest: Manifest

    def patch_files(self) -> list[Path]:
        return [self.path / p.file for p in self.manifest.patches]

    def load_patches(self, upto: int | None = None) -> list[Patch]:
        """Parse the series (first ``upto`` patches).  Hashes were checked at load."""
        files = self.patch_files()
        return [parse_patch(p) for p in files[: len(files) if upto is None else upto]]


def verify_patch_files(directory: Path, manifest: Manifest) -> None:
    """Refuse unless the directory's *.patch files are exactly the manifest's,
    byte for byte (sha256).  This runs before any patch is parsed."""
    listed = [p.file for p in manifest.patches]
    present = sorted(p.name for p in directory.glob("*.patch"))
    for name in present:
        if name not in listed:
            raise Refusal(directory / name, "not listed in manifest.json (rebuild the manifest)")
    for entry in manifest.patches:
        path = directory / entry.file
        if not path.is_file():
            raise Refusal(path, "listed in manifest.json but missing")
        actual = sha256_file(path)
        if actual != entry.sha256:
            raise Refusal(path, f"sha256 {actual} differs from manifest.json "
                          f"({entry.sha256}): the patch file was modified after the "
                          "manifest was built")


def open_patch_set(directory: Path) -> PatchSetDir:
    directory = Path(directory)
    manifest = load_manifest(directory / MANIFEST_NAME)
    if manifest.lmcache_version != directory.name:
        raise Refusal(directory / MANIFEST_NAME, f"is for lmcache {manifest.lmcache_version}, "
                      f"but lives in a directory named {directory.name}")
    verify_patch_files(directory, manifest)
    return PatchSetDir(directory.parent.name, directory.name, directory, manifest)


def catalog(root: Path) -> list[tuple[str, str, Path]]:
    """(set, version, dir) for every ``<root>/<set>/<version>/`` directory."""
    out = []
    if not root.is_dir():
        return out
    for set_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        for ver_dir in sorted(p for p in set_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
            out.append((set_dir.name, ver_dir.name, ver_dir))
    return out


def find_patch_set(root: Path, version: str, set_name: str | None) -> PatchSetDir | None:
    """The patch set for ``version``; None when no set covers it.

    A version directory without manifest.json and without patches (the lead's
    placeholder while a series is being written) does not count as support.
    """
    matches = [(s, d) for s, v, d in catalog(root)
               if v == version and (set_name is None or s == set_name)
               and ((d / MANIFEST_NAME).exists() or any(d.glob("*.patch")))]
    if set_name is not None and not any(s == set_name for s, _, _ in catalog(root)):
        raise Refusal(root / set_name, "no such patch set")
    if not matches:
        return None
    if len(matches) > 1 and set_name is None:
        # A stacked set (engine-driven over hybrid-fa) is never the default:
        # without --set, the one base set is meant, as before stacking.
        bases = [(s, d) for s, d in matches
                 if not ((d / MANIFEST_NAME).exists() and load_manifest(d / MANIFEST_NAME).requires)]
        if len(bases) == 1:
            matches = bases
    if len(matches) > 1:
        names = ", ".join(s for s, _ in matches)
        raise Refusal(root, f"several patch sets cover lmcache {version} ({names}); choose one with --set")
    return open_patch_set(matches[0][1])


@dataclass
class ListRow:
    set: str
    lmcache_version: str
    path: str
    state: str  # patch | fixed-upstream | invalid: <reason> | no manifest
    revision: int | None = None
    patches: int = 0
    vllm_versions: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)  # the sets it is stacked on


def list_patch_sets(root: Path) -> list[ListRow]:
    rows = []
    for set_name, version, d in catalog(root):
        row = ListRow(set_name, version, str(d), "no manifest")
        if (d / MANIFEST_NAME).exists():
            try:
                ps = open_patch_set(d)
            except Refusal as exc:
                row.state = f"invalid: {exc.reason}"
            else:
                m = ps.manifest
                row.state, row.revision, row.patches = m.state, m.revision, len(m.patches)
                row.vllm_versions, row.files = m.vllm_versions, sorted(m.files)
                row.requires = list(m.requires)
        rows.append(row)
    return rows
