"""``patchtool l2 scan`` on a tier written by real servers: pristine 0.5.3 and
pristine 0.5.6 each store six chunks of qwen35-0.8b at two blocks per chunk
(``gate/restore_gate.py --phase store``: a real ``lmcache server`` with an
fs L2 tier, SIGKILLed once the objects are on disk).

The two releases write different sizes for the same model (6,815,744 B and
8,912,896 B on the CPU gate) under different chunk hashes, and each reads its
own back byte-exact.  Mixed into one plain set, in either majority, scanned
for either release as a real install (``--python`` of its runtime venv),
nothing may be flagged or moved: the set is ambiguous until the operator
names the reader's size.  The gate names each run's model uniquely, so the
0.5.6 objects are linked into the tier under the 0.5.3 run's model field (a
rename of the name only; the bytes are the server's).

Two server runs, about a minute: ``LMCACHE_PATCHTOOL_FULL=1`` only (the same
rule on synthetic files of the exact sizes runs in the unit tier,
tests/unit/test_l2_size_rule.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lab import provision

from .helpers import REPO, cli

pytestmark = [pytest.mark.torch,
              pytest.mark.skipif(os.environ.get("LMCACHE_PATCHTOOL_FULL") != "1",
                                 reason="two real servers: LMCACHE_PATCHTOOL_FULL=1")]

GATE = REPO / "gate" / "restore_gate.py"
SIZES = {"0.5.3": 6_815_744, "0.5.6": 8_912_896}  # pristine, qwen35-0.8b, C = 2N, CPU
AMBIGUOUS, FLAGGED = 21, 20


def _store(version: str, work: Path, seed: int) -> list[Path]:
    """One writer phase of the restore gate; the objects it left on disk."""
    l2 = work / f"l2-{version}"
    l2.mkdir(parents=True)
    py = provision.runtime_env(version) / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=f"{provision.overlay(version)}:{REPO}", NO_COLOR="1")
    report = work / f"store-{version}.json"
    proc = subprocess.run([str(py), str(GATE), "--phase", "store", "--l2-dir", str(l2),
                           "--state-out", str(work / f"state-{version}.json"),
                           "--model-prefix", "l2mix", "--preset", "qwen35-0.8b",
                           "--chunk-blocks", "2", "--chunks", "6", "--seed", str(seed),
                           "--json-out", str(report)],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
    assert report.exists() and json.loads(report.read_text())["verdict"] == "pass", \
        proc.stderr[-3000:]
    return sorted(p for p in l2.iterdir() if p.name.endswith(".data"))


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, list[Path]]:
    work = tmp_path_factory.mktemp("l2-real")
    return {"0.5.3": _store("0.5.3", work, 11), "0.5.6": _store("0.5.6", work, 12)}


def _mix(d: Path, written: dict[str, list[Path]], old: int, new: int) -> tuple[str, list[str]]:
    """``old`` objects of 0.5.3 and ``new`` of 0.5.6 in one plain set of ``d``;
    returns the set and the 0.5.3 names."""
    d.mkdir()
    model = written["0.5.3"][0].name.split("@", 1)[0]
    olds = []
    for p in written["0.5.3"][:old]:
        os.link(p, d / p.name)
        olds.append(p.name)
    for p in written["0.5.6"][:new]:
        os.link(p, d / f"{model}@{p.name.split('@', 1)[1]}")
    return olds[0].rsplit("@", 1)[0], olds


def test_servers_wrote_the_sizes_of_the_design_table(written):
    for v, files in written.items():
        assert len(files) == 6 and {p.stat().st_size for p in files} == {SIZES[v]}, v


@pytest.mark.parametrize("old,new", [(6, 4), (4, 6)], ids=["0.5.3-majority", "0.5.6-majority"])
@pytest.mark.parametrize("reader", ["0.5.3", "0.5.6"])
def test_no_reader_loses_its_objects(tmp_path, written, reader, old, new):
    d, q = tmp_path / "tier", tmp_path / "q"
    prefix, olds = _mix(d, written, old, new)
    before = sorted(os.listdir(d))
    py = str(provision.runtime_env(reader) / "bin" / "python")
    r = cli("l2", "scan", str(d), "--python", py, "--quarantine", str(q), "--json")
    res = r.json["result"]
    assert r.rc == AMBIGUOUS, (r.rc, r.err)
    assert res["reader"]["detail"].startswith(f"pristine lmcache {reader}")
    [row] = res["sets"]
    assert row["ambiguous"] and row["flagged"] == [] and row["set"] == prefix
    assert row["sizes"] == {str(SIZES["0.5.3"]): old, str(SIZES["0.5.6"]): new}
    assert res["quarantine"]["moved"] == 0 and not q.exists() and sorted(os.listdir(d)) == before
    # the operator names the reader's size: exactly the other release's objects move
    r = cli("l2", "scan", str(d), "--python", py, "--expect-size",
            f"{prefix}={SIZES[reader]}", "--quarantine", str(q), "--json")
    assert r.rc == 0, r.err
    moved = set(os.listdir(q)) - {"quarantine.jsonl"}
    assert (moved == set(olds)) is (reader == "0.5.6") and len(moved) == (old if reader ==
                                                                           "0.5.6" else new)
