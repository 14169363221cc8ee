"""The CPU restore gate (gate/restore_gate.py), run as a subprocess in the
runtime venv against the real ``lmcache server``.

* pristine 0.5.3: every sub-paged preset FAILS (FA fidelity reported, GDN
  intact, chunks still found on L2 after the restart: the silent corruption),
  the k=1 control PASSES;
* patched 0.5.3: every preset passes (skips until the patch series exists);
* failure paths: a server that never gets ready is an ERROR (exit 2), and an
  interrupted gate stops its servers and removes its temp dirs and memory.

The fast tier runs one pristine sub-paged preset and the control (one server
pair, ~30 s on a 2-CPU box); the rest is ``slow``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GATE = REPO / "gate" / "restore_gate.py"

from gate import restore_plan, restore_server  # stdlib only: no torch

SUBPAGED = ["qwen35-0.8b", "gdn-27b", "pure-attn-bs128"]
# One server pair takes ~25-45 s on an idle 2-CPU box (two server boots of ~8 s
# each dominate); the bound only catches hangs on a shared, loaded machine.
MAX_SECONDS = 180


def run_gate(python: Path, overlay: Path, presets: list[str], *extra: str, timeout: float = 300):
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1")
    argv = [str(python), str(GATE), "--json"] + [a for p in presets for a in ("--preset", p)] + list(extra)
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))
    took = time.monotonic() - t0
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"no JSON report (rc {proc.returncode})\nstdout:\n{proc.stdout[-3000:]}\n"
                    f"stderr:\n{proc.stderr[-5000:]}")
    return proc, report, took


def by_preset(report: dict) -> dict[str, dict]:
    return {p["preset"]: p for p in report["presets"]}


def assert_cleaned_up(report: dict) -> None:
    """Every server gone, its L1 segment removed, the temp dirs removed."""
    assert report["cleanup_errors"] == []
    for cycle in report["cycles"]:
        assert not Path(cycle["workdir"]).exists()
        for server in cycle["servers"]:
            pid = server["pid"]
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
            assert not restore_server.l1_shm_path(pid).exists()


def assert_silent_corruption(p: dict, chunks: int = 3) -> None:
    """The 0.5.3 signature: stored, found on disk after the restart, FA wrong."""
    assert p["verdict"] == "fail", p["reasons"]
    assert p["stored"]["ok"] and p["on_disk"]["objects"] == chunks
    assert p["on_disk"]["fraction_of_full"] < 1.0  # 1/k of the FA bytes reach the disk
    ar = p["after_restart"]
    assert ar["chunks_found"] == chunks and ar["l2_hits"] == chunks and ar["l1_hits"] == 0
    assert p["restored"]["retrieve"]["ok"] is True  # the server reports success...
    fa = p["fidelity"]["fa"]
    assert fa["pages_total"] > 0 and fa["pages_exact"] < fa["pages_total"]  # ...but the FA bytes are wrong
    assert 0.0 <= fa["pages_fraction"] < 1.0 and fa["byte_fraction"] < 1.0
    if p["geometry"]["num_gdn_layers"]:
        assert p["fidelity"]["gdn"]["blocks_fraction"] == 1.0  # GDN survives intact
    assert p["foreign_writes"]["bytes"] > 0  # and other blocks were overwritten
    assert any("wrong FA bytes" in r for r in p["reasons"])


def assert_clean_pass(p: dict, chunks: int = 3) -> None:
    assert p["verdict"] == "pass", p["reasons"]
    ar = p["after_restart"]
    assert ar["chunks_found"] == chunks and ar["l2_hits"] > 0
    assert p["restored"]["chunks_restored_exact"] == chunks
    assert p["fidelity"]["fa"]["pages_fraction"] == 1.0
    if p["fidelity"]["gdn"]:
        assert p["fidelity"]["gdn"]["blocks_fraction"] == 1.0
    assert p["foreign_writes"]["bytes"] == 0
    assert p["block_ids"]["store"] != p["block_ids"]["retrieve"]


# ---------------------------------------------------------------------------
# pure-Python pieces (no venv needed)
# ---------------------------------------------------------------------------


def test_prefetch_split_parses_the_servers_l1_l2_account() -> None:
    log = ("\x1b[32;20m[2026-01-01 00:00:00,000] LMCache INFO:\x1b[0m Prefetch request completed (L1+L2): "
           "4/4 retained keys (1 L1, 3 L2) in 12.3 ms (external_request_id=gate-restore-abc, "
           "prefetch_request_id=7) \x1b[3m(storage_manager.py:718:x)\x1b[0m\n")
    from gate import procs  # noqa: PLC0415

    assert restore_server.prefetch_split(procs.ansi_strip(log), "gate-restore-abc") == \
        {"keys_hit": 4, "keys_requested": 4, "l1": 1, "l2": 3}
    assert restore_server.prefetch_split(procs.ansi_strip(log), "other") is None


def test_cycles_group_presets_by_chunk_size() -> None:
    cycles = restore_plan.plan_cycles(["qwen35-0.8b", "gdn-27b", "control-k1", "pure-attn-bs128"], 2, None)
    assert cycles == [(1088, ["qwen35-0.8b", "control-k1"]), (3200, ["gdn-27b"]), (256, ["pure-attn-bs128"])]
    with pytest.raises(SystemExit):
        restore_plan.plan_cycles(["gdn-27b"], 2, 1000)


def test_server_command_line_binds_loopback_only(tmp_path: Path) -> None:
    spec = restore_server.ServerSpec(5555, 8080, 1088, 1.0, tmp_path / "l2", tmp_path)
    argv = spec.argv()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--http-host") + 1] == "127.0.0.1"
    assert json.loads(argv[argv.index("--l2-adapter") + 1]) == {"type": "fs", "base_path": str(tmp_path / "l2")}
    assert argv[argv.index("--supported-transfer-mode") + 1] == "lmcache_driven"


def test_unknown_preset_is_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, str(GATE), "--preset", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown geometry preset" in proc.stderr


# ---------------------------------------------------------------------------
# the real server: pristine 0.5.3
# ---------------------------------------------------------------------------


def test_client_malloc_perturb_fills_new_memory_and_refuses_a_non_byte() -> None:
    """--client-malloc-perturb: after it, this process's new heap memory holds
    BYTE ^ 0xff (what the engine-driven identity check relies on: a byte no
    transfer writes is then never zero by chance); 0 or 256 is refused in
    one line before anything starts."""
    probe = (
        "import ctypes, sys; from gate import restore_gate\n"
        "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p\n"
        "restore_gate.malloc_perturb(0x5A)\n"
        "p = libc.malloc(8 << 20)\n"
        "print(set(ctypes.string_at(p, 8 << 20)))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "{165}"  # 0xA5 in every byte of an 8 MiB block
    for bad in ("0", "256"):
        r = subprocess.run([sys.executable, str(GATE), "--client-malloc-perturb", bad, "--preset",
                            "qwen35-0.8b"], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert r.stderr.strip().splitlines() == [
            f"restore_gate.py: --client-malloc-perturb {int(bad)}: give a byte 1..255"]


def test_pristine_053_subpaged_fails_and_k1_passes(runtime_python_053: Path, pristine_overlay_053: Path) -> None:
    proc, report, took = run_gate(runtime_python_053, pristine_overlay_053, ["qwen35-0.8b", "control-k1"])
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert report["verdict"] == "fail" and report["exit_code"] == 1
    assert report["versions"]["lmcache"] == "0.5.3"
    assert report["versions"]["lmcache_dir"] == str(pristine_overlay_053)
    assert report["server"]["lmcache_dir"] == str(pristine_overlay_053)  # the server ran the same tree
    assert "lmcache" in report["server"]["argv"][1] and "server" in report["server"]["argv"]
    presets = by_preset(report)
    assert_silent_corruption(presets["qwen35-0.8b"])
    assert presets["qwen35-0.8b"]["fidelity"]["fa"]["pages_exact"] == 0  # realistic ids: no page lands right
    assert_clean_pass(presets["control-k1"])
    for phase in ("server_start_1", "store", "flush_to_disk", "kill", "server_start_2", "restore", "total"):
        assert report["timings"][phase] >= 0
    kill = report["cycles"][0]["servers"][0]["kill"]
    assert kill["signal"] == "SIGKILL" and kill["returncode"] == -9 and kill["group_gone"]
    assert kill["l1_shm_left_by_kill"] and kill["l1_shm_removed"]
    # stay-alive arm (default 10 s heartbeat): reported, never part of the verdict; whichever way
    # the heartbeat fell, hits after the restart need a re-registration with the new server
    for name in ("qwen35-0.8b", "control-k1"):
        sa = presets[name]["stay_alive"]
        assert sa["ran"] and sa["heartbeat_interval_s"] == 10.0 and "summary" in sa
        assert sa["reregistered_with_new_server"] or sa["lookup_hit_tokens"] == 0
    assert_cleaned_up(report)
    assert "restore gate: FAIL" in proc.stderr and "qwen35-0.8b" in proc.stderr
    assert took < MAX_SECONDS


@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for p in SUBPAGED if p != "qwen35-0.8b"])
def test_pristine_053_fails_other_subpaged_presets(runtime_python_053: Path, pristine_overlay_053: Path,
                                                   preset: str) -> None:
    proc, report, took = run_gate(runtime_python_053, pristine_overlay_053, [preset])
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert_silent_corruption(by_preset(report)[preset])
    assert_cleaned_up(report)
    assert took < MAX_SECONDS


@pytest.mark.slow
@pytest.mark.parametrize("heartbeat", [60.0, 1.0])
def test_pristine_053_stay_alive_worker(runtime_python_053: Path, pristine_overlay_053: Path,
                                        heartbeat: float) -> None:
    """The optional arm, made deterministic by the heartbeat interval.

    60 s (longer than the whole restart): the live worker's heartbeat never sees
    the outage, it never re-registers, and every lookup after the restart is a
    miss -- what 0.5.3 does with its default 10 s heartbeat whenever the ping
    in flight is answered by the new server.  1 s: the heartbeat sees the
    outage, re-registers on recovery, and the worker gets its chunks back.
    Neither outcome changes the verdict.
    """
    proc, report, _ = run_gate(runtime_python_053, pristine_overlay_053, ["control-k1"],
                               "--heartbeat-interval", str(heartbeat))
    assert proc.returncode == 0, proc.stderr[-4000:]
    p = by_preset(report)["control-k1"]
    sa = p["stay_alive"]
    assert sa["ran"] and sa["heartbeat_interval_s"] == heartbeat and p["verdict"] == "pass"
    if heartbeat > 30:
        assert sa["worker_healthy"] and not sa["reregistered_with_new_server"]
        assert sa["lookup_hit_tokens"] == 0 and "never re-registered" in sa["summary"]
    else:
        assert sa["reregistered_with_new_server"] and sa["chunks_found"] == 3
        assert sa["chunks_restored_exact"] == 3 and sa["foreign_writes"] == 0


# ---------------------------------------------------------------------------
# the real server: patched 0.5.3
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("presets", [["qwen35-0.8b", "control-k1"], ["gdn-27b"], ["pure-attn-bs128"]],
                         ids=lambda p: "+".join(p))
def test_patched_053_passes_every_preset(runtime_python_053: Path, patched_overlay_053: Path,
                                         presets: list[str]) -> None:
    proc, report, took = run_gate(runtime_python_053, patched_overlay_053, presets)
    assert proc.returncode == 0, json.dumps([p["reasons"] for p in report["presets"]]) + proc.stderr[-4000:]
    assert report["verdict"] == "pass"
    assert report["server"]["lmcache_dir"] == str(patched_overlay_053)
    for name in presets:
        assert_clean_pass(by_preset(report)[name])
        on_disk = by_preset(report)[name]["on_disk"]
        # one full-fidelity object per chunk, or (a hybrid, part 19) its GDN state
        # and its attention as two objects that together hold every byte
        assert sum(on_disk["object_bytes"]) == on_disk["full_fidelity_object_bytes"], on_disk
    assert_cleaned_up(report)
    assert took < MAX_SECONDS


# ---------------------------------------------------------------------------
# failure paths
# ---------------------------------------------------------------------------


def test_server_never_ready_is_an_error(runtime_python_053: Path, pristine_overlay_053: Path) -> None:
    """Server A's 0.5 s start on the clock overlaps the client's torch import (gate.run), so on a
    loaded machine A can be up in time and server B (no import to hide behind) is the one that
    misses it; a cold CI run under pytest-xdist met that once.  Either is this error."""
    proc, report, _ = run_gate(runtime_python_053, pristine_overlay_053, ["control-k1"], "--server-timeout", "0.5")
    assert proc.returncode == 2
    assert report["verdict"] == "error" and re.match(r"server [AB] did not start: ", report["reason"]), \
        report["reason"]
    assert [p["verdict"] for p in report["presets"]] == ["error"]  # no preset got a pass/fail verdict
    assert report["cycles"][-1]["servers"][-1]["returncode"] is not None  # the unready server was killed
    assert_cleaned_up(report)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_gate_cleans_up(runtime_python_053: Path, pristine_overlay_053: Path, sig: int) -> None:
    env = dict(os.environ, PYTHONPATH=f"{pristine_overlay_053}:{REPO}", NO_COLOR="1")
    gate = subprocess.Popen([str(runtime_python_053), str(GATE), "--json", "--preset", "control-k1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen = []
    try:
        for line in gate.stderr:  # progress lines arrive as they happen
            seen.append(line)
            if "server A up" in line:
                break
        gate.send_signal(sig)
        out, err = gate.communicate(timeout=60)
    finally:
        if gate.poll() is None:
            gate.kill()
    report = json.loads(out)
    assert gate.returncode == 2 and report["verdict"] == "error" and "interrupted" in report["reason"]
    assert_cleaned_up(report)
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"lmcache-restore-gate-client-{gate.pid}.log"))
