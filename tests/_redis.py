"""A real ``redis-server`` for a test: a thin wrapper over
``lab/redis_proc.py`` (one implementation for the
tests and the gates: its own process group, 127.0.0.1, a free port, a
temporary directory, no persistence, ready when it answers ``PING``).

    from _redis import running_redis

    with running_redis(tmp_path) as r:     # skips the test when no redis-server
        r.client().set("k", b"v")          # redis-py, bytes in and out
        cli("l2", "scan", r.url, ...)      # redis://127.0.0.1:PORT/0

The binary comes from ``lab/provision_redis.py`` (``redis_server()``);
when it raises ``RedisUnavailable`` the test is skipped with the reason,
never passed silently.  Shared by every test that needs a Redis tier.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

_REPO = Path(__file__).resolve().parents[1]
from gate import procs
from lab.redis_proc import RedisServer, start_redis_server
from lab.provision_redis import RedisUnavailable, redis_server
free_port = procs.free_port


class RedisProc:
    """One running ``redis-server``, as the tests use it."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.port = server.port
        self.workdir = server.workdir
        self.url = f"{server.url}/0"

    def client(self, db: int = 0) -> Any:
        """A redis-py client (``decode_responses=False``: bytes)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=30)

    def log(self) -> str:
        return self.server.log()

    def stop(self) -> None:
        """SIGKILL the server's process group and reap it."""
        self.server.stop()

    def restart(self) -> None:
        """SIGKILL it and start it again on the same port and directory."""
        self.server.restart()


@contextmanager
def running_redis(tmp_path: Path, persistence: bool = False) -> Iterator[RedisProc]:
    """A fresh server for the block (``persistence``: the append-only file,
    fsynced per write); skips the test if none can be provisioned."""
    try:
        binary = redis_server()
    except RedisUnavailable as exc:
        pytest.skip(f"no redis-server: {exc}")
    workdir = Path(tmp_path) / f"redis-{os.getpid()}-{time.monotonic_ns()}"
    r = RedisProc(start_redis_server(binary, workdir, persistence=persistence))
    try:
        yield r
    finally:
        r.stop()
