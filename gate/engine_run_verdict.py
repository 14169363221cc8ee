"""The engine gate's verdict and result: what ``engine_verdict.evaluate`` is given, and the
result JSON (``SCHEMA``) with its TTFT table, summary and extra requests.

Owns ``RunVerdict`` for ``GateRun`` (gate/engine_gate.py): the VERDICT state and
``result()``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gate import engine_prompt as gp
from gate import engine_scenarios as es
from gate import engine_verdict as gv
from gate.engine_run_env import RunStops

SCHEMA = "lmcache-patchtool/engine-gate/1"


class RunVerdict(RunStops):
    """The VERDICT state (its input assembled from the arms) and the result JSON."""

    def s_verdict(self) -> None:
        for role in ("store", "restore", "control_store", "control_restore"):
            if role not in self.logs and f"lmcache-{role}" in self.procs:
                self._collect_logs(role)
        rec = self.verdict_input()
        self.verdict = gv.evaluate(rec)
        self.note("VERDICT", self.verdict.status, reasons=self.verdict.reasons[:6])

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

    # result ------------------------------------------------------------------
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
