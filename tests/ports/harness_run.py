"""Run the ports round-trip harness (``lab.ports_roundtrip``)
in a version's runtime venv over its pristine or patched overlay: the one
runner the ports tests share."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from lab import provision
def series(version: str) -> list[Path]:
    return sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch"))


def ports_harness(version: str, patched: bool, cells: tuple[str, ...], options: list[str],
                  timeout: float = 1800, stderr: list[str] | None = None,
                  patches: list[Path] | None = None) -> dict:
    """The harness's JSON report for ``cells``; asserts it ran the overlay.
    ``stderr``, when given, receives the run's stderr (LMCache's log).
    ``patches``, when given, is the series to apply instead (e.g. an older
    revision's parts); ``patched`` is then ignored."""
    venv = provision.runtime_env(version)
    if patches is None:
        patches = series(version) if patched else None
    overlay = provision.overlay(version, patches or None)
    args = [str(venv / "bin" / "python"), "-m", "lab.ports_roundtrip",
            "--json", *options]
    for cell in cells:
        args += ["--cell", cell]
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    doc = json.loads(proc.stdout)
    root = doc["lmcache"]["root"]
    assert Path(root).resolve() == overlay.resolve(), f"ran {root}, not the overlay {overlay}"
    return doc


def vllm_layer_probe(module: str, version: str, patched: bool, out: Path, vllm: str = "0.33.0",
                     timeout: float = 900) -> dict:
    """``python -m lab.probes.<module> --out OUT`` in ``version``'s runtime venv
    over its pristine or patched overlay and the vLLM ``vllm`` layer; the JSON it wrote
    (LMCache logs to stdout, so the probe's document goes to the file)."""
    from lab import provision_vllm  # noqa: PLC0415 - heavy, only for these probes

    layer = provision_vllm.vllm_layer(version, vllm=vllm)
    overlay = provision.overlay(version, series(version) if patched else None)
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{layer}:{REPO}", LMCACHE_DISABLE_BANNER="1")
    proc = subprocess.run([str(provision.runtime_env(version) / "bin" / "python"), "-m",
                           f"lab.probes.{module}", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
