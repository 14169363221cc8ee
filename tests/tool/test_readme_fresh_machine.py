"""The README's first command, verbatim, from a fresh copy of the checkout with every cache empty.

A new user's first contact with the project is that line (README.md, "Fresh machine"): it
installs patchtool into a new ``.venv``, provisions a bare venv holding the real lmcache 0.5.6
wheel (``python -m lab.provision bare 0.5.6``) and runs ``patchtool status`` on it.  The command
substitutes provision.py's stdout as the ``--python`` path, so anything else on that stdout (pip's
own download lines, which appear only when the wheel is not cached yet) breaks it.  Nobody sees
that on a warm machine, so this test runs the line exactly as the README prints it, in a copy of
the checkout (tracked and unignored files: what a clone holds, plus the work in progress), with
``LMCACHE_PATCHTOOL_CACHE``, ``PIP_CACHE_DIR`` and ``XDG_CACHE_HOME`` pointed at empty
directories.  About a minute (a venv, ``pip install -e .``, a 17 MB download).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_first_command() -> str:
    """The first indented command of the README's "Fresh machine" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Fresh machine", 1)[1]
    m = re.search(r"^    (python3 -m venv .*)$", section, re.M)
    assert m, "README.md: no command under 'Fresh machine'"
    return m.group(1)


def fresh_copy(dest: Path) -> Path:
    """What a clone of this checkout holds (tracked files and untracked, unignored ones)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def test_readme_first_command_from_a_fresh_clone_with_empty_caches(tmp_path):
    command = readme_first_command()
    assert "-m lab.provision bare 0.5.6" in command and "patchtool status" in command, command
    clone = fresh_copy(tmp_path / "clone")
    caches = {k: tmp_path / "caches" / k.lower() for k in ("LMCACHE_PATCHTOOL_CACHE", "PIP_CACHE_DIR",
                                                           "XDG_CACHE_HOME")}
    for d in caches.values():
        d.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update({k: str(v) for k, v in caches.items()})
    proc = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert re.search(r"^state\s*: pristine\b", proc.stdout, re.M), proc.stdout
    # the wheel came through the empty cache this test made, not a warm one
    assert list((caches["LMCACHE_PATCHTOOL_CACHE"] / "wheels").glob("lmcache-0.5.6/lmcache-0.5.6-*.whl"))
    assert (caches["LMCACHE_PATCHTOOL_CACHE"] / "envs" / "bare-lmcache-0.5.6" / "bin" / "python").exists()
