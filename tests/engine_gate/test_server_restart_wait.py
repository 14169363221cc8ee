"""After the LMCache server is restarted alone, the gate asks the stored prompt
only once the engine's *worker* has re-registered its KV caches.

The scheduler side of the connector has its own heartbeat and can log
"resuming normal operation" first; a lookup sent in that window reaches a
server with no KV context for the model and misses once.  Measured through
the real engine on patched 0.5.5: the scheduler resumed 0.76 s before the
worker re-registered, the gate asked in between, and the stored prompt got 0
of 1,280 tokens although every later lookup hit.  The gate waits for the
worker's line and records the window (``scheduler_ahead_s``) from the log's
own timestamps."""

from __future__ import annotations

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
