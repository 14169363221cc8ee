"""A vLLM distribution as patchtool and the gate read it: ``vllm-<version>.dist-info/METADATA``
only, plus a ``vllm`` package that raises if anything imports it (neither may import vLLM to
inspect an install).  Shared by the unit, tool and engine_gate suites (``tests/`` is on sys.path)."""

from __future__ import annotations

from pathlib import Path


def fake_vllm(site: Path, version: str, metadata: str | None = None) -> Path:
    d = site / f"vllm-{version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(metadata if metadata is not None else
                                f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n\n"
                                "Version: 9.9 in the body is not a header\n")
    pkg = site / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('patchtool imported vllm')\n")
    return d
