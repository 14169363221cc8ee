"""A partial evidence run merged into a committed file replaces exactly the
cells it reran, keeps the rest in place, and records which run measured
which cell; a schema change refuses to merge."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

from lab import evidence_merge
KEY = ("lmcache", "vllm", "build")


def _cell(lm: str, build: str, value: int) -> dict:
    return {"lmcache": lm, "vllm": "0.33.0", "build": build, "value": value}


def _doc(command: str, cells: list[dict], schema: int = 1) -> dict:
    return {"schema": schema, "command": command, "git_head": command * 3, "seconds": 9, "cells": cells}


def test_replaces_rerun_cells_and_keeps_the_others_in_order() -> None:
    old = _doc("full", [_cell("0.5.5", "pristine", 1), _cell("0.5.5", "patched", 1),
                        _cell("0.5.6", "patched", 1)])
    new = _doc("part", [_cell("0.5.5", "patched", 2), _cell("0.5.7", "patched", 2)])
    got = evidence_merge.merge(old, new, KEY)
    assert [(c["lmcache"], c["build"], c["value"]) for c in got["cells"]] == [
        ("0.5.5", "pristine", 1), ("0.5.5", "patched", 2), ("0.5.6", "patched", 1), ("0.5.7", "patched", 2)]
    assert got["command"] == "part"
    assert got["runs"] == [
        {"command": "part", "git_head": "partpartpart", "seconds": 9,
         "cells": ["0.5.5/0.33.0/patched", "0.5.7/0.33.0/patched"]},
        {"command": "full", "git_head": "fullfullfull", "seconds": 9,
         "cells": ["0.5.5/0.33.0/pristine", "0.5.6/0.33.0/patched"]}]


def test_a_run_whose_cells_were_all_rerun_drops_out() -> None:
    first = evidence_merge.merge(_doc("a", [_cell("0.5.5", "patched", 1)]),
                                 _doc("b", [_cell("0.5.6", "patched", 1)]), KEY)
    again = evidence_merge.merge(first, _doc("c", [_cell("0.5.5", "patched", 3)]), KEY)
    assert [r["command"] for r in again["runs"]] == ["c", "b"]


def test_schema_change_refuses() -> None:
    with pytest.raises(ValueError, match="regenerate the whole file"):
        evidence_merge.merge(_doc("a", [], schema=1), _doc("b", [], schema=2), KEY)
