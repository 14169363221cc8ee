"""LMCache's native RESP client (``lmcache.lmcache_redis``) when the Redis
server goes away: restarted under a live client, or down when the client is
created.

Why: an operator's shared tier restarts (a deploy, a failover, an OOM kill).
The question is what an LMCache server on that tier does afterwards: does its
L2 come back, and are its requests answered (misses) or left waiting? This
probe drives the native client alone, with no LMCache server, against a
``redis-server`` it starts itself on a free port (persistence off):

1. ``restart``: a client stores a key; Redis is SIGKILLed; EXISTS and GET
   while it is down; Redis is started again on the same port; SET, EXISTS
   and GET four times over the next seconds.
2. ``down_at_start``: a client is created while nothing listens on the port;
   one EXISTS.

Each operation records whether a completion came back within the timeout, its
``ok``, error text and per-key results, and how long it took.

    PYTHONPATH=<overlay>:<repo> <venv>/bin/python -m lab.probes.resp_fault_probe [--out OUT]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any

from lab.probes.resp_batch_probe import emit_json

TIMEOUT_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis(exe: str, port: int, workdir: str) -> subprocess.Popen:
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"resp_fault_probe: redis-server did not start on {port}")
            time.sleep(0.05)


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _op(client: Any, name: str, future_id: int) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < TIMEOUT_S:
        for fid, ok, error, results in client.drain_completions():
            if int(fid) == int(future_id):
                return {"op": name, "completed": True, "ok": bool(ok), "error": error or None,
                        "per_key": None if results is None else [bool(r) for r in results],
                        "seconds": round(time.monotonic() - t0, 3)}
        time.sleep(0.005)
    return {"op": name, "completed": False, "seconds": TIMEOUT_S}


def run(exe: str) -> dict:
    from lmcache.lmcache_redis import LMCacheRedisClient  # noqa: PLC0415

    import lmcache  # noqa: PLC0415

    value = bytearray(b"v" * 100)
    out: dict[str, Any] = {"lmcache": getattr(lmcache, "__version__", None), "timeout_s": TIMEOUT_S}
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        proc = _start_redis(exe, port, tmp)
        client = LMCacheRedisClient("127.0.0.1", port, 2, "", "")
        steps = [_op(client, "set", client.submit_batch_set(["k"], [memoryview(value)]))]
        _kill(proc)
        buf = bytearray(100)
        steps.append(_op(client, "exists while down", client.submit_batch_exists(["k"])))
        steps.append(_op(client, "get while down", client.submit_batch_get(["k"], [memoryview(buf)])))
        proc = _start_redis(exe, port, tmp)
        for i in range(4):
            time.sleep(0.5)
            steps.append(_op(client, f"set after restart #{i + 1}", client.submit_batch_set(["k"], [memoryview(value)])))
        steps.append(_op(client, "exists after restart", client.submit_batch_exists(["k"])))
        buf = bytearray(100)
        steps.append(_op(client, "get after restart", client.submit_batch_get(["k"], [memoryview(buf)])))
        _kill(proc)
        after = [s for s in steps if "after restart" in s["op"]]
        out["restart"] = {"steps": steps,
                          "reconnected": any(s.get("ok") and s.get("per_key") in (None, [True]) for s in after)}
        port = _free_port()
        client2 = LMCacheRedisClient("127.0.0.1", port, 2, "", "")
        first = _op(client2, "exists", client2.submit_batch_exists(["k"]))
        out["down_at_start"] = {"steps": [first], "answered": first["completed"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    args = ap.parse_args(argv)
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("resp_fault_probe: redis-server is not on PATH (lab/provision_redis.py)")
    emit_json(run(exe), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
