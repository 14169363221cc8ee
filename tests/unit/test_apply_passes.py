"""A stacked apply classifies the install once before and once after, and
parses RECORD once each time: planning works from the classification it is
given (each layer's own status, the parsed RECORD), never from a second look.
Counted in-process on the synthetic two-layer stack (tests/unit/test_stacked_sets.py)."""

from __future__ import annotations

import collections
import contextlib
import io
import shutil
from pathlib import Path

import pytest

import patchtool.classify as C
import patchtool.record as R
from patchtool.cli import main

from .test_stacked_sets import TOP, make_stack


@pytest.fixture
def counted(monkeypatch) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    layer, parse = C._classify, R.Record.parse.__func__

    def one_layer(*a, **k):
        counts["layer"] += 1
        return layer(*a, **k)

    def record_parse(cls, data, where="RECORD"):
        counts["record"] += 1
        return parse(cls, data, where)

    monkeypatch.setattr(C, "_classify", one_layer)
    monkeypatch.setattr(R.Record, "parse", classmethod(record_parse))
    return counts


def run(*argv: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        return main(list(argv))


def test_a_stacked_apply_classifies_once_before_and_once_after(tmp_path, site, patch_root,
                                                               wheel, counted, monkeypatch):
    root = make_stack(Path(shutil.copytree(patch_root, tmp_path / "p")), wheel)
    monkeypatch.setenv("LMCACHE_PATCHTOOL_PATCHES", str(root))
    assert run("apply", "--site-packages", str(site), "--set", TOP, "--json") == 0
    # two layers, each judged once before and once after; RECORD parsed once each time
    assert counted == {"layer": 4, "record": 2}
    counted.clear()
    assert run("revert", "--site-packages", str(site), "--json") == 0
    assert counted == {"layer": 4, "record": 2}
