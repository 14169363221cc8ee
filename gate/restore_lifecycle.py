"""The server lifecycle of the CPU restore gate (stdlib only until the client
is imported): per-phase timings, a server started on fresh ports, SIGKILLed,
restarted over the same L2 tier, and its description in the report.

:class:`ServerLifecycle` is the base of ``gate/restore_gate.py``'s ``Gate``
(through :class:`gate.restore_cycle.CycleSteps`): it holds the state the whole
run shares (options, display, timings, cycles, preset runs, the supervisor)
and the guards every step runs under.  The server itself is
:mod:`gate.restore_server`.
"""

from __future__ import annotations

import argparse
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from gate import procs
from gate.l2_tier import Tier
from gate.restore_display import Display
from gate.restore_plan import GateError, PresetRun
from gate.restore_server import (HEALTH_PATH, ServerSpec, await_server, kill_server, launch_server,
                                 server_lmcache_dir)


class ServerLifecycle:
    """Run state, phase timings and the server pair's start / kill / restart."""

    sup: procs.Supervisor  # set by Gate.run for the run's server cycles

    def __init__(self, args: argparse.Namespace, display: Display) -> None:
        self.args, self.d = args, display
        self.timings: dict[str, float] = {}
        self.cycles: list[dict[str, Any]] = []
        self.runs: list[PresetRun] = []
        self.server_info: dict[str, Any] = {}
        self.steps: Any = None  # restore_steps.ClientSteps once torch + lmcache are imported
        self.cleanup_errors: list[Any] = []

    @contextmanager
    def phase(self, cycle: dict[str, Any], name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            dt = time.monotonic() - t0
            cycle["timings"][name] = round(cycle["timings"].get(name, 0.0) + dt, 4)
            self.timings[name] = round(self.timings.get(name, 0.0) + dt, 4)

    def _import_client(self) -> None:
        """torch + lmcache (seconds on a small machine): done while server A boots."""
        if self.steps is None:
            # Function-level: the client steps import torch and lmcache, which
            # `--help` and a server that never starts must not wait for.
            from gate.restore_steps import ClientSteps  # noqa: PLC0415

            self.steps = ClientSteps(self.args)
            self.on_imported()

    def on_imported(self) -> None:  # replaced by main() to print the version header
        pass

    # -- one server pair -----------------------------------------------------
    def _new_cycle(self, n: int, chunk: int, runs: list[PresetRun]) -> dict[str, Any]:
        cycle: dict[str, Any] = {"cycle": n, "chunk_size": chunk, "presets": [r.geo.name for r in runs],
                                 "timings": {}, "servers": []}
        self.cycles.append(cycle)
        return cycle

    def _l1_gb(self, runs: list[PresetRun]) -> float:
        return self.args.l1_size_gb or max(1.0, 2.5 * sum(r.full_object_bytes() * r.chunks for r in runs) / 2**30)

    def _start_server(self, cycle: dict[str, Any], chunk: int, l1_gb: float, tier: Tier, workdir: Path,
                      label: str, timing: str) -> tuple[procs.ManagedProcess, ServerSpec]:
        """A server on fresh ports (retried if a port was taken meanwhile)."""
        with self.phase(cycle, timing):
            for attempt in range(3):
                zp, hp = procs.free_ports(2)
                spec = ServerSpec(zp, hp, chunk, round(l1_gb, 2), Path(tier.describe()), workdir,
                                  transfer_mode=self.args.transfer_mode, l2_adapter=tier.adapter_json())
                server = launch_server(self.sup, spec, label)
                cycle["servers"].append(server.describe())
                self._import_client()  # torch + lmcache load while the server boots
                try:
                    await_server(server, spec, self.args.server_timeout)
                    break
                except procs.StartupError as exc:
                    cycle["servers"][-1] = server.describe()
                    if attempt == 2 or "address already in use" not in str(exc).lower():
                        raise GateError(f"server {label} did not start: {exc}") from exc
        cycle["servers"][-1] = self._server_desc(server, spec, label)
        self.d.step(f"server {label} up: pid {server.pid}, {spec.zmq_url}, ready by {HEALTH_PATH} on "
                    f":{spec.http_port}", server.ready_at - server.started_at)
        return server, spec

    def _kill(self, cycle: dict[str, Any], server: procs.ManagedProcess, label: str) -> dict[str, Any]:
        with self.phase(cycle, "kill"):
            t_kill = time.monotonic()
            kill = kill_server(server)
        cycle["servers"][-1]["kill"] = kill
        self.d.step(f"server {label} SIGKILLed: reaped (rc {kill['returncode']}), group gone, "
                    f"L1 segment {'removed' if kill['l1_shm_left_by_kill'] else 'not left'}",
                    time.monotonic() - t_kill, kill["group_gone"] and kill["l1_shm_removed"])
        return kill

    def _restart(self, cycle: dict[str, Any], spec: ServerSpec, t_kill: float
                 ) -> tuple[procs.ManagedProcess, ServerSpec, float]:
        """Server B on the same ports and L2 directory (a Redis tier: another node,
        on other ports, over the same Redis); the restart window since the kill."""
        args = self.args
        if args.redis_url:
            zp, hp = procs.free_ports(2)
            spec = ServerSpec(zp, hp, spec.chunk_size, spec.l1_size_gb, spec.l2_dir, spec.workdir,
                              transfer_mode=spec.transfer_mode, l2_adapter=spec.l2_adapter)
        with self.phase(cycle, "server_start_2"):
            server = launch_server(self.sup, spec, "B", pythonpath=args.restart_pythonpath)
            cycle["servers"].append(server.describe())
            try:
                await_server(server, spec, args.server_timeout)
            except procs.StartupError as exc:
                cycle["servers"][-1] = server.describe()
                raise GateError(f"server B did not start: {exc}") from exc
        restart_window = time.monotonic() - t_kill
        cycle["restart_window_s"] = round(restart_window, 3)
        cycle["servers"][-1] = self._server_desc(server, spec, "B")
        other = cycle["servers"][-1]["lmcache_dir"] if args.restart_pythonpath else None
        where = (f"another node ({spec.zmq_url}) over {args.redis_url}" if args.redis_url
                 else "the same ports and L2 dir")
        self.d.step(f"server B up on {where}: pid {server.pid} "
                    f"(restart window {restart_window:.1f} s)" + (f", lmcache from {other}" if other else ""),
                    server.ready_at - server.started_at)
        return server, spec, restart_window

    # -- helpers ---------------------------------------------------------------
    def _server_desc(self, proc: procs.ManagedProcess, spec: ServerSpec, label: str) -> dict[str, Any]:
        desc = proc.describe()
        desc.update(label=label, zmq_url=spec.zmq_url, health_url=spec.health_url, l2_dir=str(spec.l2_dir),
                    readiness_seconds=round(proc.ready_at - proc.started_at, 3),
                    lmcache_dir=server_lmcache_dir(proc.pid))
        if not self.server_info:
            self.server_info = {"argv": list(proc.argv),
                                "readiness": f"GET {HEALTH_PATH} -> 200 {{\"status\": \"healthy\"}}",
                                "lmcache_dir": desc["lmcache_dir"]}
        return desc

    def _alive_or_die(self, server: procs.ManagedProcess) -> None:
        if not server.alive():
            raise GateError(f"{server.name} died (returncode {server.returncode})\n--- last lines of "
                            f"{server.log_path} ---\n{server.log_tail()}")

    def _guard(self, r: PresetRun, what: str, fn: Callable[[], Any]) -> None:
        if r.error:
            return
        try:
            fn()
        except GateError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded as this preset's error
            r.error = f"{what}: {type(exc).__name__}: {exc}"
            r.result["traceback"] = traceback.format_exc()
            self.d.step(f"{r.geo.name}: ERROR during {what}: {type(exc).__name__}: {exc}", None, False)
