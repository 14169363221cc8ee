"""``patchtool ci``: the gate passes on the real 0.5.3 wheel in the runtime
env, and fails with its documented exit code on an unsupported version, a
version without a patch set, a fixed-upstream version, a tampered wheel,
warnings, and an interpreter without torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import TARGET_FILE, cli, flip_one_byte, rewrite_wheel, sha256

PHASES = ["resolve", "patch-set", "fetch", "build", "install", "verify", "roundtrip", "restore"]


def _phases(res: dict) -> dict[str, str]:
    return {p["phase"]: p["result"] for p in res["phases"]}


def _ci(py: Path, patches: Path, *args: str):
    return cli("ci", "--python", str(py), "--json", *args, patches=patches)


@pytest.mark.slow
def test_ci_passes_on_053(tmp_path, runtime_python_053, patches_root, built):
    out = tmp_path / "out"
    r = _ci(runtime_python_053, patches_root, "--pin", "lmcache==0.5.3", "--preset",
            "qwen35-0.8b", "-o", str(out))
    assert r.rc == 0, r.out[-3000:] + r.err[-3000:]
    doc = r.json
    assert doc["command"] == "ci" and doc["exit_code"] == 0
    res = doc["result"]
    assert [p["phase"] for p in res["phases"]] == PHASES
    assert set(_phases(res).values()) == {"pass"}, res["phases"]
    assert all(p["seconds"] >= 0 for p in res["phases"])
    # The downloaded wheel is the manifest's; the rebuild is the same bytes
    # as `patchtool wheel` gave.
    assert res["wheel"]["sha256"] == built["sha256"]
    assert sha256(Path(res["wheel"]["path"])) == built["sha256"]
    phases = {p["phase"]: p for p in res["phases"]}
    gate = phases["restore"]["data"]["report"]
    assert gate["tool"] == "restore_gate" and gate["verdict"] == "pass"
    assert gate["versions"]["lmcache"] == "0.5.3+hybridfa.r1"  # the scratch install, not the venv's
    rt = phases["roundtrip"]["data"]["report"]
    assert rt["summary"]["passed"] == rt["summary"]["cells"] > 0
    assert res["work_dir"] is None  # the scratch dir was removed


@pytest.mark.slow
def test_ci_warnings_fail_unless_allowed(tmp_path, runtime_python_053, patches_root):
    """A re-zipped wheel (sha256 unknown to the manifest, files identical)
    and a deployment vLLM the set was not verified with: two warnings."""
    from lab import provision

    other = rewrite_wheel(provision.wheel("0.5.3"), tmp_path / provision.wheel("0.5.3").name)
    args = ("--wheel", str(other), "--vllm", "0.26.0", "--preset", "control-k1")
    r = _ci(runtime_python_053, patches_root, *args)
    assert r.rc == 18, r.out[-3000:] + r.err[-3000:]
    res = r.json["result"]
    assert len(res["warnings"]) == 2
    assert _phases(res)["build"] == "warn" and _phases(res)["patch-set"] == "warn"
    assert _phases(res)["restore"] == "pass" and not res["ok"]
    r = _ci(runtime_python_053, patches_root, *args, "--allow-warnings")
    assert r.rc == 0 and r.json["result"]["ok"] and len(r.json["result"]["warnings"]) == 2


def test_ci_unsupported_version(runtime_python_053, patches_root):
    r = _ci(runtime_python_053, patches_root, "--pin", "lmcache==0.5.2")
    assert r.rc == 7, r.err
    res = r.json["result"]
    assert _phases(res)["patch-set"] == "fail"
    assert "older than every version" in res["phases"][1]["detail"]
    assert [p["result"] for p in res["phases"][2:]] == ["skipped"] * 6


def test_ci_no_patch_set(tmp_path, runtime_python_053, patches_root):
    r = _ci(runtime_python_053, patches_root, "--pin", "lmcache==0.6.0")
    assert r.rc == 16, r.err
    assert "no patch set for lmcache 0.6.0" in r.json["result"]["phases"][1]["detail"]
    req = tmp_path / "requirements.txt"
    req.write_text("--index-url https://pypi.org/simple\n"
                   "vllm==0.27.1  # the engine\n"
                   "lmcache==0.5.7 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    r = _ci(runtime_python_053, patches_root, "--requirements", str(req))
    assert r.rc == 16, r.err
    assert r.json["result"]["phases"][0]["data"]["vllm"] == "0.27.1"


def test_ci_fixed_upstream(runtime_python_053, fixed_root):
    r = _ci(runtime_python_053, fixed_root, "--pin", "lmcache==0.5.6")
    assert r.rc == 8, r.err
    assert "needs no patch" in r.json["result"]["phases"][1]["detail"]


def test_ci_tampered_wheel(tmp_path, runtime_python_053, patches_root, wheel053):
    bad = rewrite_wheel(wheel053, tmp_path / wheel053.name, flip_one_byte(TARGET_FILE))
    r = _ci(runtime_python_053, patches_root, "--wheel", str(bad))
    assert r.rc == 15, r.err
    res = r.json["result"]
    assert _phases(res)["build"] == "fail" and "pre-image" in res["phases"][3]["detail"]
    assert _phases(res)["install"] == "skipped"


def test_ci_human_summary(runtime_python_053, patches_root):
    r = cli("ci", "--python", str(runtime_python_053), "--pin", "lmcache==0.5.2",
            patches=patches_root)
    assert r.rc == 7
    assert "phase" in r.out and "patch-set" in r.out and "FAIL" in r.out


def test_ci_refusals(tmp_path, bare_python_053, runtime_python_053, patches_root):
    r = cli("ci", "--python", str(bare_python_053), "--pin", "lmcache==0.5.3",
            patches=patches_root)
    assert r.rc == 3 and r.err.count("\n") == 1 and "has no torch" in r.err and r.out == ""
    r = _ci(runtime_python_053, patches_root, "--wheel", str(tmp_path / "missing.whl"))
    assert r.rc == 3 and "no such wheel file" in r.err
    req = tmp_path / "r.txt"
    req.write_text("torch==2.13.0\n")
    r = _ci(runtime_python_053, patches_root, "--requirements", str(req))
    assert r.rc == 3 and "does not pin lmcache" in r.json["result"]["phases"][0]["detail"]
