"""Fixtures for the tool tests: real wheels, real venvs (``pip install
--no-deps``, via lab/provision.py), copied per test so the cached
environments are never modified, and a test patch set built from real
wheel files with the tool's own ``manifest build``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab import provision

from .helpers import (REPO, cli, copy_venv, insert_after, replace_line, site_of, wheel_member,
                      write_diff)

VERSIONS = ("0.5.3", "0.5.4", "0.5.5", "0.5.6", "0.5.7rc2")
# Files of the 0.5.3 wheel the test series touches; F1 is touched by both patches.
F1 = "lmcache/v1/kv_layer_groups.py"
F2 = "lmcache/v1/platform/base/cache_context.py"
F3 = "lmcache/integration/vllm/kv_cache_group_edits.py"


@pytest.fixture(scope="session")
def wheel053() -> Path:
    return provision.wheel("0.5.3")


def make_series(dest: Path, wheel: Path, variant: str = "a") -> Path:
    """Write a 2-patch series for lmcache 0.5.3 into ``dest`` (a
    ``<root>/<set>/0.5.3`` dir).  01 edits F1 (two hunks) and F2; 02 edits F1
    again (on top of 01) and F3.  ``variant`` changes 02's text (a new revision)."""
    dest.mkdir(parents=True, exist_ok=True)
    f1 = wheel_member(wheel, F1)
    f2 = wheel_member(wheel, F2)
    f3 = wheel_member(wheel, F3)
    f1_a = insert_after(f1, 12, b"# patchtool-test 01: first hunk")
    f1_a = replace_line(f1_a, 301, f1_a.split(b"\n")[300] + b"  # patchtool-test 01")
    f2_a = insert_after(f2, 40, b"# patchtool-test 01: cache_context")
    write_diff(dest / "01-first.patch", F1, f1, f1_a)
    write_diff(dest / "01-first.patch", F2, f2, f2_a, append=True)
    f1_b = insert_after(f1_a, 600, b"# patchtool-test 02 variant " + variant.encode())
    f3_b = insert_after(f3, 20, b"# patchtool-test 02: group edits " + variant.encode())
    write_diff(dest / "02-second.patch", F1, f1_a, f1_b)
    write_diff(dest / "02-second.patch", F3, f3, f3_b, append=True)
    return dest


def build(dest: Path, wheel: Path, *extra: str) -> None:
    r = cli("manifest", "build", str(dest), "--wheel", str(wheel), "--json", *extra)
    assert r.rc == 0, r.err


@pytest.fixture(scope="session")
def test_patches(tmp_path_factory, wheel053) -> Path:
    """Root dir (as LMCACHE_PATCHTOOL_PATCHES) holding testset/0.5.3, manifest built."""
    root = tmp_path_factory.mktemp("patches")
    d = make_series(root / "testset" / "0.5.3", wheel053)
    build(d, wheel053, "--vllm", "0.27.1", "--upstream", "https://example.invalid/issue/1")
    return root


@pytest.fixture
def patches_copy(tmp_path, test_patches) -> Path:
    """A private copy of the test patch root (for tests that tamper with it)."""
    dest = tmp_path / "patches"
    shutil.copytree(test_patches, dest)
    return dest


@pytest.fixture(scope="session")
def bare_envs() -> dict[str, Path]:
    return {v: provision.bare_env(v) for v in VERSIONS}


@pytest.fixture
def venv053(tmp_path, bare_envs) -> Path:
    """A private copy of the bare lmcache 0.5.3 venv."""
    return copy_venv(bare_envs["0.5.3"], tmp_path / "venv053")


@pytest.fixture(scope="session")
def fresh_site053(bare_envs) -> Path:
    """The untouched cached site dir, to compare trees against (read-only use)."""
    return site_of(bare_envs["0.5.3"])


@pytest.fixture(scope="session")
def target_dir_053(tmp_path_factory, wheel053) -> Path:
    """``pip install --no-deps --target`` of the real 0.5.3 wheel (built once)."""
    dest = tmp_path_factory.mktemp("target053") / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(dest), str(wheel053)], check=True)
    return dest


def real_series_dir() -> Path | None:
    d = REPO / "patches" / "hybrid-fa" / "0.5.3"
    return d if (d / "manifest.json").exists() else None
