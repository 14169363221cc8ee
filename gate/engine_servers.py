"""Command lines and log facts for the servers the engine gate runs (stdlib only).

vLLM (0.27.1) is started as ``vllm serve MODEL ...``; the LMCache side through
the MP connector shipped by the lmcache wheel.  The KV-transfer config keys come
from ``lmcache/integration/vllm/lmcache_mp_connector.py`` (0.5.3):

* ``kv_connector: "LMCacheMPConnector"``, ``kv_role: "kv_both"``;
* ``kv_connector_module_path: "lmcache.integration.vllm.lmcache_mp_connector"``:
  vLLM's factory imports the class from this module directly
  (``distributed/kv_transfer/kv_connector/factory.py``), so vLLM's in-tree
  fallback (``LMCacheMPConnectorUpstream``, chosen silently when the import
  fails or ``LMCACHE_USE_UPSTREAM_MP`` is set) can never be used by accident;
* ``kv_connector_extra_config``: ``lmcache.mp.host`` (default ``tcp://localhost``),
  ``lmcache.mp.port`` (default 5555) -- the connector reads them at :622/:625;
  ``lmcache.mp.server_urls`` is the multi-server alternative;
  ``lmcache.mp.mq_timeout`` / ``lmcache.mp.heartbeat_interval`` are optional.

``validate_mamba_step_alignment`` (connector :145) refuses a hybrid model in
align mode unless ``block_size <= max_num_batched_tokens < 2 * block_size``, so
``--max-num-batched-tokens`` defaults to the expected logical block size.

``lmcache server`` (``lmcache/cli/commands/server.py``) takes ``--host/--port``
(ZMQ), ``--http-host/--http-port`` (FastAPI: ``/healthcheck``, ``/status``,
``/metrics``), ``--chunk-size``, ``--l1-size-gb`` and ``--eviction-policy``
(both required), ``--l2-adapter '{"type": "fs", "base_path": DIR}'``
(``v1/distributed/l2_adapters/fs_l2_adapter.py``).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"


def default_bin(name: str, python: str | None = None) -> list[str]:
    """``<dir of the interpreter>/<name>`` if it exists, else ``name`` from PATH."""
    cand = Path(python or sys.executable).parent / name
    return [str(cand)] if cand.exists() else [name]


def split_cmd(cmd: str | Sequence[str] | None, fallback: list[str]) -> list[str]:
    if cmd is None:
        return list(fallback)
    if isinstance(cmd, str):
        return shlex.split(cmd)
    return list(cmd)


def kv_transfer_config(host: str, port: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
           "kv_connector_module_path": CONNECTOR_MODULE,
           "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": port}}
    if extra:
        cfg["kv_connector_extra_config"].update(extra)
    return cfg


@dataclass
class VllmSettings:
    model: str
    served_model_name: str = "gate-model"
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int = 40960
    max_num_batched_tokens: int = 544
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    attention_backend: str | None = "FLASHINFER"
    gdn_prefill_backend: str | None = "triton"
    block_size: int | None = None
    mamba_ssm_cache_dtype: str | None = None  # None: not passed (vLLM's auto)
    enforce_eager: bool = True
    seed: int = 0
    # vLLM 0.27.1 leaves prefix caching off for hybrid models unless asked; the Mamba
    # cache mode then becomes 'none' and LMCache refuses the model.  Passed in every
    # arm (the cold one too, so chunking is the same everywhere).
    enable_prefix_caching: bool = True
    mamba_cache_mode: str | None = "align"
    extra_args: tuple[str, ...] = ()
    # ``python -m vllm.entrypoints.openai.api_server`` takes the model as --model; ``vllm serve``
    # as its first argument
    model_flag: bool = False
    pass_gpu_memory_utilization: bool = True  # not on CPU


def vllm_argv(prefix: Sequence[str], s: VllmSettings, kv_cfg: dict[str, Any] | None) -> list[str]:
    """``max_num_batched_tokens`` 0 (or None) leaves vLLM's default (multi-block prefill steps)."""
    argv = list(prefix) + (["--model", s.model] if s.model_flag else [s.model]) + [
        "--host", s.host, "--port", str(s.port), "--served-model-name", s.served_model_name,
        "--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--max-num-seqs", "1",
        "--tensor-parallel-size", str(s.tensor_parallel_size), "--seed", str(s.seed),
        "--generation-config", "vllm",
    ]
    if s.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    if s.pass_gpu_memory_utilization:
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if s.tokenizer:
        argv += ["--tokenizer", s.tokenizer]
    if s.attention_backend:
        argv += ["--attention-backend", s.attention_backend]
    if s.gdn_prefill_backend:
        argv += ["--gdn-prefill-backend", s.gdn_prefill_backend]
    if s.block_size:
        argv += ["--block-size", str(s.block_size)]
    if s.mamba_ssm_cache_dtype:
        argv += ["--mamba-ssm-cache-dtype", s.mamba_ssm_cache_dtype]
    if s.enforce_eager:
        argv += ["--enforce-eager"]
    if s.enable_prefix_caching:
        argv += ["--enable-prefix-caching"]
    if s.mamba_cache_mode:
        argv += ["--mamba-cache-mode", s.mamba_cache_mode]
    if kv_cfg is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_cfg, separators=(",", ":"))]
    return argv + list(s.extra_args)


@dataclass
class LMCacheSettings:
    host: str = "127.0.0.1"
    port: int = 5555
    http_port: int = 8080
    chunk_size: int = 544
    l1_size_gb: float = 8.0
    l2_dir: str = ""
    extra_args: tuple[str, ...] = ()
    transfer_mode: str | None = None  # --supported-transfer-mode (None: the server's default)
    # --l2-adapter JSON of another tier (l2_tier.RespTier.adapter_json: a shared Redis); None: fs over l2_dir
    l2_adapter: str | None = None


def lmcache_argv(prefix: Sequence[str], s: LMCacheSettings) -> list[str]:
    if not s.l2_dir and not s.l2_adapter:
        raise ValueError("the LMCache server needs an L2 directory")
    l2 = s.l2_adapter or json.dumps({"type": "fs", "base_path": s.l2_dir}, separators=(",", ":"))
    return list(prefix) + [
        "--host", s.host, "--port", str(s.port), "--http-host", s.host, "--http-port", str(s.http_port),
        "--chunk-size", str(s.chunk_size), "--l1-size-gb", str(s.l1_size_gb), "--eviction-policy", "LRU",
        "--l2-adapter", l2,
    ] + (["--supported-transfer-mode", s.transfer_mode] if s.transfer_mode else []) + list(s.extra_args)


# ---------------------------------------------------------------------------
# Log facts
# ---------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
SUBPAGED_RE = re.compile(r"group (\d+): sub-paged, k=(\d+) \(tokens_per_block=(\d+), slots_per_block=(\d+)\)"
                         r".*\[lmcache-patchtool hybrid-fa\]")
COMPRESSED_RE = re.compile(r"group (\d+): compressed \(tokens_per_block=(\d+), slots_per_block=(\d+)\)")
VLLM_BLOCK_RE = re.compile(r"Setting attention block size to (\d+) tokens")
VLLM_PADDING_RE = re.compile(r"Padding mamba page size by ([0-9.]+)%")
# vllm/platforms/cpu.py's SSM state decision (a CPU without AVX-512 BF16 logs neither line)
VLLM_SSM_RESET_RE = re.compile(r"Reset SSM cache type to float32 for accelerated GDN")
VLLM_SSM_KEPT_RE = re.compile(r"Using (float16|bfloat16) SSM state storage for the CPU accelerated GDN backend")
VLLM_BACKEND_RE = re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z_0-9]+) (?:attention )?backend")
VLLM_EXTERNAL_CONNECTOR_RE = re.compile(r"Using external LMCacheMPConnector|Creating v1 connector with name: (\w+)")
# the line an engine that refused to start leaves last: an exception, a refusal
ERROR_LINE_RE = re.compile(r"(\w+(?:Error|Exception)\b.*|.*\brefus\w*\b.*|.*does not support.*)")


def lmcache_log_facts(text: str) -> dict[str, Any]:
    text = _ANSI.sub("", text)
    sub = [{"group": int(m[0]), "k": int(m[1]), "tokens_per_block": int(m[2]), "slots_per_block": int(m[3])}
           for m in SUBPAGED_RE.findall(text)]
    comp = [{"group": int(m[0]), "tokens_per_block": int(m[1]), "slots_per_block": int(m[2])}
            for m in COMPRESSED_RE.findall(text)]
    return {"sub_paged_groups": sub, "compressed_groups": comp,
            "patch_marker_lines": text.count("[lmcache-patchtool hybrid-fa]")}


# wrappers vLLM puts around a worker's exception: never the root cause
_WRAPPER_RE = re.compile(r"initialization failed|See root cause above|check the stack trace above|EngineDeadError")
_EXC_RE = re.compile(r"\b((?:[A-Z]\w*)?(?:Error|Exception)): (.+)$")  # a bare "Exception: ..." too


_LOG_TIME = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")


def log_gap(first: str, second: str) -> float | None:
    """Seconds between two LMCache log lines by their own timestamps
    (``[YYYY-MM-DD HH:MM:SS,mmm]``); None if either has none."""
    stamps = [_LOG_TIME.search(ln) for ln in (first, second)]
    if not all(stamps):
        return None
    t = [time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000 for m in stamps]
    return round(t[1] - t[0], 3)


def last_error_line(text: str) -> str | None:
    """One line naming why a process failed (trimmed): the first exception a log records that is
    not a wrapper (vLLM re-raises a worker's error twice more), outside WARNING lines; else the
    last line naming an exception or a refusal; None when there is none."""
    lines = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    for ln in lines:
        m = _EXC_RE.search(ln)
        if m and " WARNING " not in ln and not _WRAPPER_RE.search(ln):
            return " ".join(f"{m.group(1)}: {m.group(2)}".split())[:400]
    for ln in reversed(lines):
        m = ERROR_LINE_RE.search(ln)
        if m and "Traceback" not in ln:
            return " ".join(ln.split())[:400]
    return None


_FRAME_RE = re.compile(r'File "([^"]+)", line \d+')


def lmcache_refusal(text: str) -> str | None:
    """The exception LMCache raised inside vLLM's worker when that killed the engine at a request
    (LMCache 0.5.3-0.5.5's engine-driven worker refuses a hybrid at the first store, not at
    start): the first non-wrapper exception line of the log, when the traceback frame just above
    it is in an ``lmcache`` package; None for any other failure (those stay errors)."""
    lines = [ln for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    last_frame = None
    for ln in lines:
        m = _FRAME_RE.search(ln)
        if m:
            last_frame = m.group(1)
            continue
        e = _EXC_RE.search(ln)
        if e and " WARNING " not in ln and not _WRAPPER_RE.search(ln):
            if last_frame and "/lmcache/" in last_frame:
                return " ".join(f"{e.group(1)}: {e.group(2)}".split())[:400]
            return None
    return None


def vllm_log_facts(text: str) -> dict[str, Any]:
    """What a vLLM log says: the hybrid's aligned block, the Mamba padding, the SSM state decision
    (``reset-to-float32``, ``kept-bfloat16``/``kept-float16``, or None: no line), the attention
    backends and the connector lines."""
    text = _ANSI.sub("", text)
    blocks = [int(x) for x in VLLM_BLOCK_RE.findall(text)]
    pads = [float(x) for x in VLLM_PADDING_RE.findall(text)]
    kept = VLLM_SSM_KEPT_RE.findall(text)
    ssm = "reset-to-float32" if VLLM_SSM_RESET_RE.search(text) else (f"kept-{kept[-1]}" if kept else None)
    backends = sorted(set(VLLM_BACKEND_RE.findall(text)))
    return {"attention_block_size": blocks[-1] if blocks else None,
            "mamba_padding_pct": pads[-1] if pads else None, "ssm_state_decision": ssm,
            "attention_backends_logged": backends,
            "connector_lines": [m.group(0) for m in VLLM_EXTERNAL_CONNECTOR_RE.finditer(text)][:4]}
