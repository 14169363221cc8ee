"""Fixtures for the block-id resync tests (LMCache 0.5.3): vLLM layers built
and cached by lab/provision_vllm.py (0.27.1, and 0.33.0 whose
SchedulerOutput carries ``kv_connector_block_state``), and a runner for
lab/resync_sim.py against pristine or patched
lmcache 0.5.3.

Builds: ``pristine`` (the wheel), ``patched`` (the resync parts of the series,
03 and 08, applied with ``patch -p1 -F0``) and ``r2`` (03 alone: the resync of
revision 2, before part 08).  One batch run per (build, vLLM) yields every
scenario (one import of vLLM and lmcache per run); ``patched`` runs also carry
part 08's agreement check (``--check``) and the fault scenarios of
``_resync_results.FAULT_SCENARIOS``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lab import provision  # made importable by tests/conftest.py
from _resync_results import FAULT_SCENARIOS, SCENARIOS

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "patches" / "hybrid-fa" / "0.5.3"
PATCH_03 = SERIES / "03-block-id-resync.patch"
PATCH_08 = SERIES / "08-block-state-from-vllm.patch"
SIM = ["-m", "lab.resync_sim"]  # the repository root on PYTHONPATH (tests/conftest.py)


@pytest.fixture(scope="session")
def vllm_layer():
    """``vllm_layer(vllm="0.27.1")`` -> the layer directory for lmcache 0.5.3."""
    from lab import provision_vllm

    return lambda vllm="0.27.1": provision_vllm.vllm_layer("0.5.3", vllm=vllm)


@pytest.fixture(scope="session")
def resync_overlays() -> dict[str, Path]:
    # Only the resync parts: 01/02/05/07 touch other code and are tested elsewhere.
    return {"pristine": provision.overlay("0.5.3"),
            "patched": provision.overlay("0.5.3", [PATCH_03, PATCH_08]),
            "r2": provision.overlay("0.5.3", [PATCH_03])}


@pytest.fixture(scope="session")
def run_batch(runtime_python_053, vllm_layer, resync_overlays, tmp_path_factory):
    """``run_batch(which, vllm="0.27.1")`` -> the batch result (cached)."""
    cache: dict[tuple[str, str], dict] = {}

    def run(which: str, vllm: str = "0.27.1") -> dict:
        key = (which, vllm)
        if key not in cache:
            out = tmp_path_factory.mktemp("sim") / f"{which}-{vllm}.json"
            scenarios = SCENARIOS + (FAULT_SCENARIOS if which == "patched" else ())
            env = dict(os.environ,
                       PYTHONPATH=f"{resync_overlays[which]}:{vllm_layer(vllm)}:{REPO}",
                       LMCACHE_DISABLE_BANNER="1")
            proc = subprocess.run([str(runtime_python_053), *SIM, "batch",
                                   "--scenarios", ",".join(scenarios), "--out", str(out)]
                                  + (["--check"] if which == "patched" else []),
                                  env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            result = json.loads(out.read_text())
            result["stderr"] = proc.stderr
            assert result["patched"] == (which != "pristine"), "wrong lmcache on the path"
            assert result["vllm"] == vllm, "wrong vLLM layer on the path"
            cache[key] = result
        return cache[key]

    return run


@pytest.fixture(scope="session")
def run_sim(run_batch):
    """``run_sim(scenario, which, vllm="0.27.1")`` -> one scenario's result,
    with the batch's stderr."""

    def run(scenario: str, which: str, vllm: str = "0.27.1") -> dict:
        batch = run_batch(which, vllm)
        return dict(batch["scenarios"][scenario], stderr=batch["stderr"])

    return run
