"""The shipped patch sets and the gate are found from an editable install
and from a built wheel; the wheel ships the gate folder whole (every file of
``gate/``, no list) and nothing of the lab, and every gate script's ``--help``
works from the installed wheel alone."""

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


def test_editable_install_finds_checkout(tmp_path):
    code = "from patchtool import resources; print(resources.patches_root()); print(resources.gate_root())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == [str(REPO / "patches"), str(REPO / "gate")]


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


def gate_files() -> set[str]:
    """Every tracked file of gate/, relative to it: what the wheel must ship."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "gate"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    return {f.removeprefix("gate/") for f in out}


def gate_scripts() -> list[str]:
    """The gate files a user or patchtool runs by path (they have a main)."""
    return sorted(f for f in gate_files() if "/" not in f and f.endswith(".py")
                  and 'if __name__ == "__main__":' in (REPO / "gate" / f).read_text())


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
    prefix = "patchtool/_data/gate/"
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
    shipped = {n[len(prefix):] for n in names if n.startswith(prefix)}
    # the gate folder whole, from the package declaration alone (no file list)
    assert shipped == gate_files(), (f"shipped, not in gate/: {sorted(shipped - gate_files())}; "
                                     f"in gate/, not shipped: {sorted(gate_files() - shipped)}")
    assert {"restore_gate.py", "roundtrip.py", "engine_gate.py", "engine_shim/sitecustomize.py",
            "__init__.py", "procs.py"} <= shipped
    # patchtool._data is the repository root as a data-only package: nothing
    # but the patch sets, the gate and the upstream proposals (status names
    # the parts a release contains) - no lab, no stray root-level module.
    assert {n.split("/")[2] for n in names if n.startswith("patchtool/_data/")} == \
        {"patches", "gate", "upstream"}
    shipped_upstream = {n.split("/", 3)[3] for n in names if n.startswith("patchtool/_data/upstream/")}
    assert shipped_upstream == {p.name for p in (REPO / "upstream").glob("0*.patch")} | {"parts.json"}
    assert not [n for n in names if "standins" in n or "prepare_carry" in n or "page_map" in n
                or n.startswith(("tests/", "lab/", "bench/")) or "/lab/" in n]
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
            "print(patchtool.__file__); print(resources.patches_root()); print(resources.gate_root()); "
            "from patchtool import upstream; print(len(upstream.load()))")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         check=True).stdout.split()
    assert out[0].startswith(str(site))
    patches, gate = Path(out[1]), Path(out[2])
    assert int(out[3]) == len(list((REPO / "upstream").glob("0*.patch")))  # read from the wheel
    assert patches == site / "patchtool" / "_data" / "patches"
    patch_files = sorted(p.relative_to(REPO / "patches") for p in (REPO / "patches").glob("*/*/*.patch"))
    assert sorted(p.relative_to(patches) for p in patches.glob("*/*/*.patch")) == patch_files
    assert gate == site / "patchtool" / "_data" / "gate" and (gate / "geometry.py").is_file()
    # Every gate script runs by path from the installed tree, as patchtool's
    # runner starts it (the folder above the gate on PYTHONPATH, so `from gate
    # import ...` finds the installed helpers), and argparse answers before
    # torch is needed.
    scripts = gate_scripts()
    assert {"restore_gate.py", "roundtrip.py", "engine_gate.py"} <= set(scripts)
    for script in scripts:
        r = subprocess.run([py, str(gate / script), "--help"], capture_output=True, text=True,
                           cwd=tmp_path, env={**env, "PYTHONPATH": str(gate.parent)})
        assert r.returncode == 0 and r.stdout.startswith("usage: "), (script, r.stderr[-2000:])
    r = subprocess.run([py, "-m", "patchtool", "list", "--json"], capture_output=True, text=True,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "hybrid-fa" in r.stdout
