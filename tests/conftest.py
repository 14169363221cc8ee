"""Shared fixtures: real lmcache wheels and environments, provisioned by
``scripts/provision.py`` and cached across runs (never installed by hand)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import provision  # noqa: E402

SERIES_053 = REPO / "patches" / "hybrid-fa" / "0.5.3"


def series(version: str) -> list[Path]:
    """The ordered patch files of the hybrid-FA set for ``version``."""
    return sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def runtime_python_053() -> Path:
    """Interpreter of a venv where lmcache 0.5.3 imports and serves on CPU."""
    return provision.runtime_env("0.5.3") / "bin" / "python"


@pytest.fixture(scope="session")
def pristine_overlay_053() -> Path:
    return provision.overlay("0.5.3")


@pytest.fixture(scope="session")
def patched_overlay_053() -> Path:
    patches = series("0.5.3")
    if not patches:
        pytest.skip("no 0.5.3 patch series yet")
    return provision.overlay("0.5.3", patches)
