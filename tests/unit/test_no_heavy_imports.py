"""``patchtool`` never imports torch, vllm or lmcache to inspect an install
(README), neither in its own process nor in a ``--python`` interpreter it
probes.

The guard is a ``sitecustomize`` whose ``sys.meta_path`` finder logs every
attempt to import one of those packages (installed or not, caught or not) to
``$PATCHTOOL_IMPORT_GUARD_LOG`` and then refuses it.  It is put on
``PYTHONPATH`` for the patchtool process, and into the target venv's
site-packages for the probed interpreter (the probe runs with ``-I``, which
ignores ``PYTHONPATH`` but still runs ``sitecustomize``).  The first tests
prove that the guard detects an import, so a silent guard cannot pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import Run, cli

from . import synthwheel as sw

BANNED = ("torch", "vllm", "lmcache")
GUARD = f'''\
import os, sys

_BANNED = {BANNED!r}


class _ImportGuard:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BANNED:
            log = os.environ.get("PATCHTOOL_IMPORT_GUARD_LOG")
            if log:
                with open(log, "a") as fh:
                    fh.write(f"{{os.getpid()}} {{sys.executable}} {{name}}\\n")
            raise ImportError(f"import guard: {{name}} must not be imported here")
        return None


sys.meta_path.insert(0, _ImportGuard())
'''


@pytest.fixture
def guard(tmp_path) -> tuple[Path, dict]:
    """(guard dir, env): the env puts the guard on PYTHONPATH and names its log."""
    d = tmp_path / "guard"
    d.mkdir()
    (d / "sitecustomize.py").write_text(GUARD)
    log = tmp_path / "imports.log"
    return d, {"PYTHONPATH": str(d), "PATCHTOOL_IMPORT_GUARD_LOG": str(log)}


def attempted(env: dict) -> list[str]:
    log = Path(env["PATCHTOOL_IMPORT_GUARD_LOG"])
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def guarded_venv(venv, guard) -> Path:
    """The venv with the synthetic lmcache and the guard in its site-packages;
    returns its interpreter."""
    (sw.venv_site(venv) / "sitecustomize.py").write_text(GUARD)
    return venv / "bin" / "python"


def test_guard_detects_an_import_in_the_tool_process(guard):
    _, env = guard
    for mod in BANNED:
        proc = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True,
                              text=True, env={**os.environ, **env})
        assert proc.returncode != 0 and "import guard" in proc.stderr
    # a caught ImportError is still recorded
    subprocess.run([sys.executable, "-c", "try:\n import vllm.config\nexcept ImportError: pass"],
                   check=True, env={**os.environ, **env})
    assert [line.split()[-1] for line in attempted(env)] == [*BANNED, "vllm"]


def test_guard_catches_a_tool_that_imports_torch(tmp_path, site, patch_root, guard):
    """A copy of patchtool whose cli.py tries ``import torch`` (and swallows the
    ImportError) is caught by the same check the real tool passes."""
    import shutil

    import patchtool

    pkg = tmp_path / "shadow"
    shutil.copytree(Path(patchtool.__file__).parent, pkg / "patchtool",
                    ignore=shutil.ignore_patterns("__pycache__"))
    cli_py = pkg / "patchtool" / "cli.py"
    text = cli_py.read_text()
    future = "from __future__ import annotations\n"
    assert future in text
    cli_py.write_text(text.replace(future, future + "try:\n    import torch\nexcept "
                                   "ImportError:\n    pass\n", 1))
    guard_dir, env = guard
    # -S: skip the dev venv's .pth files, whose editable-install finder would
    # load the real patchtool ahead of the copy; put the guard, the copy and
    # the venv's site-packages (for unidiff, rich) on sys.path by hand.
    import sysconfig

    boot = ("import sys; sys.path[:0] = sys.argv[1:4]; del sys.argv[1:4]; import sitecustomize; "
            "from patchtool.cli import main; sys.argv[0] = 'patchtool'; sys.exit(main())")
    proc = subprocess.run([sys.executable, "-S", "-c", boot, str(guard_dir), str(pkg),
                           sysconfig.get_paths()["purelib"], "status", "--site-packages",
                           str(site), "--json"], capture_output=True, text=True,
                          env={**os.environ, **env, "LMCACHE_PATCHTOOL_PATCHES": str(patch_root)})
    r = Run(proc.returncode, proc.stdout, proc.stderr)
    assert r.rc == 0, r.err  # the tool itself did not notice ...
    assert r.json["result"]["state"] == "pristine"
    assert [line.split()[-1] for line in attempted(env)] == ["torch"]  # ... the guard did


def test_guard_detects_an_import_in_the_probed_interpreter(guarded_venv, guard):
    _, env = guard
    # -I: what the tool's probe uses; lmcache IS installed in this venv
    proc = subprocess.run([str(guarded_venv), "-I", "-c", "import lmcache"], capture_output=True,
                          text=True, env={**os.environ, **env})
    assert proc.returncode != 0 and "import guard" in proc.stderr
    assert attempted(env)[-1].endswith(" lmcache")
    # and without the guard the synthetic lmcache does import: the guard is what refused it
    subprocess.run([str(guarded_venv), "-I", "-S", "-c", "import sys; sys.path.append("
                    f"{str(sw.venv_site(guarded_venv.parent.parent))!r}); import lmcache"],
                   check=True)


def test_status_imports_nothing_heavy(site, patch_root, guard):
    _, env = guard
    for args in (("status",), ("status", "--json"), ("status", "--deep"), ("verify",),
                 ("apply", "--dry-run")):
        r = cli(*args, "--site-packages", str(site), patches=patch_root, env=env)
        assert r.rc in (0, 5), (args, r.err)
    # no target: the running interpreter's own site dirs
    assert cli("status", "--json", patches=patch_root, env=env).rc == 0
    assert attempted(env) == []


def test_status_python_imports_nothing_heavy(guarded_venv, patch_root, guard):
    _, env = guard
    py = str(guarded_venv)
    r = cli("status", "--python", py, "--json", patches=patch_root, env=env)
    assert r.rc == 0, r.err
    assert r.json["result"]["state"] == "pristine"
    assert r.json["result"]["python"] == py
    assert cli("status", "--python", py, "--deep", patches=patch_root, env=env).rc == 0
    assert cli("apply", "--python", py, patches=patch_root, env=env).rc == 0
    assert cli("verify", "--python", py, patches=patch_root, env=env).rc == 0
    assert attempted(env) == []
