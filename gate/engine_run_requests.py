"""The engine gate's requests to a running engine: one prompt with its metric deltas, the
wait for LMCache's L2 stores to be flushed, the health check.

Owns ``RunRequests`` for ``GateRun`` (gate/engine_gate.py); the arms
(``engine_run_steps``) call it."""

from __future__ import annotations

import time
from typing import Any

from gate import engine_client as client
from gate import engine_metrics as gm
from gate import engine_prompt as gp
from gate import engine_servers as gs
from gate.engine_run_env import RunEnv
from gate.engine_run_state import EngineRefused, GateAbort
from gate.l2_tier import RespTier, files_under  # stdlib; redis-py only when used


class RunRequests(RunEnv):
    """Asking the engine, reading the servers' metrics, waiting for the L2 flush."""

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
                found = files_under(l2_dir)  # a .tmp renamed meanwhile is skipped
                files, size = list(found), sum(found.values())
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
