"""The shipped patch sets and verify scripts are found from an editable
install and from a built wheel."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from .helpers import REPO


def test_editable_install_finds_checkout(tmp_path):
    code = "from patchtool import resources; print(resources.patches_root()); print(resources.verify_root())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == [str(REPO / "patches"), str(REPO / "verify")]


@pytest.mark.slow
def test_built_wheel_ships_patch_sets(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
                    str(REPO)], check=True)
    whl = next(wheels.glob("lmcache_patchtool-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # Runtime deps come from this test venv (a .pth line, not its editable hook).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(whl)], check=True)
    code = ("import patchtool, sys; from patchtool import resources; "
            "print(patchtool.__file__); print(resources.patches_root()); print(resources.verify_root())")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                         text=True, cwd=tmp_path, check=True).stdout.split()
    assert out[0].startswith(str(site))
    patches, verify = Path(out[1]), Path(out[2])
    assert patches == site / "patchtool" / "_data" / "patches"
    shipped = sorted(p.relative_to(REPO / "patches") for p in (REPO / "patches").glob("*/*/*.patch"))
    assert sorted(p.relative_to(patches) for p in patches.glob("*/*/*.patch")) == shipped
    assert (verify / "geometry.py").is_file()
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "patchtool", "list", "--json"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "hybrid-fa" in r.stdout
