"""The process a gate or probe runs in: what its report records about it, and
how it keeps the library's own output out of its progress lines (stdlib only).

Shared by ``gate/restore_gate.py`` and the research probes built on the same
server plumbing (:mod:`.restore_server`).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


def versions() -> dict[str, Any]:
    """Python, lmcache and torch of this interpreter, where lmcache loads from
    and, for a provisioned overlay, its stamp (which patches it carries)."""
    out: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable,
                           "platform": platform.platform()}
    for dist in ("lmcache", "torch"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        import lmcache  # noqa: PLC0415 - the target's lmcache, only when a report is written

        pkg = Path(lmcache.__file__).resolve().parent
        out["lmcache_dir"] = str(pkg.parent)
        stamp = pkg.parent / ".provisioned"
        if stamp.exists():
            out["overlay"] = json.loads(stamp.read_text())
    except Exception as exc:  # noqa: BLE001
        out["lmcache_import_error"] = f"{type(exc).__name__}: {exc}"
    return out


@contextmanager
def quiet_library_output(log_path: Path | None) -> Iterator[Any]:
    """Send fd 1 and fd 2 (lmcache's client-side logging, warnings) to a file.

    Yields ``(stdout, stderr)`` file objects on the ORIGINAL descriptors, for
    the report and the progress lines.
    """
    out = os.fdopen(os.dup(1), "w", buffering=1)
    err = os.fdopen(os.dup(2), "w", buffering=1)
    if log_path is None:
        try:
            yield out, err
        finally:
            out.close()
            err.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield out, err
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        out.close()
        err.close()


def run_json_probe(probe: Callable[[], dict[str, Any]], name: str, fmt: str) -> int:
    """Run a probe with the library's output sent to a log, print its JSON
    document on the original stdout: 0, or 2 with the error, its traceback
    and the log's last 40 lines in the document."""
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}-client-{os.getpid()}.log"
    code = 0
    with quiet_library_output(log) as (out, _err):
        try:
            doc = probe()
        except Exception as exc:  # noqa: BLE001 - any failure is the probe's answer
            doc = {"format": fmt, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            try:
                doc["client_log_tail"] = log.read_text("utf-8", "replace").splitlines()[-40:]
            except OSError:
                pass
            code = 2
        out.write(json.dumps(doc, default=str) + "\n")
        out.flush()
    log.unlink(missing_ok=True)
    return code
