"""Host-side facts for the GPU gate: GPU memory, our own leftover processes,
versions and patched-file hashes (stdlib only; torch is only imported inside a
child interpreter of the target venv).

Processes are recognised as *ours* by an environment marker
(``LMCACHE_PATCHTOOL_GATE_RUN=<run id>``) that every child of the gate inherits,
so a vLLM ``EngineCore`` that left the process group is still found, and nothing
that the gate did not start is ever signalled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

MARKER_ENV = "LMCACHE_PATCHTOOL_GATE_RUN"

TARGET_FILES = (
    "lmcache/v1/kv_layer_groups.py",
    "lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py",
    "lmcache/v1/platform/base/cache_context.py",
    "lmcache/integration/vllm/lmcache_mp_connector.py",
)
PATCH_MARKER = "[lmcache-patchtool hybrid-fa]"


# ---------------------------------------------------------------------------
# Our processes, by marker
# ---------------------------------------------------------------------------


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return needle in fh.read().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return data[data.rfind(")") + 2:].split()[0]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def marked_pids(run_id: str, *, exclude: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Live processes whose environment carries ``MARKER_ENV=run_id``."""
    if not os.path.isdir("/proc"):  # pragma: no cover - Linux only
        return []
    needle = f"{MARKER_ENV}={run_id}".encode()
    me = {os.getpid(), *exclude}
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in me:
            continue
        pid = int(name)
        if _state(pid) in (None, "Z", "X"):
            continue
        if _environ_has(pid, needle):
            out.append({"pid": pid, "cmdline": _cmdline(pid)[:200]})
    return out


def kill_marked(run_id: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """SIGKILL every live process carrying our marker, by pid; return what was found."""
    found = marked_pids(run_id)
    for p in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p["pid"], signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and marked_pids(run_id):
        time.sleep(0.05)
    return found


# ---------------------------------------------------------------------------
# GPU memory via nvidia-smi
# ---------------------------------------------------------------------------


@dataclass
class GpuState:
    ok: bool
    gpus: list[dict[str, Any]] = field(default_factory=list)  # index, name, used_mib, total_mib
    apps: list[dict[str, Any]] = field(default_factory=list)  # pid, used_mib
    error: str | None = None

    def used(self, indices: Sequence[int] | None = None) -> int:
        return sum(g["used_mib"] for g in self.gpus if indices is None or g["index"] in indices)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "gpus": self.gpus, "apps": self.apps, "error": self.error}


def query_gpus(nvidia_smi: Sequence[str], timeout: float = 20.0) -> GpuState:
    def run(args: list[str]) -> str:
        res = subprocess.run(list(nvidia_smi) + args, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"{shlex.join(list(nvidia_smi) + args)} -> {res.returncode}: {res.stderr.strip()[:300]}")
        return res.stdout

    try:
        gpus = []
        for line in run(["--query-gpu=index,name,memory.used,memory.total",
                         "--format=csv,noheader,nounits"]).splitlines():
            if not line.strip():
                continue
            idx, name, used, total = [x.strip() for x in line.split(",")]
            gpus.append({"index": int(idx), "name": name, "used_mib": int(float(used)),
                         "total_mib": int(float(total))})
        apps = []
        for line in run(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]).splitlines():
            if not line.strip():
                continue
            pid, used = [x.strip() for x in line.split(",")[:2]]
            with contextlib.suppress(ValueError):
                apps.append({"pid": int(pid), "used_mib": int(float(used))})
        return GpuState(True, gpus, apps)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        return GpuState(False, error=str(exc))


def visible_gpu_indices(env: dict[str, str] | None = None) -> list[int] | None:
    """Indices from CUDA_VISIBLE_DEVICES when it is a plain list of ints, else None (all)."""
    val = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if not val:
        return None
    try:
        return [int(x) for x in val.split(",") if x.strip()]
    except ValueError:
        return None


# ---------------------------------------------------------------------------
# Versions and hashes (in the target interpreter)
# ---------------------------------------------------------------------------

_PROBE = r"""
import hashlib, importlib.metadata as md, importlib.util as iu, json, os, sys
out = {"python": sys.version.split()[0], "executable": sys.executable, "packages": {}}
for n in ("lmcache", "vllm", "torch", "transformers", "flashinfer-python", "safetensors", "matplotlib"):
    try:
        out["packages"][n] = md.version(n)
    except Exception:
        out["packages"][n] = None
spec = iu.find_spec("lmcache")
files = {}
marker = None
if spec and spec.submodule_search_locations:
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    out["lmcache_root"] = root
    for rel in json.loads(sys.argv[1]):
        p = os.path.join(root, rel)
        try:
            data = open(p, "rb").read()
            files[rel] = hashlib.sha256(data).hexdigest()
            if rel.endswith("kv_layer_groups.py"):
                marker = sys.argv[2].encode() in data
        except OSError:
            files[rel] = None
out["lmcache_files_sha256"] = files
out["patch_marker_present"] = marker
if "--torch" in sys.argv:
    try:
        import torch
        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            out["gpu_name"] = torch.cuda.get_device_name(0)
            out["gpu_capability"] = list(torch.cuda.get_device_capability(0))
    except Exception as exc:
        out["torch_error"] = repr(exc)
print(json.dumps(out))
"""


def probe_environment(python: str, *, with_torch: bool = True, timeout: float = 120.0) -> dict[str, Any]:
    args = [python, "-c", _PROBE, json.dumps(list(TARGET_FILES)), PATCH_MARKER] + (["--torch"] if with_torch else [])
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python}: {exc}"}
    if res.returncode != 0:
        return {"error": f"{python} exited {res.returncode}: {res.stderr.strip()[-500:]}"}
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unparsable probe output: {res.stdout[-300:]!r}"}


def sha256_path(path: str | os.PathLike) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
