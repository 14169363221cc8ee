"""Fixtures for the part-03 / DCP-guard port tests (LMCache 0.5.4, 0.5.5,
0.5.6): per version, the vLLM 0.27.1 layer built against that version's
runtime env (scripts/provision_vllm.py), pristine and patched overlays, and
ONE batch run of verify/lmcache_patchtool_verify/resync_sim.py per (version,
pristine|patched) that yields every scenario and the DCP construction probe (one import of vLLM and
lmcache per run keeps CI cost at ~10 s a run)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import provision  # made importable by tests/conftest.py

REPO = Path(__file__).resolve().parents[2]
VERIFY = REPO / "verify"
SIM = ["-m", "lmcache_patchtool_verify.resync_sim"]  # verify/ on PYTHONPATH
SCENARIOS = ("hybrid", "hybrid-c1", "plain", "plain-spec")
CONSTRUCT_DCP = (1, 2)  # test_resync_ports.CONSTRUCT_DCP must match


def series(version: str) -> list[Path]:
    return sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch"))


@pytest.fixture(scope="session")
def port_sim(tmp_path_factory):
    """``port_sim(version, which)`` -> batch result (cached per session).

    ``which`` is ``pristine`` (the wheel) or ``patched`` (the whole series,
    01..04, applied with ``patch -p1 -F0``)."""
    import provision_vllm  # scripts/ is on sys.path (tests/conftest.py)

    cache: dict[tuple[str, str], dict] = {}

    def run(version: str, which: str) -> dict:
        key = (version, which)
        if key in cache:
            return cache[key]
        patches = series(version) if which == "patched" else None
        if which == "patched" and not any(p.name.startswith("03-") for p in patches):
            pytest.fail(f"no 03 patch for {version}")
        overlay = provision.overlay(version, patches)
        layer = provision_vllm.vllm_layer(version)
        python = provision.runtime_env(version) / "bin" / "python"
        out = tmp_path_factory.mktemp("resync-ports") / f"{version}-{which}.json"
        env = dict(os.environ, PYTHONPATH=f"{overlay}:{layer}:{VERIFY}", LMCACHE_DISABLE_BANNER="1")
        proc = subprocess.run(
            [str(python), *SIM, "batch", "--out", str(out),
             "--scenarios", ",".join(SCENARIOS),
             "--construct-dcp", ",".join(map(str, CONSTRUCT_DCP))],
            env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(out.read_text())
        assert result["patched"] == (which == "patched"), "wrong lmcache on the path"
        result["stderr"] = proc.stderr
        result["overlay"] = str(overlay)
        cache[key] = result
        return result

    return run
