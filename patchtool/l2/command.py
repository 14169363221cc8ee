"""The ``patchtool l2 scan`` command: option checks, the scan, the
quarantine and the final re-scan, and the exit status.  Every refusal comes
before the first write; rendering is ``patchtool.l2.render``; the undo,
``l2 restore``, is ``patchtool.l2.restore`` alone.  :func:`scan_and_move` is
the same for every tier: :func:`run_scan` runs it on a directory with the fs
quarantine, ``patchtool.l2.redis_scan`` on a Redis tier with its renames.

Exit status of ``l2 scan`` (docs/disk-tier.md, "Exit codes"): from what DIR holds when
the command ends, never from what a plan expected to move:

* ``L2_FLAGGED`` (20) while a flagged object is in DIR;
* else ``L2_AMBIGUOUS`` (21) while a set is ambiguous (several sizes and no
  evidence of the reader's): nothing in it was judged or moved;
* else 0.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import Refusal
from ..exitcodes import ExitCode
from .names import PREFIX_RE
from .quarantine import QuarantineResult, check_dest, quarantine
from .reader import TierReader
from .rules import CATEGORIES, CORRUPT, EXPECT_OPTION, NEVER_READ, Expectations, Plan
from .scan import FinalState, ScanResult, as_final, final_state, judged, scan
from .source import FsTier, TierSource
from .content_check import Checker


@dataclass
class ScanReport(ScanResult):
    quarantine: QuarantineResult | None = None
    final: FinalState | None = None
    remaining_flagged: int = 0  # flagged objects in DIR when the command ends


# (the scan's plan, the categories to move) -> what moved, and the plan that ran
Mover = Callable[[Plan, list[str]], tuple[QuarantineResult, Plan]]
# the scan's fields -> the report (a tier's subclass adds its own fields)
ReportOf = Callable[[dict], ScanReport]


def parse_only(value: str | None) -> list[str] | None:
    """``--only``: the categories to move (``None``: not given)."""
    if value is None:
        return None
    chosen = [c.strip() for c in value.split(",") if c.strip()]
    bad = [c for c in chosen if c not in CATEGORIES]
    if bad or not chosen:
        raise Refusal("--only", f"{value!r}: choose from {','.join(CATEGORIES)}",
                      ExitCode.USAGE)
    return [c for c in CATEGORIES if c in chosen]


def parse_expect(values: list[str] | None, prefix_re: re.Pattern = PREFIX_RE,
                 form: str = "<model>@0x<kv_rank 8 hex>@<group hex>") -> Expectations:
    """``--expect-size SET=SIZE`` (repeatable): SET is a file name up to its
    group field (``<model>@0x<kv_rank>@<group>``, as the report prints it);
    a Redis tier's sets are its native keys up to the group field
    (``prefix_re``, ``form``: ``patchtool.l2.redis_keys``)."""
    out: Expectations = {}
    for v in values or []:
        prefix, eq, size = v.rpartition("=")
        if not eq or prefix_re.fullmatch(prefix) is None:
            raise Refusal(EXPECT_OPTION, f"{v[:60]!r}: expected SET=SIZE, SET as the report "
                          f"prints it ({form})", ExitCode.USAGE)
        if not size.isdigit() or int(size) == 0:
            raise Refusal(EXPECT_OPTION, f"{v[:60]!r}: SIZE must be a positive number of "
                          "bytes", ExitCode.USAGE)
        if out.get(prefix, int(size)) != int(size):
            raise Refusal(EXPECT_OPTION, f"{prefix[:60]!r} is named twice with different "
                          "sizes", ExitCode.USAGE)
        out[prefix] = int(size)
    return out


def check_options(only: list[str] | None, quarantine: bool, sizes: bool,
                  expect: Expectations, verify: bool) -> None:
    """The refusals that need no tier (exit 2), for every tier alike."""
    if only is not None and not quarantine:
        raise Refusal("--only", "applies only to --quarantine", ExitCode.USAGE)
    if verify and not sizes:
        raise Refusal("--verify", "reads every object's content; --names-only reads names only: "
                      "give one of them", ExitCode.USAGE)
    if only and CORRUPT in only and not verify:
        raise Refusal("--only", f"{CORRUPT} is judged by --verify (content): add --verify",
                      ExitCode.USAGE)
    if not sizes and only and set(only) - {NEVER_READ}:
        raise Refusal("--only", f"--names-only judges {NEVER_READ} only (the other categories "
                      "are decided by sizes): drop --names-only or choose --only never-read",
                      ExitCode.USAGE)
    if not sizes and expect:
        raise Refusal(EXPECT_OPTION, "needs sizes, which --names-only does not read",
                      ExitCode.USAGE)


def run_scan(path: Path, reader: TierReader, dest: Path | None = None,
             only: list[str] | None = None, sizes: bool = True,
             expect: Expectations | None = None, check: Checker | None = None) -> ScanReport:
    """``l2 scan DIR``; ``sizes=False`` is ``--names-only``; ``check`` is
    ``--verify`` (``patchtool.l2.content_check.checker``)."""
    expect = expect or {}
    check_options(only, dest is not None, sizes, expect, check is not None)
    mover: Mover | None = None
    if dest is not None:
        create = check_dest(path, dest)

        def move(plan: Plan, chosen: list[str]) -> tuple[QuarantineResult, Plan]:
            return quarantine(path, dest, plan, chosen, reader, expect, create)
        mover = move
    return scan_and_move(FsTier(path), reader, mover, only, sizes, expect, check)


def scan_and_move(tier: TierSource, reader: TierReader, mover: Mover | None,
                  only: list[str] | None, sizes: bool, expect: Expectations,
                  check: Checker | None, report_of: ReportOf | None = None) -> ScanReport:
    """The scan, the quarantine ``mover`` runs (when asked) and the final
    re-scan.  ``report_of`` makes the report from the scan's fields (default
    :class:`ScanReport`)."""
    res, plan = scan(tier, reader, sizes, expect, check)
    fields = {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}
    report = report_of(fields) if report_of is not None else ScanReport(**fields)
    if mover is None:
        report.final = as_final(res)
    else:
        if only is None:
            only = list(judged(sizes, check is not None)) if sizes else [NEVER_READ]
        report.quarantine, ran = mover(plan, only)
        report.final = final_state(tier, reader, sizes, expect, [plan, ran], check)
    report.remaining_flagged = report.final.flagged_objects
    return report


def scan_exit_code(report: ScanReport) -> ExitCode:
    if report.final.flagged_objects:
        return ExitCode.L2_FLAGGED
    if report.final.ambiguous_sets:
        return ExitCode.L2_AMBIGUOUS
    return ExitCode.OK
