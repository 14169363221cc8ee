#!/usr/bin/env python3
"""CPU restore gate: store, hard-kill, restart, restore -- through the real server.

Run BY PATH in the target interpreter (the venv whose lmcache is under test;
prepend an overlay to PYTHONPATH to test a patched tree -- the server inherits
it)::

    <venv>/bin/python -m gate.restore_gate --json [--preset NAME ...]

Per server cycle (presets that share a chunk size share one):

1. start ``<venv>/bin/lmcache server`` on 127.0.0.1 (free ZMQ/HTTP ports), L1
   plus an ``fs`` L2 in a fresh temporary directory (or, with ``--redis-url``,
   LMCache's ``resp`` adapter on that Redis server), ``lmcache_driven``
   transfers; ready when ``GET /healthcheck`` answers ``{"status": "healthy"}``;
2. per preset, a client (LMCache's own vLLM scheduler + worker adapters)
   registers CPU KV caches in vLLM 0.27.1's geometry, fills them AFTER
   registration (the server maps the same shared memory), looks the prompt up
   (a miss, as vLLM does first), stores a multi-chunk request, ends the session;
3. waits until every chunk is a ``.data`` file in the L2 directory (a key in Redis);
4. SIGKILLs the server's process group, reaps it, verifies it is gone and
   removes its L1 shared-memory segment;
5. starts a fresh server on the same ports and L2 directory (on a Redis tier:
   another node, a server on other ports over the same Redis);
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

The server side is ``gate.restore_server``, the client steps
``restore_steps``, the verdicts ``restore_verdict``; ``Gate`` is layered by
responsibility: ``restore_lifecycle.ServerLifecycle`` (run state, phase
timings, server start / SIGKILL / restart), ``restore_cycle.CycleSteps``
(store, flush, restore and stay-alive steps and their progress lines) and,
here, the phases that order them; ``restore_display.Display`` prints the
progress lines.  This script plans the server pairs, runs the phases and
writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gate import geometry, procs, tier_objects
from gate.restore_cycle import CycleSteps
from gate.restore_display import Display
from gate.restore_env import quiet_library_output, versions
from gate.restore_plan import GateError, PresetRun, json_infos, plan_cycles
from gate.restore_server import (HEALTH_PATH, ServerSpec, await_server, kill_server,
                                                  l2_adapters_status, launch_server, object_groups,
                                                  server_lmcache_dir)
from gate.l2_tier import RespTier, Tier, listing, tier_of
from gate.restore_verdict import preset_report
from gate.xver_outcome import preset as gate_preset
from gate.xver_state import STATE_SCHEMA, expected_digest

# What this module offers by name, the server plumbing it imports included:
# probes and benches take those from here (bench/bench_engine_driven.py uses
# rg.launch_server, rg.await_server, rg.ServerSpec, rg.versions,
# rg.quiet_library_output), as they did before Gate was split into
# restore_lifecycle / restore_cycle.
__all__ = ["ALL_PRESETS", "COPY_SEED_STEP", "EXIT_ERROR", "EXIT_FAIL", "EXIT_PASS", "SCHEMA", "STALE_SHM",
           "TRANSFER_MODES", "Display", "Gate", "GateError", "HEALTH_PATH", "PresetRun", "RespTier",
           "ServerSpec", "Tier", "await_server", "kill_server", "l2_adapters_status", "launch_server",
           "listing", "main", "malloc_perturb", "native_get_failures", "object_groups", "parse_args",
           "quiet_library_output", "server_lmcache_dir", "stale_client_segments", "tier_of", "versions"]

SCHEMA = 1
EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
# --preset all: vLLM 0.30+'s GDN view (unpadded row, padded stride) is refused
# on CPU by every LMCache version (docs/ports.md); name such a preset to run it.
ALL_PRESETS = tuple(n for n, g in geometry.PRESETS.items() if g.gdn_view != "0.30")
TRANSFER_MODES = ("lmcache_driven", "engine_driven", "auto")
# --copies: copy i of a preset uses seed + i * COPY_SEED_STEP (a run also draws seed + 1).
COPY_SEED_STEP = 100


# LMCache's CPU clients put their KV caches in POSIX shared memory named
# /lmcache_kv_<pid>_<n> (platform/cpu/shm.py) and create it exclusively.  A
# segment with this process's pid was left by a dead process that had the
# same pid (pids wrap at pid_max): the first register would fail with
# FileExistsError, so the gate refuses before starting anything.
STALE_SHM = "stale shared-memory segments named for pid"


def stale_client_segments(shm: Path = Path("/dev/shm")) -> list[str]:
    """Segments named like this process's LMCache CPU clients' that it did not make."""
    return sorted(p.name for p in shm.glob(f"lmcache_kv_{os.getpid()}_*"))


# LMCache's native connector clients (RESP, ...) print one line per failed key
# load to the server's output, e.g. "[LMCache GET] key K failed: buffer size
# mismatch": the server's own account of why a stored object was a miss.
_NATIVE_GET_FAILED = re.compile(r"\[LMCache GET\] key \S+ failed: (.+?)\s*$", re.MULTILINE)


def native_get_failures(server_log: str) -> dict[str, int]:
    """Failed native-client key loads in a server's log, by reason."""
    out: dict[str, int] = {}
    for reason in _NATIVE_GET_FAILED.findall(server_log):
        out[reason] = out.get(reason, 0) + 1
    return out


# ---------------------------------------------------------------------------
# The gate: server pairs and phases (the client steps are restore_steps.ClientSteps,
# the verdicts restore_verdict.preset_report, the server restore_server; the
# server lifecycle is restore_lifecycle.ServerLifecycle, the store/restore steps
# restore_cycle.CycleSteps)
# ---------------------------------------------------------------------------


class Gate(CycleSteps):
    """The phases: --phase both (_cycle), store (_store_cycle), restore (_run_restore_phase)."""

    def run(self) -> None:
        args = self.args
        stale = stale_client_segments()
        if stale:
            raise GateError(f"{STALE_SHM} {os.getpid()}: {', '.join(stale[:3])}"
                            + (f" (+{len(stale) - 3})" if len(stale) > 3 else "")
                            + "; this process's clients would collide with them (run again: another pid)")
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

    def _cycle(self, n: int, chunk: int, runs: list[PresetRun]) -> None:
        """--phase both: store, flush, hard kill, restart, restore."""
        cycle = self._new_cycle(n, chunk, runs)
        workdir = self.sup.tempdir(prefix="lmcache-restore-gate-")
        l2_dir = workdir / "l2"
        l2_dir.mkdir()
        cycle["workdir"] = str(workdir)
        tier = tier_of(l2_dir, self.args.redis_url)
        # 1.-3. first server, store, every chunk on disk
        server, spec = self._start_server(cycle, chunk, self._l1_gb(runs), tier, workdir, "A", "server_start_1")
        self._store_all(cycle, runs, spec, server, "restore-gate")
        self._flush(cycle, runs, tier, server)
        if self.args.redis_url:
            # Node A's clients go with node A (server B is another node): closed
            # while their server is up, as a clean shutdown of that node would.
            self._close_first_clients(runs)
        # 4. hard kill
        t_kill = time.monotonic()
        self._kill(cycle, server, "A")
        # 5. fresh server on the same ports and L2 directory (Redis: another node)
        server, spec, restart_window = self._restart(cycle, spec, t_kill)
        # 6. fresh client: look up, prefetch from L2, retrieve elsewhere, compare
        self._restore_all(cycle, runs, spec, server)
        if isinstance(tier, RespTier):
            cycle["l2_adapters_status"] = l2_adapters_status(spec)
        # 7. optional: the worker that stayed alive across the restart
        self._stay_alive_arm(cycle, runs, server, restart_window)
        with self.phase(cycle, "shutdown"):
            cycle["servers"][-1]["kill"] = kill_server(server)

    # -- cross-version phases (lab/xver_gate.py runs them in two venvs) ----
    def _store_cycle(self, n: int, chunk: int, runs: list[PresetRun]) -> None:
        """--phase store: start, store, flush to ``--l2-dir``, SIGKILL.  Nothing is restored here."""
        args = self.args
        cycle = self._new_cycle(n, chunk, runs)
        workdir = self.sup.tempdir(prefix="lmcache-xver-store-")
        cycle["workdir"] = str(workdir)
        tier = tier_of(args.l2_dir, args.redis_url)
        server, spec = self._start_server(cycle, chunk, self._l1_gb(runs), tier, workdir, "W", "server_start_1")
        self._store_all(cycle, runs, spec, server, args.model_prefix)
        self._flush(cycle, runs, tier, server)
        self._close_first_clients(runs)
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
                     "engine_groups": json_infos(r.layout.infos if r.layout else None),
                     "stored": r.result.get("stored"), "on_disk": r.result.get("on_disk")}
            entries.append(entry)
        state = {"schema": STATE_SCHEMA, "writer": self.args.model_prefix, "l2_dir": str(self.args.l2_dir),
                 "redis_url": self.args.redis_url,
                 "versions": versions(), "presets": entries}
        Path(self.args.state_out).write_text(json.dumps(state, indent=1) + "\n")

    def _load_states(self) -> dict[int, list[PresetRun]]:
        """--phase restore: every writer's stored presets (from ``--state-in``), by chunk size."""
        by_chunk: dict[int, list[PresetRun]] = {}
        for st in (json.loads(Path(p).read_text()) for p in self.args.state_in):
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
        return by_chunk

    def _run_restore_phase(self) -> None:
        """--phase restore: per chunk size, one fresh server over ``--l2-dir`` and a
        fresh client per stored (writer, preset) of every ``--state-in``; with
        ``--server-per-request`` a fresh server for each of those instead."""
        by_chunk = self._load_states()
        tier = tier_of(self.args.l2_dir, self.args.redis_url)
        groups = [(chunk, runs) for chunk, runs in by_chunk.items()]
        if self.args.server_per_request:
            groups = [(chunk, [r]) for chunk, runs in groups for r in runs]
        with procs.Supervisor(keep_paths=self.args.keep_tmp) as sup:
            self.sup = sup
            for n, (chunk, runs) in enumerate(groups, 1):
                self.d.head(f"[cycle {n}/{len(groups)}] chunk size {chunk} tokens: "
                            + ", ".join(f"{r.writer}/{r.geo.name}" for r in runs))
                cycle = self._new_cycle(n, chunk, runs)
                cycle["requests"] = [{"writer": r.writer, "preset": r.geo.name} for r in runs]
                workdir = sup.tempdir(prefix="lmcache-xver-restore-")
                cycle["workdir"] = str(workdir)
                server, spec = self._start_server(cycle, chunk, self._l1_gb(runs), tier, workdir, "R",
                                                  "server_start_2")
                for r in runs:
                    if not r.error:
                        r.result["on_disk"] = {"model_fields": listing(tier.objects(r.model))}
                self._restore_all(cycle, runs, spec, server)
                cycle["l2_adapters_status"] = l2_adapters_status(spec)
                cycle["native_get_failures"] = native_get_failures(server.log_text())
                with self.phase(cycle, "shutdown"):
                    cycle["servers"][-1]["kill"] = kill_server(server)
            self.cleanup_errors = sup.cleanup_errors

    def preset_report(self, r: PresetRun) -> dict[str, Any]:
        return preset_report(r, self.args.phase, self.args.transfer_mode)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", metavar="NAME",
                    help="geometry preset (repeatable; 'all' = every preset but vLLM 0.30+'s padded GDN view "
                         "(the *-v030 presets, which on CPU only --transfer-mode engine_driven with the "
                         f"stacked patch sets moves): {', '.join(ALL_PRESETS)}; default all)")
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
                         "stored and judges it exact/miss/wrong (lab/xver_gate.py runs the two in two venvs)")
    ap.add_argument("--connector-edits", action=argparse.BooleanOptionalAction, default=None,
                    help="register through the installed connector's own kv_cache_group_edits (0.5.6 re-views a "
                         "hybrid's sub-paged attention); default: on with --phase store/restore, off otherwise")
    ap.add_argument("--l2-dir", metavar="DIR", help="--phase store/restore: the persistent fs L2 directory")
    ap.add_argument("--redis-url", metavar="redis://HOST:PORT",
                    help="a shared Redis tier instead of fs: the servers use LMCache's resp adapter on it (the "
                         "server after the kill is another node on other ports); with --phase store/restore it "
                         "replaces --l2-dir. The gate writes keys of its own random model names there")
    ap.add_argument("--server-per-request", action="store_true",
                    help="--phase restore: a fresh server for each stored (writer, preset) request instead of one "
                         "per chunk size, so no request's loads can affect another's (a pristine native RESP "
                         "client fails every later load after one of a value of another size)")
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
    return ap


def _expand_presets(ap: argparse.ArgumentParser, names: list[str]) -> list[str]:
    """``--preset a,b --preset all`` -> known preset names, in order, once each."""
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
    return list(dict.fromkeys(out))


def _check_phase_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The options each --phase needs (a usage error, exit 2, before anything starts)."""
    if args.chunks < 1 or args.chunk_blocks < 1:
        ap.error("--chunks and --chunk-blocks must be >= 1")
    if args.copies < 1 or (args.copies > 1 and args.phase != "store"):
        ap.error("--copies N (N >= 1) is for --phase store")
    if args.server_per_request and args.phase != "restore":
        ap.error("--server-per-request is for --phase restore")
    if args.connector_edits is None:
        args.connector_edits = args.phase != "both"
    if args.redis_url:
        try:
            RespTier.from_url(args.redis_url)
        except ValueError as exc:
            ap.error(f"--redis-url {exc}")
        if args.l2_dir:
            ap.error("--redis-url and --l2-dir name two tiers; give one")
    if args.phase != "both":
        if not args.redis_url and (not args.l2_dir or not Path(args.l2_dir).is_dir()):
            ap.error(f"--phase {args.phase} needs --l2-dir, an existing directory (got {args.l2_dir!r}), "
                     "or --redis-url")
        if args.phase == "store" and not args.state_out:
            ap.error("--phase store needs --state-out")
        if args.phase == "restore" and not args.state_in:
            ap.error("--phase restore needs at least one --state-in")
        if "@" in args.model_prefix or "+" in args.model_prefix:
            ap.error("--model-prefix may not contain '@' or '+'")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = _parser()
    args = ap.parse_args(argv)
    args.preset = _expand_presets(ap, args.preset or ["all"])
    _check_phase_args(ap, args)
    return args


def malloc_perturb(byte: int) -> None:
    """glibc ``mallopt(M_PERTURB, byte)`` for this process (the gate's client,
    which is the engine-driven worker): new heap memory is filled with
    ``byte ^ 0xff``, freed memory with ``byte``, instead of whatever it held.
    ``M_MMAP_THRESHOLD`` goes to glibc's maximum so large buffers come from
    the heap too, not from fresh (zeroed) mappings."""
    import ctypes  # noqa: PLC0415 - only for --client-malloc-perturb

    if not 0 < byte < 256:
        raise SystemExit(f"restore_gate.py: --client-malloc-perturb {byte}: give a byte 1..255")
    libc = ctypes.CDLL(None)
    m_mmap_threshold, m_perturb = -3, -6
    if not (libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024) and libc.mallopt(m_perturb, byte)):
        raise SystemExit("restore_gate.py: --client-malloc-perturb: mallopt refused (not glibc?)")


def _run_gate(gate: Gate, d: Display, args: argparse.Namespace, report: dict[str, Any]) -> str | None:
    """Run the gate; the error that stopped it (None: it ran to the end).  Every
    client still open is closed, whatever happened."""
    def header() -> None:
        report["versions"] = versions()
        v = report["versions"]
        d.head(f"lmcache {v.get('lmcache')} from {v.get('lmcache_dir')}"
               + (f" (overlay, {len(v['overlay'].get('patches', []))} patches)" if v.get("overlay") else "")
               + f", torch {v.get('torch')}, python {v.get('python')}")

    gate.on_imported = header
    error: str | None = None
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
    return error


def _overall(presets: list[dict[str, Any]], error: str | None, phase: str) -> tuple[str, int, str]:
    """(verdict, exit code, reason) of the whole run from the presets' verdicts."""
    verdicts = [p["verdict"] for p in presets]
    if error or "error" in verdicts or not presets:
        reason = error or next((f"{p['preset']}: {p['reasons'][0]}" for p in presets
                                if p["verdict"] == "error"), "no preset ran")
        return "error", EXIT_ERROR, reason
    if "fail" in verdicts:
        return "fail", EXIT_FAIL, "; ".join(f"{p['preset']}: {p['reasons'][0]}" for p in presets
                                            if p["verdict"] == "fail")
    reason = {"both": f"all {len(presets)} presets restored byte-exact from L2 after a hard kill",
              "store": f"all {len(presets)} presets stored and on disk; server killed",
              "restore": f"no wrong hit in {len(presets)} restores ("
                         + ", ".join(f"{o} {sum(p.get('outcome') == o for p in presets)}"
                                     for o in ("exact", "miss")) + ")"}[phase]
    return "pass", EXIT_PASS, reason


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {"chunks": args.chunks, "chunk_blocks": args.chunk_blocks, "chunk_size": args.chunk_size,
            "seed": args.seed, "stay_alive": args.stay_alive,
            "restart_pythonpath": args.restart_pythonpath, "phase": args.phase,
            "connector_edits": args.connector_edits,
            "l2_dir": args.l2_dir, "redis_url": args.redis_url,
            "state_in": args.state_in, "state_out": args.state_out,
            "server_per_request": args.server_per_request,
            "window_rule": args.window_rule,
            "restart_window_rule": args.restart_window_rule or args.window_rule,
            "heartbeat_interval": args.heartbeat_interval}


def _print_verdicts(d: Display, presets: list[dict[str, Any]], verdict: str, reason: str, total: float) -> None:
    d.line()
    for p in presets:
        d.verdict((f"{p['writer']} -> " if p.get("writer") else "")
                  + f"{p['preset']:16} {p['verdict'].upper():5} {p['reasons'][0]}",
                  {"pass": True, "fail": False}.get(p["verdict"]))
    d.verdict(f"restore gate: {verdict.upper()} ({reason.splitlines()[0] if reason else ''}) "
              f"in {total:.1f} s", {"pass": True, "fail": False}.get(verdict))


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
        error = _run_gate(gate, d, args, report)
        presets = [gate.preset_report(r) for r in gate.runs]
        verdict, code, reason = _overall(presets, error, args.phase)
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
                      cycles=gate.cycles, presets=presets, options=_options(args),
                      cleanup_errors=gate.cleanup_errors,
                      client_log=str(client_log) if client_log and args.keep_tmp else None)
        _print_verdicts(d, presets, verdict, reason, timings["total"])
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
