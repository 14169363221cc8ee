"""The ``patchtool l2 scan`` command: option checks, the scan, the
quarantine and the final re-scan, and the exit status.  Every refusal comes
before the first write; rendering is ``patchtool.l2render``; the undo,
``l2 restore``, is ``patchtool.l2restore`` alone.

Exit status of ``l2 scan`` (docs/disk-tier.md, "Exit codes"): from what DIR holds when
the command ends, never from what a plan expected to move:

* ``L2_FLAGGED`` (20) while a flagged object is in DIR;
* else ``L2_AMBIGUOUS`` (21) while a set is ambiguous (several sizes and no
  evidence of the reader's): nothing in it was judged or moved;
* else 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .errors import Refusal
from .exitcodes import ExitCode
from .l2names import PREFIX_RE
from .l2quarantine import QuarantineResult, check_dest, quarantine
from .l2reader import TierReader
from .l2rules import CATEGORIES, CORRUPT, EXPECT_OPTION, NEVER_READ, Expectations
from .l2scan import FinalState, ScanResult, as_final, final_state, judged, scan
from .l2verify import Checker


@dataclass
class ScanReport(ScanResult):
    quarantine: QuarantineResult | None = None
    final: FinalState | None = None
    remaining_flagged: int = 0  # flagged objects in DIR when the command ends


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


def parse_expect(values: list[str] | None) -> Expectations:
    """``--expect-size SET=SIZE`` (repeatable): SET is a file name up to its
    group field (``<model>@0x<kv_rank>@<group>``, as the report prints it)."""
    out: Expectations = {}
    for v in values or []:
        prefix, eq, size = v.rpartition("=")
        if not eq or PREFIX_RE.fullmatch(prefix) is None:
            raise Refusal(EXPECT_OPTION, f"{v[:60]!r}: expected SET=SIZE, SET as the report "
                          "prints it (<model>@0x<kv_rank 8 hex>@<group hex>)", ExitCode.USAGE)
        if not size.isdigit() or int(size) == 0:
            raise Refusal(EXPECT_OPTION, f"{v[:60]!r}: SIZE must be a positive number of "
                          "bytes", ExitCode.USAGE)
        if out.get(prefix, int(size)) != int(size):
            raise Refusal(EXPECT_OPTION, f"{prefix[:60]!r} is named twice with different "
                          "sizes", ExitCode.USAGE)
        out[prefix] = int(size)
    return out


def run_scan(path: Path, reader: TierReader, dest: Path | None = None,
             only: list[str] | None = None, sizes: bool = True,
             expect: Expectations | None = None, check: Checker | None = None) -> ScanReport:
    """``l2 scan``; ``sizes=False`` is ``--names-only``; ``check`` is
    ``--verify`` (``patchtool.l2verify.checker``)."""
    expect = expect or {}
    if only is not None and dest is None:
        raise Refusal("--only", "applies only to --quarantine", ExitCode.USAGE)
    if check is not None and not sizes:
        raise Refusal("--verify", "reads every object's content; --names-only reads names only: "
                      "give one of them", ExitCode.USAGE)
    if only and CORRUPT in only and check is None:
        raise Refusal("--only", f"{CORRUPT} is judged by --verify (content): add --verify",
                      ExitCode.USAGE)
    if not sizes and only and set(only) - {NEVER_READ}:
        raise Refusal("--only", f"--names-only judges {NEVER_READ} only (the other categories "
                      "are decided by sizes): drop --names-only or choose --only never-read",
                      ExitCode.USAGE)
    if not sizes and expect:
        raise Refusal(EXPECT_OPTION, "needs sizes, which --names-only does not read",
                      ExitCode.USAGE)
    create = check_dest(path, dest) if dest is not None else False
    res, plan = scan(path, reader, sizes, expect, check)
    report = ScanReport(**{f.name: getattr(res, f.name) for f in dataclasses.fields(res)})
    if dest is None:
        report.final = as_final(res)
    else:
        if only is None:
            only = list(judged(sizes, check is not None)) if sizes else [NEVER_READ]
        report.quarantine, ran = quarantine(path, dest, plan, only, reader, expect, create)
        report.final = final_state(path, reader, sizes, expect, [plan, ran], check)
    report.remaining_flagged = report.final.flagged_objects
    return report


def scan_exit_code(report: ScanReport) -> ExitCode:
    if report.final.flagged_objects:
        return ExitCode.L2_FLAGGED
    if report.final.ambiguous_sets:
        return ExitCode.L2_AMBIGUOUS
    return ExitCode.OK
