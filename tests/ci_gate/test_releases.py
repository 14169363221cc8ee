"""The operator's checks on the newer releases, with the shipped patch sets:
``patchtool ci --pin lmcache==X`` and, on the install that run leaves behind,
``patchtool verify --restore cpu --roundtrip``.

CI runs 0.5.6 (0.5.3 is covered by test_ci.py and test_verify_restore.py);
``LMCACHE_PATCHTOOL_FULL=1`` adds 0.5.4 and 0.5.5.  What these catch:

* the round-trip harness must adapt itself to the release it runs on (0.5.6
  moved the transfer functions: without ``ports_compat.install`` it dies on
  ``_HAS_NATIVE_OBJECT_GROUP_TRANSFER`` before the first cell);
* every cell of the fast matrix passes, the identity cell included: its block
  ids never include vLLM's null block 0, which 0.5.4+ servers rightly do not
  store (ids from 0 made that cell fail on every release but 0.5.3).

Both checks restore one preset (qwen35-0.8b): the whole preset list is the
restore gate's own tests' job."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lab import provision

from .helpers import REPO, cli

FULL = os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
VERSIONS = ["0.5.6"] + (["0.5.4", "0.5.5"] if FULL else [])
PRESET = "qwen35-0.8b"
PHASES = ["resolve", "patch-set", "fetch", "build", "install", "verify", "roundtrip", "restore"]
SHIPPED = REPO / "patches"


def _roundtrip_all_pass(report: dict, version: str, built: str) -> None:
    assert report["lmcache"]["version"] == built, report["lmcache"]  # the patched build, not the venv's
    cells = report["cells"]
    bad = [(c["name"], c.get("error"), c["verdict"]["reasons"]) for c in cells if not c["verdict"]["pass"]]
    assert not bad, (version, bad)
    assert report["summary"] == {"cells": len(cells), "passed": len(cells), "errors": 0}
    identity = [c for c in cells if c["cell"]["ids"] == "identity"]
    assert identity, [c["name"] for c in cells]
    for c in identity:
        for ids in (*c["ids"]["store"].values(), *c["ids"]["retrieve"].values()):
            assert 0 not in ids, (c["name"], c["ids"])  # block 0 is vLLM's null block


@pytest.fixture(scope="module", params=VERSIONS)
def ci_run(request, tmp_path_factory) -> dict:
    """``patchtool ci --pin lmcache==X`` in X's runtime venv, its work dir kept."""
    version = request.param
    py = provision.runtime_env(version) / "bin" / "python"
    work = tmp_path_factory.mktemp(f"ci-{version}")
    r = cli("ci", "--pin", f"lmcache=={version}", "--python", str(py), "--preset", PRESET,
            "--work-dir", str(work), "--json", patches=SHIPPED)
    return {"version": version, "python": py, "site": work / "site", "run": r}


@pytest.mark.slow
def test_ci_pin_passes(ci_run):
    r, version = ci_run["run"], ci_run["version"]
    assert r.rc == 0, r.out[-4000:] + r.err[-3000:]
    res = r.json["result"]
    assert [p["phase"] for p in res["phases"]] == PHASES
    assert {p["phase"]: p["result"] for p in res["phases"]} == dict.fromkeys(PHASES, "pass")
    assert res["patch_set"] == "hybrid-fa" and res["lmcache_version"] == version
    built = res["wheel"]["version"]
    assert built.startswith(f"{version}+hybridfa.r"), built
    phases = {p["phase"]: p for p in res["phases"]}
    _roundtrip_all_pass(phases["roundtrip"]["data"]["report"], version, built)
    gate = phases["restore"]["data"]["report"]
    assert gate["verdict"] == "pass" and [p["preset"] for p in gate["presets"]] == [PRESET]
    assert gate["versions"]["lmcache"] == built


@pytest.mark.slow
def test_verify_restore_cpu_and_roundtrip_pass(ci_run):
    """The per-deploy check on the install ci left behind (``--site-packages``)."""
    assert ci_run["run"].rc == 0, "ci failed: see test_ci_pin_passes"
    site, version = ci_run["site"], ci_run["version"]
    built = ci_run["run"].json["result"]["wheel"]["version"]
    r = cli("verify", "--json", "--restore", "cpu", "--roundtrip", "--site-packages", str(site),
            "--python", str(ci_run["python"]), "--preset", PRESET, patches=SHIPPED)
    assert r.rc == 0, r.out[-4000:] + r.err[-3000:]
    checks = {c["name"]: c for c in r.json["result"]["checks"]}
    assert list(checks) == ["files", "record", "roundtrip-cpu", "restore-cpu"]
    assert all(c["ok"] for c in checks.values()), {n: c["detail"] for n, c in checks.items()}
    _roundtrip_all_pass(checks["roundtrip-cpu"]["data"]["report"], version, built)
    assert checks["roundtrip-cpu"]["data"]["pythonpath"] == str(Path(site).resolve())
    gate = checks["restore-cpu"]["data"]["report"]
    assert gate["verdict"] == "pass" and gate["versions"]["lmcache_dir"] == str(Path(site).resolve())
