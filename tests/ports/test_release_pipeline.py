"""lab/release.py's port report on the real wheels: the 0.5.6 parts tried
in order on 0.5.7rc2's wheel (the porter's to-do list, as measured by hand
in docs/ports.md), and a version's own shipped series on its own wheel, every
part applying.  --dry-run: the evidence commands are printed, not run."""

from __future__ import annotations

import json
import subprocess
import sys

from .harness_run import REPO

SCRIPT = REPO / "lab" / "release.py"


def report(tmp_path, new: str, prev: str) -> dict:
    out = tmp_path / "release.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "lmcache", new, "--from", prev, "--dry-run",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    doc["stdout"] = proc.stdout
    return doc


def test_056_parts_on_057rc2_wheel(tmp_path):
    doc = report(tmp_path, "0.5.7rc2", "0.5.6")
    got = {(r["set"], r["part"]): r for r in doc["port_report"]}
    applies = {k[1] for k, r in got.items() if r["applies"] and k[0] == "hybrid-fa"}
    # 20-fs-load-jobs: 0.5.7rc2's fs adapter load and lookup are 0.5.6's (docs/ports.md, issue 39)
    assert applies == {"01-staging-views", "04-dcp-guard", "05-layout-keys", "09-padded-block-stride",
                       "12-l2-checksum", "16-native-l2-size-batches", "20-fs-load-jobs"}
    assert got[("hybrid-fa", "02-page-ratio")]["failed_hunks"] == {
        "lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py": "1 of 3"}
    assert got[("hybrid-fa", "03-block-id-resync")]["failed_hunks"] == {
        "lmcache/integration/vllm/lmcache_mp_connector.py": "1 of 11",
        "lmcache/integration/vllm/lmcache_mp_metadata.py": "3 of 9"}
    assert [k[1] for k, r in got.items() if k[0] == "engine-driven" and r["applies"]] == ["03-zero-window-tail"]
    # rc2 has its own series, so the evidence steps are listed (not run: --dry-run)
    assert [s["name"] for s in doc["steps"]][:2] == ["manifest hybrid-fa", "manifest engine-driven"]
    assert all(s["rc"] is None for s in doc["steps"]) and "would run: " in doc["stdout"]


def test_own_series_applies_whole_on_its_wheel(tmp_path):
    doc = report(tmp_path, "0.5.7rc2", "0.5.7rc2")
    assert doc["port_report"] and all(r["applies"] for r in doc["port_report"]), doc["port_report"]
