"""One run of ``lab/xver_gate.py`` for the xver tests (fs and Redis edges)."""

from __future__ import annotations

import json
import shlex
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
XVER = REPO / "lab" / "xver_gate.py"
# Extra xver_gate.py arguments for every run, e.g. "--exclude-patch 05-layout-keys"
# (the tier as it was before layout keys: the CI edges then FAIL with wrong hits).
EXTRA = shlex.split(os.environ.get("LMCACHE_PATCHTOOL_XVER_ARGS", ""))


def run_xver(work: Path, *args: str, timeout: float = 1800) -> tuple[subprocess.CompletedProcess, dict]:
    """The gate in this interpreter (it needs no torch); its process and its JSON result."""
    out = work / "result.json"
    proc = subprocess.run([sys.executable, str(XVER), "--work-dir", str(work / "wd"), "--json-out", str(out),
                           *args, *EXTRA], capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    if not out.exists():
        pytest.fail(f"xver_gate wrote no result (rc {proc.returncode}):\n{proc.stderr[-5000:]}")
    return proc, json.loads(out.read_text())
