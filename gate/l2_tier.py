"""The L2 tier a gate's servers share: an ``fs`` directory or a Redis (RESP) server.

The restore gate stores through one server, kills it and restores through
another; both are started with the same ``--l2-adapter``.  This module owns
what differs between tiers: the adapter's JSON, how to list one model's
finished objects (files, or keys found with ``SCAN``), and whether an object
carries the checksum trailer of a patched build.  Everything else in the gate
is tier-blind.

Object names are LMCache's own: the fs adapter's file name
(``<model>@<rank>@<group>@<hash>[@salt].data``, ``/`` written ``-SEP-``) or
the native connector's key (``<model>@<rank>@<group>@<hash>[@salt]``), which
a patched build that seals objects prefixes with ``lmcptsum1@``
(native_connector_l2_adapter.py, part 17-resp-checksum).

The RESP side imports redis-py lazily: it runs in the target environment
(every LMCache release depends on ``redis``) and in the project venv.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# The checksum trailer both tiers' patched adapters append: 64 bytes ending in
# this magic (fs_l2_adapter.py part 12, native_connector_l2_adapter.py part 17).
TRAILER_LEN = 64
TRAILER_MAGIC = b"LMCPTSUM"
# The key prefix of a sealed RESP object (part 17-resp-checksum).
SEALED_KEY_PREFIX = "lmcptsum1@"


@dataclass(frozen=True)
class TierObject:
    """One finished object: its name on the tier, size and trailer."""

    name: str
    size: int
    sealed: bool

    @property
    def model_field(self) -> str:
        """The model field of the name (``+namespace`` included), ``/`` restored."""
        return self.name.removeprefix(SEALED_KEY_PREFIX).split("@", 1)[0].replace("-SEP-", "/")

    @property
    def kv_len(self) -> int:
        return self.size - TRAILER_LEN if self.sealed else self.size


class Tier(Protocol):
    def adapter_json(self) -> str: ...
    def objects(self, model: str) -> list[TierObject]: ...
    def unfinished(self) -> int: ...
    def describe(self) -> str: ...


def _of_model(name: str, model: str) -> bool:
    """Whether an object name (fs or RESP, sealed or not) belongs to ``model``:
    its model field is ``model`` or, where a build keys by layout,
    ``model+<namespace>`` (``+`` never occurs in the gates' own model names)."""
    field = name.removeprefix(SEALED_KEY_PREFIX).split("@", 1)[0]
    return field == model or field.startswith(model + "+")


def files_under(root: Path | str) -> dict[Path, int]:
    """Every file under ``root`` with its size, as found now.

    The fs adapter writes ``<name>.tmp`` and renames it to ``<name>.data``, so
    a ``.tmp`` listed by ``rglob`` can be gone by the time it is stat'ed.  Such
    a file is left out (its ``.data`` shows up on the next listing) rather than
    aborting the caller: the gate polls this while stores are in flight.
    """
    out: dict[Path, int] = {}
    for f in sorted(Path(root).rglob("*")):
        try:
            st = f.lstat()  # one call: a regular file (not a link) and its size
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[f] = st.st_size
    return out


class FsTier:
    """LMCache's ``fs`` adapter over one directory (written as .tmp, renamed to .data)."""

    def __init__(self, base: Path) -> None:
        self.base = Path(base)

    def adapter_json(self) -> str:
        return json.dumps({"type": "fs", "base_path": str(self.base)}, separators=(",", ":"))

    def paths(self, model: str) -> list[Path]:
        safe = model.replace("/", "-SEP-")
        return sorted(p for p in self.base.glob("*.data") if _of_model(p.name.removesuffix(".data"), safe))

    def objects(self, model: str) -> list[TierObject]:
        out = []
        for p in self.paths(model):
            with open(p, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                sealed = size >= TRAILER_LEN and (f.seek(size - len(TRAILER_MAGIC)), f.read())[1] == TRAILER_MAGIC
            out.append(TierObject(p.name, size, sealed))
        return out

    def unfinished(self) -> int:
        return len(list(self.base.glob("*.tmp")))

    def describe(self) -> str:
        return str(self.base)


class RespTier:
    """LMCache's ``resp`` adapter against one Redis server (its native client)."""

    def __init__(self, host: str, port: int, db: int = 0) -> None:
        self.host, self.port, self.db = host, int(port), db
        self._client: Any = None

    @classmethod
    def from_url(cls, url: str) -> "RespTier":
        """``redis://HOST:PORT`` (LMCache's adapter has no database index: db 0)."""
        from urllib.parse import urlsplit  # noqa: PLC0415

        parts = urlsplit(url)
        if parts.scheme != "redis" or not parts.hostname or not parts.port:
            raise ValueError(f"{url!r}: expected redis://HOST:PORT")
        if parts.path not in ("", "/", "/0"):
            raise ValueError(f"{url!r}: LMCache's resp adapter uses database 0 only")
        return cls(parts.hostname, parts.port)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def client(self) -> Any:
        if self._client is None:
            import redis  # noqa: PLC0415 - the target env and the project venv have it

            self._client = redis.Redis(host=self.host, port=self.port, db=self.db, socket_timeout=10)
        return self._client

    def adapter_json(self) -> str:
        # num_workers 2: the native client's connections (one per worker); the
        # gate's requests are small and the machines have 2 cores.
        return json.dumps({"type": "resp", "host": self.host, "port": self.port, "num_workers": 2},
                          separators=(",", ":"))

    def keys(self, model: str) -> list[str]:
        """Every key of ``model``, sealed or not, by ``SCAN`` (never ``KEYS``)."""
        c = self.client()
        out = set()
        for pattern in (f"{_glob_escape(model)}[@+]*", f"{SEALED_KEY_PREFIX}{_glob_escape(model)}[@+]*"):
            for raw in c.scan_iter(match=pattern, count=1000):
                name = raw.decode() if isinstance(raw, bytes) else raw
                if _of_model(name, model):
                    out.add(name)
        return sorted(out)

    def objects(self, model: str) -> list[TierObject]:
        names = self.keys(model)
        c = self.client()
        pipe = c.pipeline(transaction=False)
        for n in names:
            pipe.strlen(n)
            pipe.getrange(n, -len(TRAILER_MAGIC), -1)
        replies = pipe.execute()
        out = []
        for i, n in enumerate(names):
            size, tail = replies[2 * i], replies[2 * i + 1]
            if size:  # 0: the key vanished between SCAN and STRLEN
                out.append(TierObject(n, int(size), size >= TRAILER_LEN and tail == TRAILER_MAGIC))
        return out

    def all_objects(self) -> list[TierObject]:
        """Every key on the server, sized (for a Redis the caller owns)."""
        c = self.client()
        names = sorted(k.decode() if isinstance(k, bytes) else k for k in c.scan_iter(count=1000))
        pipe = c.pipeline(transaction=False)
        for n in names:
            pipe.strlen(n)
            pipe.getrange(n, -len(TRAILER_MAGIC), -1)
        replies = pipe.execute()
        return [TierObject(n, int(replies[2 * i]), replies[2 * i] >= TRAILER_LEN and replies[2 * i + 1] == TRAILER_MAGIC)
                for i, n in enumerate(names) if replies[2 * i]]

    def value(self, name: str) -> bytes | None:
        return self.client().get(name)

    def put(self, name: str, value: bytes) -> None:
        self.client().set(name, value)

    def unfinished(self) -> int:
        return 0  # a SET is atomic: a key exists whole or not at all

    def describe(self) -> str:
        return self.url


def _glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis ``MATCH`` glob."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def listing(objs: list[TierObject]) -> dict[str, Any]:
    """Per model field seen in the names: object count and distinct sizes."""
    out: dict[str, Any] = {}
    for o in objs:
        entry = out.setdefault(o.model_field, {"objects": 0, "sizes": []})
        entry["objects"] += 1
        if o.size not in entry["sizes"]:
            entry["sizes"].append(o.size)
    for entry in out.values():
        entry["sizes"].sort()
    return out


def tier_of(l2_dir: str | Path | None, redis_url: str | None) -> Tier:
    """The tier a gate's options name (``--redis-url`` wins; else ``--l2-dir``)."""
    if redis_url:
        return RespTier.from_url(redis_url)
    if l2_dir is None:
        raise ValueError("an fs tier needs a directory")
    return FsTier(Path(l2_dir))
