"""``patchtool verify --restore cpu --edges``: the disk-tier upgrade and
downgrade edges of the installed version, through the real server.

An operator who patches (or reverts) an install keeps the fs L2 tier the
other build wrote.  This check runs both edges in the target environment:

* pristine -> installed: ``gate/restore_gate.py --phase store`` with the
  pristine wheel of the installed version first on ``PYTHONPATH`` (its server
  and client), SIGKILL, then ``--phase restore`` with the installed (patched)
  lmcache on the same directory;
* installed -> pristine: the same, the other way round.

Each preset's outcome is ``exact`` (every stored chunk hit and restored
byte-exact), ``miss`` (no hit, or a loud failure that wrote nothing) or
``wrong`` (a hit with wrong bytes, or bytes written outside the destination).
The check fails on any ``wrong``; ``miss`` is the safe answer where the two
builds' bytes differ (sub-paged and hybrid layouts live under the patched
build's own key namespace), ``exact`` where they are the same (attention with
k = 1 keeps LMCache's keys and bytes).

The pristine copy is the real wheel: ``--edges-wheel FILE``, or downloaded
with the target interpreter's ``pip download --no-deps`` (needs the index).
This module never imports lmcache or torch.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import Refusal
from .runner import RunEnv, run_script
from .wheelbuild import download, wheel_version

# Presets whose byte classes cover the edges: hybrid k = 17, pure attention
# k = 2, hybrid k = 1 and attention k = 1 (gate/xver_outcome.py).
EDGE_PRESETS = ("qwen35-0.8b", "pure-attn-bs128", "control-k1", "pure-attn-k1")


@dataclass
class EdgeRun:
    writer: str  # "pristine" | "installed"
    reader: str
    outcomes: dict[str, str]  # preset -> exact | miss | wrong
    why: dict[str, str]
    seconds: float


def pristine_wheel(python: str, version: str, dest: Path, given: str | None) -> Path:
    """The real lmcache wheel of ``version``: the one given (checked to be that
    version, and not a wheel this tool patched), or ``pip download``'s."""
    if not given:
        return download(version, python, dest)
    return check_given_wheel(given, version)


def check_given_wheel(given: str, version: str) -> Path:
    """``--edges-wheel``: a real, unpatched lmcache wheel of ``version``."""
    path = Path(given)
    found = wheel_version(path)  # refuses a missing file, a non-lmcache or a patched wheel
    if found != version:
        raise Refusal(path, f"is lmcache {found}, but the installed version is {version}")
    return path


def extract(wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest)
    except (OSError, zipfile.BadZipFile) as exc:
        raise Refusal(wheel, f"is not a readable wheel ({exc})") from None
    if not (dest / "lmcache").is_dir():
        raise Refusal(wheel, "holds no lmcache package")
    return dest


def _phase(env: RunEnv, script: Path, args: list[str], timeout: float | None, what: str):
    run = run_script(env, script, args, "--json-out", timeout=timeout)
    rep = run.report
    if rep is None or rep.get("verdict") == "error":
        why = (rep or {}).get("reason") or next(
            (ln.strip() for ln in reversed(run.stderr_tail) if ln.strip()), f"exit {run.exit_code}")
        raise EdgeError(f"{what}: {str(why).splitlines()[0]}")
    return run, rep


class EdgeError(Exception):
    """An edge could not reach a verdict (a phase errored)."""


def run_edges(env, gate_root: Path, version: str, *, wheel: str | None, presets: list[str],
              timeout: float | None) -> list[EdgeRun]:
    """Both edges of ``version`` in ``env`` (runner.RunEnv of the installed build)."""
    script = gate_root / "restore_gate.py"
    presets = presets or list(EDGE_PRESETS)
    with tempfile.TemporaryDirectory(prefix="patchtool-edges-") as tmp:
        work = Path(tmp)
        pristine_dir = extract(pristine_wheel(env.python, version, work / "dl", wheel), work / "pristine")
        pp = os.pathsep.join([str(pristine_dir)] + ([env.pythonpath] if env.pythonpath else []))
        builds = {"installed": env, "pristine": RunEnv(env.python, pp, env.probe)}
        runs = []
        for writer, reader in (("pristine", "installed"), ("installed", "pristine")):
            d = work / f"{writer}-to-{reader}"
            (d / "l2").mkdir(parents=True)
            common = [a for p in presets for a in ("--preset", p)] + ["--quiet"]
            run_w, _ = _phase(builds[writer], script, ["--phase", "store", "--l2-dir", str(d / "l2"),
                                                        "--state-out", str(d / "state.json"),
                                                        "--model-prefix", f"edges-{writer}", *common],
                              timeout, f"{writer} writer")
            run_r, rep = _phase(builds[reader], script, ["--phase", "restore", "--l2-dir", str(d / "l2"),
                                                          "--state-in", str(d / "state.json"), *common],
                                timeout, f"{reader} reader")
            outcomes = {p["preset"]: p.get("outcome", "?") for p in rep.get("presets", [])}
            why = {p["preset"]: p.get("outcome_why", "") for p in rep.get("presets", [])}
            runs.append(EdgeRun(writer, reader, outcomes, why, round(run_w.seconds + run_r.seconds, 1)))
    return runs
