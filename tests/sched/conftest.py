"""Fixtures for the scheduler-faithful simulation:
``lab/sched_sim.py`` run in an LMCache version's
runtime venv with ``PYTHONPATH = <lmcache overlay>:<vLLM X layer>:<repo>`` (X =
0.27.1 unless a test asks for another).

One CLI run per (version, build, vLLM) yields every scenario of the set (one import
of vLLM and LMCache per run: ~15 s), cached for the session.

Builds: ``pristine`` (the wheel), ``patched`` (the hybrid-fa series as git
tracks it: ``git ls-files``, so a patch still untracked in a working tree, a
revision in progress, is not picked up until it is added), ``r1`` (that
series without the parts revision 2 added, :data:`R2_PARTS`: part 03 revision
1 alone, kept as the measured baseline) and ``r3`` (that series without the
parts revision 4 added, :data:`R4_PARTS`: the old parts a revision-4 test
must fail on).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest

from lab import provision  # made importable by tests/conftest.py

REPO = Path(__file__).resolve().parents[2]
SIM = ["-m", "lab.sched_sim"]  # the repository root on PYTHONPATH (tests/conftest.py)


# file-name prefixes of the parts added after part 03 revision 1 that change
# the connector's or server's behaviour here (revision 2: 06, 07; revision 3:
# 08, which reads vLLM 0.30+'s block state; revision 4: 11, the vLLM hit
# count on an LMCache miss; 05, keys only, and 09/10, worker and server
# registration and transfer, are inert for the sim).  r1 = the series
# without them.
R2_PARTS = ("06-", "07-", "08-", "11-")
# The parts revision 4 added; r3 = the series without them.
R4_PARTS = ("09-", "10-", "11-", "12-")
# Parts newer than every baseline build, dropped from r1 and r3 too: part 15
# (vLLM 0.34's scheduler output) edits lines that parts 03/08 wrote, so its
# hunks apply only on the whole series (and the baselines predate it); part 19
# (0.5.3's port of 06, its revision 9) likewise.
LATER_PARTS = ("15-", "19-")


def tracked_series(version: str) -> list[Path]:
    """The ordered patch files of the hybrid-fa set for ``version`` that git tracks."""
    rel = f"patches/hybrid-fa/{version}"
    try:
        out = subprocess.run(["git", "ls-files", "--", f"{rel}/*.patch"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every patch
        return sorted((REPO / rel).glob("*.patch"))
    return sorted(REPO / p for p in out)


@pytest.fixture(scope="session")
def sched_run(tmp_path_factory) -> Callable[..., dict[str, dict[str, Any]]]:
    """``sched_run(version, build, scenarios="ci", vllm="0.27.1")`` -> {scenario name:
    result}: the simulation in ``version``'s runtime venv over the vLLM ``vllm``
    layer (lab/provision_vllm.py), with that vLLM's own scheduler features."""
    from lab import provision_vllm

    cache: dict[tuple[str, str, str, str, int | None], dict[str, dict[str, Any]]] = {}

    def run(version: str, build: str, scenarios: str = "ci",
            vllm: str = "0.27.1", block_size: int | None = None) -> dict[str, dict[str, Any]]:
        key = (version, build, scenarios, vllm, block_size)
        if key in cache:
            return cache[key]
        patches = tracked_series(version) if build in ("patched", "r1", "r3") else None
        if build in ("r1", "r3"):
            drop = (R2_PARTS if build == "r1" else R4_PARTS) + LATER_PARTS
            patches = [p for p in patches or () if not p.name.startswith(drop)]
        if patches is not None and not any(p.name.startswith("03-") for p in patches):
            pytest.fail(f"no tracked 03 patch for {version}")
        overlay = provision.overlay(version, patches)
        layer = provision_vllm.vllm_layer(version, vllm=vllm)
        stamp = json.loads((layer / provision.STAMP).read_text())
        python = Path(stamp.get("runtime_env") or provision.runtime_env(version)) / "bin" / "python"
        out = tmp_path_factory.mktemp("sched") / f"{version}-{build}-{vllm}.json"
        if block_size is not None:  # e.g. pure attention at the block an operator passes
            scenarios += f",--block-size={block_size}"
        env = dict(os.environ, PYTHONPATH=f"{overlay}:{layer}:{REPO}",
                   LMCACHE_DISABLE_BANNER="1")
        args = [a for s in scenarios.split(",")
                for a in ((s,) if s.startswith("--") else ("--scenario", s))]
        proc = subprocess.run([str(python), *SIM, *args, "--version", version,
                               "--build", build, "--out", str(out)],
                              env=env, capture_output=True, text=True, timeout=1800)
        # Any assertion inside vLLM's real Scheduler/KVCacheManager (or the
        # connector) aborts the run: a non-zero exit fails every test using it.
        assert proc.returncode == 0, proc.stderr[-4000:]
        results = {r["scenario"]: r for r in json.loads(out.read_text())}
        for r in results.values():
            assert r["vllm_version"] == vllm, "wrong vLLM layer on the path"
            if r.get("constructed"):
                assert r["patched"] == (build != "pristine"), "wrong lmcache on the path"
            r["stderr_tail"] = proc.stderr[-2000:]
        cache[key] = results
        return results

    return run
