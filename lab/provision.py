#!/usr/bin/env python3
"""Provision and cache the environments the tests and benches need.

Everything here is keyed by what it contains, built once, and reused:

* ``wheel(V)``          the real ``lmcache==V`` wheel from the package index.
* ``bare_env(V)``       a venv with ``pip install --no-deps lmcache==V`` (the tool
                        never imports lmcache, so file-level tests need no torch).
* ``runtime_env(V)``    a venv where ``import lmcache`` works on CPU: lmcache ``V``
                        in its own site-packages, over ``runtime_base()``.
* ``runtime_base()``    what every runtime venv shares, reached through one ``.pth``
                        line: torch 2.13.0 (the CPU build vLLM 0.27.1 pins), openai
                        (the ``lmcache server`` CLI needs it to load) and the newest
                        series' dependencies.  Built once (about 2 min, 1.8 GB); a
                        runtime venv then takes about 20 s and 0.1 GB.

A finished environment carries a ``.provisioned`` stamp written last, so an
interrupted build is detected and rebuilt instead of half-used.  The cache
root is ``$LMCACHE_PATCHTOOL_CACHE`` or ``~/.cache/lmcache-patchtool``.

Environment:

* ``LMCACHE_PATCHTOOL_TORCH_INDEX``  an index URL passed as ``--index-url`` to
  the torch install only, e.g. ``https://download.pytorch.org/whl/cpu`` for
  the CPU build.  Without it, ``pip install torch==X`` takes whatever the
  configured index serves; on PyPI that is the CUDA build (about 2.5 GB more
  in the shared base).
* ``LMCACHE_PATCHTOOL_PIP_ARGS``  extra arguments for every pip call (split
  like a shell would), e.g. ``--index-url https://mirror.example/simple`` or
  ``--find-links /wheels``.
* ``LMCACHE_PATCHTOOL_PY311``  the Python 3.11 interpreter venvs are made from.

While it builds, each step prints one progress line to stderr and appends it
to ``<cache root>/provision.log``, e.g.
``provision: runtime 0.5.3: installing torch 2.13.0 (step 2/3, 35 s)``, and a
long step repeats it every 30 s.  pytest captures a fixture's stderr, so
tests/conftest.py routes these lines to the terminal (``set_progress_sink``);
``tail -f ~/.cache/lmcache-patchtool/provision.log`` works from anywhere.

Command line: ``python -m lab.provision runtime 0.5.3`` (or ``bare``/``wheel``),
``python -m lab.provision status`` (what is cached).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

# vLLM 0.27.1 pins torch 2.13.0; a CPU build of it is what these machines carry.
TORCH_VERSION = "2.13.0"
STAMP = ".provisioned"
TORCH_INDEX_ENV = "LMCACHE_PATCHTOOL_TORCH_INDEX"
PIP_ARGS_ENV = "LMCACHE_PATCHTOOL_PIP_ARGS"
HEARTBEAT_S = 30.0
LOG_NAME = "provision.log"
# The versions the tests provision: one per shipped hybrid-FA patch set.
_PATCHES = Path(__file__).resolve().parents[1] / "patches" / "hybrid-fa"
VERSIONS = tuple(sorted(p.name for p in _PATCHES.iterdir() if p.is_dir())) if _PATCHES.is_dir() else ()


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


# ---------------------------------------------------------------- progress

_sink: Callable[[str], None] | None = None


def set_progress_sink(fn: Callable[[str], None] | None) -> None:
    """Send progress lines to ``fn`` instead of stderr (tests/conftest.py
    writes them past pytest's capture); None restores stderr."""
    global _sink
    _sink = fn


def progress(line: str) -> None:
    line = f"provision: {line}"
    (_sink or (lambda text: print(text, file=sys.stderr, flush=True)))(line)
    try:
        with open(cache_root() / LOG_NAME, "a") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
    except OSError:
        pass


class Steps:
    """Numbered progress of one build: ``what: doing (step n/total, E s)``."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.n, self.doing = what, total, 0, ""
        self.started = time.monotonic()

    def elapsed(self) -> int:
        return round(time.monotonic() - self.started)

    def step(self, doing: str) -> None:
        self.n += 1
        self.doing = doing
        progress(f"{self.what}: {doing} (step {self.n}/{self.total}, {self.elapsed()} s)")

    def still(self) -> None:
        progress(f"{self.what}: still {self.doing} (step {self.n}/{self.total}, {self.elapsed()} s)")

    def done(self, where: Path) -> None:
        progress(f"{self.what}: ready in {self.elapsed()} s ({where})")


def _run(cmd: list[str], steps: Steps | None = None, **kw) -> None:
    """Run ``cmd`` (check=True); while it runs, repeat the current step's
    progress line every HEARTBEAT_S seconds.

    The child's stdout goes to our stderr: this script's stdout carries only
    the path it was asked for, so ``"$(provision.py bare V)"`` and every
    ``--json`` document built on provisioning stay machine-readable."""
    print("+", shlex.join(cmd), file=sys.stderr, flush=True)
    kw.setdefault("stdout", sys.stderr.fileno())
    proc = subprocess.Popen(cmd, **kw)
    while True:
        try:
            rc = proc.wait(timeout=HEARTBEAT_S)
            break
        except subprocess.TimeoutExpired:
            if steps is not None:
                steps.still()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc:
        raise subprocess.CalledProcessError(rc, cmd)


def pip_args() -> list[str]:
    """``$LMCACHE_PATCHTOOL_PIP_ARGS``, appended to every pip call."""
    return shlex.split(os.environ.get(PIP_ARGS_ENV, ""))


def torch_index_args() -> list[str]:
    """``--index-url $LMCACHE_PATCHTOOL_TORCH_INDEX`` for the torch install (after
    the common pip args, so it wins over an ``--index-url`` there)."""
    url = os.environ.get(TORCH_INDEX_ENV, "").strip()
    return ["--index-url", url] if url else []


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
        steps = Steps(f"wheel {version}", 1)
        steps.step(f"downloading lmcache=={version}")
        _run([_python(), "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
              "-d", str(tmp), f"lmcache=={version}", *pip_args()], steps)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        found = sorted(dest.glob(f"lmcache-{version}-*.whl"))[0]
        steps.done(found)
        return found


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
        steps = Steps(f"bare {version}", 2)
        steps.step("creating the venv")
        _fresh_venv(venv)
        steps.step(f"installing lmcache {version} --no-deps")
        _run([str(_venv_python(venv)), "-m", "pip", "install", "-q", "--no-deps", str(whl),
              *pip_args()], steps)
        _stamp(venv, {"lmcache": version, "kind": "bare"})
        steps.done(venv)
        return venv


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def _release_key(version: str) -> tuple:
    """Sort key for ``X.Y.Z`` and ``X.Y.ZrcN``: numeric, a final after its rcs."""
    m = re.fullmatch(r"(\d+(?:\.\d+)*)(?:rc(\d+))?", version)
    if not m:
        return ((), 0, 0)
    release = tuple(int(x) for x in m.group(1).split("."))
    return (release, 0 if m.group(2) else 1, int(m.group(2) or 0))


def _base_deps_version(requested: str) -> str:
    """Whose dependencies the shared base carries: the newest shipped series
    (one fixed choice, so every machine builds the same base), else the
    version asked for (a checkout with no shipped series)."""
    return max(VERSIONS, key=_release_key) if VERSIONS else requested


def runtime_base(torch_version: str, deps_from: str) -> Path:
    """The heavy half every runtime venv shares: torch ``torch_version``, openai
    and the newest series' dependencies, with no lmcache installed.

    Each runtime venv reaches it through one ``.pth`` line and installs only
    lmcache and whatever dependency its version pins differently (pip leaves
    the base's copy alone, "outside environment", and the venv's own copy
    wins on ``sys.path``).  One torch install instead of one per version: in a
    cold run here the base took 192 s, then each version 16-18 s (113-137 s
    each before).  Called by :func:`runtime_env`, which picks ``deps_from``."""
    venv = cache_root() / "envs" / f"runtime-base-torch{torch_version}"
    with _locked(venv.name):
        if (venv / STAMP).exists():
            return venv
        started = time.monotonic()
        whl = wheel(deps_from)
        steps = Steps(f"runtime base torch {torch_version}", 4)
        steps.step("creating the venv")
        _fresh_venv(venv)
        py = str(_venv_python(venv))
        index = torch_index_args()
        steps.step(f"installing torch {torch_version}"
                   + (f" from {index[1]}" if index else " (set $" + TORCH_INDEX_ENV
                      + " for the CPU build)"))
        # torch first and pinned: otherwise lmcache's unpinned torch requirement
        # pulls a multi-GB CUDA build.  The second call finds torch==X satisfied
        # (a +cpu local version matches ==X) and keeps it.
        _run([py, "-m", "pip", "install", "-q", f"torch=={torch_version}", *pip_args(), *index],
             steps)
        steps.step(f"installing lmcache {deps_from}'s dependencies and openai")
        _run([py, "-m", "pip", "install", "-q", str(whl), "openai", f"torch=={torch_version}",
              *pip_args()], steps)
        steps.step(f"removing lmcache {deps_from} (each runtime venv installs its own)")
        _run([py, "-m", "pip", "uninstall", "-q", "-y", "lmcache"], steps)
        torch_build = _installed_torch(py)
        if torch_build.get("cuda"):
            progress(f"runtime base: torch {torch_build['version']} is a CUDA build "
                     f"({torch_build['nvidia_dists']} nvidia-* packages, about 2.5 GB more than "
                     f"the CPU build); set {TORCH_INDEX_ENV}=https://download.pytorch.org/whl/cpu "
                     "and delete this venv to use the CPU build")
        _stamp(venv, {"torch": torch_version, "kind": "runtime-base", "deps_from": deps_from,
                      "torch_build": torch_build, "torch_index": index[1] if index else None,
                      "build_seconds": round(time.monotonic() - started, 1)})
        steps.done(venv)
        return venv


BASE_PTH = "lmcache_patchtool_runtime_base.pth"


def _base_of(venv: Path) -> Path | None:
    """The shared base a runtime venv's ``.pth`` names (None: a self-contained venv)."""
    try:
        line = (_site_packages(venv) / BASE_PTH).read_text().strip()
    except (OSError, StopIteration):
        return None
    return Path(line).parents[2] if line else None


def runtime_env(version: str, torch_version: str = TORCH_VERSION) -> Path:
    """A venv in which lmcache ``version`` imports and its server runs on CPU,
    on torch ``torch_version`` (default 2.13.0, vLLM 0.27.1's pin; a vLLM
    layer whose pin has a CPU build asks for that one): lmcache ``version``
    in its own site-packages over :func:`runtime_base`."""
    venv = cache_root() / "envs" / f"runtime-lmcache-{version}-torch{torch_version}"
    with _locked(venv.name):
        base = _base_of(venv) if (venv / STAMP).exists() else None
        if (venv / STAMP).exists() and (base is None or (base / STAMP).exists()):
            return venv
        started = time.monotonic()
        whl = wheel(version)
        base = runtime_base(torch_version, _base_deps_version(version))
        steps = Steps(f"runtime {version}", 2)
        steps.step(f"creating the venv over the shared base {base.name}")
        _fresh_venv(venv)
        (_site_packages(venv) / BASE_PTH).write_text(f"{_site_packages(base)}\n")
        py = str(_venv_python(venv))
        steps.step(f"installing lmcache {version} and any dependency the base lacks")
        _run([py, "-m", "pip", "install", "-q", str(whl), "openai", f"torch=={torch_version}",
              *pip_args()], steps)
        base_stamp = json.loads((base / STAMP).read_text())
        _stamp(venv, {"lmcache": version, "torch": torch_version, "kind": "runtime",
                      "base": str(base), "torch_build": base_stamp.get("torch_build", {}),
                      "torch_index": base_stamp.get("torch_index"),
                      "build_seconds": round(time.monotonic() - started, 1)})
        steps.done(venv)
        return venv


_TORCH_PROBE = r"""
import json, importlib.metadata as md
names = [d.metadata["Name"] or "" for d in md.distributions()]
nvidia = sum(1 for n in names if n.lower().startswith("nvidia-"))
version = md.version("torch")
print(json.dumps({"version": version, "nvidia_dists": nvidia,
                  "cuda": "+cpu" not in version and nvidia > 0}))
"""


def _installed_torch(py: str) -> dict:
    """Which torch build landed, read from its metadata (torch is not imported)."""
    try:
        out = subprocess.run([py, "-c", _TORCH_PROBE], capture_output=True, text=True,
                             check=True).stdout
        return json.loads(out)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return {}


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
        progress(f"overlay {dest.name}: extracting the wheel"
                 + (f" and applying {len(patches)} patches" if patches else ""))
        with zipfile.ZipFile(wheel(version)) as zf:
            zf.extractall(dest)
        for patch in patches or []:
            _run(["patch", "-p1", "-F0", "--no-backup-if-mismatch", "-s", "-d", str(dest),
                  "-i", str(Path(patch).resolve())])
        _stamp(dest, {"lmcache": version, "patches": [str(p) for p in patches or []]})
        return dest


# ---------------------------------------------------------------- inventory


def inventory(versions: tuple[str, ...] = VERSIONS) -> dict[str, dict[str, bool]]:
    """kind -> {version: cached?} for the artefacts the tests use, from stamps
    and file names only (cheap: a few stat calls, builds nothing)."""
    root = cache_root()
    envs = root / "envs"
    from_stamp = {
        "bare": lambda v: envs / f"bare-lmcache-{v}",
        "runtime": lambda v: envs / f"runtime-lmcache-{v}-torch{TORCH_VERSION}",
    }
    out = {"wheel": {v: any((root / "wheels" / f"lmcache-{v}").glob(f"lmcache-{v}-*.whl"))
                     for v in versions}}
    for kind, where in from_stamp.items():
        out[kind] = {v: (where(v) / STAMP).exists() for v in versions}
    # lab/provision_vllm.py's layer (vLLM 0.27.1, or $LMCACHE_PATCHTOOL_VLLM): one per vLLM
    # version, probed once per lmcache version
    layer = envs / f"vllm-{os.environ.get('LMCACHE_PATCHTOOL_VLLM', '').strip() or '0.27.1'}-layer"
    out["vllm-layer"] = {v: (layer / STAMP).exists() and (layer / f".probed-lmcache-{v}").exists()
                         for v in versions}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["wheel", "bare", "runtime", "status"])
    ap.add_argument("version", nargs="?")
    args = ap.parse_args(argv)
    if args.kind == "status":
        print(f"cache: {cache_root()}")
        for kind, versions in inventory().items():
            cached = [v for v, ok in versions.items() if ok]
            missing = [v for v, ok in versions.items() if not ok]
            print(f"{kind:11s} cached: {' '.join(cached) or '-':24s} "
                  f"to build: {' '.join(missing) or '-'}")
        return 0
    if not args.version:
        ap.error(f"{args.kind} needs a version")
    fn = {"wheel": wheel, "bare": bare_env, "runtime": runtime_env}[args.kind]
    print(fn(args.version))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
