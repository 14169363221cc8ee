"""The engine gate's extra requests (engine_scenarios.py): where the mid-step follow-up's shared
prefix ends, how a follow-up and a server restart are judged, and the verdict they feed."""

from __future__ import annotations

from gate import engine_scenarios as es
from gate import engine_verdict as gv


def test_mid_step_point_lies_inside_a_step_after_a_step_end():
    # vLLM for CPU: 2048-token budget, block and chunk 640 -> steps of 1920
    p = es.mid_step_point(7681, chunk=640, step=es.step_tokens(2048, 640))
    assert (p.step_end, p.boundary, p.inside_step) == (3840, 4480, True)
    assert p.boundary < p.m < p.boundary + 640 and p.step_end < p.boundary < p.step_end + 1920
    # shorter than two steps: the boundary is inside the first step, no true state before it
    q = es.mid_step_point(2561, chunk=640, step=1920)
    assert (q.step_end, q.boundary, q.inside_step) == (0, 640, True)
    # one block per step: every chunk boundary is a step end (said, not hidden)
    r = es.mid_step_point(7681, chunk=640, step=640)
    assert r.inside_step is False and r.boundary % 640 == 0
    assert es.mid_step_point(7681, chunk=640, step=None).inside_step is None


def _entry(tokens, lps, *, ext=0.0, loc=0.0):
    return {"token_ids": tokens, "token_logprobs": lps, "top_logprobs": [{str(t): lp} for t, lp in zip(tokens, lps)],
            "vllm_delta": {"external_hits": ext, "local_hits": loc}}


def _checks(ref, restored):
    return {n: ok for n, ok, _, _ in es.followup_checks("mid-step", ref, restored, tol=0.0, hit_min=0.95,
                                                        compare=gv.compare_outputs)}


def test_followup_judged_against_the_store_engines_own_prefix_hit():
    ref = _entry([1, 2, 3], [-0.5, -0.25, -1.0], loc=3840)
    assert _checks(ref, _entry([1, 2, 3], [-0.5, -0.25, -1.0], ext=3840)) == {"mid-step_answer": True,
                                                                                "mid-step_hits": True}
    # a wrong state shows in the logprobs even when the greedy tokens agree
    assert _checks(ref, _entry([1, 2, 3], [-0.5, -0.26, -1.0], ext=3840))["mid-step_answer"] is False
    # more hit tokens than the states vLLM had: a state that never existed was served
    assert _checks(ref, _entry([1, 2, 3], [-0.5, -0.25, -1.0], ext=4480))["mid-step_hits"] is False
    # too few
    assert _checks(ref, _entry([1, 2, 3], [-0.5, -0.25, -1.0], ext=1920))["mid-step_hits"] is False
    # served by the restored engine's own prefix cache: LMCache not exercised, not a pass
    assert _checks(ref, _entry([1, 2, 3], [-0.5, -0.25, -1.0], loc=3840))["mid-step_hits"] is None
    # no true state before the boundary: 0 hits is right
    assert _checks(_entry([1], [-0.5]), _entry([1], [-0.5]))["mid-step_hits"] is True


def test_server_restart_outcomes():
    ok_ask = {"what": "stored prompt", "phase": "after", "ideal_hits": 1280, "external_hits": 1280, "answer_ok": True}
    rec = {"asks": [ok_ask], "stores_after": {"ok": True, "detail": "2 new"}, "health": {"ok": True}}
    assert es.server_restart_outcome(rec, hit_min=0.95)[0] == "recovered"
    assert es.server_restart_outcome(rec | {"asks": [ok_ask | {"external_hits": 0}]}, hit_min=0.95)[0] == "lost-hits"
    assert es.server_restart_outcome(rec | {"stores_after": {"ok": False}}, hit_min=0.95)[0] == "stores-lost"
    assert es.server_restart_outcome(rec | {"asks": [ok_ask | {"answer_ok": False}]}, hit_min=0.95)[0] == "wrong"
    assert es.server_restart_outcome(rec | {"health": {"ok": False}}, hit_min=0.95)[0] == "errors"
    err = {"what": "stored prompt", "phase": "after", "error": "HTTP 500"}
    assert es.server_restart_outcome(rec | {"asks": [err]}, hit_min=0.95)[0] == "errors"


def test_added_objects():
    before = {"a": (1, "x"), "b": (2, "y")}
    assert es.added_objects(before, before | {"c": (3, "z")}) == (["c"], [])
    assert es.added_objects(before, {"a": (1, "x"), "b": (2, "q")}) == ([], ["b"])


def test_verdict_fails_on_a_wrong_followup_and_a_lost_server():
    """The extra checks reach the verdict: a follow-up whose restored answer differs fails it, and so
    does a server restart after which the stored prompt no longer hits."""
    ref = _entry([1, 2], [-0.5, -0.25], loc=640)
    arms = {"store_followup": {"mid-step": ref}, "restore": {"mid-step": _entry([1, 3], [-0.5, -0.25], ext=640)}}
    rec = {"extras": {"mid-step": {"kind": "followup"}}}
    checks = {c.name: c.ok for c in gv.extra_checks(rec, arms, 0.0, 0.95)}
    assert checks["mid-step_answer"] is False
    lost = {"asks": [{"what": "stored prompt", "phase": "after", "ideal_hits": 640, "external_hits": 0,
                      "answer_ok": True}], "stores_after": {"ok": True}, "health": {"ok": True}}
    checks = {c.name: c.ok for c in gv.extra_checks({"server_restart": lost}, {}, 0.0, 0.95)}
    assert checks["server_restart_recovers"] is False


def _lp(tokens, rows):
    return {"token_ids": tokens, "top_logprobs": [{f"token_id:{t}": lp for t, lp in row.items()} for row in rows]}


def test_compare_close_lets_tokens_part_only_at_a_near_tie():
    ref = _lp([5, 7, 9], [{5: -0.10, 6: -2.0}, {7: -1.000, 8: -1.010}, {9: -0.5, 1: -3.0}])
    near = _lp([5, 8, 2], [{5: -0.11, 6: -2.0}, {7: -1.012, 8: -1.005}, {2: -0.1, 9: -4.0}])
    ok, why, worst = es.compare_close(ref, near, 0.05)
    assert ok and "near-tie" in why and worst <= 0.05, why
    far = _lp([5, 8, 2], [{5: -0.11, 6: -2.0}, {7: -1.5, 8: -0.4}, {2: -0.1, 9: -4.0}])
    ref_far = _lp([5, 7, 9], [{5: -0.10, 6: -2.0}, {7: -0.4, 8: -1.5}, {9: -0.5, 1: -3.0}])
    assert es.compare_close(ref_far, far, 0.05)[0] is False
    # the other side's token is not even in the reference's top-k: no near-tie, whatever the rest says
    unseen = _lp([5, 3, 2], [{5: -0.11, 6: -2.0}, {3: -0.9, 7: -1.0, 8: -1.01}, {2: -0.1}])
    assert es.compare_close(ref, unseen, 0.05)[0] is False
    drift = _lp([5, 7, 9], [{5: -0.30, 6: -2.0}, {7: -1.0, 8: -1.01}, {9: -0.5, 1: -3.0}])
    assert es.compare_close(ref, drift, 0.05)[0] is False  # the first token moved by 0.2


def test_followup_true_state_against_the_from_scratch_answer():
    ref = _entry([1, 2], [-0.5, -0.25], ext=8320)
    restored = _entry([1, 2], [-0.5, -0.25], ext=8320)
    scratch = _entry([1, 2], [-0.503, -0.251])
    got = {n: ok for n, ok, _, _ in es.followup_checks("mid-step", ref, restored, tol=0.0, hit_min=0.95,
                                                       compare=gv.compare_outputs, scratch=scratch)}
    assert got == {"mid-step_answer": True, "mid-step_true_state": True, "mid-step_hits": True}
    wrong = _entry([1, 2], [-1.7, -0.25])  # a stale state: the restore and its reference agree, the truth not
    got = {n: ok for n, ok, _, _ in es.followup_checks("mid-step", ref, restored, tol=0.0, hit_min=0.95,
                                                       compare=gv.compare_outputs, scratch=wrong)}
    assert got["mid-step_true_state"] is False
    salted_hit = _entry([1, 2], [-0.5, -0.25], loc=640)
    got = {n: ok for n, ok, _, _ in es.followup_checks("mid-step", ref, restored, tol=0.0, hit_min=0.95,
                                                       compare=gv.compare_outputs, scratch=salted_hit)}
    assert got["mid-step_true_state"] is None
