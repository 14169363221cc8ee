"""The lent-device CUDA round trip's own logic, on CPU.

* ``prepare_carry.py``: slimmed wheels keep every member byte-identical with
  its RECORD row; a carry over the limit is refused and nothing is written;
* ``gpu_roundtrip_device.sh --standin``: the whole device run -- carry
  install with ``pip --target`` (never a venv), per-version extension probe,
  ``patchtool apply --site-packages``, pristine/patched round trips through
  the ``--device cuda`` code path (``cpu-standin``), timing, summary -- against
  a cp311 stand-in carry and the provisioned 0.5.3 runtime interpreter.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

from lab import prepare_carry as pc
def _row(name: str, data: bytes) -> str:
    return f"{name},sha256={urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"


def test_slim_wheel_drops_only_the_listed_members(tmp_path):
    members = {"lmcache/__init__.py": b"x = 1\n", "lmcache/lmcache_fs.cpython-312-x86_64-linux-gnu.so": b"\0" * 99,
               "lmcache/lmcache_redis.cpython-312-x86_64-linux-gnu.so": b"\1" * 99,
               "lmcache/docs/a.png": b"png", "lmcache/c_ops.cpython-312-x86_64-linux-gnu.so": b"\2" * 50}
    rec = "lmcache-0.0.1.dist-info/RECORD"
    src = tmp_path / "lmcache-0.0.1-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(src, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)
        z.writestr(rec, "\n".join([_row(n, d) for n, d in members.items()] + [f"{rec},,"]) + "\n")
    info = pc.slim_wheel(src, tmp_path / "out")
    slim = tmp_path / "out" / src.name
    pc.check_slim(src, slim)
    assert sorted(d["name"] for d in info["dropped"]) == sorted(n for n in members if "fs" in n or "redis" in n
                                                                or n.endswith(".png"))
    with zipfile.ZipFile(slim) as z:
        assert sorted(z.namelist()) == sorted(["lmcache/__init__.py", "lmcache/c_ops.cpython-312-x86_64-linux-gnu.so",
                                               rec])
        assert "lmcache_fs" not in z.read(rec).decode()


@pytest.mark.slow
def test_device_script_against_the_cpu_standin(tmp_path):
    from lab import provision

    py = provision.runtime_env("0.5.3") / "bin" / "python"
    carry = tmp_path / "carry"
    res = subprocess.run([sys.executable, str(REPO / "lab/prepare_carry.py"), "--python-version", "3.11",
                          "--versions", "0.5.3", "--out", str(carry), "--limit-mib", "0.5"],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 3 and "exceeds" in res.stderr and not carry.exists()
    res = subprocess.run([sys.executable, str(REPO / "lab/prepare_carry.py"), "--python-version", "3.11",
                          "--versions", "0.5.3", "--out", str(carry)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    sizes = json.loads(res.stdout)
    assert sizes["total_mib"] < 64
    out = tmp_path / "out"
    env = dict(os.environ, DEVICE_PYTHON=str(py), OUT=str(out))
    res = subprocess.run(["bash", str(REPO / "lab/gpu_roundtrip_device.sh"), "--carry", str(carry), "--standin",
                          "--matrix", "tiny", "--reps", "1", "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=1500, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert {"device-summary.json", "device-runs.json", "device.log"} <= set(files) and len(files) <= 8
    assert all((out / f).stat().st_size < 16 * 2**20 for f in files)
    s = json.loads((out / "device-summary.json").read_text())
    assert s["device"] == "cpu-standin" and s["deps_install"]["rc"] == 0
    v = s["versions"]["0.5.3"]
    assert v["probe"]["extensions"]["c_ops"]["loaded"] is False  # CPU torch: no libc10_cuda
    assert v["probe"]["lmcache_sees"]["native_plan_executor"] is False
    assert v["patch"]["tool"] == "patchtool" and v["patch"]["rc"] == 0
    assert v["checks"]["pristine/native/HND"]["ok"] and v["checks"]["patched/native/HND"]["ok"], v["checks"]
    assert v["timing"]["ok"] and v["timing"]["patched_k17"]["pass"] and v["timing"]["ratio"] > 0
    assert s["verified"] == ["0.5.3"] and s["skipped"] == []
    # vLLM 0.30+'s GDN view is probed and recorded (it does not decide "verified"):
    # pristine 0.5.3 cannot view the padded row; revision 4 (parts 09, 10) serves it
    probe = v["vllm030_gdn_view"]
    assert set(probe) == {"pristine/native/HND", "patched/native/HND"}, probe
    assert probe["patched/native/HND"]["ok"] and not probe["pristine/native/HND"]["ok"], probe
    runs = json.loads((out / "device-runs.json").read_text())
    assert {r["doc"]["device"]["type"] for r in runs} == {"cpu-standin"}
