"""Process supervision for the verification gates (stdlib only, no torch).

The CPU restore gate starts real ``lmcache server`` processes with it, and the
engine gate reuses it for vLLM, so nothing here knows about either:

* :class:`ManagedProcess` starts one command in its **own session and process
  group** (so a terminal's Ctrl-C reaches only the supervisor, which then
  decides), sends its output to a log file, waits for readiness *as reported
  by the process itself* (a probe: an HTTP endpoint, a log line, a TCP port;
  never a sleep), kills the whole group, reaps the leader, and verifies that
  no member of the group is left alive.
* :class:`Supervisor` is the context manager that owns every process and
  temporary path of a run: whatever happens (exception, ``KeyboardInterrupt``,
  ``SIGTERM``/``SIGHUP`` while it is active, interpreter exit) it kills what is
  still running and runs the registered cleanups, newest first.

Probes are plain callables returning true once ready; the factories
:func:`http_probe`, :func:`log_probe` and :func:`tcp_probe` build the usual
ones.  A probe may raise :class:`NotReady` (or return false) to mean "not yet".
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

__all__ = [
    "ProcessError", "StartupError", "ReadinessTimeout", "StillAlive", "NotReady",
    "ManagedProcess", "Supervisor", "free_port", "free_ports",
    "http_probe", "log_probe", "tcp_probe", "group_members", "ansi_strip", "wait_until", "remove_path",
    "supervised",
]

Probe = Callable[[], Any]


class ProcessError(RuntimeError):
    """Base class of everything this module raises about a child process."""


class StartupError(ProcessError):
    """The process exited (or could not be started) before it was ready."""


class ReadinessTimeout(StartupError):
    """The process is running but did not report readiness in time."""


class StillAlive(ProcessError):
    """A process group survived SIGKILL past the verification timeout."""


class NotReady(Exception):
    """Raised by a probe to say "not ready yet" with a reason."""


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def ansi_strip(text: str) -> str:
    return _ANSI.sub("", text)


# ---------------------------------------------------------------------------
# Ports
# ---------------------------------------------------------------------------


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free on ``host`` a moment ago.

    All sockets are held open until every port is chosen, so the ports are
    distinct.  There is an unavoidable window between closing them and the
    child binding; callers should retry a failed start with fresh ports.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


# ---------------------------------------------------------------------------
# Probes
# ---------------------------------------------------------------------------


def http_probe(url: str, *, status: int = 200, json_subset: Mapping[str, Any] | None = None,
               timeout: float = 1.0) -> Probe:
    """Ready when ``GET url`` answers ``status`` (and its JSON contains ``json_subset``)."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
                code, body = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            raise NotReady(f"{url} -> HTTP {exc.code}") from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, OSError) as exc:
            raise NotReady(f"{url} -> {getattr(exc, 'reason', exc)}") from None
        if code != status:
            raise NotReady(f"{url} -> HTTP {code}")
        if json_subset:
            try:
                data = json.loads(body)
            except ValueError:
                raise NotReady(f"{url} -> not JSON: {body[:80]!r}") from None
            for key, want in json_subset.items():
                if not isinstance(data, dict) or data.get(key) != want:
                    raise NotReady(f"{url} -> {key}={data.get(key) if isinstance(data, dict) else data!r}")
        return True

    probe.description = f"GET {url} -> {status}" + (f" with {dict(json_subset)}" if json_subset else "")  # type: ignore[attr-defined]
    return probe


def tcp_probe(host: str, port: int, timeout: float = 0.5) -> Probe:
    """Ready when a TCP connection to ``host:port`` succeeds."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError as exc:
            raise NotReady(f"tcp {host}:{port} -> {exc}") from None

    probe.description = f"tcp connect {host}:{port}"  # type: ignore[attr-defined]
    return probe


def log_probe(path: str | os.PathLike, pattern: str, *, strip_ansi: bool = True) -> Probe:
    """Ready when a line of the log file at ``path`` matches the regex ``pattern``.

    The file is read incrementally, so repeated polls are cheap.
    """
    rx = re.compile(pattern)
    state = {"pos": 0, "rest": ""}

    def probe() -> bool:
        try:
            with open(path, "r", encoding="utf-8", errors="replace") as fh:
                fh.seek(state["pos"])
                chunk = fh.read()
                state["pos"] = fh.tell()
        except FileNotFoundError:
            raise NotReady(f"{path} does not exist yet") from None
        text = state["rest"] + chunk
        lines = text.split("\n")
        state["rest"] = lines.pop()  # an unfinished last line is kept for the next poll
        for line in lines:
            if rx.search(ansi_strip(line) if strip_ansi else line):
                return True
        return False

    probe.description = f"log line /{pattern}/ in {path}"  # type: ignore[attr-defined]
    return probe


# ---------------------------------------------------------------------------
# Process groups (Linux /proc, with a portable fallback)
# ---------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, pgrp) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(")") + 2:].split()
    return fields[0], int(fields[2])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    if os.path.isdir("/proc"):
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            st = _proc_stat(int(name))
            if st and st[1] == pgid and st[0] not in ("Z", "X"):
                out.append(int(name))
        return out
    try:  # pragma: no cover - non-Linux fallback; zombies count as alive here
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    return [pgid]


# ---------------------------------------------------------------------------
# One managed process
# ---------------------------------------------------------------------------


# Exec'd in front of a command (Linux): ask the kernel to SIGKILL the child when
# the supervising process dies -- even by SIGKILL, where no cleanup code runs.
# Its own process group keeps a terminal's Ctrl-C from reaching it directly, so
# without this an abruptly killed supervisor would orphan its servers.
_PDEATHSIG_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(70)  # the supervisor is already gone\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


@dataclass
class ManagedProcess:
    """A command run in its own process group, with its output in ``log_path``.

    With ``die_with_parent`` (default, Linux only) the command is exec'd through
    a tiny launcher that sets ``PR_SET_PDEATHSIG``: the kernel kills it if the
    supervising process dies without cleaning up (strictly: when the *thread*
    that started it exits, so start processes from a long-lived thread).  The
    pid is the command's (exec keeps it); ``argv`` stays the real command line.
    """

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: str | os.PathLike | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False)
    pgid: int | None = None
    started_at: float | None = None
    ready_at: float | None = None
    readiness: str | None = None
    killed_with: str | None = None
    die_with_parent: bool = True

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> "ManagedProcess":
        if self.popen is not None:
            raise ProcessError(f"{self.name}: already started")
        self.log_path = Path(self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = list(self.argv)
        if self.die_with_parent and sys.platform.startswith("linux"):
            if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
                raise StartupError(f"{self.name}: cannot start {argv[0]!r}: not found")
            argv = [sys.executable, "-I", "-c", _PDEATHSIG_LAUNCHER, str(os.getpid()), *argv]
        log = open(self.log_path, "ab", buffering=0)
        try:
            self.popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=dict(self.env) if self.env is not None else None, cwd=self.cwd,
                start_new_session=True, close_fds=True)
        except OSError as exc:
            raise StartupError(f"{self.name}: cannot start {self.argv[0]!r}: {exc}") from exc
        finally:
            log.close()
        self.started_at = time.monotonic()
        self.pgid = self.popen.pid  # start_new_session: the leader's pid is the pgid
        return self

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise ProcessError(f"{self.name}: not started")
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_ready(self, probe: Probe, timeout: float, poll: float = 0.05) -> float:
        """Poll ``probe`` until it reports ready; return seconds since start.

        Raises :class:`StartupError` as soon as the process exits, and
        :class:`ReadinessTimeout` after ``timeout`` seconds.
        """
        if self.popen is None:
            raise ProcessError(f"{self.name}: not started")
        deadline = time.monotonic() + timeout
        last = "no probe result yet"
        while True:
            rc = self.popen.poll()
            if rc is not None:
                raise StartupError(f"{self.name} (pid {self.pid}) exited with {_rc_text(rc)} before it was ready"
                                   f"\n--- last lines of {self.log_path} ---\n{self.log_tail()}")
            try:
                if probe():
                    break
            except NotReady as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise ReadinessTimeout(f"{self.name} (pid {self.pid}) not ready after {timeout:g} s ({last})"
                                       f"\n--- last lines of {self.log_path} ---\n{self.log_tail()}")
            time.sleep(poll)
        self.ready_at = time.monotonic()
        self.readiness = getattr(probe, "description", repr(probe))
        return self.ready_at - (self.started_at or self.ready_at)

    def kill(self, timeout: float = 10.0, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole group, reap the leader, verify the group is gone."""
        if self.popen is None:
            return
        self.killed_with = signal.Signals(sig).name
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise StillAlive(f"{self.name} (pid {self.pid}) survived {self.killed_with} for {timeout} s") from None
        self.verify_gone(timeout)

    def stop(self, grace: float = 5.0, timeout: float = 10.0) -> None:
        """SIGTERM the group, SIGKILL whatever is left after ``grace`` seconds.

        ``killed_with`` records the signal that ended the leader ("SIGTERM" if it
        exited within the grace period, else "SIGKILL"); the group is always
        swept with SIGKILL and verified gone.
        """
        if self.popen is None:
            return
        if self.popen.poll() is None:
            ended_by = None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
                ended_by = "SIGTERM"
            except subprocess.TimeoutExpired:
                pass
        else:
            ended_by = self.killed_with or "exited"  # it was gone before stop()
        self.kill(timeout=timeout)  # sweeps the group, reaps, verifies; sets "SIGKILL"
        if ended_by is not None:
            self.killed_with = ended_by

    def verify_gone(self, timeout: float = 10.0) -> None:
        """Wait until no live member of the process group remains."""
        if self.popen is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            left = group_members(self.pgid)
            if not left:
                return
            if time.monotonic() >= deadline:
                raise StillAlive(f"{self.name}: process group {self.pgid} still has live members {left}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            time.sleep(0.02)

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 64 * 1024))
                data = fh.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        return "\n".join(ansi_strip(data).splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return ansi_strip(Path(self.log_path).read_text("utf-8", "replace"))
        except OSError:
            return ""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.popen.pid if self.popen else None, "argv": list(self.argv),
                "log": str(self.log_path), "readiness": self.readiness, "returncode": self.returncode,
                "killed_with": self.killed_with}

    def __enter__(self) -> "ManagedProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.popen is not None and (self.popen.poll() is None or group_members(self.pgid)):
            with contextlib.suppress(ProcessError):
                self.kill()


def _rc_text(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-rc).name}"
    return f"exit code {rc}"


# ---------------------------------------------------------------------------
# Supervisor: owns everything a run starts or creates
# ---------------------------------------------------------------------------


_LIVE_SUPERVISORS: "set[Supervisor]" = set()


def _atexit_cleanup() -> None:  # pragma: no cover - exercised through a subprocess test
    for sup in list(_LIVE_SUPERVISORS):
        sup.close()


atexit.register(_atexit_cleanup)


class Supervisor:
    """Context manager owning processes, temp dirs and cleanups of one run.

    While active (main thread only) ``SIGTERM`` and ``SIGHUP`` raise
    :class:`SystemExit` and ``SIGINT`` raises :class:`KeyboardInterrupt`, so the
    ``with`` block unwinds and :meth:`close` runs.  ``close`` is idempotent and
    also runs at interpreter exit if the block was never left normally.
    """

    def __init__(self, *, handle_signals: bool = True, keep_paths: bool = False) -> None:
        self.processes: list[ManagedProcess] = []
        self._cleanups: list[tuple[str, Callable[[], Any]]] = []
        self._handle_signals = handle_signals
        self._old_handlers: dict[int, Any] = {}
        self._closed = False
        self.keep_paths = keep_paths
        self.cleanup_errors: list[str] = []

    # -- context manager ---------------------------------------------------
    def __enter__(self) -> "Supervisor":
        _LIVE_SUPERVISORS.add(self)
        if self._handle_signals and threading.current_thread() is threading.main_thread():
            for sig, handler in ((signal.SIGINT, signal.default_int_handler),
                                 (signal.SIGTERM, _raise_exit), (signal.SIGHUP, _raise_exit)):
                with contextlib.suppress(ValueError, OSError):
                    self._old_handlers[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- processes ---------------------------------------------------------
    def start(self, name: str, argv: Sequence[str], *, log_path: str | os.PathLike,
              env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
              ready: Probe | Callable[[ManagedProcess], Probe] | None = None,
              ready_timeout: float = 60.0, die_with_parent: bool = True) -> ManagedProcess:
        """Start ``argv`` and (if ``ready`` is given) wait for readiness.

        ``ready`` is a probe, or a factory taking the started process (to build a
        probe that needs its pid or log path).  On any failure the process is
        killed before the error propagates.
        """
        proc = ManagedProcess(name=name, argv=argv, log_path=Path(log_path), env=env, cwd=cwd,
                              die_with_parent=die_with_parent)
        self.processes.append(proc)
        proc.start()
        if ready is not None:
            try:
                probe = ready(proc) if _takes_process(ready) else ready
                proc.wait_ready(probe, ready_timeout)
            except BaseException:
                with contextlib.suppress(ProcessError):
                    proc.kill()
                raise
        return proc

    # -- cleanups ----------------------------------------------------------
    def add_cleanup(self, what: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` at close (after processes are dead), newest first."""
        self._cleanups.append((what, fn))

    def remove_path_at_exit(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        self.add_cleanup(f"remove {p}", lambda: _remove(p))
        return p

    def tempdir(self, prefix: str = "gate-", base: str | os.PathLike | None = None) -> Path:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        if not self.keep_paths:
            self.remove_path_at_exit(path)
        return path

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in reversed(self.processes):
            try:
                if proc.popen is not None and (proc.popen.poll() is None or group_members(proc.pgid)):
                    proc.kill()
            except ProcessError as exc:
                self.cleanup_errors.append(str(exc))
        for what, fn in reversed(self._cleanups):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - cleanup must go on
                self.cleanup_errors.append(f"{what}: {exc}")
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, handler)
        _LIVE_SUPERVISORS.discard(self)


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _takes_process(fn: Callable) -> bool:
    import inspect  # noqa: PLC0415

    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is inspect.Parameter.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def remove_path(path: str | os.PathLike) -> None:
    """Remove a file, symlink or directory tree; a missing path is fine."""
    _remove(Path(path))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise


@contextlib.contextmanager
def supervised(**kw: Any) -> Iterator[Supervisor]:
    """``with supervised() as sup:`` shorthand."""
    with Supervisor(**kw) as sup:
        yield sup


def wait_until(predicate: Callable[[], Any], timeout: float, poll: float = 0.05,
               what: str = "condition") -> Any:
    """Poll ``predicate`` until truthy (returned) or raise :class:`TimeoutError`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(poll)
