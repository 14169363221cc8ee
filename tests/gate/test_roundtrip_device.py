"""``gate/roundtrip.py --device cuda`` plumbing, checked without a GPU.

* the CLI refuses ``--device cuda`` in one line (exit 3) where torch.cuda is
  unavailable, and ``--path direct`` without ``--device cuda``;
* ``harness_cuda``: path selection by LMCache's own module flags, the
  pass-through that records the native plan's host windows, same-process
  producer events -- against fakes;
* ``--device cpu-standin`` runs the whole ``--device cuda`` code path (event
  handles, path selection, pass-through recording, host copies, the
  path-taken check) on CPU tensors in the real 0.5.3 runtime venv: pristine
  fails every sub-paged cell exactly as on the CPU path, patched passes every
  cell, and on the native path the guards see the windows through the
  pass-through rather than the emulation.
"""

from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "gate" / "roundtrip.py"

from gate import harness_cuda as hc
# -- fakes --------------------------------------------------------------------------------

def _mod(**flags):
    m = types.SimpleNamespace(__name__="fake.transfer", lmc_ops=types.SimpleNamespace())
    m.__dict__.update(flags)
    return m


def test_select_flags_native_python_direct():
    m = _mod(_HAS_NATIVE_OBJECT_GROUP_TRANSFER=True, _HAS_BATCH_MEMCPY_ASYNC=True)
    assert hc.select_flags(m, "native") == {"_HAS_NATIVE_OBJECT_GROUP_TRANSFER": True,
                                            "_HAS_BATCH_MEMCPY_ASYNC": False}
    assert hc.select_flags(m, "python") == {"_HAS_NATIVE_OBJECT_GROUP_TRANSFER": False,
                                            "_HAS_BATCH_MEMCPY_ASYNC": False}
    assert hc.select_flags(m, "direct")["_HAS_BATCH_MEMCPY_ASYNC"] is True
    old = _mod(_HAS_NATIVE_OBJECT_GROUP_TRANSFER=False)  # 0.5.3-0.5.5: no direct flag; extension not loaded
    assert hc.select_flags(old, "python") == {"_HAS_NATIVE_OBJECT_GROUP_TRANSFER": False}
    with pytest.raises(hc.PathUnavailable, match="native plan executor"):
        hc.select_flags(old, "native")
    with pytest.raises(hc.PathUnavailable, match="0.5.6"):
        hc.select_flags(old, "direct")
    with pytest.raises(ValueError):
        hc.select_flags(old, "emulated")


def test_passthrough_records_host_windows_with_the_executors_direction():
    calls = []

    class Ops:
        class TransferDirection:
            H2D, D2H = 1, 2

        def StagingCopy(self, dst, src, size, off):  # noqa: N802
            return ("SC", dst, src, size, off)

        def DirectCopyObject(self, ptr, off, size, chunk, skips):  # noqa: N802
            return ("DO", ptr, off, size, chunk, skips)

        def execute_object_group_transfer(self, *a, **kw):
            calls.append(("plan", a, kw))

        def execute_direct_copy_transfer(self, *a, **kw):
            calls.append(("direct", a, kw))

        def multi_layer_block_kv_transfer(self, *a):
            calls.append(("kernel", a))

        other = 42

    real = Ops()
    rec = []
    stats = hc.PathStats("native")
    ns = hc.passthrough(real, 1, lambda *a: rec.append(a), stats)
    assert ns.other == 42  # everything else forwarded
    steps = [types.SimpleNamespace(staging=[ns.StagingCopy(0x1000, 0x9000, 64, 128)], launches=[1, 2])]
    ns.execute_object_group_transfer(1, "dev", 4096, ["spec"], steps, session_id="t")  # H2D: host is src
    steps = [types.SimpleNamespace(staging=[ns.StagingCopy(0x9000, 0x1000, 64, 128)], launches=[1])]
    ns.execute_object_group_transfer(2, "dev", 4096, ["spec"], steps)  # D2H: host is dst
    ns.execute_direct_copy_transfer(2, "dev", 4096, ["g"], [ns.DirectCopyObject(0x7000, 256, 32, 0, [0])])
    assert rec == [("h2d", "native", 0x9000, 128, 64, 0x9000), ("d2h", "native", 0x9000, 128, 64, 0x9000),
                   ("d2h", "direct", 0x7000, 256, 32, 0x7000)]
    assert [c[0] for c in calls] == ["plan", "plan", "direct"] and calls[0][2] == {"session_id": "t"}
    assert stats.to_json()["paths_taken"] == ["direct", "native"]
    assert (stats.calls, stats.direct_calls, stats.staging_copies, stats.steps, stats.launches) == (2, 1, 2, 2, 3)


def test_local_events_import_their_own_handles():
    class Backend:
        def __init__(self):
            self.n = 0

        def create_event(self, device):
            self.n += 1
            return f"ev{self.n}"

        def record_event(self, ev, stream):
            assert stream is None  # CPU device: no CUDA stream asked for

        def export_event(self, ev, device):
            return ev.encode()

        def import_event(self, handle, device):
            return ("imported", handle)

        def wait_event(self, ev, stream):
            return ("waited", ev)

    le = hc.LocalEvents(Backend())
    h = le.handle("cpu")
    assert le.import_event(h, "cpu") == "ev1" and le.imported == 1
    assert le.import_event(h, "cpu") == ("imported", h)  # consumed once; then the real import
    assert le.wait_event("ev1", None) == ("waited", "ev1")


# -- the CLI and the cpu-standin code path, in the real 0.5.3 runtime venv ------------------

def _harness(python, overlay, *args, check=True):
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}")
    proc = subprocess.run([str(python), str(HARNESS), *args], capture_output=True, text=True, env=env,
                          timeout=1200, cwd=str(REPO))
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_device_cuda_refused_in_one_line_without_a_gpu(runtime_python_053, pristine_overlay_053):
    proc = _harness(runtime_python_053, pristine_overlay_053, "--device", "cuda", "--json", check=False)
    assert proc.returncode == 3 and proc.stdout == ""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "LMCache" not in ln]
    assert lines == [lines[0]] and lines[0].startswith("roundtrip.py: --device cuda: torch.cuda is not available")
    proc = _harness(runtime_python_053, pristine_overlay_053, "--path", "direct", check=False)
    assert proc.returncode == 3 and "needs --device cuda" in proc.stderr


@pytest.mark.parametrize("path", ["python", "native"])
def test_standin_pristine_matches_cpu_and_patched_passes(runtime_python_053, pristine_overlay_053,
                                                         patched_overlay_053, path):
    def cells(overlay, device):
        doc = json.loads(_harness(runtime_python_053, overlay, "--json", "--no-hashes", "--matrix", "fast",
                                  "--path", path, "--device", device).stdout)
        assert doc.get("device", {}).get("type", "cpu") == device
        return {c["name"]: c for c in doc["cells"]}

    cpu, standin = cells(pristine_overlay_053, "cpu"), cells(pristine_overlay_053, "cpu-standin")
    assert cpu.keys() == standin.keys()
    for name, c in standin.items():
        assert "error" not in c, c.get("traceback")
        assert c["transfer"]["paths_taken"] == [path], name
        sub_paged = not name.startswith("control-k1")
        assert c["verdict"]["pass"] is not sub_paged, (name, c["verdict"])
        assert c["groups"]["fa"]["fraction"] == cpu[name]["groups"]["fa"]["fraction"], name
        assert c["groups"]["fa"]["foreign_bytes"] == cpu[name]["groups"]["fa"]["foreign_bytes"], name
    for name, c in cells(patched_overlay_053, "cpu-standin").items():
        assert c["verdict"]["pass"], (name, c["verdict"]["reasons"])
        assert c["guards"]["ok"] and c["guards"]["copies"]["paths_seen"] == [path], name
        if path == "native":  # the host windows came through the pass-through's StagingCopy records
            assert c["transfer"]["staging_copies"] > 0 and c["native"]["calls"] >= 2, name
            # a hybrid's objects are analysed per object group (part 19 separates them)
            copies = {side: sum(v["copies"] for v in c["guards"]["copies"][side].values()
                                if isinstance(v, dict) and "copies" in v) or c["guards"]["copies"][side]["copies"]
                      for side in ("d2h", "h2d")}
            assert copies["h2d"] == c["transfer"]["staging_copies"] - copies["d2h"]


def test_standin_direct_path_is_a_cell_error_before_0_5_6(runtime_python_053, pristine_overlay_053):
    doc = json.loads(_harness(runtime_python_053, pristine_overlay_053, "--json", "--device", "cpu-standin",
                              "--cell", "preset=control-k1,num_chunks=2,path=direct").stdout)
    (c,) = doc["cells"]
    assert "PathUnavailable" in c["error"] and "0.5.6" in c["error"] and not c["verdict"]["pass"]
