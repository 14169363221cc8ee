"""Marker-based process discovery, nvidia-smi parsing, environment probe."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from pathlib import Path

from gate import engine_system as gsys

STANDINS = Path(__file__).resolve().parents[1] / "standins"
SMI = [sys.executable, str(STANDINS / "fake_nvidia_smi.py")]


def test_marked_processes_found_even_outside_the_group_and_killed():
    run = uuid.uuid4().hex
    env = dict(os.environ, **{gsys.MARKER_ENV: run})
    # a child that leaves its session/process group, like a detached EngineCore
    p = subprocess.Popen([sys.executable, "-c", "import os,time; os.setsid(); time.sleep(60)"], env=env)
    try:
        deadline = time.monotonic() + 5
        while not gsys.marked_pids(run) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = gsys.marked_pids(run)
        assert [f["pid"] for f in found] == [p.pid]
        assert gsys.marked_pids(run + "x") == []  # exact marker value only
        killed = gsys.kill_marked(run, timeout=5)
        p.wait(timeout=5)
        assert [k["pid"] for k in killed] == [p.pid] and gsys.marked_pids(run) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_query_gpus_with_stand_in(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_GPU_STATE", str(tmp_path))
    monkeypatch.setenv("FAKE_GPU_BASE_MIB", "700")
    (tmp_path / str(os.getpid())).write_text("1234")
    st = gsys.query_gpus(SMI)
    assert st.ok and st.gpus[0]["used_mib"] == 700 + 1234 and st.gpus[0]["total_mib"] == 143771
    assert st.apps == [{"pid": os.getpid(), "used_mib": 1234}]
    assert st.used([0]) == 1934 and st.used([1]) == 0
    monkeypatch.setenv("FAKE_SMI_FAIL", "1")
    st = gsys.query_gpus(SMI)
    assert not st.ok and "couldn't communicate" in st.error
    assert not gsys.query_gpus(["/nonexistent/nvidia-smi"]).ok


def test_visible_gpu_indices():
    assert gsys.visible_gpu_indices({"CUDA_VISIBLE_DEVICES": "1,3"}) == [1, 3]
    assert gsys.visible_gpu_indices({"CUDA_VISIBLE_DEVICES": "GPU-abc"}) is None
    assert gsys.visible_gpu_indices({}) is None


def test_probe_environment_without_torch_or_lmcache():
    info = gsys.probe_environment(sys.executable)
    assert "packages" in info and info["packages"]["vllm"] is None
    assert info["lmcache_files_sha256"] == {}
    assert "torch_error" in info or "torch_cuda" not in info or info.get("cuda_available") is False
    assert "error" in gsys.probe_environment("/nonexistent/python")


def test_shared_memory_of_killed_processes_is_removed(tmp_path):
    """A SIGKILLed worker cleans up none of its /dev/shm files (LMCache's shared-memory KV cache is
    GiBs): the gate reads what the processes map before the kill and unlinks what nothing maps after."""
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415
    import uuid  # noqa: PLC0415

    from gate import engine_system as gsys  # noqa: PLC0415

    path = f"/dev/shm/gate-test-{uuid.uuid4().hex}"
    with open(path, "wb") as fh:
        fh.truncate(1 << 16)
    code = (f"import mmap,sys,time; f=open({path!r},'r+b'); m=mmap.mmap(f.fileno(), 0); "
            "print('mapped', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "mapped"
        seen = gsys.shm_mapped([child.pid])
        assert path in seen
        assert gsys.unlink_unmapped(seen) == [] and os.path.exists(path)  # still mapped: kept
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        time.sleep(0.1)
        assert gsys.unlink_unmapped(seen) == [path] and not os.path.exists(path)
    finally:
        child.kill()
        if os.path.exists(path):
            os.unlink(path)
