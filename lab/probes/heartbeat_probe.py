"""The scheduler adapter's heartbeat across a restart of the LMCache server alone
(runtime venv, a real ``lmcache server`` on 127.0.0.1, no vLLM).

vLLM's scheduler-side connector owns one ``LMCacheMPSchedulerAdapter``; its
first ``maybe_submit_lookup_request`` calls ``_ensure_heartbeat_started``,
which should start one ``HeartbeatThread`` per server: the thread that clears
the adapter's health event while the server is gone and sets it again when it
answers.  The adapter is built through :class:`restore_client.Client` (vLLM's
constructor arguments, ``lmcache.mp.heartbeat_interval`` in its extra_config)
and driven the way the scheduler drives it:

1. lookup ``before`` (starts the heartbeat); heartbeat threads counted by name
   before and after it, the adapter's own ``_heartbeats`` recorded;
2. SIGKILL the server; wait (``--wait-intervals`` heartbeat intervals) for
   ``is_healthy`` to go False;
3. lookup ``outage`` (vLLM keeps scheduling requests): sent while the adapter
   still believes the server healthy, it times out after ``mq_timeout`` and
   the adapter marks the server unhealthy; skipped when already unhealthy.
   ``--outage-lookup in-flight`` sends it right after the SIGKILL, before the
   heartbeat can have noticed, and only then waits for health to go False:
   the lookup vLLM's scheduler thread is blocked in when the server dies;
4. restart the server on the same ports; wait as long for ``is_healthy`` True;
5. lookup ``after``: answered by the server, or skipped (0 hit tokens).

A sampler thread records every change of ``is_healthy`` (seconds since the
first lookup).  Per lookup: health at submit (the adapter skips an unhealthy
submit), the hit count, whether the server answered (the adapter caches the
answer in ``_finished_lookup_results``; a skipped or timed-out lookup also
returns 0 but is never cached), and the seconds it took.

    PYTHONPATH=<overlay>:<repo> <venv>/bin/python -m lab.probes.heartbeat_probe --out OUT

Writes one JSON document to OUT (LMCache logs to stdout).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import traceback
from pathlib import Path
from typing import Any

PRESET = "pure-attn-bs128"  # one attention group; the adapter only needs its block size
THREAD_NAME = "lmcache-heartbeat"  # HeartbeatThread's PeriodicThread name


def heartbeat_threads() -> int:
    return sum(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


class HealthLog:
    """Samples ``adapter.is_healthy`` every 10 ms; keeps the changes."""

    def __init__(self, adapter: Any, t0: float) -> None:
        self.adapter, self.t0 = adapter, t0
        self.changes: list[dict[str, Any]] = [{"t": 0.0, "healthy": bool(adapter.is_healthy)}]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            healthy = bool(self.adapter.is_healthy)
            if healthy != self.changes[-1]["healthy"]:
                self.changes.append({"t": round(time.monotonic() - self.t0, 3), "healthy": healthy})

    def wait_for(self, healthy: bool, since: float, timeout: float) -> float | None:
        """Seconds from ``since`` until ``is_healthy == healthy``; None if not
        within ``timeout`` of ``since``."""
        while time.monotonic() - since < timeout:
            if bool(self.adapter.is_healthy) == healthy:
                return round(time.monotonic() - since, 3)
            time.sleep(0.01)
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def heartbeats_of(adapter: Any) -> dict[str, Any]:
    """The adapter's own record: ``_heartbeats`` (url -> thread), as started."""
    return {url: {"running": hb.is_running, "runs": hb.total_runs,
                  "last": hb.last_summary.message if hb.last_summary else None}
            for url, hb in (adapter._heartbeats or {}).items()}


def lookup(client: Any, rid: str, tokens: list[int], timeout: float, t0: float) -> dict[str, Any]:
    """One scheduler lookup (submit, poll until final) and what the adapter did with it."""
    sched = client.scheduler
    out: dict[str, Any] = {"at": round(time.monotonic() - t0, 3), "healthy_at_submit": bool(sched.is_healthy)}
    start = time.monotonic()
    out["hit_tokens"] = client.lookup(rid, tokens, timeout)
    out["seconds"] = round(time.monotonic() - start, 3)
    out["answered_by_server"] = rid in sched._finished_lookup_results
    out["healthy_after"] = bool(sched.is_healthy)
    return out


def run(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    import lmcache  # noqa: PLC0415 - the overlay's, recorded so the test can check which tree ran

    from gate import restore_client as gc  # noqa: PLC0415 - torch + lmcache: inside the runtime venv only
    from gate import restore_server, geometry, procs  # noqa: PLC0415 - after the arguments parsed, like restore_client

    doc["lmcache"] = {"version": getattr(lmcache, "__version__", None),
                      "root": str(Path(lmcache.__file__).parent.parent)}
    interval = args.interval
    wait = args.wait_intervals * interval
    doc["config"] = {"heartbeat_interval": interval, "mq_timeout": args.mq_timeout, "wait_s": wait,
                     "outage_lookup": args.outage_lookup}
    geo = geometry.preset(PRESET)
    chunk = 2 * geo.tokens_per_block
    tokens = list(range(1, 2 * chunk + 1))
    with procs.Supervisor() as sup:
        work = sup.tempdir(prefix="heartbeat-probe-")
        (work / "l2").mkdir()
        zp, hp = procs.free_ports(2)
        spec = restore_server.ServerSpec(zp, hp, chunk, 0.1, work / "l2", work)
        server = restore_server.launch_server(sup, spec, "first")
        start = time.monotonic()
        restore_server.await_server(server, spec, args.server_timeout)
        doc["server_start_s"] = round(time.monotonic() - start, 3)
        doc["server_url"] = spec.zmq_url

        layout = gc.Layout(geo, geometry.engine_group_infos(geo, "connector"))
        client = gc.Client(spec.zmq_url, "heartbeat-probe", layout, mq_timeout=args.mq_timeout,
                           heartbeat_interval=interval)
        sched = client.scheduler
        doc["adapter_heartbeat_interval"] = sched._heartbeat_interval
        doc["heartbeats_at_construction"] = repr(sched._heartbeats)
        health: HealthLog | None = None
        try:
            threads_before = heartbeat_threads()
            t0 = time.monotonic()
            health = HealthLog(sched, t0)
            lookups: dict[str, Any] = doc.setdefault("lookups", {})  # filled as it goes: kept on an error
            lookups["before"] = lookup(client, "before", tokens, args.mq_timeout + 5, t0)
            # Two intervals: a started heartbeat has pinged by now.
            time.sleep(2 * interval + 0.2)
            doc["heartbeat_threads"] = {"before_first_lookup": threads_before,
                                        "after_first_lookup": heartbeat_threads()}
            doc["adapter_heartbeats"] = heartbeats_of(sched)
            doc["healthy_before_kill"] = bool(sched.is_healthy)

            killed_at = time.monotonic()
            doc["kill"] = restore_server.kill_server(server)
            doc["kill"]["at"] = round(killed_at - t0, 3)
            if args.outage_lookup == "in-flight":
                lookups["outage"] = lookup(client, "outage", tokens, args.mq_timeout + 5, t0)
                doc["unhealthy_after_kill_s"] = health.wait_for(False, killed_at, wait)
            else:
                doc["unhealthy_after_kill_s"] = health.wait_for(False, killed_at, wait)
                lookups["outage"] = lookup(client, "outage", tokens, args.mq_timeout + 5, t0)

            server = restore_server.launch_server(sup, spec, "restarted")
            start = time.monotonic()
            restore_server.await_server(server, spec, args.server_timeout)
            ready_at = time.monotonic()
            doc["restart"] = {"at": round(start - t0, 3), "ready_s": round(ready_at - start, 3),
                              "same_ports": [spec.zmq_port, spec.http_port]}
            # from the moment the restarted server answers its healthcheck
            doc["healthy_after_restart_s"] = health.wait_for(True, ready_at, wait)
            lookups["after"] = lookup(client, "after", tokens, args.mq_timeout + 5, t0)
            doc["adapter_heartbeats_at_end"] = heartbeats_of(sched)
        finally:
            if health is not None:
                health.stop()
                doc["health_changes"] = health.changes
            # graceful: the non-graceful path reaches for the worker's pre-0.5.5
            # ``mq_client``; with the server up, UNREGISTER answers at once
            client.close(graceful=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--interval", type=float, default=1.0, help="lmcache.mp.heartbeat_interval (s)")
    ap.add_argument("--mq-timeout", type=float, default=3.0, help="lmcache.mp.mq_timeout (s)")
    ap.add_argument("--wait-intervals", type=float, default=5.0,
                    help="how many heartbeat intervals to wait for a health change")
    ap.add_argument("--server-timeout", type=float, default=120.0)
    ap.add_argument("--outage-lookup", choices=["after-notice", "in-flight"], default="after-notice",
                    help="send the outage lookup once the adapter is unhealthy (default) or right after the kill")
    args = ap.parse_args(argv)
    doc: dict[str, Any] = {}
    try:
        run(args, doc)
    except Exception as exc:  # noqa: BLE001 - the document says what broke
        doc["error"] = f"{type(exc).__name__}: {exc}"
        doc["traceback"] = traceback.format_exc()
    args.out.write_text(json.dumps(doc, indent=1))
    return 1 if "error" in doc else 0


if __name__ == "__main__":
    raise SystemExit(main())
