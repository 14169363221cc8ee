"""The engine restore gate over a shared Redis tier (LMCache's ``resp`` adapter).

Node A (a vLLM engine for CPU and its LMCache server) answers and stores the prompt into a
``redis-server`` the test starts on 127.0.0.1; both processes are SIGKILLed; node B (a new engine
and a new server: nothing shared with node A but Redis) answers the same prompt from the tier. The
verdict is the fs gate's: greedy tokens and logprobs identical to the warm reference, external hit
tokens >= 95 % of the ideal, the engine healthy after. Patched 0.5.6 stacked (hybrid-fa +
engine-driven), the tiny hybrid with multi-block prefill steps. Every key on the tier must be
sealed (part 17): the store went through the patched adapter, not around it.

CI runs the restore across nodes in the CPU geometry this machine does not pick by itself (the SSM
state dtype asked for explicitly: block 384 on a CPU with AVX-512 BF16, 640 on one without), so CI
covers both geometries with test_engine_gate.py's fs cell; the damaged-value cell (like the fs
tier's damage cells) needs LMCACHE_PATCHTOOL_FULL=1.
"""

from __future__ import annotations

import sys

from .conftest import REPO, STACK, overlay, run_gate
from .test_engine_gate import OTHER_STATE, _passes, _ran_on, full_only

sys.path.insert(0, str(REPO / "tests"))
from _redis import running_redis
def test_node_b_answers_from_node_a_stores_on_redis(tmp_path, engine_python, hybrid_model):
    with running_redis(tmp_path) as redis:
        rc, result, err = run_gate(engine_python, hybrid_model, tmp_path, "--lengths", "3k", "--no-cold-arm",
                                   "--max-num-batched-tokens", "0", "--redis-url", redis.url,
                                   "--mamba-ssm-cache-dtype", OTHER_STATE,
                                   "--lmcache-overlay", str(overlay("0.5.6", STACK)))
        keys = [k.decode() for k in redis.client().scan_iter(count=1000)]
    _passes(rc, result, err)
    _ran_on(result, OTHER_STATE, OTHER_STATE)
    assert result["config"]["redis_url"] == redis.url
    assert keys and all(k.startswith("lmcptsum1@") for k in keys), keys[:3]
    assert result["flush"]["main"]["files"] == len(keys)  # what the store arm flushed is what Redis holds


# One byte flipped in the middle of the KV bytes of every attention object (group 1) on the tier,
# between the arms: run by the gate with $GATE_REDIS_URL, in the engine venv (redis-py).
FLIP_ATTENTION = (
    "import os, redis; r = redis.Redis.from_url(os.environ['GATE_REDIS_URL']); n = 0\n"
    "for k in r.scan_iter():\n"
    "    if k.removeprefix(b'lmcptsum1@').split(b'@')[2] != b'1': continue\n"
    "    at = (r.strlen(k) - (64 if k.startswith(b'lmcptsum1@') else 0)) // 2\n"
    "    r.setrange(k, at, bytes([r.getrange(k, at, at)[0] ^ 0xFF])); n += 1\n"
    "print(f'flipped one byte in {n} attention objects'); raise SystemExit(0 if n else 1)\n")


@full_only
def test_damaged_redis_values_are_misses_with_the_right_answer(tmp_path, engine_python, hybrid_model):
    """A value damaged inside Redis between node A's store and node B's restore is a miss (the
    seal, part 17): the gate fails on the hit count alone, and node B's answer is still the
    reference's. Without 17-resp-checksum (LMCACHE_PATCHTOOL_EXCLUDE_PATCH=17-resp-checksum) the
    damaged attention is served and the answer check fails too."""
    import os
    import shlex

    skip = {s for s in os.environ.get("LMCACHE_PATCHTOOL_EXCLUDE_PATCH", "").split(",") if s}
    stack = overlay("0.5.6", STACK) if not skip else _overlay_without("0.5.6", skip)
    cmd = f"{engine_python} -c {shlex.quote(FLIP_ATTENTION)}"
    with running_redis(tmp_path) as redis:
        rc, result, err = run_gate(engine_python, hybrid_model, tmp_path, "--lengths", "3k", "--no-cold-arm",
                                   "--max-num-batched-tokens", "0", "--redis-url", redis.url,
                                   "--between-arms-cmd", cmd, "--lmcache-overlay", str(stack))
    reasons = (result.get("verdict") or {}).get("reasons") or []
    assert rc == 20 and result["verdict"]["status"] == "fail", (result.get("verdict"), err[-2000:])
    assert any(r.startswith("external_hits") for r in reasons), reasons
    assert not any(r.startswith("restore_matches_warm") for r in reasons), reasons


def _overlay_without(version: str, skip: set[str]):
    from .conftest import provision, series

    return provision.overlay(version, [p for p in series(version, STACK) if p.stem not in skip])
