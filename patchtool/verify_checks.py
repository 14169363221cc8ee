"""Named checks that ``patchtool verify`` runs, in a registry others extend.

A check is a function taking a :class:`CheckContext` and returning a
:class:`CheckResult`.  ``verify`` runs :data:`DEFAULT_CHECKS` on a patched
install; ``verify --restore MODE`` additionally runs the check registered as
``restore-MODE`` and refuses when none is registered yet.  A restore check
registers itself with::

    from patchtool.verify_checks import register

    @register("restore-cpu")
    def restore_cpu(ctx): ...  # run a script from ctx.verify_root by path
                               # in ctx.target.python; never import lmcache here
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .classify import PATCHED, Status
from .manifest import PatchSetDir
from .target import Target


@dataclass
class CheckContext:
    target: Target
    status: Status
    patch_set: PatchSetDir | None
    verify_root: Path  # the shipped verify/ scripts (patchtool.resources)


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str
    data: dict = field(default_factory=dict)


CheckFn = Callable[[CheckContext], CheckResult]
REGISTRY: dict[str, CheckFn] = {}
DEFAULT_CHECKS = ("files", "record")
RESTORE_MODES = ("cpu", "gpu")


def register(name: str) -> Callable[[CheckFn], CheckFn]:
    def deco(fn: CheckFn) -> CheckFn:
        REGISTRY[name] = fn
        return fn
    return deco


def restore_check_name(mode: str) -> str:
    return f"restore-{mode}"


@register("files")
def _files(ctx: CheckContext) -> CheckResult:
    bad = [f.path for f in ctx.status.files if f.state != "patched"]
    ok = ctx.status.state == PATCHED and not bad
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
    other states map to their own exit codes (README, "Exit codes")."""
    from .exitcodes import ExitCode

    by_state = {
        "not-installed": ExitCode.NOT_INSTALLED, "pristine": ExitCode.PRISTINE,
        "drifted": ExitCode.DRIFTED, "unsupported-version": ExitCode.UNSUPPORTED_VERSION,
        "fixed-upstream": ExitCode.FIXED_UPSTREAM,
        "patched-older-revision": ExitCode.PATCHED_OLDER_REVISION,
        "partially-patched": ExitCode.PARTIALLY_PATCHED,
    }
    st = ctx.status
    if st.state != PATCHED:
        return VerifyResult(False, st.state, by_state[st.state], st)
    checks = [REGISTRY[name](ctx) for name in (*DEFAULT_CHECKS, *extra)]
    failed = [c.name for c in checks if not c.ok]
    if failed:
        return VerifyResult(False, f"check failed: {', '.join(failed)}", ExitCode.CHECK_FAILED,
                            st, checks)
    return VerifyResult(True, PATCHED, ExitCode.OK, st, checks)
