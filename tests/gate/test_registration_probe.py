"""Registration: the startup log names sub-paged groups (operators' signal that
the fix is active) and a layout that cannot tile is refused at registration."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = ["-m", "lab.probes.registration_probe"]  # the repository root on PYTHONPATH (tests/conftest.py)


def probe(python: Path, overlay: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}")
    proc = subprocess.run([str(python), *PROBE, *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("preset,k", [("qwen35-0.8b", 17), ("pure-attn-bs128", 2)])
def test_log_names_sub_paged_groups(runtime_python_053, pristine_overlay_053, patched_overlay_053,
                                    preset, k):
    pristine = " | ".join(probe(runtime_python_053, pristine_overlay_053, "--preset", preset)["group_lines"])
    patched_doc = probe(runtime_python_053, patched_overlay_053, "--preset", preset)
    patched = " | ".join(patched_doc["group_lines"])
    assert "compressed (tokens_per_block=" in pristine and "sub-paged" not in pristine
    assert patched_doc["registered"]
    assert f"sub-paged, k={k} (" in patched and "[lmcache-patchtool hybrid-fa]" in patched
    assert "compressed" not in patched


def test_k1_group_is_neither(runtime_python_053, patched_overlay_053):
    doc = probe(runtime_python_053, patched_overlay_053, "--preset", "control-k1")
    assert doc["registered"] and doc["group_lines"] == []


def test_layout_that_does_not_tile_is_refused_at_registration(runtime_python_053, pristine_overlay_053,
                                                              patched_overlay_053):
    patched = probe(runtime_python_053, patched_overlay_053, "--break-tiling")
    assert not patched["registered"]
    assert "does not tile" in patched["error"] and "[lmcache-patchtool hybrid-fa]" in patched["error"]
    # Pristine has no such check: the same broken layout registers silently.
    assert probe(runtime_python_053, pristine_overlay_053, "--break-tiling")["registered"]
