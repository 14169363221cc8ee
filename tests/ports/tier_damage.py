"""What the tier-damage tests (fs: test_l2_checksum.py, Redis: test_resp_tier.py) check
after a reader phase of ``gate/restore_gate.py`` restored copies of a request whose
objects were damaged on the tier, one kind of damage per copy."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable, Hashable, TypeVar

Obj = TypeVar("Obj")


def damage_copies(chunks: dict[str, list[list[Obj]]], damage: dict[str, tuple[int | None, int]],
                  group_of: Callable[[Obj], Hashable],
                  apply: Callable[[str, Obj, "Obj | None"], "Obj | None"]) -> dict[str, list[Obj]]:
    """Damage every object of one chunk per copy; the objects touched, per copy.

    ``chunks[copy]`` lists, per chunk, that copy's objects (one per object
    group); ``damage[copy] = (first damaged chunk, ...)`` (None: left whole).
    ``apply(copy, victim, partner)`` damages one object on the tier (a file,
    a Redis key); ``partner`` is the object of the victim's group that the
    copy needs (``swap``: chunk 1 of the same copy; ``foreign``: chunk 2 of
    the intact copy; else None), and what ``apply`` returns is touched too."""

    def same_group(objs: list[Obj], like: Obj) -> Obj:
        (match,) = [o for o in objs if group_of(o) == group_of(like)]
        return match

    touched: dict[str, list[Obj]] = {}
    for copy, (chunk, _) in damage.items():
        if chunk is None:
            continue
        touched[copy] = list(chunks[copy][chunk])
        for victim in list(touched[copy]):
            partner = (same_group(chunks[copy][1], victim) if copy == "swap" else
                       same_group(chunks["intact"][2], victim) if copy == "foreign" else None)
            extra = apply(copy, victim, partner)
            if extra is not None:
                touched[copy].append(extra)
    return touched


def assert_outcomes(report: dict, per_preset: dict[str, dict[str, dict]],
                    damage: dict[str, tuple[int | None, int]], merged: dict[str, bool]) -> None:
    """Every copy's outcome: exact with the chunks its damage leaves whole, or a miss.

    ``damage[copy] = (first damaged chunk, chunks hit with one object per chunk)``;
    a preset whose chunks are several objects (not ``merged``) hits nothing once one is
    damaged (the prefetch loads the state of the last chunk only)."""
    by_model = {p["model_name"]: p for p in report["presets"]}
    got, want = {}, {}
    for name, entries in per_preset.items():
        for copy, e in entries.items():
            p = by_model[e["model"]]
            got[(name, copy)] = (p["outcome"], p["xver"]["chunks_hit"], p["xver"]["chunks_exact"])
            hits = damage[copy][1] if merged[name] or copy == "intact" else 0
            want[(name, copy)] = ("miss" if hits == 0 else "exact", hits, hits)
    assert got == want, "\n".join(f"{k}: {got[k]} != {want[k]}: "
                                   f"{by_model[per_preset[k[0]][k[1]]['model']]['outcome_why']}"
                                   for k in got if got[k] != want[k])


def assert_refusals_logged(report: dict, touched: dict[tuple[str, str], list[str]]) -> None:
    """One server log line per refused object, naming it; only damaged objects refused;
    and the adapter's counter in ``GET /status`` says how many."""
    log = "".join((Path(c["workdir"]) / "server-R.log").read_text(errors="replace") for c in report["cycles"])
    lines = [line for line in log.splitlines() if "rejected L2 object" in line]
    named = [n for names in touched.values() for n in names]
    for line in lines:
        assert sum(n in line for n in named) == 1, line
    for (name, copy), names in touched.items():
        count = sum(n in line for n in names for line in lines)
        assert 1 <= count <= len(names), (name, copy, count, lines)
        assert all(sum(n in line for line in lines) <= 1 for n in names), (name, copy)
    counted = sum(c["l2_adapters_status"][0]["rejected_objects"] for c in report["cycles"])
    assert counted == len(lines), [c["l2_adapters_status"] for c in report["cycles"]]


def remove_work(report: dict) -> None:
    """The reader's kept work directories and client log (``--keep-tmp``)."""
    for c in report.get("cycles", []):
        subprocess.run(["rm", "-rf", c["workdir"]], check=False)
    if report.get("client_log"):
        Path(report["client_log"]).unlink(missing_ok=True)
