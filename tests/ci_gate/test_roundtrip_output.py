"""What a person sees of the round-trip inside ``verify`` and ``ci``: the
harness's one line per finished cell (``roundtrip: [i/n] ...``), failing
cells with their reasons, streamed live; none of LMCache's own log; and in
``--json`` mode nothing on stderr and the check's JSON in its usual shape.

The harness is a stand-in ``roundtrip.py`` (``LMCACHE_PATCHTOOL_GATE``)
that prints what the real one prints (the real lines are checked in
tests/gate/test_roundtrip.py); the install is the real patched 0.5.3 one."""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli import stand_in_python

from .helpers import cli

PROGRESS = [
    "roundtrip: [1/3] pass qwen35-0.8b/C=1N/x3/skip0/scattered/python (2.0 s)",
    "roundtrip: [2/3] FAIL qwen35-0.8b/C=1N/x2/skip0/identity/python: retrieve failed; "
    "fa: restored 0.0000 of requested bytes (1.0 s)",
    "roundtrip: [3/3] FAIL gdn-27b/C=1N/x2/skip0/scattered/python: fa: 4096 foreign bytes written (6.0 s)",
]
NOISE = "[2026-12-02 03:11:17,018] LMCache ERROR: Some keys not found during retrieve!"

STAND_IN = f'''
import json, sys
argv = sys.argv[1:]
out = argv[argv.index("--out") + 1]
lines = {PROGRESS!r}
cells = []
for line in lines:
    print({NOISE!r}, file=sys.stderr, flush=True)
    print(line, file=sys.stderr, flush=True)
    word, rest = line.split("] ", 1)[1].split(" ", 1)
    name, _, reasons = rest.rsplit(" (", 1)[0].partition(": ")
    cells.append({{"name": name, "verdict": {{"pass": word == "pass",
                                            "reasons": reasons.split("; ") if reasons else []}}}})
json.dump({{"harness": "gate/roundtrip.py", "cells": cells,
           "summary": {{"cells": 3, "passed": 1, "errors": 0}}}}, open(out, "w"))
'''


@pytest.fixture
def verify_root(tmp_path) -> Path:
    root = tmp_path / "verify"
    root.mkdir()
    (root / "roundtrip.py").write_text(STAND_IN)
    return root


def _progress(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("roundtrip: ")]


def test_verify_shows_progress_and_each_failing_cell(tmp_path, verify_root, patches_root, target_site):
    py = stand_in_python(tmp_path)
    args = ("verify", "--roundtrip", "--site-packages", str(target_site), "--python", str(py))
    env = {"LMCACHE_PATCHTOOL_GATE": str(verify_root)}
    r = cli(*args, patches=patches_root, env=env)
    assert r.rc == 13, (r.out, r.err)
    assert _progress(r.err) == PROGRESS and NOISE not in r.err, r.err
    assert "1/3 cells byte-exact" in r.out and "(and 1 more failing cell(s))" in " ".join(r.out.split())

    r = cli(*args, "--json", patches=patches_root, env=env)
    assert r.rc == 13 and r.err == "", r.err
    check = r.json["result"]["checks"][-1]
    assert check["name"] == "roundtrip-cpu" and (check["ok"], check["error"]) == (False, False)
    assert set(check) == {"name", "ok", "detail", "data", "error", "skipped"}
    assert set(check["data"]) == {"script", "exit_code", "seconds", "python", "pythonpath", "argv",
                                  "report"}


def test_ci_shows_progress_and_each_failing_cell(tmp_path, verify_root, patches_root, wheel053):
    py = stand_in_python(tmp_path)
    r = cli("ci", "--wheel", str(wheel053), "--python", str(py), patches=patches_root,
            env={"LMCACHE_PATCHTOOL_GATE": str(verify_root)})
    assert r.rc == 13, (r.out, r.err)
    assert _progress(r.err) == PROGRESS and NOISE not in r.err, r.err
    assert "roundtrip" in r.out and "1/3 cells byte-exact" in " ".join(r.out.split())
