"""Fixtures for the part-03 / DCP-guard / part-08 port tests (LMCache 0.5.4,
0.5.5, 0.5.6): per version, the vLLM layers (0.27.1 and 0.33.0) built against
that version's runtime env (lab/provision_vllm.py), pristine, patched and
revision-2 overlays, and ONE batch run of
lab/resync_sim.py per (version, build, vLLM) that
yields every scenario and the DCP construction probe (one import of vLLM and
lmcache per run keeps CI cost at ~10 s a run).  Patched runs also carry part
08's agreement check (``--check``) and the fault scenarios of
``_resync_results.FAULT_SCENARIOS``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lab import provision  # made importable by tests/conftest.py
from _resync_results import FAULT_SCENARIOS

REPO = Path(__file__).resolve().parents[2]
SIM = ["-m", "lab.resync_sim"]  # the repository root on PYTHONPATH (tests/conftest.py)
SCENARIOS = ("hybrid", "hybrid-c1", "plain", "plain-spec")
CONSTRUCT_DCP = (1, 2)  # test_resync_ports.CONSTRUCT_DCP must match


def series(version: str) -> list[Path]:
    return sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch"))


# Builds: the wheel, the whole series, and the series of revision 2 (no 08).
BUILDS = {"pristine": lambda v: None,
          "patched": series,
          # revision 2: without 08, and without 15 (vLLM 0.34), which edits lines 08 wrote
          "r2": lambda v: [p for p in series(v) if not p.name.startswith(("08-", "15-"))]}


@pytest.fixture(scope="session")
def port_sim(tmp_path_factory):
    """``port_sim(version, which, vllm="0.27.1")`` -> batch result (cached per session).

    ``which`` is ``pristine`` (the wheel), ``patched`` (the whole series,
    applied with ``patch -p1 -F0``) or ``r2`` (the series without 08, and 15)."""
    from lab import provision_vllm

    cache: dict[tuple[str, str, str], dict] = {}

    def run(version: str, which: str, vllm: str = "0.27.1") -> dict:
        key = (version, which, vllm)
        if key in cache:
            return cache[key]
        patches = BUILDS[which](version)
        if patches is not None and not any(p.name.startswith("03-") for p in patches):
            pytest.fail(f"no 03 patch for {version}")
        overlay = provision.overlay(version, patches)
        layer = provision_vllm.vllm_layer(version, vllm=vllm)
        python = provision.runtime_env(version) / "bin" / "python"
        out = tmp_path_factory.mktemp("resync-ports") / f"{version}-{which}-{vllm}.json"
        env = dict(os.environ, PYTHONPATH=f"{overlay}:{layer}:{REPO}", LMCACHE_DISABLE_BANNER="1")
        scenarios = SCENARIOS + (FAULT_SCENARIOS if which == "patched" else ())
        proc = subprocess.run(
            [str(python), *SIM, "batch", "--out", str(out),
             "--scenarios", ",".join(scenarios),
             "--construct-dcp", ",".join(map(str, CONSTRUCT_DCP))]
            + (["--check"] if which == "patched" else []),
            env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(out.read_text())
        assert result["patched"] == (which != "pristine"), "wrong lmcache on the path"
        assert result["vllm"] == vllm, "wrong vLLM layer on the path"
        result["stderr"] = proc.stderr
        result["overlay"] = str(overlay)
        cache[key] = result
        return result

    return run
