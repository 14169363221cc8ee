"""The shipped patch sets and verify scripts are found from an editable
install and from a built wheel; the wheel ships exactly the part of verify/
patchtool runs (tests/tool/verify_closure.py), and every shipped script's
``--help`` works from the installed wheel alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from .helpers import REPO
from .verify_closure import verify_closure


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


def _package_data_verify() -> set[str]:
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = cfg["tool"]["setuptools"]["package-data"]["patchtool._data"]
    return {e.removeprefix("verify/") for e in listed if e.startswith("verify/")}


def test_package_data_lists_exactly_what_patchtool_runs():
    """Offline and fast: pyproject's explicit verify/ list is the closure of
    what patchtool launches (a new research file is not listed; a helper a
    shipped script imports is)."""
    listed, closure = _package_data_verify(), verify_closure(REPO)
    assert listed == closure, (f"listed, not run: {sorted(listed - closure)}; "
                               f"run, not listed: {sorted(closure - listed)}")


# Never imported before a shipped script answers --help: the scripts import
# them after parsing their arguments, so their usage prints in a venv without
# them (this one: patchtool's own interpreter, which never imports them).
HEAVY = ("torch", "vllm", "lmcache", "transformers")
GUARD = f"""\
import sys

class _Guard:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {HEAVY!r}:
            raise ImportError(f"import guard: {{name}} imported before --help")
        return None

sys.meta_path.insert(0, _Guard())
"""


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
    closure = verify_closure(REPO)
    assert shipped == closure, (f"shipped, not run: {sorted(shipped - closure)}; "
                                f"run, not shipped: {sorted(closure - shipped)}")
    assert {"restore_gate.py", "roundtrip.py", "engine_gate.py", "engine_shim/sitecustomize.py",
            "lmcache_patchtool_verify/__init__.py", "lmcache_patchtool_verify/procs.py"} <= shipped
    # patchtool._data is the repository root as a data-only package: nothing
    # but the patch sets, those verify/ files and the upstream proposals
    # (status names the parts a release contains) - no stray root-level module.
    assert {n.split("/")[2] for n in names if n.startswith("patchtool/_data/")} == \
        {"patches", "verify", "upstream"}
    shipped_upstream = {n.split("/", 3)[3] for n in names if n.startswith("patchtool/_data/upstream/")}
    assert shipped_upstream == {p.name for p in (REPO / "upstream").glob("0*.patch")} | {"parts.json"}
    assert not [n for n in names if "standins" in n or "prepare_carry" in n or "page_map" in n
                or n.startswith("tests/") or n.startswith("scripts/")]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # Runtime deps come from this test venv (a .pth line, not its editable hook).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(whl)], check=True)
    (site / "sitecustomize.py").write_text(GUARD)
    py = str(venv / "bin" / "python")
    # Nothing of the checkout reaches the installed interpreter: no PYTHONPATH,
    # cwd outside it, and its sys.path names no checkout directory (but the
    # deps' site-packages, which may sit in the checkout's .venv).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LMCACHE_PATCHTOOL_GATE",
                                                               "LMCACHE_PATCHTOOL_PATCHES")}
    path = subprocess.run([py, "-c", "import sys; print('\\n'.join(sys.path))"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, check=True).stdout.split()
    deps = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert not [d for d in path if Path(d).resolve().is_relative_to(REPO)
                and not Path(d).resolve().is_relative_to(deps)], path
    code = ("import patchtool, sys; from patchtool import resources; "
            "print(patchtool.__file__); print(resources.patches_root()); print(resources.verify_root()); "
            "from patchtool import upstream; print(len(upstream.load()))")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         check=True).stdout.split()
    assert out[0].startswith(str(site))
    patches, verify = Path(out[1]), Path(out[2])
    assert int(out[3]) == len(list((REPO / "upstream").glob("0*.patch")))  # read from the wheel
    assert patches == site / "patchtool" / "_data" / "patches"
    patch_files = sorted(p.relative_to(REPO / "patches") for p in (REPO / "patches").glob("*/*/*.patch"))
    assert sorted(p.relative_to(patches) for p in patches.glob("*/*/*.patch")) == patch_files
    assert (verify / "lmcache_patchtool_verify" / "geometry.py").is_file()
    # Every shipped script runs by path from the installed tree: it imports its
    # helper package from there, and argparse answers before torch is needed.
    for script in sorted(n for n in shipped if "/" not in n):
        argv = ["bash" if script.endswith(".sh") else py, str(verify / script), "--help"]
        r = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: {script}"), (script, r.stderr[-2000:])
    r = subprocess.run([py, "-m", "patchtool", "list", "--json"], capture_output=True, text=True,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "hybrid-fa" in r.stdout
