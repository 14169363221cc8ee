"""The real ``lmcache server`` as the CPU restore gate runs it (stdlib only, no torch).

One owner for the server side of every gate and probe that stores through a
real server and kills it: the command line (loopback only, an ``fs`` L2 or
the adapter JSON of ``l2_tier``, e.g. a Redis tier),
start in its own process group, readiness by ``GET /healthcheck``, SIGKILL
with the L1 shared-memory segment removed, and the readers of what the server
leaves behind (its log's prefetch and object-group lines, the finished L2
objects, ``GET /status``).  ``gate/restore_gate.py`` is built on it, and so
are the research probes and benches outside the wheel, which import it from
here instead of importing the gate script.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gate import procs

HEALTH_PATH = "/healthcheck"
_PREFETCH_LINE = re.compile(r"Prefetch request completed \(L1\+L2\): (\d+)/(\d+) retained keys "
                            r"\((\d+) L1, (\d+) L2\).*external_request_id=([^,\s)]+)")
_OBJECT_GROUP_LINE = re.compile(r"Object group (\d+) of (\S+) keys objects as")


def lmcache_cli() -> list[str]:
    """The ``lmcache`` console script of THIS interpreter's environment."""
    script = Path(sys.executable).parent / "lmcache"
    if script.exists():
        return [sys.executable, str(script)]
    return [sys.executable, "-c", "import sys; from lmcache.cli.main import main; sys.exit(main())"]


@dataclass
class ServerSpec:
    zmq_port: int
    http_port: int
    chunk_size: int
    l1_size_gb: float
    l2_dir: Path
    workdir: Path
    host: str = "127.0.0.1"
    # --transfer-mode: the server's --supported-transfer-mode (engine_driven:
    # PREPARE/COMMIT only; auto: both modules; the gate's default lmcache_driven)
    transfer_mode: str = "lmcache_driven"
    # --l2-adapter JSON (l2_tier.Tier.adapter_json); None: fs over l2_dir
    l2_adapter: str | None = None

    @property
    def zmq_url(self) -> str:
        return f"tcp://{self.host}:{self.zmq_port}"

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.http_port}{HEALTH_PATH}"

    def argv(self) -> list[str]:
        l2 = self.l2_adapter or json.dumps({"type": "fs", "base_path": str(self.l2_dir)}, separators=(",", ":"))
        return [*lmcache_cli(), "server",
                "--host", self.host, "--port", str(self.zmq_port),
                "--http-host", self.host, "--http-port", str(self.http_port),
                "--chunk-size", str(self.chunk_size),
                "--l1-size-gb", f"{self.l1_size_gb:g}",
                "--eviction-policy", "LRU",
                "--supported-transfer-mode", self.transfer_mode,
                "--l2-adapter", l2]


def l1_shm_path(pid: int) -> Path:
    """The server's L1 pool: ``L1MemoryManagerConfig.shm_name`` defaults to
    ``lmcache_l1_pool_<pid>``; a SIGKILLed server leaves it in /dev/shm."""
    return Path("/dev/shm") / f"lmcache_l1_pool_{pid}"


def launch_server(sup: procs.Supervisor, spec: ServerSpec, label: str,
                  pythonpath: str | None = None) -> procs.ManagedProcess:
    """Start the server process (own process group); readiness is awaited separately."""
    env = dict(os.environ)
    env.update(LMCACHE_DISABLE_BANNER="1", LMCACHE_LOG_LEVEL="INFO", PYTHONUNBUFFERED="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    proc = sup.start(f"lmcache server {label}", spec.argv(), log_path=spec.workdir / f"server-{label}.log",
                     env=env, cwd=str(spec.workdir))
    shm = l1_shm_path(proc.pid)
    sup.add_cleanup(f"remove {shm}", lambda: shm.unlink(missing_ok=True))
    return proc


def await_server(proc: procs.ManagedProcess, spec: ServerSpec, timeout: float) -> None:
    """Ready when the server itself answers ``GET /healthcheck`` with ``healthy``
    (the HTTP frontend only serves once the ZMQ server and engine are up)."""
    try:
        proc.wait_ready(procs.http_probe(spec.health_url, json_subset={"status": "healthy"}), timeout)
    except BaseException:
        proc.kill()
        raise


def kill_server(proc: procs.ManagedProcess) -> dict[str, Any]:
    """SIGKILL the group, reap, verify gone, remove the L1 segment."""
    shm = l1_shm_path(proc.pid)
    proc.kill(timeout=15)
    left = shm.exists()
    shm.unlink(missing_ok=True)
    return {"signal": "SIGKILL", "returncode": proc.returncode, "group_gone": not procs.group_members(proc.pgid),
            "l1_shm_segment": str(shm), "l1_shm_left_by_kill": left, "l1_shm_removed": not shm.exists()}


def l2_adapters_status(spec: ServerSpec) -> list[dict[str, Any]] | str:
    """``GET /status`` -> ``storage_manager.l2_adapters`` (each adapter's
    ``report_status()``), or the error text: recorded, never the verdict."""
    try:
        with urllib.request.urlopen(f"http://{spec.host}:{spec.http_port}/status", timeout=10) as resp:  # noqa: S310
            return json.loads(resp.read())["storage_manager"]["l2_adapters"]
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def server_lmcache_dir(pid: int) -> str | None:
    """Where the server process loaded lmcache from (its mapped native module)."""
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            m = re.search(r"(\S+)/lmcache/native_storage_ops[^/]*\.so$", line)
            if m:
                return m.group(1)
    except OSError:
        pass
    return None


def prefetch_split(log_text: str, request_id: str) -> dict[str, int] | None:
    """The server's own L1/L2 account of one lookup's prefetch (None: no hit logged)."""
    for m in _PREFETCH_LINE.finditer(log_text):
        if m.group(5) == request_id:
            return {"keys_hit": int(m.group(1)), "keys_requested": int(m.group(2)),
                    "l1": int(m.group(3)), "l2": int(m.group(4))}
    return None


def object_groups(log_text: str, model: str) -> int:
    """How many object groups the server keys ``model``'s chunks into: a patched
    server logs each at registration (a hybrid's GDN and attention groups are
    separate objects from part 06 on); no line (pristine): one merged group."""
    ids = [int(m.group(1)) for m in _OBJECT_GROUP_LINE.finditer(log_text) if m.group(2) == model]
    return max(ids) + 1 if ids else 1


def l2_objects(l2_dir: Path, model: str) -> list[Path]:
    """Finished objects of ``model`` in the fs L2 (written as .tmp, renamed to .data).

    The model field is ``model`` or, where a build keys by layout, ``model+<namespace>``
    (``+`` never occurs in the gate's own model names)."""
    safe = model.replace("/", "-SEP-")
    return sorted(p for p in l2_dir.glob("*.data")
                  if p.name.startswith(safe + "@") or p.name.startswith(safe + "+"))
