"""After the LMCache server is restarted alone, the gate asks the stored prompt
only once the engine's *worker* has re-registered its KV caches.

The scheduler side of the connector has its own heartbeat and can log
"resuming normal operation" first; a lookup sent in that window reaches a
server with no KV context for the model and misses once.  Measured through
the real engine on patched 0.5.5: the scheduler resumed 0.76 s before the
worker re-registered, the gate asked in between, and the stored prompt got 0
of 1,280 tokens although every later lookup hit.  The gate waits for the
worker's line and records the window (``scheduler_ahead_s``) from the log's
own timestamps.

The other order happens too.  Measured through the real engine on stacked
0.5.6 (2026-12-06): the worker re-registered at 33.506 s and resumed, the
scheduler resumed only at 34.734 s, the gate asked in between, and the
scheduler, still in degraded mode, sent no lookup: 0 of 1,280 tokens.  Each
side that logs "entering degraded mode" logs "resuming normal operation" when
it is back, so the gate also waits for as many resumes as degraded entries."""

from __future__ import annotations

import time

import engine_gate_cli as engine_gate

SCHED = ("[2026-12-02 11:26:33,515] LMCache WARNING: LMCache server is healthy again \u2014 resuming normal "
         "operation (vllm_multi_process_adapter.py:543:lmcache.integration.vllm.vllm_multi_process_adapter)")
WORKER = ("[2026-12-02 11:26:34,273] LMCache WARNING: Finished re-registering KV caches after server recovery "
          "(vllm_multi_process_adapter.py:1567:lmcache.integration.vllm.vllm_multi_process_adapter)")


class GrowingLog:
    """A vLLM log that gains one line per read (what the engine writes while the gate polls)."""

    def __init__(self, lines: list[str]) -> None:
        self.lines, self.reads = lines, 0

    def log_text(self) -> str:
        self.reads += 1
        return "\n".join(self.lines[: self.reads])

    def alive(self) -> bool:
        return True


def _gate(timeout: float) -> engine_gate.GateRun:
    run = engine_gate.GateRun.__new__(engine_gate.GateRun)  # only cfg is read by _wait_recovery
    run.cfg = engine_gate.GateConfig(model="/m", server_recover_timeout=timeout)
    return run


def test_waits_for_the_worker_not_the_scheduler() -> None:
    log = GrowingLog(["INFO unrelated", SCHED, "INFO unrelated", WORKER])
    rec = _gate(30.0)._wait_recovery(log, 0, 0.0)
    assert log.reads == 4  # did not stop at the scheduler's line (read 2)
    assert rec["recovered_line"] and rec["resumed_line"]
    assert rec["scheduler_ahead_s"] == 0.758


DEGRADED = ("[2026-12-06 23:10:20,110] LMCache WARNING: LMCache server is unhealthy \u2014 entering degraded mode "
            "(vllm_multi_process_adapter.py:614:lmcache.integration.vllm.vllm_multi_process_adapter)")
WORKER_056 = ("[2026-12-06 23:10:33,506] LMCache WARNING: Finished re-registering KV caches after server recovery "
              "(vllm_multi_process_adapter.py:1751:lmcache.integration.vllm.vllm_multi_process_adapter)")
WORKER_RESUMED = ("[2026-12-06 23:10:33,506] LMCache WARNING: LMCache server is healthy again \u2014 resuming normal "
                  "operation (vllm_multi_process_adapter.py:608:lmcache.integration.vllm.vllm_multi_process_adapter)")
SCHED_LATE = ("[2026-12-06 23:10:34,734] LMCache WARNING: LMCache server is healthy again \u2014 resuming normal "
              "operation (vllm_multi_process_adapter.py:608:lmcache.integration.vllm.vllm_multi_process_adapter)")


def test_waits_for_the_scheduler_when_the_worker_resumes_first() -> None:
    """Both sides went degraded; the worker re-registers and resumes, the scheduler resumes 1.2 s
    later (the real engine's log lines of 2026-12-06): the gate waits for the second resume."""
    log = GrowingLog([DEGRADED, DEGRADED.replace("20,110", "24,731"), WORKER_056, WORKER_RESUMED,
                      "INFO unrelated", SCHED_LATE])
    rec = _gate(30.0)._wait_recovery(log, 0, 0.0)
    assert log.reads == 6  # not at the worker's own resume (read 4)
    assert rec["recovered_line"] and rec["resumed_lines"] == 2 and rec["degraded_lines"] == 2
    assert rec["scheduler_ahead_s"] == 0.0 and rec["last_resume_after_register_s"] == 1.228


def test_a_side_that_never_resumes_is_waited_for_until_the_deadline() -> None:
    t0 = time.monotonic()
    rec = _gate(0.5)._wait_recovery(GrowingLog([DEGRADED, DEGRADED, WORKER_056, WORKER_RESUMED]), 0, 0.0)
    assert time.monotonic() - t0 >= 0.5  # it kept polling for the second side
    assert rec["recovered_line"] and rec["resumed_lines"] == 1 and rec["degraded_lines"] == 2


def test_no_worker_line_is_not_recovered() -> None:
    rec = _gate(0.5)._wait_recovery(GrowingLog([SCHED]), 0, 0.0)
    assert rec["recovered_line"] is False and rec["resumed_line"] is True
    assert rec["scheduler_ahead_s"] is None


def test_connector_config_reaches_the_connector() -> None:
    """``--connector-config`` bounds the connector's waits in the engine tests (the MQ timeout a
    lookup sent during an outage waits without a scheduler heartbeat)."""
    ns = engine_gate.build_parser().parse_args(["--model", "/m", "--connector-config", "lmcache.mp.mq_timeout=30",
                                            "--connector-config", "lmcache.mp.name=abc"])
    cfg = engine_gate.config_from_args(ns)
    assert cfg.connector_config == {"lmcache.mp.mq_timeout": 30, "lmcache.mp.name": "abc"}
