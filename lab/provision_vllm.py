#!/usr/bin/env python3
"""Provision the vLLM layer the block-id resync tests need (default vLLM 0.27.1).

Not a venv: a ``pip install --target`` directory holding vLLM ``X``
(``--no-deps``; ``X`` = ``$LMCACHE_PATCHTOOL_VLLM`` or the argument, default
0.27.1) plus the few light packages needed to import vLLM's
scheduler-side block management and ``lmcache.integration.vllm.
lmcache_mp_connector``.  It is layered with ``PYTHONPATH`` over
``provision.runtime_env(V)`` (torch 2.13.0 CPU + lmcache ``V`` + deps,
already built), so nothing heavy is installed twice::

    PYTHONPATH=<lmcache overlay>:<vllm_layer()> <runtime_env>/bin/python ...

vLLM's compiled CUDA kernels (``*.so`` under ``vllm/``, ~580 MB) cannot load
on CPU and are never imported by these modules, so they are deleted after
install.  Finished layers carry a ``.provisioned`` stamp written last.

One layer per vLLM version, shared by every lmcache version ``V``: its content
(vLLM ``--no-deps`` and the light packages, all ``--target``) depends on the
vLLM version only, so it is installed once (with the first caller's runtime
env's pip) and then **probed** against each version's runtime env and pristine
lmcache on first use (a ``.probed-lmcache-<V>`` stamp per version).  Eight
builds became two in a cold test run (0.27.1 and 0.33.0; one took 92-256 s
on 2 loaded cores).

Its pip call takes ``$LMCACHE_PATCHTOOL_PIP_ARGS`` and it prints progress
lines like lab/provision.py (see there).

The vLLM version is a parameter.  Per version, from the wheel's
own METADATA ``Requires-Dist`` (read through ``pip install --dry-run --report``,
which fetches the metadata only, and checked again against the installed
``dist-info/METADATA``):

* the **torch pin** (``torch==X``).  The layer reuses a runtime env's torch; if
  a CPU build of the pin resolves from the configured indexes, the runtime env
  for that torch is used (``provision.runtime_env(V, torch)``).  If not (vLLM
  0.33.0 pins torch 2.14.0; here ``torch==2.14.0`` resolves only to PyPI's CUDA
  build, 555 MB plus ``cuda-toolkit``), the layer says so and uses the nearest
  CPU torch, ``provision.TORCH_VERSION`` (2.13.0+cpu).  The choice is printed
  and recorded in the layer's stamp (``torch``: pin, used, why);
* the **light packages' pins** (``llguidance``, ``xgrammar``, ...) where the
  METADATA names them, plus per-version extras (``EXTRA_DEPS``).

Command line: ``python -m lab.provision_vllm [LMCACHE_V] [--vllm X]``
(prints the layer path).  Layer directories are ``vllm-<X>-layer``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lab import provision
VLLM_VERSION = "0.27.1"  # the default; $LMCACHE_PATCHTOOL_VLLM or vllm_layer(vllm=X) picks another
VLLM_ENV = "LMCACHE_PATCHTOOL_VLLM"
LMCACHE_VERSION = "0.5.3"  # the default; vllm_layer(V) builds one per version
# Imported by vllm.v1.{core,request} / the connector and absent from the
# runtime env; these pins are vLLM 0.27.1's METADATA, and for other versions
# light_deps() takes the pin from that version's METADATA.  All --no-deps.
LIGHT_DEPS = [
    "cbor2",
    "openai-harmony>=0.0.3",
    "pillow",
    "pybase64",
    "cloudpickle",
    "uvloop",
    "llguidance>=1.7.0,<1.8.0",
    "xgrammar>=0.2.1,<1.0.0",  # --no-deps: its triton dependency is ~1 GB
    "apache-tvm-ffi==0.1.11",
]
# Per-version additions: the connector path of vLLM 0.30.0 and 0.33.0 imports
# partial_json_parser, and 0.30.0's Scheduler path imports einops (through
# vllm/v1/attention/ops/vit_attn_wrappers.py); 0.28.0 needs neither.
# 0.31/0.32 are not provisioned here.
EXTRA_DEPS: dict[str, list[str]] = {"0.30.0": ["partial-json-parser", "einops"],
                                    "0.33.0": ["partial-json-parser"]}

PROBE = (
    "import vllm.v1.core.kv_cache_manager, vllm.v1.core.single_type_kv_cache_manager, "
    "vllm.v1.core.sched.output, vllm.v1.core.sched.scheduler, vllm.v1.request, "
    "lmcache.integration.vllm.lmcache_mp_connector"
)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ------------------------------------------------------------ version -> pins

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$")


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requires_dist(metadata: str | list[str]) -> list[str]:
    """``Requires-Dist`` values from METADATA text (or an already-split list)."""
    if isinstance(metadata, list):
        return list(metadata)
    return [line.split(":", 1)[1].strip() for line in metadata.splitlines()
            if line.lower().startswith("requires-dist:")]


def _unconditional(reqs: list[str]) -> dict[str, str]:
    """canonical name -> version specifier, for requirements without an
    environment marker or with a Linux-only one (what a Linux install takes)."""
    out: dict[str, str] = {}
    for req in reqs:
        body, _, marker = req.partition(";")
        if marker.strip() and "extra" in marker:
            continue  # an optional extra's requirement
        m = _NAME.match(body)
        if m:
            out[_canon(m.group(1))] = m.group(2).strip().strip("()").replace(" ", "")
    return out


def torch_pin(metadata: str | list[str]) -> str:
    """The exact torch version a vLLM wheel pins (``torch==X``)."""
    spec = _unconditional(requires_dist(metadata)).get("torch", "")
    m = re.fullmatch(r"==([0-9][0-9A-Za-z.+]*)", spec)
    if not m:
        raise ValueError(f"vLLM METADATA pins no exact torch version (torch{spec or ' absent'})")
    return m.group(1)


def light_deps(metadata: str | list[str], vllm_version: str) -> list[str]:
    """LIGHT_DEPS with each package's pin taken from ``metadata`` where it names
    the package (else LIGHT_DEPS' own spec), plus EXTRA_DEPS[vllm_version]."""
    pins = _unconditional(requires_dist(metadata))
    out = []
    for dep in LIGHT_DEPS + EXTRA_DEPS.get(vllm_version, []):
        name = _NAME.match(dep).group(1)
        spec = pins.get(_canon(name))
        out.append(f"{name}{spec}" if spec else dep)
    return out


def choose_torch(pin: str, cpu_available: bool, fallback: str = provision.TORCH_VERSION) -> dict:
    """The torch the layer runs on: the pin where a CPU build of it resolves,
    else the nearest CPU torch (``fallback``, the runtime envs' 2.13.0)."""
    if cpu_available:
        return {"pin": pin, "used": pin, "cpu_build_of_pin": True,
                "why": f"vLLM pins torch {pin}; a CPU build of it resolves"}
    return {"pin": pin, "used": fallback, "cpu_build_of_pin": False,
            "why": (f"vLLM pins torch {pin}, which has no CPU build on the configured indexes; "
                    f"using the nearest CPU torch, {fallback}")}


def _dry_run(py: str, requirement: str) -> dict:
    """pip's resolution of one requirement (no install, metadata only)."""
    out = subprocess.run([py, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                          "-q", "--report", "-", requirement, *provision.pip_args()],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["install"][0]


def is_cpu_torch(item: dict) -> bool:
    """A resolved torch (pip report item) is a CPU build: ``+cpu``, or no CUDA requirement."""
    meta = item.get("metadata", {})
    if "+cpu" in meta.get("version", ""):
        return True
    return not any(re.match(r"(nvidia-|cuda-)", r.strip().lower()) for r in meta.get("requires_dist", []))


def vllm_version(explicit: str | None = None) -> str:
    return explicit or os.environ.get(VLLM_ENV, "").strip() or VLLM_VERSION


def layer_path(lmcache_version: str = LMCACHE_VERSION, vllm: str | None = None) -> Path:
    """The layer of vLLM ``vllm`` (one for every lmcache version; ``lmcache_version`` is kept
    for the callers' signature)."""
    return provision.cache_root() / "envs" / f"vllm-{vllm_version(vllm)}-layer"


def probe_stamp(layer: Path, lmcache_version: str) -> Path:
    """Written once the layer imported with lmcache ``lmcache_version``'s runtime env."""
    return layer / f".probed-lmcache-{lmcache_version}"


def _missing_extras(dest: Path, vv: str) -> list[str]:
    """EXTRA_DEPS[vv] entries a finished layer's stamp does not list (a layer
    built before they were added is rebuilt)."""
    try:
        have = json.loads((dest / provision.STAMP).read_text()).get("light_deps", [])
    except (OSError, ValueError):
        return []
    names = {_canon(_NAME.match(d).group(1)) for d in have if _NAME.match(d)}
    return [d for d in EXTRA_DEPS.get(vv, []) if _canon(_NAME.match(d).group(1)) not in names]


def vllm_layer(lmcache_version: str = LMCACHE_VERSION, vllm: str | None = None) -> Path:
    """Build once and return the ``--target`` directory with vLLM + light deps
    for ``lmcache_version``'s runtime env (vLLM ``vllm``, else ``$LMCACHE_PATCHTOOL_VLLM``,
    else 0.27.1)."""
    vv = vllm_version(vllm)
    dest = layer_path(lmcache_version, vv)
    with provision._locked(dest.name):
        if not (dest / provision.STAMP).exists() or _missing_extras(dest, vv):
            _build_layer(dest, vv, lmcache_version)
        if not probe_stamp(dest, lmcache_version).exists():
            _probe_layer(dest, vv, lmcache_version)
        return dest


def _probe_layer(dest: Path, vv: str, lmcache_version: str) -> None:
    """Fail loudly now rather than in every test: the modules the resync tests need import with
    lmcache ``lmcache_version``'s runtime env (the torch the layer's stamp chose) and pristine tree."""
    torch_used = json.loads((dest / provision.STAMP).read_text())["torch"]["used"]
    py = str(provision.runtime_env(lmcache_version, torch_used) / "bin" / "python")
    provision.progress(f"vllm {vv} layer: probing the imports with lmcache {lmcache_version}")
    env = {"PYTHONPATH": f"{provision.overlay(lmcache_version)}:{dest}", "PATH": "/usr/bin:/bin"}
    subprocess.run([py, "-c", PROBE], check=True, env=env, stdout=subprocess.DEVNULL)
    probe_stamp(dest, lmcache_version).write_text(json.dumps({"lmcache": lmcache_version, "python": py}) + "\n")


def _build_layer(dest: Path, vv: str, lmcache_version: str) -> None:
    """Install the layer (vLLM --no-deps + light packages) with ``lmcache_version``'s runtime env's pip."""
    started = time.monotonic()
    steps = provision.Steps(f"vllm {vv} layer", 3)
    steps.step(f"reading vllm {vv}'s METADATA (torch pin, light packages' pins)")
    py0 = str(provision.runtime_env(lmcache_version) / "bin" / "python")
    meta = _dry_run(py0, f"vllm=={vv}")["metadata"].get("requires_dist", [])
    pin = torch_pin(meta)
    if pin == provision.TORCH_VERSION:
        torch = choose_torch(pin, True)
        torch["resolved"] = "the runtime env's CPU torch"
    else:
        item = _dry_run(py0, f"torch=={pin}")
        torch = choose_torch(pin, is_cpu_torch(item))
        torch["resolved"] = item.get("download_info", {}).get("url")
    provision.progress(f"vllm {vv} layer {lmcache_version}: torch: {torch['why']}")
    runtime = provision.runtime_env(lmcache_version, torch["used"])
    py = str(runtime / "bin" / "python")
    deps = light_deps(meta, vv)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    pip = [py, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
           "--target", str(dest)]
    steps.step(f"installing vllm {vv} --no-deps and {len(deps)} light packages")
    provision._run(pip + [f"vllm=={vv}"] + deps + provision.pip_args(), steps)
    installed = next(dest.glob(f"vllm-{vv}.dist-info"), None)
    if installed is not None and torch_pin((installed / "METADATA").read_text()) != pin:
        raise SystemExit(f"provision: vllm {vv}: the installed METADATA's torch pin differs from {pin}")
    steps.step("deleting vLLM's CUDA kernels (*.so)")
    removed = 0
    for so in (dest / "vllm").rglob("*.so"):
        removed += so.stat().st_size
        so.unlink()
    provision._stamp(dest, {
        "vllm": vv, "built_with_lmcache_runtime": lmcache_version, "kind": "vllm-layer",
        "runtime_env": str(runtime), "light_deps": deps, "torch": torch,
        "removed_cuda_so_bytes": removed, "size_bytes": _du(dest),
        "build_seconds": round(time.monotonic() - started, 1),
    })
    steps.done(dest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm = None
    if "--vllm" in argv:
        i = argv.index("--vllm")
        vllm = argv[i + 1]
        del argv[i:i + 2]
    layer = vllm_layer(*(argv[:1] or [LMCACHE_VERSION]), vllm=vllm)
    print(layer)
    print(json.dumps(json.loads((layer / provision.STAMP).read_text())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
