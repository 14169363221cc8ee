"""Run a script of the shipped gate (``gate/*.py``) in the TARGET
environment and collect its JSON report.

The tool never imports torch or lmcache itself: the scripts run by path in
an interpreter that has them (``--python``), with an optional directory
(``--site-packages``, a ``pip install --target`` dir) put first on
``PYTHONPATH`` so that *that* lmcache is the one imported, by the script and
by every process it starts (the restore gate's ``lmcache server`` inherits
the environment).  The folder that holds the ``gate`` package goes after it,
so the script's ``from gate import ...`` finds its helpers (the repository
root in a checkout, ``patchtool/_data`` in the wheel).

Before a script runs, the interpreter is probed (stdlib only, no lmcache
import) so that a missing torch, or an lmcache that would be imported from
somewhere other than the install being verified, is refused in one line
instead of failing minutes later.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import Refusal, excerpt

# Runs in the target interpreter WITHOUT -I: PYTHONPATH must apply.  find_spec
# on a top-level name locates the package without executing it.
_PROBE = r"""
import importlib.util, json, sys
def loc(name):
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return spec.origin
try:
    import importlib.metadata as md
    vllm = md.version("vllm")
except Exception:
    vllm = None
print(json.dumps({"executable": sys.executable, "version": sys.version.split()[0],
                  "torch": loc("torch"), "lmcache": loc("lmcache"), "vllm": vllm}))
"""


@dataclass
class RunEnv:
    """Where a check runs: the interpreter and what goes first on PYTHONPATH."""

    python: str
    pythonpath: str | None  # a --site-packages dir, prepended
    probe: dict = field(default_factory=dict)

    def environ(self, import_root: Path | None = None) -> dict[str, str]:
        """The process environment; ``import_root`` (the folder holding the
        ``gate`` package) goes on ``PYTHONPATH`` after ``pythonpath``."""
        env = dict(os.environ)
        first = [p for p in (self.pythonpath, str(import_root) if import_root else None) if p]
        if first:
            old = env.get("PYTHONPATH")
            env["PYTHONPATH"] = os.pathsep.join(first + ([old] if old else []))
        env.setdefault("NO_COLOR", "1")
        return env


def probe(python: str, pythonpath: str | None) -> dict:
    env = RunEnv(python, pythonpath)
    if not Path(python).exists():
        raise Refusal(python, "no such interpreter")
    try:
        # On stdin ("-"), not argv: a program that is not Python cannot echo it back.
        proc = subprocess.run([python, "-"], input=_PROBE, capture_output=True, text=True,
                              env=env.environ(), timeout=120)
    except OSError as exc:
        raise Refusal(python, f"cannot run interpreter: {exc.strerror or exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Refusal(python, f"interpreter probe failed: {excerpt(last)}")
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        if not isinstance(info, dict):
            raise ValueError
    except (ValueError, IndexError):
        raise Refusal(python, "did not answer like a Python interpreter (printed: "
                      f"{excerpt(proc.stdout, 60)!r})") from None
    return info


def resolve(python: str | None, site_packages: str | None, expect_site: Path | None,
            what: str) -> RunEnv:
    """The environment a restore check of ``what`` runs in.  Refuses when
    the interpreter has no torch or would import another lmcache."""
    if site_packages is not None and python is None:
        raise Refusal("--site-packages", f"running {what} needs an interpreter with torch "
                      "and lmcache's dependencies: add --python PATH (the directory is put "
                      "first on its PYTHONPATH)")
    exe = python or sys.executable
    env = RunEnv(exe, str(Path(site_packages).resolve()) if site_packages else None)
    env.probe = probe(exe, env.pythonpath)
    if env.probe.get("torch") is None:
        hint = "" if python else " (this is patchtool's own interpreter; pass --python)"
        raise Refusal(exe, f"has no torch, so {what} cannot run here{hint}: use the "
                      "interpreter of the environment lmcache runs in")
    if expect_site is not None:
        want = os.path.realpath(Path(expect_site) / "lmcache")
        got = env.probe.get("lmcache")
        if got is None or os.path.realpath(got) != want:
            raise Refusal(exe, f"would import lmcache from {got or 'nowhere'}, not from the "
                          f"install being verified ({want}); {what} would test another copy")
    return env


def _stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the script's process group, so it can stop the servers it
    started (they also die with it: PR_SET_PDEATHSIG), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


@dataclass
class ScriptRun:
    script: str
    argv: list[str]
    python: str
    pythonpath: str | None
    exit_code: int | None  # None: killed on timeout
    seconds: float
    report: dict | None  # the script's JSON report, when it wrote one
    stderr_tail: list[str] = field(default_factory=list)
    timed_out: bool = False


def run_script(env: RunEnv, script: Path, args: list[str], report_opt: str, *,
               timeout: float | None = None,
               echo: bool | Callable[[str], bool] = False) -> ScriptRun:
    """Run ``script`` (a file of the gate folder) by path; ``report_opt`` is
    the script's option that writes its JSON report to a file (``--json-out``,
    ``--out``).  ``echo`` streams the script's stderr to ours: every line, or
    those it accepts."""
    if not script.is_file():
        raise Refusal(script, "gate script not found (see `patchtool/resources.py`)")
    with tempfile.TemporaryDirectory(prefix="patchtool-check-") as tmp:
        report_path = Path(tmp) / "report.json"
        argv = [env.python, str(script), *args, report_opt, str(report_path)]
        tail: deque[str] = deque(maxlen=60)
        started = time.monotonic()
        # Own process group: on timeout the script's servers die with it.
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, errors="replace", env=env.environ(script.parent.parent),
                                start_new_session=True)

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                tail.append(line.rstrip("\n"))
                if echo is True or (callable(echo) and echo(line)):
                    sys.stderr.write(line)
                    sys.stderr.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            code = None
        except BaseException:
            _stop(proc)
            raise
        reader.join(timeout=10)
        seconds = round(time.monotonic() - started, 3)
        report = None
        try:
            report = json.loads(report_path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            pass
    return ScriptRun(script.name, argv[1:], env.python, env.pythonpath, code, seconds, report,
                     list(tail), timed_out)
