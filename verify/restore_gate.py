#!/usr/bin/env python3
"""CPU restore gate: store, hard-kill, restart, restore -- through the real server.

Run BY PATH in the target interpreter (the venv whose lmcache is under test;
prepend an overlay to PYTHONPATH to test a patched tree -- the server inherits
it)::

    <venv>/bin/python verify/restore_gate.py --json [--preset NAME ...]

Per server cycle (presets that share a chunk size share one):

1. start ``<venv>/bin/lmcache server`` on 127.0.0.1 (free ZMQ/HTTP ports), L1
   plus an ``fs`` L2 in a fresh temporary directory, ``lmcache_driven``
   transfers; ready when ``GET /healthcheck`` answers ``{"status": "healthy"}``;
2. per preset, a client (LMCache's own vLLM scheduler + worker adapters)
   registers CPU KV caches in vLLM 0.27.1's geometry, fills them AFTER
   registration (the server maps the same shared memory), looks the prompt up
   (a miss, as vLLM does first), stores a multi-chunk request, ends the session;
3. waits until every chunk is a ``.data`` file in the L2 directory;
4. SIGKILLs the server's process group, reaps it, verifies it is gone and
   removes its L1 shared-memory segment;
5. starts a fresh server on the same ports and L2 directory;
6. per preset, a FRESH client registers fresh caches, poisons them, looks up
   (the server prefetches from L2; L1/L2 split read from the server's log),
   retrieves into DIFFERENT block ids and compares byte for byte per chunk,
   and checks that nothing outside the destination blocks changed;
7. optional (not part of the verdict): the first client, alive all along like
   a running vLLM, looks up and (on a hit) retrieves again.

Verdict per preset: PASS only if every stored chunk is found after the restart,
at least one came from L2, every restored byte is right and no foreign byte
changed.  Exit code 0 pass, 1 fail, 2 error.  Human progress goes to stderr,
``--json`` prints the report on stdout (``--json-out PATH`` writes it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
import time
import traceback
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from lmcache_patchtool_verify import geometry, procs, tier_objects
from lmcache_patchtool_verify.xver_outcome import classify
from lmcache_patchtool_verify.xver_outcome import preset as gate_preset
from lmcache_patchtool_verify.xver_state import STATE_SCHEMA, expected_digest, l2_listing, regenerate_expected

SCHEMA = 1
EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
# --preset all: vLLM 0.30+'s GDN view (unpadded row, padded stride) is refused
# on CPU by every LMCache version (docs/ports.md); name such a preset to run it.
ALL_PRESETS = tuple(n for n, g in geometry.PRESETS.items() if g.gdn_view != "0.30")
HEALTH_PATH = "/healthcheck"
# What LMCache's engine-driven path raises for a multi-group (hybrid) model, in
# transfer_context/worker_transfer.py: ``_single_group_block_ids`` at the first
# store (0.5.3-0.5.5), or ``EngineDrivenTransferContext.register`` at
# registration (0.5.6, before the store is reached).
ENGINE_DRIVEN_REFUSALS = ("engine-driven transfer does not support hybrid KV cache groups",
                          "engine-driven transfer does not support multiple KV transfer groups")
TRANSFER_MODES = ("lmcache_driven", "engine_driven", "auto")
# --copies: copy i of a preset uses seed + i * COPY_SEED_STEP (a run also draws seed + 1).
COPY_SEED_STEP = 100
_PREFETCH_LINE = re.compile(r"Prefetch request completed \(L1\+L2\): (\d+)/(\d+) retained keys "
                            r"\((\d+) L1, (\d+) L2\).*external_request_id=([^,\s)]+)")


class GateError(Exception):
    """Infrastructure failure: the gate could not reach a verdict."""


# ---------------------------------------------------------------------------
# Human display (stderr; plain lines, colour only on a terminal)
# ---------------------------------------------------------------------------


class Display:
    def __init__(self, stream, quiet: bool = False) -> None:
        self.stream, self.quiet = stream, quiet
        self.color = hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")

    def _c(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def line(self, text: str = "") -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def head(self, text: str) -> None:
        self.line(self._c(text, "1"))

    def step(self, text: str, seconds: float | None = None, ok: bool | None = True) -> None:
        mark = {True: self._c("ok  ", "32"), False: self._c("FAIL", "31;1"), None: "..  "}[ok]
        took = f"  ({seconds:.2f} s)" if seconds is not None else ""
        self.line(f"  {mark} {text}{took}")

    def verdict(self, text: str, passed: bool | None) -> None:
        colour = {True: "32;1", False: "31;1", None: "33;1"}[passed]
        self.line(self._c(text, colour))


# ---------------------------------------------------------------------------
# Server handling
# ---------------------------------------------------------------------------


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

    @property
    def zmq_url(self) -> str:
        return f"tcp://{self.host}:{self.zmq_port}"

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.http_port}{HEALTH_PATH}"

    def argv(self) -> list[str]:
        l2 = json.dumps({"type": "fs", "base_path": str(self.l2_dir)}, separators=(",", ":"))
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
    import urllib.request  # noqa: PLC0415

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


_OBJECT_GROUP_LINE = re.compile(r"Object group (\d+) of (\S+) keys objects as")


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


# ---------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------


@dataclass
class PresetRun:
    geo: geometry.Geometry
    chunk_size: int
    chunks: int
    seed: int
    model: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # live state during the run
    layout: Any = None
    restore_layout: Any = None  # the fresh client's after the restart (--restart-window-rule)
    tokens: list[int] = field(default_factory=list)
    src_ids: list[list[int]] = field(default_factory=list)
    dst_ids: list[list[int]] = field(default_factory=list)
    expected: dict = field(default_factory=dict)
    client1: Any = None
    num_blocks: int = 0
    # --phase restore: which writer stored it, and its entry in the writer's state file
    writer: str = ""
    state_entry: dict = field(default_factory=dict)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.geo.tokens_per_block

    @property
    def stored_tokens(self) -> int:
        return self.chunks * self.chunk_size

    def full_object_bytes(self) -> int:
        """Bytes of one chunk's object if every FA/GDN byte were kept."""
        g = self.geo
        return self.blocks_per_chunk * (g.num_fa_layers * g.fa_block_bytes + g.num_gdn_layers * g.gdn_block_bytes)


def _json_infos(infos: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    return None if infos is None else [dict(i, layer_indices=list(i["layer_indices"])) for i in infos]


def plan_cycles(names: list[str], chunk_blocks: int, chunk_size: int | None) -> list[tuple[int, list[str]]]:
    """Group presets by chunk size (one server pair per group), in given order."""
    cycles: dict[int, list[str]] = {}
    for name in names:
        geo = gate_preset(name)
        c = chunk_size if chunk_size else chunk_blocks * geo.tokens_per_block
        if c % geo.tokens_per_block:
            raise SystemExit(f"--chunk-size {c} is not a multiple of {name}'s block size {geo.tokens_per_block}")
        cycles.setdefault(c, []).append(name)
    return list(cycles.items())


# ---------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------


class Gate:
    def __init__(self, args: argparse.Namespace, display: Display) -> None:
        self.args, self.d = args, display
        self.timings: dict[str, float] = {}
        self.cycles: list[dict[str, Any]] = []
        self.runs: list[PresetRun] = []
        self.server_info: dict[str, Any] = {}

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
        if getattr(self, "gc", None) is None:
            from lmcache_patchtool_verify import gate_client as gc  # noqa: PLC0415

            self.gc = gc
            self.on_imported()

    def on_imported(self) -> None:  # replaced by main() to print the version header
        pass

    def run(self) -> None:
        self.gc = None
        args = self.args
        if args.phase == "restore":
            self._run_restore_phase()
            return
        cycles = plan_cycles(args.preset, args.chunk_blocks, args.chunk_size)
        with procs.Supervisor(keep_paths=args.keep_tmp) as sup:
            self.sup = sup
            for n, (chunk, names) in enumerate(cycles, 1):
                # --copies: independent requests per preset (own model name, own seed)
                runs = [PresetRun(gate_preset(name), chunk, args.chunks, args.seed + COPY_SEED_STEP * i)
                        for name in names for i in range(args.copies)]
                self.runs.extend(runs)
                self.d.head(f"[cycle {n}/{len(cycles)}] chunk size {chunk} tokens: {', '.join(names)}")
                if args.phase == "store":
                    self._store_cycle(n, chunk, runs)
                else:
                    self._cycle(n, chunk, runs)
            self.cleanup_errors = sup.cleanup_errors
        if args.phase == "store":
            self._write_state()

    # -- one server pair -----------------------------------------------------
    def _new_cycle(self, n: int, chunk: int, runs: list[PresetRun]) -> dict[str, Any]:
        cycle: dict[str, Any] = {"cycle": n, "chunk_size": chunk, "presets": [r.geo.name for r in runs],
                                 "timings": {}, "servers": []}
        self.cycles.append(cycle)
        return cycle

    def _l1_gb(self, runs: list[PresetRun]) -> float:
        return self.args.l1_size_gb or max(1.0, 2.5 * sum(r.full_object_bytes() * r.chunks for r in runs) / 2**30)

    def _start_server(self, cycle: dict[str, Any], chunk: int, l1_gb: float, l2_dir: Path, workdir: Path,
                      label: str, timing: str) -> tuple[procs.ManagedProcess, ServerSpec]:
        """A server on fresh ports (retried if a port was taken meanwhile)."""
        with self.phase(cycle, timing):
            for attempt in range(3):
                zp, hp = procs.free_ports(2)
                spec = ServerSpec(zp, hp, chunk, round(l1_gb, 2), l2_dir, workdir,
                                  transfer_mode=self.args.transfer_mode)
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

    def _store_all(self, cycle: dict[str, Any], runs: list[PresetRun], spec: ServerSpec,
                   server: procs.ManagedProcess, model_prefix: str) -> None:
        """Store through a first client per preset."""
        d = self.d
        for r in runs:
            r.model = f"{model_prefix}-{r.geo.name}-{uuid.uuid4().hex[:8]}"
            with self.phase(cycle, "register_fill"):
                self._guard(r, "register+fill", lambda r=r: self._prepare_source(r, spec))
            with self.phase(cycle, "store"):
                self._guard(r, "store", lambda r=r: self._store(r))
            self._alive_or_die(server)
            if not r.error:
                st = r.result["stored"]
                d.step(f"{r.geo.name}: stored {st['chunks_ok']}/{r.chunks} chunks "
                       f"({r.stored_tokens} tokens, {r.blocks_per_chunk} blocks/chunk, k={r.geo.k})",
                       st["seconds"], st["ok"])

    def _flush(self, cycle: dict[str, Any], runs: list[PresetRun], l2_dir: Path,
               server: procs.ManagedProcess) -> None:
        """Wait until every chunk is a finished object in the L2 directory."""
        with self.phase(cycle, "flush_to_disk"):
            t0 = time.monotonic()
            log = procs.ansi_strip(server.log_text())
            want = {r.model: r.chunks * object_groups(log, r.model) for r in runs if not r.error}

            def flushed() -> bool:
                self._alive_or_die(server)
                return all(len(l2_objects(l2_dir, m)) >= c for m, c in want.items()) \
                    and not list(l2_dir.glob("*.tmp"))

            try:
                procs.wait_until(flushed, self.args.step_timeout, poll=0.02, what="every chunk on disk")
                flushed_ok = True
            except TimeoutError:
                flushed_ok = False
            for r in runs:
                if r.error:
                    continue
                objs = l2_objects(l2_dir, r.model)
                # KV bytes: a patched build's file also holds a 64-byte checksum trailer
                sizes = sorted({tier_objects.kv_len(p) for p in objs})
                r.result["on_disk"] = {"objects": len(objs), "expected": want[r.model], "object_bytes": sizes,
                                       "checksum_trailers": sum(tier_objects.has_trailer(p) for p in objs),
                                       "full_fidelity_object_bytes": r.full_object_bytes(),
                                       "fraction_of_full": (sizes[0] / r.full_object_bytes()) if sizes else None,
                                       "model_fields": l2_listing(objs)}
            self.d.step(f"L2 flushed: {sum(len(l2_objects(l2_dir, m)) for m in want)}/{sum(want.values())} "
                        f"objects on disk in {l2_dir}", time.monotonic() - t0, flushed_ok)

    def _kill(self, cycle: dict[str, Any], server: procs.ManagedProcess, label: str) -> dict[str, Any]:
        with self.phase(cycle, "kill"):
            t_kill = time.monotonic()
            kill = kill_server(server)
        cycle["servers"][-1]["kill"] = kill
        self.d.step(f"server {label} SIGKILLed: reaped (rc {kill['returncode']}), group gone, "
                    f"L1 segment {'removed' if kill['l1_shm_left_by_kill'] else 'not left'}",
                    time.monotonic() - t_kill, kill["group_gone"] and kill["l1_shm_removed"])
        return kill

    def _restore_all(self, cycle: dict[str, Any], runs: list[PresetRun], spec: ServerSpec,
                     server: procs.ManagedProcess) -> None:
        """Fresh client per preset: look up, prefetch from L2, retrieve elsewhere, compare."""
        for r in runs:
            if r.error:
                continue
            with self.phase(cycle, "restore"):
                self._guard(r, "restore", lambda r=r: self._restore(r, spec, server))
            self._alive_or_die(server)
            if not r.error:
                self._print_restore(r)

    def _cycle(self, n: int, chunk: int, runs: list[PresetRun]) -> None:
        args, d, sup = self.args, self.d, self.sup
        cycle = self._new_cycle(n, chunk, runs)
        workdir = sup.tempdir(prefix="lmcache-restore-gate-")
        l2_dir = workdir / "l2"
        l2_dir.mkdir()
        cycle["workdir"] = str(workdir)
        l1_gb = self._l1_gb(runs)

        # 1.-3. first server, store, every chunk on disk
        server, spec = self._start_server(cycle, chunk, l1_gb, l2_dir, workdir, "A", "server_start_1")
        self._store_all(cycle, runs, spec, server, "restore-gate")
        self._flush(cycle, runs, l2_dir, server)

        # 4. hard kill
        t_kill = time.monotonic()
        self._kill(cycle, server, "A")

        # 5. fresh server on the same ports and L2 directory
        with self.phase(cycle, "server_start_2"):
            server = launch_server(sup, spec, "B", pythonpath=args.restart_pythonpath)
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
        d.step(f"server B up on the same ports and L2 dir: pid {server.pid} "
               f"(restart window {restart_window:.1f} s)" + (f", lmcache from {other}" if other else ""),
               server.ready_at - server.started_at)

        # 6. fresh client: look up, prefetch from L2, retrieve elsewhere, compare
        self._restore_all(cycle, runs, spec, server)

        # 7. optional: the worker that stayed alive across the restart
        for r in runs:
            if r.client1 is None:
                continue
            with self.phase(cycle, "stay_alive"):
                if args.stay_alive and not r.error:
                    try:
                        r.result["stay_alive"] = self._stay_alive(r, server, restart_window)
                    except Exception as exc:  # noqa: BLE001 - optional arm, never the verdict
                        r.result["stay_alive"] = {"ran": False, "error": f"{type(exc).__name__}: {exc}"}
                    sa = r.result["stay_alive"]
                    d.step(f"{r.geo.name}: stay-alive worker: {sa.get('summary', sa.get('error'))}", None, None)
                r.client1.close(graceful=server.alive())
                r.client1 = None

        with self.phase(cycle, "shutdown"):
            cycle["servers"][-1]["kill"] = kill_server(server)

    # -- cross-version phases (verify/xver_gate.py runs them in two venvs) ----
    def _store_cycle(self, n: int, chunk: int, runs: list[PresetRun]) -> None:
        """--phase store: start, store, flush to ``--l2-dir``, SIGKILL.  Nothing is restored here."""
        args = self.args
        cycle = self._new_cycle(n, chunk, runs)
        workdir = self.sup.tempdir(prefix="lmcache-xver-store-")
        cycle["workdir"] = str(workdir)
        l2_dir = Path(args.l2_dir)
        server, spec = self._start_server(cycle, chunk, self._l1_gb(runs), l2_dir, workdir, "W", "server_start_1")
        self._store_all(cycle, runs, spec, server, args.model_prefix)
        self._flush(cycle, runs, l2_dir, server)
        # Close the writer's clients while their server is up: closing one whose
        # server is gone hangs in the adapter's shutdown.  Every chunk is on disk.
        for r in runs:
            if r.client1 is not None:
                r.client1.close(graceful=True)
                r.client1 = None
        self._kill(cycle, server, "W")

    def _write_state(self) -> None:
        """The state file a reader phase needs to restore and judge these stores."""
        entries = []
        for r in self.runs:
            entry = {"preset": r.geo.name, "model": r.model, "chunk_size": r.chunk_size, "chunks": r.chunks,
                     "seed": r.seed, "num_blocks": r.num_blocks, "tokens": r.tokens, "src_ids": r.src_ids,
                     "dst_ids": r.dst_ids, "error": r.error,
                     "expected_sha256": expected_digest(r.expected) if r.expected else None,
                     "chunk_hashes": tier_objects.chunk_hashes(r.tokens, r.chunk_size, r.chunks) if r.tokens else None,
                     "engine_groups": _json_infos(r.layout.infos if r.layout else None),
                     "stored": r.result.get("stored"), "on_disk": r.result.get("on_disk")}
            entries.append(entry)
        state = {"schema": STATE_SCHEMA, "writer": self.args.model_prefix, "l2_dir": str(self.args.l2_dir),
                 "versions": versions(), "presets": entries}
        Path(self.args.state_out).write_text(json.dumps(state, indent=1) + "\n")

    def _run_restore_phase(self) -> None:
        """--phase restore: per chunk size, one fresh server over ``--l2-dir`` and a
        fresh client per stored (writer, preset) of every ``--state-in``."""
        args = self.args
        states = [json.loads(Path(p).read_text()) for p in args.state_in]
        by_chunk: dict[int, list[PresetRun]] = {}
        for st in states:
            if st.get("schema") != STATE_SCHEMA:
                raise GateError(f"state file of writer {st.get('writer')}: schema {st.get('schema')}, "
                                f"this gate reads {STATE_SCHEMA}")
            for e in st["presets"]:
                r = PresetRun(gate_preset(e["preset"]), e["chunk_size"], e["chunks"], e["seed"], model=e["model"])
                r.writer = st["writer"]
                r.state_entry = e
                if e.get("error") or not e.get("expected_sha256"):
                    r.error = f"writer {st['writer']} failed this preset: {e.get('error') or 'no expected bytes'}"
                r.tokens, r.src_ids, r.dst_ids, r.num_blocks = e["tokens"], e["src_ids"], e["dst_ids"], e["num_blocks"]
                by_chunk.setdefault(r.chunk_size, []).append(r)
                self.runs.append(r)
        l2_dir = Path(args.l2_dir)
        with procs.Supervisor(keep_paths=args.keep_tmp) as sup:
            self.sup = sup
            for n, (chunk, runs) in enumerate(by_chunk.items(), 1):
                self.d.head(f"[cycle {n}/{len(by_chunk)}] chunk size {chunk} tokens: "
                            + ", ".join(f"{r.writer}/{r.geo.name}" for r in runs))
                cycle = self._new_cycle(n, chunk, runs)
                workdir = sup.tempdir(prefix="lmcache-xver-restore-")
                cycle["workdir"] = str(workdir)
                server, spec = self._start_server(cycle, chunk, self._l1_gb(runs), l2_dir, workdir, "R",
                                                  "server_start_2")
                for r in runs:
                    if not r.error:
                        r.result["on_disk"] = {"model_fields": l2_listing(l2_objects(l2_dir, r.model))}
                self._restore_all(cycle, runs, spec, server)
                cycle["l2_adapters_status"] = l2_adapters_status(spec)
                with self.phase(cycle, "shutdown"):
                    cycle["servers"][-1]["kill"] = kill_server(server)
            self.cleanup_errors = sup.cleanup_errors

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

    def _guard(self, r: PresetRun, what: str, fn) -> None:
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

    def _num_blocks(self, r: PresetRun, layout) -> int:
        return 1 + layout.num_groups * r.chunks * r.blocks_per_chunk + 2

    def _prepare_source(self, r: PresetRun, spec: ServerSpec) -> None:
        gc, args = self.gc, self.args
        import random  # noqa: PLC0415

        # The connector's EngineGroupInfo, window fields included (0.5.4+: the GDN
        # group has sw_size_tokens = N, so the server keeps only its chunk-end slot).
        r.layout = gc.Layout(r.geo, geometry.engine_group_infos(r.geo, args.window_rule))
        r.restore_layout = gc.Layout(r.geo, geometry.engine_group_infos(
            r.geo, args.restart_window_rule or args.window_rule))
        r.num_blocks = self._num_blocks(r, r.layout)
        per_group = r.chunks * r.blocks_per_chunk
        r.src_ids = gc.choose_block_ids(r.layout.num_groups, per_group, r.num_blocks, r.seed)
        r.dst_ids = gc.choose_block_ids(r.layout.num_groups, per_group, r.num_blocks, r.seed + 1,
                                        differ_from=r.src_ids)
        rng = random.Random(r.seed)
        # a prompt of `chunks` full chunks plus a partial one (never stored)
        r.tokens = [rng.randrange(1, 150_000) for _ in range(r.stored_tokens + r.geo.tokens_per_block // 2)]
        t0 = time.monotonic()
        r.client1 = gc.Client(spec.zmq_url, r.model, r.layout, mq_timeout=args.step_timeout,
                              heartbeat_interval=args.heartbeat_interval, transfer_mode=args.transfer_mode)
        caches = geometry.build_kv_caches(r.geo, r.num_blocks, fill=0)
        self._connector_edits(r, caches, "store")
        r.client1.register(caches)
        r.expected = gc.fill_source(r.client1, r.src_ids, r.seed)  # AFTER registration: live shared memory
        r.result["register_seconds"] = round(time.monotonic() - t0, 3)

    def _store(self, r: PresetRun) -> None:
        args = self.args
        t0 = time.monotonic()
        rid = f"gate-store-{uuid.uuid4().hex[:12]}"
        miss = r.client1.lookup(rid, r.tokens, args.step_timeout)  # vLLM looks up every new request first
        ok = r.client1.store(rid, r.tokens, r.src_ids, r.stored_tokens, args.step_timeout)
        r.client1.finish_request(rid)
        r.result["stored"] = {"ok": ok, "chunks_ok": r.chunks if ok else 0, "tokens": r.stored_tokens,
                              "lookup_before_store_hit_tokens": miss, "seconds": round(time.monotonic() - t0, 3)}

    def _restore(self, r: PresetRun, spec: ServerSpec, server: procs.ManagedProcess) -> None:
        gc, args = self.gc, self.args
        t0 = time.monotonic()
        xver = args.phase == "restore"
        if r.layout is None:  # reader phase: the READER's connector sets the window fields
            r.layout = r.restore_layout = gc.Layout(r.geo, geometry.engine_group_infos(r.geo, args.window_rule))
        client = gc.Client(spec.zmq_url, r.model, r.restore_layout or r.layout, mq_timeout=args.step_timeout,
                           heartbeat_interval=args.heartbeat_interval, transfer_mode=args.transfer_mode)
        try:
            caches = geometry.build_kv_caches(r.geo, r.num_blocks, fill=gc.POISON)
            self._connector_edits(r, caches, "restore")
            client.register(caches)
            gc.poison(client)  # AFTER registration: registration re-points the storage
            if xver:
                self._regenerate_expected(r, client)
            rid = f"gate-restore-{uuid.uuid4().hex[:12]}"
            t_lookup = time.monotonic()
            hit = client.lookup(rid, r.tokens, args.step_timeout)
            lookup_s = time.monotonic() - t_lookup
            found = hit // r.chunk_size
            split = prefetch_split(server.log_text(), rid)
            if split is None and hit:  # the line is logged before the answer; allow for a slow flush
                try:
                    split = procs.wait_until(lambda: prefetch_split(server.log_text(), rid), 2.0, poll=0.05)
                except TimeoutError:
                    split = None
            if split is not None:
                split["source"] = "server log"
            elif hit:
                # No log line (another lmcache version?): a fresh server's L1 cannot
                # hold this model's keys before its first lookup, so hits are L2's.
                split = {"keys_hit": found, "keys_requested": None, "l1": 0, "l2": found,
                         "source": "inferred: fresh server, first lookup of this model (no prefetch log line)"}
            else:
                split = {"keys_hit": 0, "keys_requested": None, "l1": 0, "l2": 0,
                         "source": "no hit (the server logs nothing)"}
            retrieve = {"ok": None, "detail": "skipped: no hit"}
            t_ret = time.monotonic()
            if hit:
                try:
                    ok, detail = client.retrieve(rid, r.tokens, r.dst_ids, hit, args.step_timeout)
                except Exception as exc:  # noqa: BLE001
                    if not xver:
                        raise
                    # another build's object may be refused loudly: a miss if nothing was written
                    ok, detail = False, f"raised {type(exc).__name__}: {exc}"
                retrieve = {"ok": ok, "detail": detail}
            retrieve_s = time.monotonic() - t_ret
            client.finish_request(rid)
            t_cmp = time.monotonic()
            check = gc.check_restore(client, r.dst_ids, r.expected, chunks=r.chunks,
                                     blocks_per_chunk=r.blocks_per_chunk, restored_chunks=found,
                                     untouched=gc.POISON)
            if xver and retrieve["ok"] is False:
                # A failed retrieve must have written nothing: every byte still poison.
                check["foreign_writes"] = gc.check_restore(
                    client, r.dst_ids, r.expected, chunks=r.chunks, blocks_per_chunk=r.blocks_per_chunk,
                    restored_chunks=0, untouched=gc.POISON)["foreign_writes"]
            compare_s = time.monotonic() - t_cmp
        finally:
            client.close(graceful=server.alive())
        r.result["after_restart"] = {"hit_tokens": hit, "chunks_found": found, "chunks_stored": r.chunks,
                                     "server_prefetch": split, "l2_hits": split["l2"], "l1_hits": split["l1"],
                                     "lookup_seconds": round(lookup_s, 3)}
        r.result["restored"] = {"retrieve": retrieve, "chunks_restored_exact": check["chunks_exact"],
                                "per_chunk": check["per_chunk"], "retrieve_seconds": round(retrieve_s, 3),
                                "compare_seconds": round(compare_s, 3), "seconds": round(time.monotonic() - t0, 3)}
        r.result["fidelity"] = {"fa": check["fa"], "gdn": check["gdn"]}
        r.result["foreign_writes"] = check["foreign_writes"]
        if xver:
            r.result["xver"] = {"chunks_stored": r.chunks, "chunks_hit": found, "retrieve_ok": retrieve["ok"],
                                "chunks_exact": sum(1 for c in check["per_chunk"][:found] if c["exact"]),
                                "foreign_bytes": check["foreign_writes"]["bytes"]}

    def _connector_edits(self, r: PresetRun, caches: Any, when: str) -> None:
        """--connector-edits: register what the installed connector registers.

        Runs the version's own ``apply_kv_cache_group_edits`` on vLLM's tensors
        (0.5.6 re-views a hybrid's sub-paged attention as ``(nb, 2, N, 1, hs')``;
        0.5.5+ re-views GDN with ``as_strided``).  Every edit is a contiguous view
        of the same memory, so a logical block is still one row of the registered
        tensor (checked: a copy would make the byte checks read stale memory).
        """
        if not self.args.connector_edits:
            return
        from lmcache_patchtool_verify import ports_edits  # noqa: PLC0415 - target env only

        info = ports_edits.apply_edits(caches, "HND")
        for layer, t in enumerate(caches.tensors):
            if not t.is_contiguous() or t.data_ptr() != caches.raw[layer].data_ptr():
                raise GateError(f"{r.geo.name}: the connector's edit of layer {layer} is not a contiguous view "
                                f"of vLLM's tensor (shape {tuple(t.shape)}): the gate's byte checks cannot follow it")
        r.result.setdefault("connector_edits", {})[when] = [
            {"layer": x["layer"], "kind": x["kind"], "edited": x["edited"], "shape": x["shape"]}
            for x in info["layers"]]

    def _regenerate_expected(self, r: PresetRun, client: Any) -> None:
        """The writer's source bytes, from its seed, proven equal by the writer's digest."""
        rows = [client.rows(layer).shape[1] for layer in range(len(r.geo.layer_kinds))]
        r.expected = regenerate_expected(rows, client.layout.group_of_layer, r.src_ids, r.seed)
        want = r.state_entry["expected_sha256"]
        got = expected_digest(r.expected)
        if got != want:
            raise GateError(f"{r.writer}/{r.geo.name}: the source bytes regenerated from seed {r.seed} do not "
                            f"match the writer's (sha256 {got[:12]} != {want[:12]}): not deterministic across "
                            f"the two environments, refusing to judge")

    def _stay_alive(self, r: PresetRun, server: procs.ManagedProcess, restart_window: float) -> dict[str, Any]:
        """The first client never restarted.  Report what the target does with it."""
        gc, args = self.gc, self.args
        c = r.client1
        hb = args.heartbeat_interval if args.heartbeat_interval is not None else \
            getattr(c.worker, "_heartbeat_interval", None)
        out: dict[str, Any] = {"ran": True, "heartbeat_interval_s": hb, "restart_window_s": round(restart_window, 3),
                               "worker_healthy": c.worker.is_healthy, "instance_id": c.instance_id}
        if not c.worker.is_healthy and hb:
            # Degraded mode (the heartbeat saw the outage): a live vLLM keeps
            # serving, so give the heartbeat up to two intervals to recover.
            t0 = time.monotonic()
            with contextlib.suppress(TimeoutError):
                procs.wait_until(lambda: c.worker.is_healthy, min(2 * hb + 1, args.step_timeout), poll=0.05)
            out["waited_for_recovery_s"] = round(time.monotonic() - t0, 3)
        out["reregistered_with_new_server"] = f"Registered KV cache for GPU ID {c.instance_id}" in server.log_text()
        rid = f"gate-stayalive-{uuid.uuid4().hex[:12]}"
        hit = c.lookup(rid, r.tokens, args.step_timeout)
        out["lookup_hit_tokens"] = hit
        out["chunks_found"] = hit // r.chunk_size
        if hit:
            blocks = {layer: r.src_ids[r.layout.group_of_layer[layer]] for layer in range(len(r.geo.layer_kinds))}
            gc.poison(c, blocks)
            ok, detail = c.retrieve(rid, r.tokens, r.src_ids, hit, args.step_timeout)
            check = gc.check_restore(c, r.src_ids, r.expected, chunks=r.chunks, blocks_per_chunk=r.blocks_per_chunk,
                                     restored_chunks=hit // r.chunk_size, untouched=gc.BACKGROUND)
            out["retrieve"] = {"ok": ok, "detail": detail}
            out["chunks_restored_exact"] = check["chunks_exact"]
            out["fidelity"] = {"fa": check["fa"], "gdn": check["gdn"]}
            out["foreign_writes"] = check["foreign_writes"]["bytes"]
        c.finish_request(rid)
        out["server_had_no_layout_for_model"] = f"No GPU context found for model {r.model}" in server.log_text()
        out["worker_healthy_after"] = c.worker.is_healthy
        if hit == 0:
            why = ("the worker never re-registered with the new server (its heartbeat saw no failure)"
                   if not out["reregistered_with_new_server"] else "re-registered, but still no hit")
            if out["server_had_no_layout_for_model"]:
                why += "; the server had no KV layout for the model, so its lookup answered 0"
            out["summary"] = f"0 hits after the restart: {why}"
        else:
            out["summary"] = (f"{out['chunks_found']}/{r.chunks} chunks found, "
                              f"{out.get('chunks_restored_exact', 0)} restored exactly"
                              + (" (re-registered)" if out["reregistered_with_new_server"] else ""))
        return out

    # -- verdicts --------------------------------------------------------------
    def _store_phase_report(self, r: PresetRun, rep: dict[str, Any]) -> dict[str, Any]:
        """--phase store: pass = the server confirmed the store and every chunk is on disk."""
        st, od = r.result.get("stored", {}), r.result.get("on_disk", {})
        reasons = []
        if not st.get("ok"):
            reasons.append("the server did not confirm the store")
        if od.get("objects", 0) < od.get("expected", r.chunks):
            reasons.append(f"only {od.get('objects', 0)}/{od.get('expected', r.chunks)} objects reached the fs L2")
        rep["verdict"] = "fail" if reasons else "pass"
        rep["reasons"] = reasons or [f"{r.chunks} chunks stored and on disk ({od.get('object_bytes')} B each)"]
        return rep

    def _restore_phase_report(self, r: PresetRun, rep: dict[str, Any]) -> dict[str, Any]:
        """--phase restore: one outcome (exact / miss / wrong); fail only on a wrong hit."""
        outcome, why = classify(r.result.get("xver") or {"error": "not completed: no restore result"})
        rep.update(writer=r.writer, outcome=outcome, outcome_why=why)
        rep["verdict"] = {"wrong": "fail", "error": "error"}.get(outcome, "pass")
        rep["reasons"] = [f"{outcome}: {why}"]
        return rep

    def _print_restore(self, r: PresetRun) -> None:
        res, d = r.result, self.d
        ar, rs = res["after_restart"], res["restored"]
        d.step(f"{r.geo.name}: found {ar['chunks_found']}/{r.chunks} chunks after restart "
               f"(server: {ar['l1_hits']} from L1, {ar['l2_hits']} from L2)", ar["lookup_seconds"],
               ar["chunks_found"] == r.chunks and ar["l2_hits"] > 0)
        fa, gdn = res["fidelity"]["fa"], res["fidelity"]["gdn"]
        parts = []
        if fa:
            parts.append(f"FA pages exact {fa['pages_exact']}/{fa['pages_total']}")
        if gdn:
            nr = gdn.get("blocks_not_restored_by_design")
            parts.append(f"GDN blocks exact {gdn['blocks_exact']}/{gdn['blocks_total']}"
                         + (f" (chunk-end slots; {nr} non-end slots not stored by design)" if nr else ""))
        fw = res["foreign_writes"]
        d.step(f"{r.geo.name}: restored into other blocks: {rs['chunks_restored_exact']}/{r.chunks} chunks exact; "
               + ", ".join(parts) + f"; foreign bytes changed {fw['bytes']}", rs["seconds"],
               rs["chunks_restored_exact"] == r.chunks and fw["bytes"] == 0)

    def preset_report(self, r: PresetRun) -> dict[str, Any]:
        rep: dict[str, Any] = {"preset": r.geo.name, "geometry": r.geo.to_json(), "model_name": r.model,
                               "chunk_size": r.chunk_size, "chunks": r.chunks,
                               "blocks_per_chunk": r.blocks_per_chunk, "num_logical_blocks": r.num_blocks,
                               "block_ids": {"store": r.src_ids, "retrieve": r.dst_ids},
                               "engine_groups": _json_infos(r.layout.infos if r.layout else None),
                               "engine_groups_after_restart": _json_infos(
                                   r.restore_layout.infos if r.restore_layout else None)}
        rep.update({k: v for k, v in r.result.items() if k != "traceback"})
        reasons: list[str] = []
        if r.error and self.args.transfer_mode != "lmcache_driven" \
                and any(m in r.error for m in ENGINE_DRIVEN_REFUSALS):
            # The engine-driven path refusing a multi-group model: a loud
            # failure (the pristine outcome), not an infrastructure error.
            rep["verdict"], rep["loud_refusal"] = "fail", True
            rep["reasons"] = [f"loud refusal ({r.error.splitlines()[0]})"]
            return rep
        if r.error:
            rep["verdict"], rep["reasons"] = "error", [r.error]
            if "traceback" in r.result:
                rep["traceback"] = r.result["traceback"]
            if self.args.phase == "restore":
                rep.update(writer=r.writer, outcome="error", outcome_why=r.error.splitlines()[0])
            return rep
        if self.args.phase == "store":
            return self._store_phase_report(r, rep)
        if self.args.phase == "restore":
            return self._restore_phase_report(r, rep)
        st = r.result.get("stored", {})
        if not st.get("ok"):
            reasons.append("the server did not confirm the store")
        od = r.result.get("on_disk", {})
        if od.get("objects", 0) < od.get("expected", r.chunks):
            reasons.append(f"only {od.get('objects', 0)}/{od.get('expected', r.chunks)} objects reached the fs L2")
        ar = r.result.get("after_restart")
        if ar is None:
            rep["verdict"], rep["reasons"] = "error", ["not completed: the run stopped before the restore"]
            return rep
        if ar["hit_tokens"] == 0:
            reasons.append("0 hits after the restart (nothing restored: a vacuous pass is a fail)")
        elif ar["chunks_found"] < r.chunks:
            reasons.append(f"lost chunks: {ar['chunks_found']}/{r.chunks} found after the restart")
        if ar["hit_tokens"] and ar["l2_hits"] == 0:
            reasons.append("0 L2 hits after the restart (the server did not serve from disk)")
        rs = r.result["restored"]
        if ar["hit_tokens"] and not rs["retrieve"]["ok"]:
            reasons.append(f"retrieve failed: {rs['retrieve']['detail']}")
        fa, gdn = r.result["fidelity"]["fa"], r.result["fidelity"]["gdn"]
        if fa and fa["pages_total"] and fa["pages_exact"] < fa["pages_total"]:
            reasons.append(f"wrong FA bytes: {fa['pages_exact']}/{fa['pages_total']} kernel pages exact "
                           f"({fa['pages_fraction']:.1%}), {fa['bytes_total'] - fa['bytes_equal']} bytes differ")
        if gdn and gdn["blocks_total"] and gdn["blocks_exact"] < gdn["blocks_total"]:
            reasons.append(f"wrong GDN bytes: {gdn['blocks_exact']}/{gdn['blocks_total']} blocks exact")
        fw = r.result["foreign_writes"]
        if fw["bytes"]:
            reasons.append(f"foreign writes: {fw['bytes']} bytes in {fw['blocks']} blocks outside the destination")
        if gdn is not None and ar["hit_tokens"] and not gdn["blocks_total"]:
            reasons.append("no GDN slot expected to be restored (the expectation is broken)")
        rep["verdict"] = "fail" if reasons else "pass"
        nr = (gdn or {}).get("blocks_not_restored_by_design")
        rep["reasons"] = reasons or ["every stored chunk came back from L2 after a hard kill, byte-exact, "
                                     "into other block ids, with no foreign write"
                                     + (f" (GDN: the chunk-end slot of each chunk, which is all the server "
                                        f"stores; {nr} non-end slots stay unrestored)" if nr else "")]
        return rep


# ---------------------------------------------------------------------------
# Report, CLI
# ---------------------------------------------------------------------------


def versions() -> dict[str, Any]:
    import importlib.metadata as md  # noqa: PLC0415

    out: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable,
                           "platform": platform.platform()}
    for dist in ("lmcache", "torch"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        import lmcache  # noqa: PLC0415

        pkg = Path(lmcache.__file__).resolve().parent
        out["lmcache_dir"] = str(pkg.parent)
        stamp = pkg.parent / ".provisioned"
        if stamp.exists():
            out["overlay"] = json.loads(stamp.read_text())
    except Exception as exc:  # noqa: BLE001
        out["lmcache_import_error"] = f"{type(exc).__name__}: {exc}"
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", metavar="NAME",
                    help="geometry preset (repeatable; 'all' = every preset but vLLM 0.30+'s GDN view, "
                         f"which no LMCache version runs on CPU: {', '.join(ALL_PRESETS)}; default all)")
    ap.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    ap.add_argument("--json-out", metavar="PATH", help="also write the JSON report to PATH")
    ap.add_argument("--chunks", type=int, default=3, help="chunks in the stored request (default 3)")
    ap.add_argument("--chunk-blocks", type=int, default=2,
                    help="logical blocks per LMCache chunk (chunk size = this x N; default 2)")
    ap.add_argument("--chunk-size", type=int, help="explicit LMCache chunk size in tokens (overrides --chunk-blocks)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--copies", type=int, default=1,
                    help="--phase store: independent requests per preset, each under its own model name, "
                         f"copy i with seed + {COPY_SEED_STEP}*i (default 1)")
    ap.add_argument("--window-rule", choices=list(geometry.WINDOW_RULES), default="connector",
                    help="EngineGroupInfo window fields the clients send: connector (the installed connector's "
                         "own rule: 0.5.4+ give the GDN group sw_size_tokens = N; default) | none | end")
    ap.add_argument("--restart-window-rule", choices=list(geometry.WINDOW_RULES),
                    help="the same for the fresh client after the restart (default: --window-rule); with "
                         "--restart-pythonpath pass the restarted version's rule (none: 0.5.3, end: 0.5.4+)")
    ap.add_argument("--l1-size-gb", type=float, help="server L1 size (default: sized from the presets, >= 1)")
    ap.add_argument("--step-timeout", type=float, default=60.0,
                    help="bound for each store/flush/lookup/retrieve wait, seconds (default 60)")
    ap.add_argument("--server-timeout", type=float, default=120.0,
                    help="bound for a server to report healthy, seconds (default 120)")
    ap.add_argument("--stay-alive", action=argparse.BooleanOptionalAction, default=True,
                    help="run the optional stay-alive worker arm (reported, not part of the verdict)")
    ap.add_argument("--heartbeat-interval", type=float,
                    help="worker heartbeat seconds (default: the adapter's own, 10 s in 0.5.3)")
    ap.add_argument("--restart-pythonpath", metavar="PATH",
                    help="experiment: run the restarted server B with this PYTHONPATH (another lmcache tree, e.g. "
                         "pristine after patched) to see what a build switch over a persistent L2 does")
    ap.add_argument("--phase", choices=["both", "store", "restore"], default="both",
                    help="both (default): the restore gate. store: store and flush into --l2-dir, SIGKILL, write "
                         "--state-out. restore: a fresh server over --l2-dir restores what each --state-in "
                         "stored and judges it exact/miss/wrong (verify/xver_gate.py runs the two in two venvs)")
    ap.add_argument("--connector-edits", action=argparse.BooleanOptionalAction, default=None,
                    help="register through the installed connector's own kv_cache_group_edits (0.5.6 re-views a "
                         "hybrid's sub-paged attention); default: on with --phase store/restore, off otherwise")
    ap.add_argument("--l2-dir", metavar="DIR", help="--phase store/restore: the persistent fs L2 directory")
    ap.add_argument("--state-out", metavar="PATH", help="--phase store: where to write the state for readers")
    ap.add_argument("--state-in", action="append", metavar="PATH",
                    help="--phase restore: a writer's state file (repeatable: writers use distinct model names)")
    ap.add_argument("--model-prefix", default="xver",
                    help="--phase store: model names are PREFIX-<preset>-<random> (no '@' or '+')")
    ap.add_argument("--transfer-mode", choices=list(TRANSFER_MODES), default="lmcache_driven",
                    help="server --supported-transfer-mode and the clients' lmcache.mp.mp_transfer_mode "
                         "(default lmcache_driven; engine_driven: the worker gathers/scatters CPU bytes, "
                         "PREPARE/COMMIT; auto: the server loads both modules and the clients pick by "
                         "device, i.e. engine_driven on CPU); docs/design/engine-driven.md")
    ap.add_argument("--client-malloc-perturb", type=lambda v: int(v, 0), metavar="BYTE",
                    help="glibc mallopt(M_PERTURB, BYTE) in this (client) process, servers untouched: "
                         "memory the worker allocates then starts as BYTE^0xff instead of zeros or an "
                         "earlier allocation's bytes, so an object byte that no transfer writes shows up "
                         "in the object-identity comparison every time (e.g. 0x5A)")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary directories (logs, L2 files)")
    ap.add_argument("--verbose", action="store_true", help="let lmcache's client-side logging through to stderr")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--list-presets", action="store_true")
    args = ap.parse_args(argv)
    names = args.preset or ["all"]
    out: list[str] = []
    for n in names:
        for part in n.split(","):
            part = part.strip()
            if part == "all":
                out.extend(ALL_PRESETS)
            elif part:
                try:
                    gate_preset(part)
                except KeyError as exc:
                    ap.error(str(exc))
                out.append(part)
    args.preset = list(dict.fromkeys(out))
    if args.chunks < 1 or args.chunk_blocks < 1:
        ap.error("--chunks and --chunk-blocks must be >= 1")
    if args.copies < 1 or (args.copies > 1 and args.phase != "store"):
        ap.error("--copies N (N >= 1) is for --phase store")
    if args.connector_edits is None:
        args.connector_edits = args.phase != "both"
    if args.phase != "both":
        if not args.l2_dir or not Path(args.l2_dir).is_dir():
            ap.error(f"--phase {args.phase} needs --l2-dir, an existing directory (got {args.l2_dir!r})")
        if args.phase == "store" and not args.state_out:
            ap.error("--phase store needs --state-out")
        if args.phase == "restore" and not args.state_in:
            ap.error("--phase restore needs at least one --state-in")
        if "@" in args.model_prefix or "+" in args.model_prefix:
            ap.error("--model-prefix may not contain '@' or '+'")
    return args


@contextmanager
def quiet_library_output(log_path: Path | None) -> Iterator[Any]:
    """Send fd 1 and fd 2 (lmcache's client-side logging, warnings) to a file.

    Yields ``(stdout, stderr)`` file objects on the ORIGINAL descriptors, for
    the report and the progress lines.
    """
    out = os.fdopen(os.dup(1), "w", buffering=1)
    err = os.fdopen(os.dup(2), "w", buffering=1)
    if log_path is None:
        try:
            yield out, err
        finally:
            out.close()
            err.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield out, err
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        out.close()
        err.close()


def malloc_perturb(byte: int) -> None:
    """glibc ``mallopt(M_PERTURB, byte)`` for this process (the gate's client,
    which is the engine-driven worker): new heap memory is filled with
    ``byte ^ 0xff``, freed memory with ``byte``, instead of whatever it held.
    ``M_MMAP_THRESHOLD`` goes to glibc's maximum so large buffers come from
    the heap too, not from fresh (zeroed) mappings."""
    import ctypes  # noqa: PLC0415

    if not 0 < byte < 256:
        raise SystemExit(f"restore_gate.py: --client-malloc-perturb {byte}: give a byte 1..255")
    libc = ctypes.CDLL(None)
    m_mmap_threshold, m_perturb = -3, -6
    if not (libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024) and libc.mallopt(m_perturb, byte)):
        raise SystemExit("restore_gate.py: --client-malloc-perturb: mallopt refused (not glibc?)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_presets:
        for g in geometry.PRESETS.values():
            print(f"{g.name:18} {g.description}")
        return EXIT_PASS
    t_start = time.monotonic()
    if args.client_malloc_perturb is not None:
        malloc_perturb(args.client_malloc_perturb)
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    client_log = None if args.verbose else Path(os.environ.get("TMPDIR", "/tmp")) / \
        f"lmcache-restore-gate-client-{os.getpid()}.log"
    report: dict[str, Any] = {"tool": "restore_gate", "schema": SCHEMA}
    with quiet_library_output(client_log) as (out, err):
        d = Display(err, args.quiet)
        gate = Gate(args, d)
        error: str | None = None
        def header() -> None:
            report["versions"] = versions()
            v = report["versions"]
            d.head(f"lmcache {v.get('lmcache')} from {v.get('lmcache_dir')}"
                   + (f" (overlay, {len(v['overlay'].get('patches', []))} patches)" if v.get("overlay") else "")
                   + f", torch {v.get('torch')}, python {v.get('python')}")

        gate.on_imported = header
        try:
            d.head({"both": "LMCache CPU restore gate: ", "store": "xver writer phase (store, flush, kill): ",
                    "restore": "xver reader phase (fresh server over a persistent L2): "}[args.phase]
                   + (", ".join(args.preset) if args.phase != "restore" else f"{len(args.state_in)} writer(s)"))
            gate.run()
        except GateError as exc:
            error = str(exc)
        except (KeyboardInterrupt, SystemExit) as exc:
            error = f"interrupted ({type(exc).__name__})"
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        finally:
            for r in gate.runs:
                if r.client1 is not None:
                    try:
                        r.client1.close(graceful=False)
                    except Exception:  # noqa: BLE001
                        pass
        if "versions" not in report:
            try:
                report["versions"] = versions()
            except Exception as exc:  # noqa: BLE001
                report["versions"] = {"error": f"{type(exc).__name__}: {exc}"}
        presets = [gate.preset_report(r) for r in gate.runs]
        verdicts = [p["verdict"] for p in presets]
        if error or "error" in verdicts or not presets:
            verdict, code = "error", EXIT_ERROR
            reason = error or next((f"{p['preset']}: {p['reasons'][0]}" for p in presets
                                    if p["verdict"] == "error"), "no preset ran")
        elif "fail" in verdicts:
            verdict, code = "fail", EXIT_FAIL
            reason = "; ".join(f"{p['preset']}: {p['reasons'][0]}" for p in presets if p["verdict"] == "fail")
        else:
            verdict, code = "pass", EXIT_PASS
            reason = {"both": f"all {len(presets)} presets restored byte-exact from L2 after a hard kill",
                      "store": f"all {len(presets)} presets stored and on disk; server killed",
                      "restore": f"no wrong hit in {len(presets)} restores ("
                                 + ", ".join(f"{o} {sum(p.get('outcome') == o for p in presets)}"
                                             for o in ("exact", "miss")) + ")"}[args.phase]
        if client_log is not None and verdict == "error":
            try:
                report["client_log_tail"] = procs.ansi_strip(client_log.read_text("utf-8", "replace")).splitlines()[-60:]
            except OSError:
                pass
        timings = dict(gate.timings)
        timings["total"] = round(time.monotonic() - t_start, 3)
        if args.transfer_mode != "lmcache_driven":
            report["transfer_mode"] = args.transfer_mode
        report.update(verdict=verdict, exit_code=code, reason=reason, server=gate.server_info, timings=timings,
                      cycles=gate.cycles, presets=presets,
                      options={"chunks": args.chunks, "chunk_blocks": args.chunk_blocks, "chunk_size": args.chunk_size,
                               "seed": args.seed, "stay_alive": args.stay_alive,
                               "restart_pythonpath": args.restart_pythonpath, "phase": args.phase,
                               "connector_edits": args.connector_edits,
                               "l2_dir": args.l2_dir, "state_in": args.state_in, "state_out": args.state_out,
                               "window_rule": args.window_rule,
                               "restart_window_rule": args.restart_window_rule or args.window_rule,
                               "heartbeat_interval": args.heartbeat_interval},
                      cleanup_errors=getattr(gate, "cleanup_errors", []),
                      client_log=str(client_log) if client_log and args.keep_tmp else None)
        d.line()
        for p in presets:
            d.verdict((f"{p['writer']} -> " if p.get("writer") else "")
                      + f"{p['preset']:16} {p['verdict'].upper():5} {p['reasons'][0]}",
                      {"pass": True, "fail": False}.get(p["verdict"]))
        d.verdict(f"restore gate: {verdict.upper()} ({reason.splitlines()[0] if reason else ''}) "
                  f"in {timings['total']:.1f} s", {"pass": True, "fail": False}.get(verdict))
        if error and not args.quiet:
            d.line(error)
        text = json.dumps(report, indent=2, default=str)
        if args.json_out:
            Path(args.json_out).write_text(text + "\n")
        if args.json:
            out.write(text + "\n")
            out.flush()
    if client_log is not None and not args.keep_tmp:
        client_log.unlink(missing_ok=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
