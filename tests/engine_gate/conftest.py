"""Fixtures for the engine gate's CPU tests: stand-in
commands, and a runner for ``gate/engine_gate.py`` as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STANDINS = REPO / "tests" / "standins"
GATE_DIR = REPO / "gate"

PY = sys.executable
BLOCK = 128  # stand-in logical block; FlashInfer page 32 -> k = 4


def standin(name: str, *extra: str) -> str:
    return " ".join([PY, str(STANDINS / name), *extra])


def marked_processes(tag: str) -> list[int]:
    """Live processes whose environment carries GATE_TEST_TAG=tag."""
    needle = f"GATE_TEST_TAG={tag}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as fh:
                st = fh.read().decode("ascii", "replace")
        except OSError:
            continue
        if needle in env and st[st.rfind(")") + 2:].split()[0] not in ("Z", "X"):
            out.append(int(name))
    return out


class GateRunner:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tmp / "model"
        self.model.mkdir()
        (self.model / "config.json").write_text(json.dumps({"architectures": ["Fake"]}))
        self.gpu_state = tmp / "gpu"
        self.tag = uuid.uuid4().hex

    def tiny(self) -> None:
        (self.model / "config.json").write_text(json.dumps({"architectures": ["Fake"], "lmcache_patchtool_tiny": True}))

    def argv(self, *extra: str, vllm: str = "", lmcache: str = "", control_lmcache: str | None = None,
             control_vllm: str | None = None, lengths: str = "1024,2048") -> list[str]:
        a = [PY, str(GATE_DIR / "engine_gate.py"), "--model", str(self.model), "--tokenizer", "byte",
             "--lengths", lengths, "--block-size", str(BLOCK), "--page-tokens", "32",
             "--vllm-cmd", standin("fake_vllm.py", "serve", vllm).strip(),
             "--lmcache-cmd", standin("fake_lmcache.py", lmcache).strip(),
             "--nvidia-smi", standin("fake_nvidia_smi.py"), "--target-python", PY,
             "--work-dir", str(self.tmp / "work"), "--out", str(self.tmp / "result.json"),
             "--poll-s", "0.05", "--flush-quiet-s", "0.3", "--stop-grace-s", "3", "--kill-timeout-s", "5",
             "--gpu-free-timeout", "3", "--metrics-settle-s", "2", "--vllm-start-timeout", "20",
             "--lmcache-start-timeout", "20", "--flush-timeout", "10", "--request-timeout", "30",
             "--env", f"GATE_TEST_TAG={self.tag}"]
        if control_lmcache is not None or control_vllm is not None:
            a += ["--control-lmcache-cmd", standin("fake_lmcache.py", control_lmcache or "").strip(),
                  "--control-vllm-cmd", standin("fake_vllm.py", "serve", control_vllm or "").strip()]
        return a + list(extra)

    def env(self, **kw: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"FAKE_GPU_STATE": str(self.gpu_state), "FAKE_VLLM_BLOCK": str(BLOCK),
                    "FAKE_PREFILL_US": "250", "FAKE_RESTORE_US": "1", "GATE_TEST_TAG": self.tag})
        env.update(kw)
        return env

    def run(self, *extra: str, timeout: float = 120, env: dict[str, str] | None = None, **kw):
        res = subprocess.run(self.argv(*extra, **kw), capture_output=True, text=True, timeout=timeout,
                             env=env or self.env(), cwd=self.tmp)
        result = None
        p = self.tmp / "result.json"
        if p.exists():
            result = json.loads(p.read_text())
        return res, result


@pytest.fixture
def gate(tmp_path: Path) -> GateRunner:
    g = GateRunner(tmp_path)
    yield g
    left = marked_processes(g.tag)
    for pid in left:  # never leave a stand-in behind, even when a test fails
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    assert not left, f"processes of this test survived the gate: {left}"


def _load_gate_module():
    """``gate/engine_gate.py`` as module ``engine_gate_cli`` (``engine_gate`` is this test package's name)."""
    import importlib.util

    if "engine_gate_cli" in sys.modules:
        return sys.modules["engine_gate_cli"]
    spec = importlib.util.spec_from_file_location("engine_gate_cli", GATE_DIR / "engine_gate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["engine_gate_cli"] = mod
    spec.loader.exec_module(mod)
    return mod


_load_gate_module()
