"""Fixtures for the block-id resync tests: the vLLM 0.27.1 layer (built and
cached by scripts/provision_vllm.py), and a runner for
verify/lmcache_patchtool_verify/resync_sim.py against pristine or patched lmcache 0.5.3."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import provision  # made importable by tests/conftest.py

REPO = Path(__file__).resolve().parents[2]
PATCH_03 = REPO / "patches" / "hybrid-fa" / "0.5.3" / "03-block-id-resync.patch"
VERIFY = REPO / "verify"
SIM = ["-m", "lmcache_patchtool_verify.resync_sim"]  # verify/ on PYTHONPATH


@pytest.fixture(scope="session")
def vllm_layer() -> Path:
    import provision_vllm  # scripts/ is on sys.path (tests/conftest.py)

    return provision_vllm.vllm_layer()


@pytest.fixture(scope="session")
def resync_overlays() -> dict[str, Path]:
    # Only 03 is applied here: 01/02 touch other files and are tested elsewhere.
    return {"pristine": provision.overlay("0.5.3"),
            "patched": provision.overlay("0.5.3", [PATCH_03])}


@pytest.fixture(scope="session")
def run_sim(runtime_python_053, vllm_layer, resync_overlays, tmp_path_factory):
    cache: dict[tuple[str, str], dict] = {}

    def run(scenario: str, which: str) -> dict:
        key = (scenario, which)
        if key not in cache:
            out = tmp_path_factory.mktemp("sim") / f"{scenario}-{which}.json"
            env = dict(os.environ,
                       PYTHONPATH=f"{resync_overlays[which]}:{vllm_layer}:{VERIFY}",
                       LMCACHE_DISABLE_BANNER="1")
            proc = subprocess.run([str(runtime_python_053), *SIM, scenario,
                                   "--out", str(out)],
                                  env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            result = json.loads(out.read_text())
            result["stderr"] = proc.stderr
            assert result["patched"] == (which == "patched"), "wrong lmcache on the path"
            cache[key] = result
        return cache[key]

    return run
