"""Fixtures of the offline unit tier: a synthetic lmcache ``9.9.9`` wheel
(tests/unit/synthwheel.py), installed once per session with real pip
(``--no-index --target``), copied per test, and a test patch set built with
the tool's own ``manifest build``.  No network, no torch, no real lmcache.

Every test in this directory is marked ``unit`` (tests/conftest.py), so
``pytest tests/unit`` and ``pytest -m unit`` select the same tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from . import synthwheel as sw


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The synthetic lmcache 9.9.9 wheel (CRLF RECORD)."""
    return sw.make_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def fresh_site(tmp_path_factory, wheel) -> Path:
    """``pip install --target`` of :func:`wheel`: the reference tree (never modify it)."""
    return sw.install_target(wheel, tmp_path_factory.mktemp("fresh") / "site")


@pytest.fixture
def site(tmp_path, fresh_site) -> Path:
    """A private copy of the installed synthetic lmcache, for ``--site-packages``."""
    return sw.copy_site(fresh_site, tmp_path / "site")


@pytest.fixture(scope="session")
def patch_root(tmp_path_factory, wheel) -> Path:
    """LMCACHE_PATCHTOOL_PATCHES root: synthset/9.9.9, 2 patches, revision 1."""
    return sw.make_patch_root(tmp_path_factory.mktemp("patches"), wheel,
                              extra=("--vllm", "0.27.1", "--upstream", "https://example.invalid/1"))


@pytest.fixture(scope="session")
def patch_root_r2(tmp_path_factory, patch_root, wheel) -> Path:
    """The same set at revision 2 (02's text changed); revision 1 is kept in
    ``previous_revisions``."""
    root = tmp_path_factory.mktemp("patches-r2")
    shutil.copytree(patch_root, root, dirs_exist_ok=True)
    d = root / sw.SET / sw.VERSION
    base = sw.wheel_files(wheel)
    sw.write_series(d, base, sw.default_steps(base, variant="b"))
    sw.manifest_build(d, wheel, "--revision", "2")
    return root


@pytest.fixture(scope="session")
def patch_root_r2_appended(tmp_path_factory, patch_root, wheel) -> Path:
    """Revision 2 made by APPENDING a patch (03 edits UNTOUCHED, a file revision
    1 never touched), 01 and 02 unchanged: how the real series grew 05-layout-keys."""
    root = tmp_path_factory.mktemp("patches-r2-appended")
    shutil.copytree(patch_root, root, dirs_exist_ok=True)
    d = root / sw.SET / sw.VERSION
    base = sw.wheel_files(wheel)
    steps = sw.default_steps(base)
    steps.append(("03-third.patch", {sw.UNTOUCHED: sw.insert_after(base[sw.UNTOUCHED], 5,
                                                                    b"# unit 03: appended")}))
    sw.write_series(d, base, steps)
    sw.manifest_build(d, wheel, "--revision", "2")
    return root


@pytest.fixture
def patches_copy(tmp_path, patch_root) -> Path:
    """A private copy of :func:`patch_root` (for tests that tamper with it)."""
    return Path(shutil.copytree(patch_root, tmp_path / "patches"))


@pytest.fixture(scope="session")
def venv_template(tmp_path_factory, fresh_site) -> Path:
    """A ``python -m venv --without-pip`` venv with the synthetic lmcache in
    its site-packages (copied from :func:`fresh_site`)."""
    venv = tmp_path_factory.mktemp("venv") / "venv"
    sw.make_venv(venv)
    sw.copy_site(fresh_site, sw.venv_site(venv))
    return venv


@pytest.fixture
def venv(tmp_path, venv_template) -> Path:
    """A private copy of :func:`venv_template`; its interpreter is ``venv / "bin/python"``."""
    return Path(shutil.copytree(venv_template, tmp_path / "venv", symlinks=True))
