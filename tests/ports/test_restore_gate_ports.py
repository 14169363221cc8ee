"""The CPU restore gate (real `lmcache server`, fs L2, SIGKILL, restart) against
every ported version: pristine fails the sub-paged presets and passes k=1;
the patched series passes every preset.

The gate drives LMCache's worker adapter directly, as the server sees vLLM's
tensors *after* the connector-side edits. It does not run
`apply_kv_cache_group_edits`, so on 0.5.6 it measures the server side alone:
pristine 0.5.6 fails the hybrid preset here exactly as 0.5.3 does, while in
production 0.5.6's connector re-views hybrid FA groups first (docs/ports.md
measures that path with the real edit). The pure-attention preset gets no
edit on any version, so it is the production case everywhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gate"))

from lab import provision
from test_restore_gate import assert_silent_corruption, by_preset, run_gate
# CI: the first and last ported release (keeps the cold run under 50 min);
# LMCACHE_PATCHTOOL_FULL=1 adds 0.5.5 (and the engine-driven evidence runs it).
VERSIONS = ["0.5.4", "0.5.5", "0.5.6"] if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" \
    else ["0.5.4", "0.5.6"]


def _python(version: str) -> Path:
    return provision.runtime_env(version) / "bin" / "python"


def _series(version: str) -> list[Path]:
    return sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch"))


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_pristine_fails_sub_paged_and_passes_k1(version):
    # qwen35 and the control share a chunk size: one server pair.
    proc, report, _ = run_gate(_python(version), provision.overlay(version),
                               ["qwen35-0.8b", "control-k1"], "--no-stay-alive")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert report["versions"]["lmcache"] == version
    presets = by_preset(report)
    assert_silent_corruption(presets["qwen35-0.8b"])
    assert presets["control-k1"]["verdict"] == "pass"


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_patched_passes_every_preset(version):
    proc, report, _ = run_gate(_python(version), provision.overlay(version, _series(version)),
                               ["qwen35-0.8b", "control-k1", "pure-attn-bs128"], "--no-stay-alive")
    assert proc.returncode == 0, proc.stderr[-3000:]
    presets = by_preset(report)
    assert {name: p["verdict"] for name, p in presets.items()} == {
        "qwen35-0.8b": "pass", "control-k1": "pass", "pure-attn-bs128": "pass"}
    for p in presets.values():
        assert p["after_restart"]["l2_hits"] > 0  # restored from the disk tier, not vacuous
