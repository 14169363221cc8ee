"""``patchtool l2 scan redis://HOST:PORT[/DB]`` and ``l2 restore
redis://... [KEY...]``: the fs commands' options, rules, report and exit
codes (``patchtool.l2.command``), on a Redis tier (``patchtool.l2.redis_tier``),
with its moves (``patchtool.l2.redis_move``).

Every refusal comes before the first write: a malformed URL or option
(exit 2), an unreachable server, a failed login, a cluster node, no blake3
for ``--verify`` (exit 3).  A Redis error later, while reading, is refused in
one line too (exit 3); while renaming, it is a failed write (19): every
object is under its live or its quarantined name, and a re-run finishes.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from . import checksum as ck
from ..errors import Refusal
from .command import ScanReport, check_options, parse_expect, scan_and_move
from .reader import TierReader
from .redis_tier import RedisTier, connect, describe, parse_url, redis_module
from .redis_keys import PREFIX_FORM, PREFIX_RE, QUARANTINE_PREFIX, SEAL_PREFIX
from .redis_move import RedisRestoreResult, quarantine, restore
from .rules import Expectations, Plan


@dataclass
class RedisTierInfo:
    """What the report says of a Redis tier beyond the fs fields, from the
    first pass."""

    url: str  # without the password
    db: int
    server: str  # redis_version
    seal_prefix: str
    quarantine_prefix: str
    sealed: int  # objects under lmcptsum1@ keys
    unsealed: int  # objects under native keys: written without the seal
    quarantined: int  # lmcptq@ keys: moved aside by a quarantine, not objects


@dataclass
class RedisScanReport(ScanReport):
    redis: RedisTierInfo | None = None


def parse_redis_expect(values: list[str] | None) -> Expectations:
    """``--expect-size SET=SIZE`` with SET a native key up to its group field."""
    return parse_expect(values, PREFIX_RE, PREFIX_FORM)


def run_redis_scan(url: str, reader: TierReader, move: bool, only: list[str] | None,
                   sizes: bool, expect: Expectations, verify: bool,
                   python: str | None) -> RedisScanReport:
    """``l2 scan redis://...``; ``move`` is ``--quarantine``, ``verify``
    ``--verify`` (blake3 here, else in ``python``)."""
    target = parse_url(url)
    check_options(only, move, sizes, expect, verify)
    redis = redis_module()
    with connect(target) as tier, (ck.Digester(python) if verify else nullcontext()) as digester:
        try:
            return _scan(tier, reader, move, only, sizes, expect, digester)
        except redis.RedisError as exc:
            raise Refusal(tier.where, f"cannot read the tier: {describe(exc)}") from None


def _scan(tier: RedisTier, reader: TierReader, move: bool, only: list[str] | None,
          sizes: bool, expect: Expectations, digester: ck.Digester | None) -> RedisScanReport:
    check = tier.checker(digester) if digester is not None else None

    def mover(plan: Plan, chosen: list[str]):
        return quarantine(tier, plan, chosen, digester)

    def report_of(fields: dict) -> RedisScanReport:
        t = tier.first_tally
        assert t is not None
        return RedisScanReport(**fields, redis=RedisTierInfo(
            tier.where, tier.target.db, tier.server_version, SEAL_PREFIX, QUARANTINE_PREFIX,
            t.sealed, t.unsealed, t.quarantined))

    report = scan_and_move(tier, reader, mover if move else None, only, sizes, expect, check,
                           report_of)
    if report.verify is not None and digester is not None:
        report.verify.checked_with = digester.checked_with
    assert isinstance(report, RedisScanReport)
    return report


def run_redis_restore(url: str, keys: list[str]) -> RedisRestoreResult:
    """``l2 restore redis://... [KEY...]``."""
    target = parse_url(url)
    with connect(target) as tier:
        redis = redis_module()
        try:
            return restore(tier, keys)
        except redis.RedisError as exc:
            raise Refusal(tier.where, f"cannot read the tier: {describe(exc)}") from None
