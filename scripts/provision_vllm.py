#!/usr/bin/env python3
"""Provision the vLLM 0.27.1 layer the block-id resync tests need.

Not a venv: a ``pip install --target`` directory holding vLLM 0.27.1
(``--no-deps``) plus the few light packages needed to import vLLM's
scheduler-side block management and ``lmcache.integration.vllm.
lmcache_mp_connector``.  It is layered with ``PYTHONPATH`` over
``provision.runtime_env(V)`` (torch 2.13.0 CPU + lmcache ``V`` + deps,
already built), so nothing heavy is installed twice::

    PYTHONPATH=<lmcache overlay>:<vllm_layer()> <runtime_env>/bin/python ...

vLLM's compiled CUDA kernels (``*.so`` under ``vllm/``, ~580 MB) cannot load
on CPU and are never imported by these modules, so they are deleted after
install.  Finished layers carry a ``.provisioned`` stamp written last.

One layer per lmcache version ``V`` (default ``0.5.3``, whose path is
unchanged): it is installed with, and probed against, that version's runtime
env and pristine lmcache, so a layer never depends on another version's env.

Its pip call takes ``$LMCACHE_PATCHTOOL_PIP_ARGS`` and it prints progress
lines like scripts/provision.py (see there).

Command line: ``python scripts/provision_vllm.py [V]``  (prints the layer path).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provision  # noqa: E402

VLLM_VERSION = "0.27.1"
LMCACHE_VERSION = "0.5.3"  # the default; vllm_layer(V) builds one per version
# Imported by vllm.v1.{core,request} / the connector and absent from the
# runtime env; pins follow vLLM 0.27.1's METADATA.  All installed --no-deps.
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
PROBE = (
    "import vllm.v1.core.kv_cache_manager, vllm.v1.core.single_type_kv_cache_manager, "
    "vllm.v1.core.sched.output, vllm.v1.request, "
    "lmcache.integration.vllm.lmcache_mp_connector"
)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def vllm_layer(lmcache_version: str = LMCACHE_VERSION) -> Path:
    """Build once and return the ``--target`` directory with vLLM + light deps
    for ``lmcache_version``'s runtime env."""
    runtime = provision.runtime_env(lmcache_version)
    py = str(runtime / "bin" / "python")
    dest = provision.cache_root() / "envs" / f"vllm-{VLLM_VERSION}-layer-lmcache-{lmcache_version}"
    with provision._locked(dest.name):
        if (dest / provision.STAMP).exists():
            return dest
        started = time.monotonic()
        steps = provision.Steps(f"vllm layer {lmcache_version}", 3)
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        pip = [py, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
               "--target", str(dest)]
        steps.step(f"installing vllm {VLLM_VERSION} --no-deps and {len(LIGHT_DEPS)} light packages")
        provision._run(pip + [f"vllm=={VLLM_VERSION}"] + LIGHT_DEPS + provision.pip_args(), steps)
        steps.step("deleting vLLM's CUDA kernels (*.so)")
        removed = 0
        for so in (dest / "vllm").rglob("*.so"):
            removed += so.stat().st_size
            so.unlink()
        # Fail loudly now rather than in every test.
        steps.step("probing the imports the resync tests need")
        env = {"PYTHONPATH": f"{provision.overlay(lmcache_version)}:{dest}",
               "PATH": "/usr/bin:/bin"}
        subprocess.run([py, "-c", PROBE], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        provision._stamp(dest, {
            "vllm": VLLM_VERSION, "lmcache": lmcache_version, "kind": "vllm-layer",
            "runtime_env": str(runtime), "light_deps": LIGHT_DEPS,
            "removed_cuda_so_bytes": removed, "size_bytes": _du(dest),
            "build_seconds": round(time.monotonic() - started, 1),
        })
        steps.done(dest)
        return dest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    layer = vllm_layer(*argv[:1])
    print(layer)
    print(json.dumps(json.loads((layer / provision.STAMP).read_text())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
