"""A private ``redis-server`` for a gate or a test (stdlib + :mod:`procs`, no redis-py).

The RESP tier is proven against a real Redis, never a stand-in.  A gate or
test that needs one starts its own here: on 127.0.0.1, on a free port, in a
temporary directory, with persistence off (``--save "" --appendonly no``:
nothing outlives the run, nothing is written but the log; ``persistence=True``
turns the append-only file on, fsynced per write, for a restart test), in its own
process group (:class:`procs.ManagedProcess`, so a kill takes the whole
group and the kernel kills it if the starter dies).  It is ready when it
answers ``PING`` with ``+PONG`` over a plain socket: readiness is what the
server says, never a sleep, and the caller needs no Redis client for it.

The binary is the caller's to find (``lab/provision_redis.py``'s
``redis_server()``): this module is imported where ``scripts/`` is not.

    with running_redis_server(binary) as r:    # RedisServer
        url = r.url                              # redis://127.0.0.1:PORT
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from gate import procs

READY_TIMEOUT_S = 20.0
# A free port can be taken between the probe and redis-server's bind: retry
# with a fresh one.
START_TRIES = 3


class RedisStartError(RuntimeError):
    """redis-server did not become ready (the message has its log's tail)."""


def ping(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether the server at ``host:port`` answers ``PING`` with ``+PONG``
    (RESP by hand: one array of one bulk string)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n") and len(reply) < 256:
                chunk = s.recv(256)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return False
    return reply == b"+PONG\r\n"


class RedisServer:
    """One running ``redis-server`` started by :func:`start_redis_server`."""

    def __init__(self, proc: procs.ManagedProcess, port: int, workdir: Path, owns_workdir: bool,
                 binary: Path, persistence: bool = False) -> None:
        self.proc = proc
        self.host = "127.0.0.1"
        self.port = port
        self.workdir = workdir
        self._owns_workdir = owns_workdir
        self.binary = binary
        self.persistence = persistence
        self.restarts = 0

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` (database 0, the only one LMCache's adapter uses)."""
        return f"redis://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    def log(self) -> str:
        return self.proc.log_text()

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self) -> None:
        """SIGKILL the process group (nothing is persisted, so nothing is lost
        that a clean shutdown would keep), reap it, verify it is gone; remove
        the temporary directory this module made."""
        self.proc.kill()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self, ready_timeout: float = READY_TIMEOUT_S) -> None:
        """SIGKILL the server and start it again on the same port and
        directory (what it persisted, if anything, is what it loads)."""
        self.proc.kill()
        self.restarts += 1
        proc = procs.ManagedProcess(name=f"redis-server:{self.port}",
                                    argv=_argv(self.binary, self.port, self.workdir, self.persistence),
                                    log_path=self.workdir / f"redis-restart-{self.restarts}.log")
        proc.start()
        try:
            proc.wait_ready(lambda: _ready(self.port), ready_timeout)
        except procs.ProcessError as exc:
            with contextlib.suppress(procs.ProcessError):
                proc.kill()
            raise RedisStartError(f"redis-server did not come back on port {self.port}: {exc}") from exc
        self.proc = proc

    def describe(self) -> dict[str, object]:
        return {"url": self.url, "pid": self.proc.pid, "argv": list(self.proc.argv), "log": str(self.log_path),
                "persistence": "appendonly, fsync always" if self.persistence else "off", "restarts": self.restarts}


def _argv(binary: Path, port: int, workdir: Path, persistence: bool = False) -> list[str]:
    # --logfile "": log to stdout, which ManagedProcess sends to its log file.
    aof = ["--appendonly", "yes", "--appendfsync", "always"] if persistence else ["--appendonly", "no"]
    return [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *aof,
            "--dir", str(workdir), "--logfile", "", "--daemonize", "no", "--protected-mode", "yes"]


def _ready(port: int) -> bool:
    if not ping("127.0.0.1", port):
        raise procs.NotReady(f"no +PONG from 127.0.0.1:{port}")
    return True


def start_redis_server(binary: str | Path, workdir: str | Path | None = None,
                       ready_timeout: float = READY_TIMEOUT_S, persistence: bool = False) -> RedisServer:
    """Start ``binary`` on a free port and wait until it answers PING.

    ``workdir`` (its ``--dir`` and log) is made with :mod:`tempfile` when not
    given, and removed by :meth:`RedisServer.stop`.  Raises
    :class:`RedisStartError` after :data:`START_TRIES` failed starts.
    """
    owns = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="lmcache-redis-")) if owns else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    last = ""
    for attempt in range(1, START_TRIES + 1):
        port = procs.free_port()
        proc = procs.ManagedProcess(name=f"redis-server:{port}", argv=_argv(Path(binary), port, wd, persistence),
                                    log_path=wd / f"redis-{attempt}.log")
        try:
            proc.start()
            proc.wait_ready(lambda port=port: _ready(port), ready_timeout)
            return RedisServer(proc, port, wd, owns, Path(binary), persistence)
        except procs.ProcessError as exc:
            with contextlib.suppress(procs.ProcessError):
                proc.kill()
            last = str(exc)
    if owns:
        shutil.rmtree(wd, ignore_errors=True)
    raise RedisStartError(f"redis-server {binary} did not start in {START_TRIES} tries: {last}")


@contextlib.contextmanager
def running_redis_server(binary: str | Path, workdir: str | Path | None = None) -> Iterator[RedisServer]:
    """A fresh server for the block, stopped (and its group verified gone) after it."""
    server = start_redis_server(binary, workdir)
    try:
        yield server
    finally:
        server.stop()
