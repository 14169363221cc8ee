"""The engine gate on vLLM 0.34 (CUDA): its default geometry, and its extensible KV cache.

Geometry: vLLM 0.34's default block 64 makes the Qwen3.5-0.8B-like hybrid's block 576 (9 FlashInfer
pages of 64) under every GDN prefill backend, so the GPU profile's default follows the target's vLLM
(engine_device.profile); computed with vLLM 0.34.0's own block-size code, not run on a GPU.

vLLM 0.34's extensible KV cache on CUDA (gate/kv_cache_access.py):
on by default, it hands LMCache's connector driver-mapped memory that its CUDA-IPC export
cannot share while ``kv_connector_module_path`` is set (as the gate sets it).  The gate passes
``--no-enable-extensible-kv-cache`` on vLLM >= 0.34 with the GPU profile and refuses an
explicit ``--enable-extensible-kv-cache`` before any server starts, in one line.  Read from the
0.34.0 wheel; not run on a GPU (the decision is all that runs here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _fake_vllm import fake_vllm
from gate import kv_cache_access as kca

from .test_native_preflight import fake_env


@pytest.mark.parametrize("vllm, device, args, add", [
    ("0.33.0", "gpu", [], ()),
    ("0.34.0", "cpu", [], ()),
    (None, "gpu", [], ()),
    ("0.34.0", "gpu", [], (kca.OFF,)),
    ("0.35.1+cu130", "gpu", [], (kca.OFF,)),
    ("0.34.0", "gpu", [kca.OFF], ()),
    ("0.34.0", "gpu", ["--kv-cache-memory-bytes=8000000000"], ()),
])
def test_decision(vllm, device, args, add):
    assert kca.decide(vllm, device, args).add_args == add


def test_an_explicit_extensible_cache_is_refused_in_one_line():
    with pytest.raises(kca.ExtensibleKvCacheRefused) as exc:
        kca.decide("0.34.0", "gpu", ["--enable-extensible-kv-cache"])
    msg = str(exc.value)
    assert "\n" not in msg and kca.OFF in msg and "not yet run on a GPU" in msg


def test_without_a_module_path_vllm_picks_the_legacy_access_itself():
    assert kca.decide("0.34.0", "gpu", ["--enable-extensible-kv-cache"], module_path_set=False).add_args == ()


def _with_vllm(py: str, version: str) -> str:
    """fake_env's interpreter with a vllm distribution of ``version`` on its path (the gate reads
    the target's packages from their dist-info, never by importing vLLM)."""
    fake_vllm(Path(py).parent / "site", version)
    return py


def test_gate_refuses_an_explicit_extensible_cache_before_any_server(gate, tmp_path):
    py = _with_vllm(fake_env(tmp_path / "env"), "0.34.0")
    res, result = gate.run("--target-python", py, "--vllm-arg=--enable-extensible-kv-cache")
    assert res.returncode != 0, res.stderr[-2000:]
    [reason] = result["verdict"]["reasons"]
    assert "--enable-extensible-kv-cache and kv_connector_module_path set" in reason and "\n" not in reason
    entered = [t["state"] for t in result["trace"] if t["what"] == "enter"]
    assert entered == ["PREFLIGHT", "ABORT", "VERDICT"] and result["processes"] == []


def test_gate_turns_the_extensible_cache_off_on_034(gate, tmp_path):
    py = _with_vllm(fake_env(tmp_path / "env"), "0.34.0")
    res, result = gate.run("--target-python", py)
    notes = [t["what"] for t in result["trace"] if kca.OFF in t["what"]]
    assert notes and "added" in notes[0], res.stderr[-2000:]
    vllm_cmds = [p["argv"] for p in result["processes"] if "fake_vllm" in " ".join(p.get("argv", []))]
    assert vllm_cmds and all(kca.OFF in a for a in vllm_cmds), result["processes"][:2]


@pytest.mark.parametrize("vllm, block, page", [("0.33.0", 544, 32), (None, 544, 32), ("0.34.0", 576, 64),
                                               ("0.34.2+cu130", 576, 64)])
def test_gpu_default_geometry_follows_the_target_vllm(vllm, block, page):
    from gate import engine_device as ed
    prof = ed.profile("gpu", vllm)
    assert (prof.block_size, prof.page_tokens) == (block, page)
    assert ed.profile("cpu", vllm).block_size is None  # CPU: asked of the engine


def test_gate_reads_the_target_vllm_for_its_gpu_geometry(gate, tmp_path):
    """No --block-size / --page-tokens: the gate sizes keys for 576/64 on a vLLM 0.34 target (the
    stand-in engine then reports its own block, 128, and the log check stops the run: loud)."""
    import json
    import subprocess

    py = _with_vllm(fake_env(tmp_path / "env"), "0.34.0")
    argv = gate.argv("--target-python", py)
    i = argv.index("--block-size")
    assert argv[i:i + 4:2] == ["--block-size", "--page-tokens"]
    del argv[i:i + 4]
    subprocess.run(argv, capture_output=True, text=True, timeout=120, env=gate.env(), cwd=gate.tmp)
    result = json.loads((gate.tmp / "result.json").read_text())
    [geo] = [t for t in result["trace"] if t["what"].startswith("geometry (")]
    assert geo["geometry"]["block_size"] == 576, geo
    assert "k 9" in next(t["what"] for t in result["trace"] if t["what"].startswith("work dir"))
