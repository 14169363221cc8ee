"""The one reader of wheels and installed ``*.dist-info`` directories.

* METADATA is parsed with the stdlib's ``email.parser`` (headers only; the
  body may say anything), as the core-metadata spec prescribes.
* Project names are compared in their PEP 503 canonical form, the one
  ``packaging.utils.canonicalize_name`` gives (``LMCache``, ``lmcache`` and
  ``LM_Cache`` are one project).
* A wheel's members are read checked against the wheel's own RECORD (hash
  and size), so a member edited after the wheel was built is refused.

Every failure to read is a :class:`~patchtool.errors.Refusal` naming the file.
Nothing here imports torch, lmcache or any non-stdlib module (``status``
runs without this tool's dependencies); ``zipfile`` is imported on use, so
``status`` starts fast.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from email.parser import BytesHeaderParser
from pathlib import Path

from .errors import Refusal
from .exitcodes import ExitCode
from .record import Record, RecordRow, record_hash

DIST = "lmcache"
METADATA = "METADATA"
RECORD = "RECORD"
# dist-info files a wheel's RECORD lists without a hash: RECORD itself and its
# signatures.
UNHASHED = (RECORD, "RECORD.jws", "RECORD.p7s")
_DIST_SUFFIXES = (".dist-info", ".egg-info")


# PEP 503's normalization, which ``packaging.utils.canonicalize_name`` is (a test
# pins the two equal).  Spelled out here because ``status --json`` runs in the
# target interpreter without this tool's dependencies (tests/tool/test_lifecycle).
_SEPARATORS = re.compile(r"[-_.]+")


def canonical_name(name: str) -> str:
    """A project name in canonical form (PEP 503): ``LM_Cache`` -> ``lm-cache``."""
    return _SEPARATORS.sub("-", name).lower()


def project_of(entry: str) -> str | None:
    """The canonical project name of a site-packages entry that describes a
    distribution (``Foo_Bar-1.0.dist-info``, ``*.egg-info``, ``Foo.egg-link``),
    or None for any other entry."""
    for suffix in _DIST_SUFFIXES:
        if entry.endswith(suffix) and "-" in entry[: -len(suffix)]:
            return canonical_name(entry[: -len(suffix)].split("-", 1)[0])
    if entry.endswith(".egg-link"):
        return canonical_name(entry[: -len(".egg-link")])
    return None


@dataclass(frozen=True)
class Metadata:
    name: str  # as written
    version: str

    @property
    def project(self) -> str:
        return canonical_name(self.name)


def parse_metadata(data: bytes, where: object) -> Metadata:
    """Name and Version of a METADATA file (refuses one without Version)."""
    headers = BytesHeaderParser().parsebytes(data)

    def get(key: str) -> str:
        value = headers.get(key)
        return "" if value is None else str(value).strip()

    version = get("Version")
    if not version:
        raise Refusal(where, "has no Version header")
    return Metadata(get("Name"), version)


# ---------------------------------------------------------------- installed


def _read_bytes(path: Path, missing: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise Refusal(path, missing) from None
    except OSError as exc:
        raise Refusal(path, f"cannot read: {exc.strerror or exc}") from None


def read_metadata(dist_info: Path) -> Metadata:
    """The METADATA of an installed ``*.dist-info`` directory."""
    path = Path(dist_info) / METADATA
    return parse_metadata(_read_bytes(path, "missing: the distribution is incomplete"), path)


def dists_in(site_dir: str, project: str) -> list[Path]:
    """Every ``<project>-*.dist-info`` / ``.egg-info`` / ``.egg-link`` entry of
    one site dir, sorted (the one scan of a site dir for a project)."""
    want = canonical_name(project)
    return sorted(Path(e.path) for e in os.scandir(site_dir) if project_of(e.name) == want)


def installed_version(site_dirs: list[str], project: str) -> str | None:
    """The version in the METADATA of the first ``<project>-*.dist-info`` in
    ``site_dirs`` (searched in order, as lmcache's are), or None when there is
    none.  For a neighbour of lmcache (vLLM) that is only reported, never
    acted on, so an unreadable METADATA also gives None instead of a refusal."""
    for d in site_dirs:
        try:
            found = [p for p in dists_in(d, project) if p.suffix == ".dist-info"]
        except OSError:
            continue
        for dist in found:
            try:
                return read_metadata(dist).version
            except Refusal:
                continue
    return None


def read_record(dist_info: Path) -> Record:
    """The RECORD of an installed ``*.dist-info`` directory."""
    return Record.read(Path(dist_info) / RECORD)


def read_installer(dist_info: Path) -> str:
    """The INSTALLER file's first line ("pip", "uv"), or "" when absent."""
    path = Path(dist_info) / "INSTALLER"
    try:
        return path.read_bytes().decode("utf-8", "replace").strip().split("\n", 1)[0].strip()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise Refusal(path, f"cannot read: {exc.strerror or exc}") from None


def read_json(path: Path) -> dict | None:
    """A JSON file of a dist-info directory (``direct_url.json``, the patched
    wheel's provenance): None when absent, a refusal when unreadable or not
    a JSON object."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Refusal(path, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise Refusal(path, "not valid JSON (not UTF-8)") from None
    try:
        doc = json.loads(text)
    except ValueError:
        raise Refusal(path, "not valid JSON") from None
    if not isinstance(doc, dict):
        raise Refusal(path, "not valid JSON (not an object)")
    return doc


# ---------------------------------------------------------------- wheels


class Wheel:
    """An open wheel: its one ``*.dist-info``, METADATA and RECORD.

    ``Wheel.open(path)`` refuses a file that is not a readable zip, not a
    wheel (not exactly one top-level ``*.dist-info/RECORD``) or (with
    ``project``) a wheel of another project.  Use it as a context manager.
    """

    def __init__(self, path: Path, zf, dist_info: str, metadata: Metadata, record: Record):
        self.path = path
        self.zf = zf
        self.dist_info = dist_info  # "lmcache-0.5.3.dist-info"
        self.metadata = metadata
        self.record = record

    @classmethod
    def open(cls, path: Path, project: str | None = DIST) -> "Wheel":
        import zipfile  # lazy: status reads installs, never wheels, and starts faster without it

        path = Path(path)
        if not path.is_file():
            raise Refusal(path, "no such wheel file")
        try:
            zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise Refusal(path, f"not a readable zip ({exc})") from None
        try:
            records = [n for n in zf.namelist()
                       if n.count("/") == 1 and n.endswith(f".dist-info/{RECORD}")]
            if len(records) != 1:
                raise Refusal(path, "not a wheel: expected exactly one *.dist-info/RECORD")
            dist_info = records[0].split("/")[0]
            whl = cls(path, zf, dist_info, Metadata("", ""), Record.from_rows([]))
            whl.metadata = parse_metadata(whl.read(f"{dist_info}/{METADATA}"),
                                          f"{path}: {dist_info}/{METADATA}")
            whl.record = Record.parse(whl.read(records[0]), f"{path}: {records[0]}")
            if project is not None and whl.metadata.project != canonical_name(project):
                raise Refusal(path, f"is a wheel of {whl.metadata.name!r}, not {project}")
        except BaseException:
            zf.close()
            raise
        return whl

    def close(self) -> None:
        self.zf.close()

    def __enter__(self) -> "Wheel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ members

    @property
    def version(self) -> str:
        return self.metadata.version

    @property
    def record_name(self) -> str:
        return f"{self.dist_info}/{RECORD}"

    def names(self) -> list[str]:
        return self.zf.namelist()

    def infolist(self) -> list:
        return self.zf.infolist()

    def has(self, name: str) -> bool:
        try:
            self.zf.getinfo(name)
        except KeyError:
            return False
        return True

    def read(self, name) -> bytes:
        """A member's bytes (``name`` or a ZipInfo), NOT checked against RECORD."""
        # lazy: status reads installs, never wheels, and starts faster without these
        import zipfile
        import zlib

        shown = getattr(name, "filename", name)
        try:
            return self.zf.read(name)
        except KeyError:
            raise Refusal(self.path, f"has no {shown}") from None
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError,
                RuntimeError) as exc:
            raise Refusal(self.path, f"{shown}: unreadable member ({exc})") from None

    def _is_unhashed(self, name: str) -> bool:
        return name.startswith(self.dist_info + "/") and name.rsplit("/", 1)[1] in UNHASHED

    def check(self, name: str, data: bytes, code: ExitCode = ExitCode.REFUSED) -> None:
        """Refuse unless ``data`` (member ``name``'s bytes) matches its RECORD row."""
        row: RecordRow | None = self.record.row(name)
        if row is None or not row.hash:
            raise Refusal(self.path, f"{name} has no hashed RECORD row", code)
        if row.hash != record_hash(data) or (row.size and row.size != str(len(data))):
            raise Refusal(self.path, f"{name} does not match the wheel's own RECORD (the wheel "
                          "was modified after it was built)", code)

    def member(self, name: str, code: ExitCode = ExitCode.REFUSED) -> bytes:
        """A member's bytes, checked against the wheel's own RECORD."""
        data = self.read(name)
        self.check(name, data, code)
        return data

    def check_all(self, code: ExitCode = ExitCode.REFUSED) -> None:
        """Every member against RECORD, and every hashed RECORD row against a
        member: nothing unlisted, nothing missing, nothing modified."""
        for info in self.zf.infolist():
            if info.is_dir() or self._is_unhashed(info.filename):
                continue
            self.check(info.filename, self.read(info), code)
        names = set(self.zf.namelist())
        missing = sorted(r.path for r in self.record.rows if r.hash and r.path not in names)
        if missing:
            raise Refusal(self.path, f"RECORD lists {missing[0]}, which the wheel does not "
                          "contain", code)
