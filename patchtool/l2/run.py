"""The one entry into the ``l2`` commands: a parsed request in, a result and
its exit status out.

:mod:`patchtool.operations` calls :func:`scan` and :func:`restore` (it
resolves the reader of a target install); the CLI only parses and renders.
Every refusal is raised here, before the first write.  The tier modules are
imported lazily, each by the branch that needs it, so an fs scan never
imports redis-py and ``--verify``'s checker loads only with ``--verify``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import Refusal
from ..exitcodes import ExitCode
from .reader import TierReader, parse_assume
from .redis_keys import is_redis_url


@dataclass(frozen=True)
class ScanRequest:
    """``patchtool l2 scan`` as parsed (the target install apart)."""

    tier: str                      # DIR, or redis://HOST:PORT[/DB]
    quarantine: str | None = None  # None: none; "": without DEST (Redis); else DEST (fs)
    only: str | None = None        # --only LIST
    expect_size: list[str] = field(default_factory=list)
    names_only: bool = False
    verify: bool = False
    assume: str | None = None      # --assume pristine|kvlN instead of a target


# What resolves the target's reader: () -> (reader, the target's interpreter
# when it is not patchtool's own).  Called only without --assume.
ReaderOf = Callable[[], "tuple[TierReader, str | None]"]


def scan(req: ScanRequest, reader_of: ReaderOf, has_target: bool) -> tuple[Any, ExitCode]:
    """Scan (and quarantine) one tier; the result and the exit status."""
    from . import command  # lazy: the scan modules load only for l2

    redis = is_redis_url(req.tier)
    only = command.parse_only(req.only)
    if redis:
        from .redis_scan import parse_redis_expect  # lazy: only a redis:// tier needs it

        expect = parse_redis_expect(req.expect_size)
        if req.quarantine:
            raise Refusal("--quarantine", "a Redis tier's quarantine is in the tier itself (each "
                          "key renamed to lmcptq@KEY): give --quarantine without DEST",
                          ExitCode.USAGE)
    else:
        expect = command.parse_expect(req.expect_size)
        if req.quarantine == "":
            raise Refusal("--quarantine", "needs DEST for an fs tier: the directory to move "
                          "flagged objects into (same filesystem as DIR)", ExitCode.USAGE)
    if req.assume is not None:
        if has_target:
            raise Refusal("--assume", "give --assume or a target (--python/--site-packages), "
                          "not both", ExitCode.USAGE)
        reader, check_python = parse_assume(req.assume), None
    else:
        reader, check_python = reader_of()
    if redis:
        from .redis_scan import run_redis_scan  # lazy: only a redis:// tier needs it

        res = run_redis_scan(req.tier, reader, req.quarantine is not None, only,
                             not req.names_only, expect, req.verify, check_python)
    else:
        verified_with: list[str] = []
        check = None
        if req.verify:
            from .content_check import checker  # lazy: only --verify reads object contents

            check = checker(Path(req.tier), check_python, verified_with)
        res = command.run_scan(Path(req.tier), reader,
                               Path(req.quarantine) if req.quarantine else None, only,
                               sizes=not req.names_only, expect=expect, check=check)
        if res.verify is not None and verified_with:
            res.verify.checked_with = verified_with[0]
    return res, command.scan_exit_code(res)


def restore(dest: str, keys: list[str]) -> Any:
    """``patchtool l2 restore``: an fs quarantine as a whole, or Redis keys."""
    if is_redis_url(dest):
        from .redis_scan import run_redis_restore  # lazy: only a redis:// tier needs it

        return run_redis_restore(dest, keys)
    if keys:
        raise Refusal("KEY", "restoring by key applies to a redis:// tier; an fs "
                      "quarantine is restored as a whole: patchtool l2 restore DEST",
                      ExitCode.USAGE)
    from .restore import restore as restore_fs  # lazy: only l2 restore needs it

    return restore_fs(Path(dest))
