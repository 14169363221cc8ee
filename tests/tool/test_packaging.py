"""The shipped patch sets and verify scripts are found from an editable
install and from a built wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from .helpers import REPO


def test_editable_install_finds_checkout(tmp_path):
    code = "from patchtool import resources; print(resources.patches_root()); print(resources.verify_root())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == [str(REPO / "patches"), str(REPO / "verify")]


def _clean_tree(dest: Path) -> Path:
    """The checkout's tracked and untracked-but-not-ignored files, copied: a
    build from it cannot pick up a stale ``build/`` of an older layout."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, files):
        src = REPO / rel.decode()
        if src.is_file():
            (dest / rel.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel.decode())
    return dest


def _expected_verify_members() -> set[str]:
    """What ``patchtool._data.verify`` ships: the scripts at the top of
    verify/ and the helper package; never the stand-ins or dev tools."""
    v = REPO / "verify"
    top = {p.name for p in v.iterdir() if p.is_file() and p.suffix in (".py", ".sh", ".md")}
    pkg = {str(p.relative_to(v)) for p in (v / "lmcache_patchtool_verify").rglob("*.py")
           if "__pycache__" not in p.parts}
    return top | pkg


@pytest.mark.slow
def test_built_wheel_ships_patch_sets(tmp_path):
    wheels = tmp_path / "wheels"
    src = _clean_tree(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
                    str(src)], check=True)
    whl = next(wheels.glob("lmcache_patchtool-*.whl"))
    prefix = "patchtool/_data/verify/"
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
    shipped = {n[len(prefix):] for n in names if n.startswith(prefix)}
    assert shipped == _expected_verify_members()
    assert {"restore_gate.py", "roundtrip.py", "gpu_gate.py", "gpu_roundtrip_device.sh",
            "lmcache_patchtool_verify/__init__.py", "lmcache_patchtool_verify/procs.py"} <= shipped
    assert not [n for n in names if "standins" in n or "prepare_carry" in n or "page_map" in n
                or n.startswith("tests/") or n.startswith("scripts/")]
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
    assert (verify / "lmcache_patchtool_verify" / "geometry.py").is_file()
    # The scripts patchtool runs by path import their helper package from the
    # installed location (argparse runs before anything needs torch).
    for script in ("restore_gate.py", "roundtrip.py", "gpu_gate.py"):
        r = subprocess.run([str(venv / "bin" / "python"), str(verify / script), "--help"],
                           capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 0 and "usage" in r.stdout, (script, r.stderr[-2000:])
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "patchtool", "list", "--json"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "hybrid-fa" in r.stdout
