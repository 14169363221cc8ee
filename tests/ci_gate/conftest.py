"""Fixtures for the ci-gate tests: the real 0.5.3 wheel, scratch patch roots
whose manifests are built from it with the tool's own ``manifest build``
(the shipped manifest.json is the lead's to generate), and a patched wheel
built once per session."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from lab import provision

from .helpers import REPO, cli

SERIES = REPO / "patches" / "hybrid-fa" / "0.5.3"


def _build_manifest(d: Path, wheel: Path, *extra: str) -> None:
    r = cli("manifest", "build", str(d), "--wheel", str(wheel), "--json", *extra)
    assert r.rc == 0, r.err


@pytest.fixture(scope="session")
def wheel053() -> Path:
    return provision.wheel("0.5.3")


@pytest.fixture(scope="session")
def patches_root(tmp_path_factory, wheel053) -> Path:
    """A copy of the real hybrid-fa 0.5.3 series with its manifest built
    (as LMCACHE_PATCHTOOL_PATCHES)."""
    root = tmp_path_factory.mktemp("patches")
    d = root / "hybrid-fa" / "0.5.3"
    d.mkdir(parents=True)
    for p in sorted(SERIES.glob("*.patch")):
        shutil.copy2(p, d / p.name)
    _build_manifest(d, wheel053, "--vllm", "0.27.1", "--upstream",
                    "https://github.com/LMCache/LMCache/issues/4247")
    return root


@pytest.fixture(scope="session")
def inert_root(tmp_path_factory, wheel053) -> Path:
    """A patch set holding only 01-staging-views, which adds helpers and
    changes no behaviour: an install "patched" with it still has the 1-of-k
    bug, so the restore checks must FAIL on it (the negative control)."""
    root = tmp_path_factory.mktemp("inert")
    d = root / "hybrid-fa" / "0.5.3"
    d.mkdir(parents=True)
    shutil.copy2(SERIES / "01-staging-views.patch", d)
    _build_manifest(d, wheel053, "--vllm", "0.27.1")
    return root


@pytest.fixture(scope="session")
def fixed_root(tmp_path_factory, patches_root) -> Path:
    """The 0.5.3 set plus a fixed-upstream manifest for 0.5.6 (a scratch
    fixture: it says nothing about the real 0.5.6)."""
    root = tmp_path_factory.mktemp("fixed")
    shutil.copytree(patches_root / "hybrid-fa", root / "hybrid-fa")
    d = root / "hybrid-fa" / "0.5.6"
    d.mkdir()
    _build_manifest(d, provision.wheel("0.5.6"), "--fixed-upstream",
                    "test fixture: pretend upstream fixed it")
    return root


@pytest.fixture(scope="session")
def built(tmp_path_factory, patches_root, wheel053) -> dict:
    """``patchtool wheel --from`` the real wheel: the JSON result."""
    out = tmp_path_factory.mktemp("built")
    r = cli("wheel", "--from", str(wheel053), "-o", str(out), "--json", patches=patches_root)
    assert r.rc == 0, r.err
    return r.json["result"]


@pytest.fixture(scope="session")
def bare_python_053() -> Path:
    """An interpreter without torch (lmcache only, --no-deps)."""
    return provision.bare_env("0.5.3") / "bin" / "python"


@pytest.fixture(scope="session")
def target_site(tmp_path_factory, built, runtime_python_053) -> Path:
    """The patched wheel installed with ``pip install --no-deps --target``."""
    site = tmp_path_factory.mktemp("target") / "site"
    subprocess.run([str(runtime_python_053), "-m", "pip", "install", "-q", "--no-deps",
                    "--no-index", "--target", str(site), built["path"]], check=True)
    return site
