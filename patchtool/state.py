"""``<site>/.lmcache-patchtool/state.json``: what apply did, so revert can undo
it byte-exactly.  One typed record, parsed and validated in one place.

Schema ``lmcache-patchtool/state/v1`` (unchanged since revision 1 of the tool,
so installs patched by an older patchtool keep reverting)::

    {"schema", "tool_version", "lmcache_version", "dist_info", "patch_set",
     "revision", "applied_through",
     "files": {path: {"original": "originals/<path>",
                      "pre": {hash, size}, "patched": {hash, size},
                      "record_row": [path, hash, size]}}}

An install patched with a stack of sets (hybrid-fa, then engine-driven over
it) is written as schema ``lmcache-patchtool/state/v2``, one record per layer,
lowest first::

    {"schema", "tool_version", "lmcache_version", "dist_info",
     "sets": [{"patch_set", "revision", "applied_through", "files": {...}}, ...]}

Each layer's ``files`` entry is as in v1, relative to THAT layer: ``pre`` and
``original`` are the bytes the layer found (the wheel's, or for a file a lower
layer also edits, that layer's post-image, kept under ``layers/<set>/``), and
``record_row`` is RECORD's row before the layer.  A single layer is always
written as v1, byte for byte what the tool wrote before stacking existed, so
either tool reads the other's single-set state; a patchtool older than stacks
refuses a v2 state in one line (unknown schema) instead of half-reverting it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import Refusal
from .fsio import Reader
from .manifest import FileHash
from .record import RecordRow

STATE_FILE = "state.json"
SCHEMA = "lmcache-patchtool/state/v1"
SCHEMA_STACK = "lmcache-patchtool/state/v2"
ORIGINALS = "originals"
# Pre-images of a stacked layer's files that a lower layer also edits.
LAYER_ORIGINALS = "layers"


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
class LayerState:
    """What one patch set of the stack did: its revision, how far its series
    went, and per file what it found (so peeling it restores exactly that)."""

    patch_set: str
    revision: int
    applied_through: str
    files: dict[str, SavedFile] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"patch_set": self.patch_set, "revision": self.revision,
                "applied_through": self.applied_through,
                "files": {p: f.to_json() for p, f in self.files.items()}}


def _files(raw: dict) -> dict[str, SavedFile]:
    files = {}
    for path, e in raw.items():
        row = [str(x) for x in e["record_row"]]
        if len(row) != 3:
            raise ValueError(f"record_row of {path}")
        files[str(path)] = SavedFile(
            str(e["original"]), FileHash(str(e["pre"]["hash"]), int(e["pre"]["size"])),
            RecordRow(*row),
            FileHash(str(e["patched"]["hash"]), int(e["patched"]["size"]))
            if "patched" in e else None)
    return files


def _layer(raw: dict) -> LayerState:
    return LayerState(str(raw["patch_set"]), int(raw["revision"]), str(raw["applied_through"]),
                      _files(raw["files"]))


@dataclass
class InstallState:
    tool_version: str
    lmcache_version: str
    dist_info: str
    layers: list[LayerState] = field(default_factory=list)  # lowest first

    @property
    def top(self) -> LayerState:
        return self.layers[-1]

    def layer(self, name: str) -> LayerState | None:
        return next((la for la in self.layers if la.patch_set == name), None)

    def set_names(self) -> list[str]:
        return [la.patch_set for la in self.layers]

    def originals(self) -> dict[str, SavedFile]:
        """Per path, the entry of the LOWEST layer that edited it: the wheel's
        bytes and RECORD row (what reverting the whole stack puts back)."""
        out: dict[str, SavedFile] = {}
        for la in self.layers:
            for path, f in la.files.items():
                out.setdefault(path, f)
        return out

    @classmethod
    def parse(cls, data: bytes, where: Path) -> "InstallState":
        try:
            raw = json.loads(data)
        except ValueError:
            raise Refusal(where, "not valid JSON") from None
        schema = raw.get("schema") if isinstance(raw, dict) else None
        if schema not in (SCHEMA, SCHEMA_STACK):
            raise Refusal(where, f"unknown schema {schema!r}")
        try:
            layers = ([_layer(raw)] if schema == SCHEMA else
                      [_layer(la) for la in raw["sets"]])
            if not layers:
                raise ValueError("no sets")
            return cls(str(raw["tool_version"]), str(raw["lmcache_version"]),
                       str(raw["dist_info"]), layers)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise Refusal(where, f"malformed state record ({exc!r})") from None

    def render(self) -> bytes:
        head = {"tool_version": self.tool_version, "lmcache_version": self.lmcache_version,
                "dist_info": self.dist_info}
        if len(self.layers) == 1:
            obj = {"schema": SCHEMA, **head, **{k: v for k, v in self.top.to_json().items()}}
        else:
            obj = {"schema": SCHEMA_STACK, **head, "sets": [la.to_json() for la in self.layers]}
        return (json.dumps(obj, indent=2) + "\n").encode()


# ---------------------------------------------------------------- leftovers


@dataclass
class Leftover:
    """Files of the state dir that no record of THIS install names: the
    state of another lmcache version (``pip install lmcache==X`` replaces the
    package and never looks here, so the old version's state.json and saved
    pristine files stay), or saved files no record lists any more.  None of
    them can restore anything in this install; apply and revert remove them
    in their own transaction, status and verify report them."""

    dir: str
    lmcache_version: str | None  # the version whose state.json is here; None: orphans only
    files: list[str]  # relative to the state dir, sorted

    def describe(self) -> str:
        whose = (f"left by lmcache {self.lmcache_version}" if self.lmcache_version
                 else "that no record names")
        return f"{len(self.files)} file(s) of patchtool state {whose}"


def saved_entries(state_dir: Path, reader: Reader) -> list[str]:
    """Every entry under the trees of saved files (``originals/``,
    ``layers/``), relative to ``state_dir``."""
    return [str(p.relative_to(state_dir)) for tree in (ORIGINALS, LAYER_ORIGINALS)
            for p in reader.entries(state_dir / tree)]


def find_leftover(state_dir: Path, state: InstallState | None, version: str,
                  reader: Reader) -> Leftover | None:
    """What of the state dir belongs to no record of lmcache ``version``:
    ``state`` (the parsed state.json) when it is another version's, and every
    saved entry that ``state`` does not name when it is this version's."""
    other = state is not None and state.lmcache_version != version
    named: set[str] = set()
    if state is not None and not other:
        named = {f.original for la in state.layers for f in la.files.values()}
    files = [e for e in saved_entries(state_dir, reader) if e not in named]
    if other:
        files.append(STATE_FILE)
    if not files:
        return None
    return Leftover(str(state_dir), state.lmcache_version if other else None, sorted(files))


def refuse_links(state_dir: Path, leftover: Leftover | None, reader: Reader) -> None:
    """A symbolic link among the leftovers is not deleted on a guess: a
    rollback would put a regular file where it was."""
    for rel in (leftover.files if leftover else []):
        link = reader.link_on(state_dir, rel)
        if link is not None:
            raise Refusal(link, "is a symbolic link inside patchtool's state dir; remove it "
                          "by hand")
