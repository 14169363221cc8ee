#!/usr/bin/env python3
"""Provision and cache the environments the tests and benches need.

Everything here is keyed by what it contains, built once, and reused:

* ``wheel(V)``          the real ``lmcache==V`` wheel from the package index.
* ``bare_env(V)``       a venv with ``pip install --no-deps lmcache==V`` (the tool
                        never imports lmcache, so file-level tests need no torch).
* ``runtime_env(V)``    a venv where ``import lmcache`` works on CPU: torch 2.13.0
                        (the CPU build vLLM 0.27.1 pins), ``lmcache==V`` with its
                        dependencies, and ``openai`` (the ``lmcache server`` CLI
                        needs it to load).

A finished environment carries a ``.provisioned`` stamp written last, so an
interrupted build is detected and rebuilt instead of half-used.  The cache
root is ``$LMCACHE_PATCHTOOL_CACHE`` or ``~/.cache/lmcache-patchtool``.

Command line: ``python scripts/provision.py runtime 0.5.3`` (or ``bare``/``wheel``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# vLLM 0.27.1 pins torch 2.13.0; a CPU build of it is what these machines carry.
TORCH_VERSION = "2.13.0"
STAMP = ".provisioned"


def cache_root() -> Path:
    root = os.environ.get("LMCACHE_PATCHTOOL_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "lmcache-patchtool"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _locked(name: str) -> Iterator[None]:
    """Serialise builds of one artefact across processes (pytest-xdist, CI)."""
    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kw)


def _python() -> str:
    """The interpreter venvs are created from: Python 3.11 (the wheels are cp311)."""
    for cand in (os.environ.get("LMCACHE_PATCHTOOL_PY311"), "python3.11", sys.executable):
        if not cand:
            continue
        exe = shutil.which(cand) or cand
        try:
            out = subprocess.run([exe, "-c", "import sys;print(sys.version_info[:2]==(3,11))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            continue
        if out == "True":
            return exe
    raise SystemExit("provision: a Python 3.11 interpreter is needed (lmcache wheels are cp311)")


def wheel(version: str) -> Path:
    """Download (once) the real lmcache wheel for ``version``; returns its path."""
    dest = cache_root() / "wheels" / f"lmcache-{version}"
    with _locked(f"wheel-{version}"):
        found = sorted(dest.glob(f"lmcache-{version}-*.whl")) if dest.exists() else []
        if found:
            return found[0]
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _run([_python(), "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
              "-d", str(tmp), f"lmcache=={version}"])
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        return sorted(dest.glob(f"lmcache-{version}-*.whl"))[0]


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _fresh_venv(venv: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([_python(), "-m", "venv", str(venv)])


def _stamp(venv: Path, info: dict) -> None:
    (venv / STAMP).write_text(json.dumps(info, indent=2) + "\n")


def bare_env(version: str) -> Path:
    """A venv with only the lmcache distribution installed (``--no-deps``)."""
    venv = cache_root() / "envs" / f"bare-lmcache-{version}"
    with _locked(venv.name):
        if (venv / STAMP).exists():
            return venv
        whl = wheel(version)
        _fresh_venv(venv)
        _run([str(_venv_python(venv)), "-m", "pip", "install", "-q", "--no-deps", str(whl)])
        _stamp(venv, {"lmcache": version, "kind": "bare"})
        return venv


def runtime_env(version: str) -> Path:
    """A venv in which lmcache ``version`` imports and its server runs on CPU."""
    venv = cache_root() / "envs" / f"runtime-lmcache-{version}-torch{TORCH_VERSION}"
    with _locked(venv.name):
        if (venv / STAMP).exists():
            return venv
        started = time.monotonic()
        whl = wheel(version)
        _fresh_venv(venv)
        py = str(_venv_python(venv))
        # torch first and pinned: otherwise lmcache's unpinned torch requirement
        # pulls a multi-GB CUDA build.
        _run([py, "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"])
        _run([py, "-m", "pip", "install", "-q", str(whl), "openai", f"torch=={TORCH_VERSION}"])
        _stamp(venv, {"lmcache": version, "torch": TORCH_VERSION, "kind": "runtime",
                      "build_seconds": round(time.monotonic() - started, 1)})
        return venv


def overlay(version: str, patches: list[Path] | None = None) -> Path:
    """A ``--target``-style directory holding lmcache ``version`` from its wheel,
    optionally with ``patches`` applied (GNU ``patch -p1 -F0``, zero fuzz).

    Prepend it to ``PYTHONPATH`` of :func:`runtime_env`'s interpreter to run a
    patched lmcache without copying the 1.8 GB venv.  Keyed by the patches'
    content, so editing a patch rebuilds its overlay.
    """
    import hashlib
    import zipfile

    digest = hashlib.sha256()
    for patch in patches or []:
        digest.update(Path(patch).read_bytes())
    key = digest.hexdigest()[:16] if patches else "pristine"
    dest = cache_root() / "overlays" / f"lmcache-{version}-{key}"
    with _locked(dest.name):
        if (dest / STAMP).exists():
            return dest
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with zipfile.ZipFile(wheel(version)) as zf:
            zf.extractall(dest)
        for patch in patches or []:
            _run(["patch", "-p1", "-F0", "--no-backup-if-mismatch", "-s", "-d", str(dest),
                  "-i", str(Path(patch).resolve())])
        _stamp(dest, {"lmcache": version, "patches": [str(p) for p in patches or []]})
        return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["wheel", "bare", "runtime"])
    ap.add_argument("version")
    args = ap.parse_args(argv)
    fn = {"wheel": wheel, "bare": bare_env, "runtime": runtime_env}[args.kind]
    print(fn(args.version))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
