"""The geometry a real vLLM engine will run on, asked of that engine's own code
before it starts (stdlib only; the probe runs inside the target venv).

Why this exists: the logical block N of a hybrid model is not a constant of
the device.  vLLM aligns it so that one attention page holds one Mamba/GDN
state page, and the state's size depends on its dtype, which vLLM for CPU
picks from the machine: with AVX-512 BF16 it resets an ``auto`` SSM state to
float32 for its accelerated GDN kernels (``vllm/platforms/cpu.py``, "Reset SSM
cache type to float32"), elsewhere the state stays bfloat16.  The tiny
Qwen3-Next-like model of the engine tests gets N = 640 on the first kind of
CPU and N = 384 on the second, and an LMCache server started with the wrong
chunk refuses the engine ("chunk size 640 must be a multiple of 384").

So the gate never assumes N: :func:`probe` builds the engine's own
``VllmConfig`` from the flags the gate will pass, constructs the model's
layers on the meta device (no weights, no memory), and runs vLLM's own
``update_block_size_for_backend`` and ``select_common_block_size``: the same
code that decides N and the kernel page when the engine starts.  After the
engine is up, :func:`check_against_log` compares the probe with what the
engine logged (``engine_servers.vllm_log_facts``), so a probe that diverged from the real start is a loud abort,
never a gate run on a wrong geometry.

The CPU features that decided the SSM state dtype (AVX-512 BF16, AMX) are
recorded with the result, read both by torch (what vLLM asks) and from
``/proc/cpuinfo``.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# ``--mamba-ssm-cache-dtype`` values that pin the hybrid's geometry on any CPU: an explicit
# float32 is never reset; an explicit bfloat16 is kept by the CPU GDN backend (cpu.py keeps
# float16/bfloat16 for mamba backend "gdn" and resets only "auto" or other backends)
SSM_DTYPES = ("auto", "float32", "bfloat16", "float16")

# Runs in the target interpreter: argv[1] is a JSON object of EngineArgs fields.  The last line
# printed is the JSON result; everything vLLM logs goes to stderr.
_PROBE = r"""
import json, os, sys, tempfile
want = json.loads(sys.argv[1])
out = {}
import torch
out["torch_cpu"] = {"avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
                    "amx_tile": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())}
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.config.vllm import set_current_vllm_config
from vllm.model_executor.models import ModelRegistry
out["vllm"] = getattr(vllm, "__version__", "?")
out["platform"] = type(current_platform).__name__
args = EngineArgs(**want)
cfg = args.create_engine_config()
out["block_size_before_alignment"] = cfg.cache_config.block_size
mc = cfg.model_config
out["hybrid"] = bool(mc.is_hybrid)
if mc.is_hybrid:
    # the layers register themselves (and their attention backends) in the compilation
    # config's static forward context while the model is constructed; on the meta device
    # that costs no memory and loads no weight
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="file://" + tempfile.mktemp(prefix="geo-probe-"))
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    with set_current_vllm_config(cfg):
        initialize_model_parallel(1, 1)
        with torch.device("meta"):
            model_cls(vllm_config=cfg, prefix="")
    current_platform.update_block_size_for_backend(cfg)
    # what the state is stored in: an "auto" SSM cache dtype left as is (a CPU without
    # AVX-512 BF16) resolves to the model's dtype here, as it does when the engine allocates
    with set_current_vllm_config(cfg):
        dtypes = model_cls.get_mamba_state_dtype_from_config(cfg)
    out["mamba_state_dtypes"] = [str(d).replace("torch.", "") for d in dtypes]
    backends = current_platform._find_non_ssm_backends(cfg)
    out["attention_backends"] = [b.get_name() for b in backends]
    if backends:
        from vllm.v1.worker.utils import select_common_block_size
        out["kernel_block"] = select_common_block_size(cfg.cache_config.block_size, backends)
out["block_size"] = cfg.cache_config.block_size
out["ssm_cache_dtype_config"] = cfg.cache_config.mamba_ssm_cache_dtype
out["ssm_state_dtype"] = (out.get("mamba_state_dtypes") or [cfg.cache_config.mamba_ssm_cache_dtype])[-1]
out["mamba_page_size_padded"] = cfg.cache_config.mamba_page_size_padded
print(json.dumps(out))
"""

class GeometryError(Exception):
    """The engine's geometry could not be learned, or the engine started on another one."""


@dataclass(frozen=True)
class EngineGeometry:
    block_size: int  # the logical block N the engine's KV cache manager uses
    hybrid: bool
    ssm_state_dtype: str | None  # what vLLM resolved (float32 / bfloat16 / ...); None: not hybrid
    ssm_state_dtype_asked: str  # what the gate passed ("auto": the machine decides)
    kernel_block: int | None  # the attention kernel page vLLM picks for N (None: not probed)
    attention_backends: tuple[str, ...]
    mamba_page_size_padded: int | None
    cpu_features: dict[str, Any]
    vllm: str
    source: str  # "probe": asked of vLLM's code; "given": --block-size on the command line

    @property
    def expect_k(self) -> int:
        """Kernel pages per logical block (1 on vLLM for CPU: CPU_ATTN takes any multiple of 32)."""
        return self.block_size // self.kernel_block if self.kernel_block else 1

    def why(self) -> str:
        """One line: N and what decided it."""
        if self.source == "given":
            return f"block {self.block_size} (given on the command line)"
        if not self.hybrid:
            return f"block {self.block_size} (pure attention: vLLM's block)"
        feats = self.cpu_features
        # what vLLM asks (torch's check), else what /proc/cpuinfo lists
        bf16 = (feats.get("torch") or {}).get("avx512_bf16", feats.get("avx512_bf16"))
        decided = (f"asked {self.ssm_state_dtype_asked}" if self.ssm_state_dtype_asked != "auto" else
                   "auto: " + ("AVX-512 BF16 present, vLLM resets it to float32" if bf16 else
                               "no AVX-512 BF16, the model's dtype is kept"))
        return f"block {self.block_size}, SSM state {self.ssm_state_dtype} ({decided}), kernel page " \
               f"{self.kernel_block}, k {self.expect_k}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"expect_k": self.expect_k, "why": self.why()}


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool]:
    """The CPU features that decide vLLM for CPU's SSM state dtype, from ``/proc/cpuinfo``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
            break
    return {"avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "amx_tile": "amx_tile" in flags}


def engine_args(model: str, *, ssm_state_dtype: str = "auto", vllm_block_size: int | None = None,
                mamba_cache_mode: str | None = "align", enable_prefix_caching: bool = True,
                dtype: str = "auto", tensor_parallel_size: int = 1,
                max_model_len: int | None = None) -> dict[str, Any]:
    """The EngineArgs fields of the gate's vLLM command line that can move the geometry."""
    kw: dict[str, Any] = {"model": model, "enforce_eager": True, "dtype": dtype,
                          "enable_prefix_caching": enable_prefix_caching,
                          "tensor_parallel_size": tensor_parallel_size,
                          "mamba_ssm_cache_dtype": ssm_state_dtype}
    if mamba_cache_mode:
        kw["mamba_cache_mode"] = mamba_cache_mode
    if vllm_block_size:
        kw["block_size"] = vllm_block_size
    if max_model_len:
        kw["max_model_len"] = max_model_len
    return kw


def parse_probe(stdout: str, asked: str, cpuinfo: str | None = None) -> EngineGeometry:
    """The probe's last JSON line as an :class:`EngineGeometry`."""
    try:
        raw = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise GeometryError(f"vLLM geometry probe: unparsable output ({exc}): {stdout[-300:]!r}") from None
    feats: dict[str, Any] = dict(cpu_flags(cpuinfo))
    feats["torch"] = raw.get("torch_cpu") or {}
    return EngineGeometry(block_size=int(raw["block_size"]), hybrid=bool(raw.get("hybrid")),
                          ssm_state_dtype=raw.get("ssm_state_dtype") if raw.get("hybrid") else None,
                          ssm_state_dtype_asked=asked, kernel_block=raw.get("kernel_block"),
                          attention_backends=tuple(raw.get("attention_backends") or ()),
                          mamba_page_size_padded=raw.get("mamba_page_size_padded"),
                          cpu_features=feats, vllm=str(raw.get("vllm", "?")), source="probe")


def probe(python: str, args: dict[str, Any], *, env: dict[str, str] | None = None,
          timeout: float = 300.0) -> EngineGeometry:
    """Ask vLLM in the venv of ``python`` which geometry an engine started with ``args`` gets."""
    try:
        res = subprocess.run([python, "-c", _PROBE, json.dumps(args)], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GeometryError(f"vLLM geometry probe ({python}): {exc}") from None
    if res.returncode != 0:
        tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        raise GeometryError(f"vLLM geometry probe ({python}) exited {res.returncode}: {tail[0][-400:]}")
    return parse_probe(res.stdout, str(args.get("mamba_ssm_cache_dtype", "auto")))


def given(block_size: int, *, asked: str = "auto") -> EngineGeometry:
    """A geometry taken from the command line (``--block-size``), checked against the log only."""
    return EngineGeometry(block_size=block_size, hybrid=True, ssm_state_dtype=None, ssm_state_dtype_asked=asked,
                          kernel_block=None, attention_backends=(), mamba_page_size_padded=None,
                          cpu_features=cpu_flags(), vllm="?", source="given")


def check_against_log(geo: EngineGeometry, facts: dict[str, Any]) -> str | None:
    """None when the started engine's log (``engine_servers.vllm_log_facts``) agrees with ``geo``; else
    the one-line reason.

    A pure-attention engine logs no alignment (its block is vLLM's, or the one given): nothing to
    compare.  A hybrid whose log carries no alignment line kept its pre-alignment block, which
    the probe would have said too."""
    logged = facts.get("attention_block_size")
    if logged is None:
        return None
    if int(logged) != geo.block_size:
        return (f"the engine aligned its hybrid block to {logged} tokens, the gate placed keys and sized "
                f"the LMCache chunk for {geo.block_size} ({geo.why()})")
    return None

