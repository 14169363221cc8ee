"""``<site>/.lmcache-patchtool/state.json``: what apply did, so revert can undo
it byte-exactly.  One typed record, parsed and validated in one place.

Schema ``lmcache-patchtool/state/v1`` (unchanged since revision 1 of the tool,
so installs patched by an older patchtool keep reverting)::

    {"schema", "tool_version", "lmcache_version", "dist_info", "patch_set",
     "revision", "applied_through",
     "files": {path: {"original": "originals/<path>",
                      "pre": {hash, size}, "patched": {hash, size},
                      "record_row": [path, hash, size]}}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import Refusal
from .manifest import FileHash
from .record import RecordRow

STATE_FILE = "state.json"
SCHEMA = "lmcache-patchtool/state/v1"
ORIGINALS = "originals"


@dataclass(frozen=True)
class SavedFile:
    """One patched file: where its pristine bytes are kept, and its RECORD row
    as the wheel's installer wrote it."""

    original: str  # relative to the state dir
    pre: FileHash
    record_row: RecordRow
    patched: FileHash | None = None

    def to_json(self) -> dict:
        out = {"original": self.original, "pre": self.pre.to_json(),
               "record_row": [self.record_row.path, self.record_row.hash, self.record_row.size]}
        if self.patched is not None:
            out["patched"] = self.patched.to_json()
        return out


@dataclass
class InstallState:
    tool_version: str
    lmcache_version: str
    dist_info: str
    patch_set: str
    revision: int
    applied_through: str
    files: dict[str, SavedFile] = field(default_factory=dict)

    @classmethod
    def parse(cls, data: bytes, where: Path) -> "InstallState":
        try:
            raw = json.loads(data)
        except ValueError:
            raise Refusal(where, "not valid JSON") from None
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
            schema = raw.get("schema") if isinstance(raw, dict) else None
            raise Refusal(where, f"unknown schema {schema!r}")
        try:
            files = {}
            for path, e in raw["files"].items():
                row = [str(x) for x in e["record_row"]]
                if len(row) != 3:
                    raise ValueError(f"record_row of {path}")
                files[str(path)] = SavedFile(
                    str(e["original"]), FileHash(str(e["pre"]["hash"]), int(e["pre"]["size"])),
                    RecordRow(*row),
                    FileHash(str(e["patched"]["hash"]), int(e["patched"]["size"]))
                    if "patched" in e else None)
            return cls(str(raw["tool_version"]), str(raw["lmcache_version"]),
                       str(raw["dist_info"]), str(raw["patch_set"]), int(raw["revision"]),
                       str(raw["applied_through"]), files)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise Refusal(where, f"malformed state record ({exc!r})") from None

    def render(self) -> bytes:
        obj = {"schema": SCHEMA, "tool_version": self.tool_version,
               "lmcache_version": self.lmcache_version, "dist_info": self.dist_info,
               "patch_set": self.patch_set, "revision": self.revision,
               "applied_through": self.applied_through,
               "files": {p: f.to_json() for p, f in self.files.items()}}
        return (json.dumps(obj, indent=2) + "\n").encode()
