"""A Redis (RESP) L2 tier as ``l2 scan`` reads it: the URL, the connection,
and :class:`RedisTier`, a :class:`~patchtool.l2.source.TierSource`.  The keys'
grammar is ``patchtool.l2.redis_keys``; moving keys is ``patchtool.l2.redis_move``.

What the tool sends, and why it is safe while LMCache servers write:

* ``SCAN`` with a cursor and ``COUNT``, never ``KEYS`` (which blocks the
  server for the whole keyspace).  ``SCAN`` returns every key present for the
  whole iteration at least once, and may return one twice, so each pass keeps
  the set of keys it has seen.  That is per-key memory, which the fs pass
  avoids; a RAM tier holds few keys for its bytes (100 GB of 2 MiB objects is
  50,000 keys), so it is small.
* ``STRLEN`` per key, pipelined per ``SCAN`` batch.  ``STRLEN`` answers 0 for
  a key that is gone and for an empty value alike, so a 0 is asked again as
  ``EXISTS`` + ``STRLEN`` in one ``MULTI``: a key gone by then is counted as
  *vanished* (the fs pass's notion: listed, then gone before its size was
  read).  A key of another type (``WRONGTYPE``) named like an object is
  foreign, like a directory named like one on the fs tier.
* ``GET`` one key at a time for ``--verify`` (objects are MBs).  A single
  ``GET`` is atomic in Redis, so no read is torn; but a key can be
  rewritten between the listing and the read, or between two reads.  The
  rule (:meth:`RedisTier.judge`): a value that passes is ``ok``; a value
  that fails is read again, and is *corrupt* only when two consecutive reads
  return the same bytes and both fail.  A value that changes on each of
  :data:`READS` reads is not judged (``unreadable``), and one that is gone is
  not judged either.  So a writer storing valid values never gets one
  reported corrupt.
* A key without the seal prefix is *unsealed* (pristine LMCache, or a build
  without the seal wrote it): it promises no trailer, so it is not read, and
  its verdict is :data:`UNSEALED`, counted and never flagged, as the fs scan
  counts objects without a trailer.  A *sealed* key whose value has no valid
  trailer is corrupt: the key says the patched adapter wrote it with one.
* Nothing else is written: the only write the tool ever sends is the
  ``RENAMENX`` of a quarantine or a restore, guarded by ``WATCH``
  (``patchtool.l2.redis_move``).

A Redis Cluster node is refused: ``SCAN`` sees one node's keys, and a
``RENAMENX`` to the quarantine name crosses hash slots.

``redis`` (redis-py) is imported only here, and only when a ``redis://`` tier
is scanned: the fs commands and ``status`` never load it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from urllib.parse import unquote, urlsplit

from . import checksum as ck
from ..errors import Refusal
from ..exitcodes import ExitCode
from .names import SetKey
from .reader import TierReader
from .redis_keys import KEY_RE, QUARANTINE_PREFIX, is_sealed, prefix_key, set_prefix
from .rules import Plan
from .tally import UNKNOWN_SIZE, Tally, add_foreign, count
from .content_check import Checker

SCAN_COUNT = 1000  # SCAN's COUNT hint: keys per round trip
READS = 3  # reads of a value that fails before it is left unjudged (changing)
CONNECT_TIMEOUT_S = 10.0
# A GET of a multi-MB value on a busy server; a stalled server is refused after this.
SOCKET_TIMEOUT_S = 120.0

UNSEALED = "unsealed"  # verify verdict: a key without the seal prefix, not read
_UNSEALED_DETAIL = ("unsealed key (no lmcptsum1@ prefix): written without the seal, so it "
                    "cannot be verified")
# STRLEN outcomes that are not a size
VANISHED, WRONGTYPE = -2, -3


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``redis://[user:password@]host[:port][/db]``."""

    url: str  # as reports name it: the password replaced by ***
    host: str
    port: int
    db: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)


def parse_url(text: str) -> RedisTarget:
    """The target of a ``redis://`` URL; a malformed one is refused (exit 2)."""
    def bad(why: str) -> Refusal:
        return Refusal(_redact(text), why, ExitCode.USAGE)

    parts = urlsplit(text)
    if parts.scheme != "redis":
        raise bad("not a redis:// URL")
    if parts.query or parts.fragment:
        raise bad("a redis:// URL here takes no ?options or #fragment: "
                  "redis://[user:password@]HOST:PORT[/DB]")
    try:
        port = parts.port if parts.port is not None else 6379
    except ValueError:
        raise bad("the port is not a number from 0 to 65535") from None
    host = parts.hostname
    if not host:
        raise bad("no host: redis://[user:password@]HOST:PORT[/DB]")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise bad(f"the database {path!r} is not a number: redis://HOST:PORT/DB")
    db = int(path) if path else 0
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    shown_host = f"[{host}]" if ":" in host else host
    auth = ""
    if user or password is not None:
        auth = (user or "") + (":***" if password is not None else "") + "@"
    return RedisTarget(f"redis://{auth}{shown_host}:{port}/{db}", host, port, db, user or None,
                       password)


def _redact(text: str) -> str:
    """A URL as typed, without its password (a refusal names the target)."""
    return re.sub(r"^(redis://[^:@/]*:)[^@/]*@", r"\1***@", text)


def redis_module() -> Any:
    """redis-py, imported on the redis path only."""
    try:
        import redis  # noqa: PLC0415 - lazy: only a redis:// tier loads the client
    except ImportError as exc:
        raise Refusal("redis://", f"the redis package is not importable ({exc}): "
                      "pip install 'redis>=4.5'") from None
    return redis


def connect(target: RedisTarget) -> "RedisTier":
    """A connected tier; an unreachable or refusing server, a failed login
    or a cluster node is refused in one line naming the URL."""
    redis = redis_module()
    from redis.backoff import NoBackoff  # noqa: PLC0415 - lazy: only a redis:// tier loads the client
    from redis.retry import Retry  # noqa: PLC0415 - lazy: only a redis:// tier loads the client

    # No retries: a RENAMENX re-sent after a lost reply would be misreported.
    client = redis.Redis(host=target.host, port=target.port, db=target.db,
                         username=target.username, password=target.password,
                         socket_connect_timeout=CONNECT_TIMEOUT_S,
                         socket_timeout=SOCKET_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
                         decode_responses=False)
    try:
        client.ping()
        server = client.info("server")
        cluster = client.info("cluster")
    except redis.RedisError as exc:
        client.close()
        raise Refusal(target.url, f"cannot connect: {describe(exc)}") from None
    if str(cluster.get("cluster_enabled", 0)) == "1":
        client.close()
        raise Refusal(target.url, "is a Redis Cluster node: SCAN would see one node's keys and "
                      "a quarantine rename would cross hash slots; give a standalone server")
    return RedisTier(target, client, str(server.get("redis_version", "?")))


def describe(exc: BaseException) -> str:
    """A redis-py error as one short line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def key_bytes(name: str) -> bytes:
    """The key bytes of a name (names are decoded with surrogateescape)."""
    return name.encode("utf-8", "surrogateescape")


def key_name(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


@dataclass
class RedisTally(Tally):
    """The fs :class:`~patchtool.l2.tally.Tally`, plus what only a Redis tier
    holds: how many objects carry the seal, and the quarantined keys (in the
    same keyspace, under ``lmcptq@``; not objects)."""

    sealed: int = 0
    unsealed: int = 0
    quarantined: int = 0


class RedisTier:
    """One Redis database as an L2 tier (see the module docstring)."""

    def __init__(self, target: RedisTarget, client: Any, server_version: str) -> None:
        self.target = target
        self.client = client
        self.server_version = server_version
        self.where = target.url
        self.first_tally: RedisTally | None = None

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "RedisTier":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ reads

    def keys(self, match: str | None = None) -> Iterator[list[bytes]]:
        """Every key, once, in ``SCAN`` batches (deduplicated: ``SCAN`` may
        return a key twice)."""
        seen: set[bytes] = set()
        cursor = 0
        while True:
            cursor, batch = self.client.scan(cursor=cursor, match=match, count=SCAN_COUNT)
            fresh = [k for k in batch if k not in seen]
            seen.update(fresh)
            if fresh:
                yield fresh
            if int(cursor) == 0:
                return

    def strlen(self, keys: list[bytes]) -> list[int]:
        """Each key's size; :data:`VANISHED` or :data:`WRONGTYPE` instead."""
        if not keys:
            return []
        redis = redis_module()
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        out = [self._size(v, redis) for v in pipe.execute(raise_on_error=False)]
        zeros = [i for i, v in enumerate(out) if v == 0]
        if zeros:  # 0 is an empty value or a key that is gone: ask both at once
            pipe = self.client.pipeline(transaction=True)
            for i in zeros:
                pipe.exists(keys[i])
                pipe.strlen(keys[i])
            again = pipe.execute(raise_on_error=False)
            for j, i in enumerate(zeros):
                exists, size = again[2 * j], self._size(again[2 * j + 1], redis)
                out[i] = VANISHED if exists == 0 else size
        return out

    @staticmethod
    def _size(v: Any, redis: Any) -> int:
        if isinstance(v, redis.ResponseError) and "WRONGTYPE" in str(v):
            return WRONGTYPE
        if isinstance(v, Exception):
            raise v
        return int(v)

    def size_of(self, name: str) -> int | None:
        size = self.strlen([key_bytes(name)])[0]
        return None if size < 0 else size

    def exists(self, name: str) -> bool:
        return bool(self.client.exists(key_bytes(name)))

    def get(self, name: str) -> bytes | None:
        """The whole value; ``None`` once the key is gone."""
        return self.client.get(key_bytes(name))

    # ------------------------------------------------------------ the pass

    def tally(self, sizes: bool) -> RedisTally:
        """One ``SCAN`` pass, ``STRLEN`` pipelined per batch (none with
        ``sizes=False``: every object lands in ``UNKNOWN_SIZE``, and a
        non-string key named like an object is counted as an object, since
        only its type would tell)."""
        t = RedisTally(sizes_read=sizes)
        match = KEY_RE.fullmatch
        for batch in self.keys():
            objects: list[tuple[bytes, str, re.Match]] = []
            for k in batch:
                name = key_name(k)
                if name.startswith(QUARANTINE_PREFIX):
                    t.quarantined += 1
                    continue
                m = match(name)
                if m is None:
                    add_foreign(t, name)
                    continue
                objects.append((k, name, m))
            lens = self.strlen([o[0] for o in objects]) if sizes else [UNKNOWN_SIZE] * len(objects)
            for (_k, name, m), size in zip(objects, lens):
                if size == VANISHED:
                    t.vanished += 1
                    continue
                if size == WRONGTYPE:
                    add_foreign(t, name)
                    continue
                if is_sealed(m):
                    t.sealed += 1
                else:
                    t.unsealed += 1
                count(t.sets.setdefault(set_prefix(m), {}), size, name)
        if self.first_tally is None:
            self.first_tally = t
        return t

    def set_key(self, prefix: str) -> SetKey:
        return prefix_key(prefix)

    def candidates(self, reader: TierReader, plan: Plan) -> dict[str, tuple[str, int]]:
        """A second ``SCAN`` pass: the objects ``reader`` reads that ``plan``
        leaves unflagged, with their sizes."""
        out: dict[str, tuple[str, int]] = {}
        readable: dict[str, bool] = {}
        for batch in self.keys():
            objects: list[tuple[bytes, str, str]] = []
            for k in batch:
                name = key_name(k)
                m = None if name.startswith(QUARANTINE_PREFIX) else KEY_RE.fullmatch(name)
                if m is None:
                    continue
                prefix = set_prefix(m)
                ok = readable.get(prefix)
                if ok is None:
                    ok = readable[prefix] = reader.reads(prefix_key(prefix))
                if ok:
                    objects.append((k, name, prefix))
            for (_k, name, prefix), size in zip(objects, self.strlen([o[0] for o in objects])):
                if size >= 0 and plan.select(prefix, size) is None:
                    out[name] = (prefix, size)
        return out

    # ------------------------------------------------------------ --verify

    def checker(self, digester: ck.Digester) -> Checker:
        """A :data:`~patchtool.l2.content_check.Checker` for this tier: sealed keys
        judged by :meth:`judge`, unsealed ones :data:`UNSEALED` unread."""
        def run(names: list[str]) -> dict[str, tuple[str, str]]:
            out: dict[str, tuple[str, str]] = {}
            for n in names:
                m = KEY_RE.fullmatch(n)
                out[n] = (self.judge(n, digester.digest) if m is not None and is_sealed(m)
                          else (UNSEALED, _UNSEALED_DETAIL))
            return out
        return run

    def judge(self, name: str, digest: ck.DigestFn,
              read: Callable[[str], bytes | None] | None = None) -> tuple[str, str]:
        """The verdict of a sealed key, from as many ``GET``s as it takes to
        be sure (module docstring): corrupt only on two consecutive equal
        reads that fail.  ``read`` defaults to :meth:`get`."""
        read = read or self.get
        previous: bytes | None = None
        for _ in range(READS):
            value = read(name)
            if value is None:
                return ck.UNREADABLE, "vanished while checked (a live tier)"
            v, detail = sealed_verdict(value, name, digest)
            if v != ck.CORRUPT:
                return v, detail
            if previous is not None and value == previous:
                return v, detail
            previous = value
        return ck.UNREADABLE, (f"changed between each of {READS} reads (a live writer): "
                               "not judged")


def sealed_verdict(value: bytes, name: str, digest: ck.DigestFn) -> tuple[str, str]:
    """One read of a sealed key, judged: ``checksum.value_verdict`` bound
    to the wire key, where a missing trailer is corrupt (the key promises
    one)."""
    v, detail = ck.value_verdict(value, key_bytes(name), digest)
    if v == ck.NO_TRAILER:
        return ck.CORRUPT, (f"sealed key without a valid trailer ({detail}): cut short or "
                            "overwritten")
    return v, detail
