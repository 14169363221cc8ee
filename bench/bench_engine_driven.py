#!/usr/bin/env python3
"""Engine-driven vs lmcache-driven: store and retrieve time per byte on CPU, in one run.

One real ``lmcache server`` with ``--supported-transfer-mode auto`` (it loads
both transfer modules; L1 only, no L2, so no background disk writes compete)
and two clients in this process, one per mode.  Each client is the restore
gate's (``gate/restore_client.Client``): LMCache's own
vLLM scheduler and worker adapters, with ``lmcache.mp.mp_transfer_mode`` set
to ``lmcache_driven`` (the server maps the worker's shared-memory KV and runs
the copy kernels) or ``engine_driven`` (the worker gathers to CPU bytes and
hands them over with PREPARE/COMMIT; the server never sees a KV tensor).
Each client registers its own model name, so the two never share objects.

After one untimed warm-up round per mode, ``--rounds`` rounds follow; each
round draws a fresh prompt (``--chunks`` full chunks of ``--chunk-blocks``
logical blocks), used by both modes, and runs the modes one after the other,
alternating which goes first.  Per mode and round:

* LOOKUP (a miss, as vLLM does first), then the STORE is timed
  (``submit_store_request`` until its future resolves), END_SESSION;
* untimed: wait until the server's L1 holds no staging or write-locked
  object (lmcache-driven finishes the write in a host callback just after
  answering, so a lookup at once could miss);
* bytes moved: what the store added to the server's L1
  (``GET /status`` -> ``l1_manager.memory_used_bytes``, after minus before);
* LOOKUP again (the prefetch; timed apart, not part of the ratio), then the
  RETRIEVE is timed (``submit_retrieve_request`` until its future resolves,
  scatter included), END_SESSION;
* untimed: the restored blocks are compared byte for byte with the source
  (``restore_client.check_restore``).

Each round also times a plain ``memcpy`` (libc ``memmove``, one thread) of
the same number of bytes between two warm buffers of this process: the floor
of what any path that copies the bytes once can cost on this machine.  The
1-minute load average is sampled before every round: the machine is shared,
and the ratios depend on it (EXPLAINER 10.6).

It prints, per mode, the bytes moved, the median store and retrieve s/GiB and
their sum, the memcpy floor in s/GiB, engine-driven / lmcache-driven ratios of
the medians, each mode's medians over the floor, and the load (start, end,
range over the rounds).  It also prints the CPU seconds per GiB the client and
the server process spent together on each store (with its commit) and
retrieve (``/proc/<pid>/task/*/schedstat``, untimed reads): on a loaded
machine the wall-clock ratios mostly measure the scheduler, the CPU time what
each path costs.  No timing is asserted; the exit code is 1 only if a
store or retrieve failed or a restored byte was wrong, 2 on an infrastructure
error.

Run with any Python 3: it provisions the runtime venv and overlay
(``lab/provision.py``) and re-runs itself there::

    python3 bench/bench_engine_driven.py                              # 0.5.6, hybrid-fa + engine-driven, qwen35-0.8b
    python3 bench/bench_engine_driven.py --build pristine --preset pure-attn-k1
    python3 bench/bench_engine_driven.py --rounds 7 --chunks 6 --json

``--build``: ``stacked`` (patches/hybrid-fa/V + patches/engine-driven/V, the
default), ``hybrid-fa`` or ``pristine``.  ``--overlay DIR`` runs an lmcache
tree instead (a ``lab/workspace.py`` workspace while authoring a part).  A pristine or hybrid-fa build
refuses a hybrid preset in engine-driven mode (docs/design/engine-driven.md,
section 3); pure-attn-k1 runs in both modes on every build.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODES = ("engine_driven", "lmcache_driven")
BUILDS = ("stacked", "hybrid-fa", "pristine")
INNER_ENV = "LMCACHE_PATCHTOOL_BENCH_ED_INNER"
GIB = 2 ** 30


# ---------------------------------------------------------------------------
# Outer: provision, then re-run in the runtime venv over the overlay
# ---------------------------------------------------------------------------


def build_patches(version: str, build: str) -> list[Path]:
    hybrid = sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch"))
    engine = sorted((REPO / "patches" / "engine-driven" / version).glob("*.patch"))
    if build == "pristine":
        return []
    if not hybrid:
        raise SystemExit(f"bench_engine_driven: no hybrid-fa set for {version} (patches/hybrid-fa/{version}/)")
    if build == "hybrid-fa":
        return hybrid
    if not engine:
        raise SystemExit(f"bench_engine_driven: no engine-driven set for {version} "
                         f"(patches/engine-driven/{version}/*.patch); use --build pristine or hybrid-fa "
                         "with --preset pure-attn-k1")
    return hybrid + engine


def outer(args: argparse.Namespace, argv: list[str]) -> int:
    from lab import provision  # noqa: PLC0415

    patches = [] if args.overlay else build_patches(args.version, args.build)
    python = provision.runtime_env(args.version) / "bin" / "python"
    if args.overlay:
        if not (args.overlay / "lmcache" / "__init__.py").is_file():
            raise SystemExit(f"bench_engine_driven: --overlay {args.overlay}: no lmcache/__init__.py there")
        overlay = args.overlay.resolve()
    else:
        overlay = provision.overlay(args.version, patches or None)
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1")
    env[INNER_ENV] = json.dumps({"overlay": str(overlay), "patches": [str(p.relative_to(REPO)) for p in patches],
                                 "tree": bool(args.overlay)})
    return subprocess.run([str(python), str(Path(__file__).resolve()), *argv], env=env).returncode


# ---------------------------------------------------------------------------
# Inner: the run itself (torch + lmcache importable)
# ---------------------------------------------------------------------------


def l1_only_spec(rg: Any, *args: Any, **kw: Any) -> Any:
    """The restore gate's ``ServerSpec`` without its ``--l2-adapter`` (L1 only)."""

    class L1OnlySpec(rg.ServerSpec):
        def argv(self) -> list[str]:
            argv = super().argv()
            i = argv.index("--l2-adapter")
            return argv[:i] + argv[i + 2:]

    return L1OnlySpec(*args, **kw)


def l1_status(spec: Any) -> dict[str, Any]:
    url = f"http://{spec.host}:{spec.http_port}/status"
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - loopback only
        doc = json.loads(resp.read())
    sm = doc["storage_manager"]
    return sm.get("l1_manager") or next(iter(sm["l1_managers"].values()))


def cpu_seconds(pid: int | str) -> float:
    """CPU time all threads of ``pid`` have run so far (``/proc/<pid>/task/*/schedstat``,
    nanoseconds: finer than the clock ticks of ``/proc/<pid>/stat``)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that just ended
    return total / 1e9


class ModeRun:
    """One client (one mode, one model) and its per-round figures."""

    def __init__(self, gc: Any, geometry: Any, geo: Any, mode: str, spec: Any, args: argparse.Namespace,
                 server_pid: int) -> None:
        self.gc, self.mode, self.geo, self.args = gc, mode, geo, args
        self.model = f"bench-ed-{mode}-{geo.name}-{uuid.uuid4().hex[:8]}"
        self.layout = gc.Layout(geo, geometry.engine_group_infos(geo, "connector"))
        self.blocks_per_chunk = args.chunk_blocks
        per_group = args.chunks * args.chunk_blocks
        self.num_blocks = 1 + 2 * self.layout.num_groups * per_group + 2
        self.src = gc.choose_block_ids(self.layout.num_groups, per_group, self.num_blocks, args.seed)
        # One client stores and retrieves, so the destinations must avoid every source
        # block (the gate's differ_from only avoids the same position's).
        used = {b for ids in self.src for b in ids}
        pool = [b for b in range(1, self.num_blocks) if b not in used]
        random.Random(args.seed + 1).shuffle(pool)
        self.dst = [pool[g * per_group:(g + 1) * per_group] for g in range(self.layout.num_groups)]
        self.client = gc.Client(spec.zmq_url, self.model, self.layout, mq_timeout=args.step_timeout,
                                transfer_mode=mode)
        self.server_pid = server_pid
        self.client.register(geometry.build_kv_caches(geo, self.num_blocks, fill=0))
        self.expected = gc.fill_source(self.client, self.src, args.seed)  # after registration
        self.dst_blocks = {layer: self.dst[self.layout.group_of_layer[layer]]
                           for layer in range(len(geo.layer_kinds))}
        self.rows: list[dict[str, Any]] = []

    def round(self, tokens: list[int], spec: Any, warmup: bool) -> dict[str, Any]:
        gc, a = self.gc, self.args
        end = a.chunks * a.chunk_blocks * self.geo.tokens_per_block
        rid = f"bench-store-{uuid.uuid4().hex[:10]}"
        miss = self.client.lookup(rid, tokens, a.step_timeout)
        used0 = l1_status(spec)["memory_used_bytes"]
        cpu0 = cpu_seconds("self") + cpu_seconds(self.server_pid)  # untimed
        t0 = time.perf_counter()
        stored = self.client.store(rid, tokens, self.src, end, a.step_timeout)
        store_s = time.perf_counter() - t0
        self.client.finish_request(rid)
        # Untimed: until the server has committed (lmcache-driven: finish_write runs
        # as a host callback after the copy, so the answer can precede it by a few
        # ms and a lookup at once could miss).
        t0 = time.perf_counter()
        deadline = t0 + a.step_timeout
        while True:
            st = l1_status(spec)
            # 0.5.3-0.5.5's /status has no staging_object_count (0.5.6 added it).
            if (st.get("staging_object_count", 0) == 0 and st["write_locked_count"] == 0) \
                    or time.perf_counter() > deadline:
                break
            time.sleep(0.002)
        commit_wait_s = time.perf_counter() - t0
        moved = st["memory_used_bytes"] - used0
        # CPU of both processes over the store and the commit wait (the HTTP
        # polls above are in it for both modes alike).
        store_cpu_s = cpu_seconds("self") + cpu_seconds(self.server_pid) - cpu0

        gc.poison(self.client, self.dst_blocks)
        rid = f"bench-retrieve-{uuid.uuid4().hex[:10]}"
        t0 = time.perf_counter()
        hit = self.client.lookup(rid, tokens, a.step_timeout)
        lookup_s = time.perf_counter() - t0
        ok, detail = False, "no hit"
        cpu0 = cpu_seconds("self") + cpu_seconds(self.server_pid)  # untimed
        t0 = time.perf_counter()
        if hit:
            ok, detail = self.client.retrieve(rid, tokens, self.dst, hit, a.step_timeout)
        retrieve_s = time.perf_counter() - t0
        retrieve_cpu_s = cpu_seconds("self") + cpu_seconds(self.server_pid) - cpu0
        self.client.finish_request(rid)
        # Untimed.  The source blocks are not poison, so the check's foreign-write
        # count is meaningless here; only the restored positions are judged.
        check = gc.check_restore(self.client, self.dst, self.expected, chunks=a.chunks,
                                 blocks_per_chunk=self.blocks_per_chunk, restored_chunks=hit // (end // a.chunks),
                                 untouched=gc.POISON)
        row = {"warmup": warmup, "miss_tokens": miss, "stored": stored, "bytes": moved, "store_s": store_s,
               "commit_wait_s": commit_wait_s, "store_cpu_s": store_cpu_s, "retrieve_cpu_s": retrieve_cpu_s,
               "lookup_s": lookup_s, "retrieve_s": retrieve_s, "hit_tokens": hit, "retrieve_ok": ok, "retrieve_detail": detail,
               "chunks_exact": check["chunks_exact"], "per_chunk_exact": [c["exact"] for c in check["per_chunk"]], "fa": check["fa"]}
        if not warmup:
            self.rows.append(row)
        return row

    def bad(self, row: dict[str, Any]) -> str | None:
        a = self.args
        end = a.chunks * a.chunk_blocks * self.geo.tokens_per_block
        if not row["stored"]:
            return "store not confirmed"
        if row["miss_tokens"]:
            return f"the lookup before the store hit {row['miss_tokens']} tokens"
        if row["hit_tokens"] != end:
            return f"lookup hit {row['hit_tokens']}/{end} tokens"
        if not row["retrieve_ok"]:
            return f"retrieve: {row['retrieve_detail']}"
        if row["chunks_exact"] != a.chunks:
            return f"{row['chunks_exact']}/{a.chunks} chunks restored byte-exact"
        return None


class MemcpyFloor:
    """A plain one-thread memcpy of ``nbytes`` between two warm buffers."""

    def __init__(self, nbytes: int) -> None:
        import ctypes  # noqa: PLC0415

        self.nbytes = nbytes
        self._src = bytearray(os.urandom(1 << 20) * max(1, -(-nbytes // (1 << 20))))[:nbytes]
        self._dst = bytearray(nbytes)  # written once below: no page faults in the timed copies
        self._memmove = ctypes.memmove
        self._src_addr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(self._src))
        self._dst_addr = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(self._dst))
        self.seconds: list[float] = []
        self.copy()

    def copy(self) -> float:
        t0 = time.perf_counter()
        self._memmove(self._dst_addr, self._src_addr, self.nbytes)
        took = time.perf_counter() - t0
        if self._dst[-1] != self._src[-1]:
            raise RuntimeError("bench_engine_driven: memcpy floor: the copy did not land")
        return took

    def round(self) -> None:
        """Three copies, keep the fastest (one round's floor)."""
        self.seconds.append(min(self.copy() for _ in range(3)))


def summarise(runs: dict[str, ModeRun], floor: MemcpyFloor, loads: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, run in runs.items():
        rows = run.rows
        nbytes = statistics.median(r["bytes"] for r in rows)
        st = [r["store_s"] / (r["bytes"] / GIB) for r in rows]
        rt = [r["retrieve_s"] / (r["bytes"] / GIB) for r in rows]
        both = [s + r for s, r in zip(st, rt)]
        st_cpu = [r["store_cpu_s"] / (r["bytes"] / GIB) for r in rows]
        rt_cpu = [r["retrieve_cpu_s"] / (r["bytes"] / GIB) for r in rows]
        out[mode] = {"model": run.model, "bytes_per_round": sorted({r["bytes"] for r in rows}),
                     "bytes_median": nbytes,
                     "store_s_per_gib": statistics.median(st), "retrieve_s_per_gib": statistics.median(rt),
                     "store_retrieve_s_per_gib": statistics.median(both),
                     "store_cpu_s_per_gib": statistics.median(st_cpu),
                     "retrieve_cpu_s_per_gib": statistics.median(rt_cpu),
                     "store_s_per_gib_range": [min(st), max(st)], "retrieve_s_per_gib_range": [min(rt), max(rt)],
                     "store_s_median": statistics.median(r["store_s"] for r in rows),
                     "retrieve_s_median": statistics.median(r["retrieve_s"] for r in rows),
                     "lookup_s_median": statistics.median(r["lookup_s"] for r in rows),
                     "rounds": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
                                for r in rows]}
    ed, ld = out["engine_driven"], out["lmcache_driven"]
    out["ratio_engine_to_lmcache"] = {
        k: ed[k] / ld[k] for k in ("store_s_per_gib", "retrieve_s_per_gib", "store_retrieve_s_per_gib",
                                   "store_cpu_s_per_gib", "retrieve_cpu_s_per_gib")}
    per_gib = [s / (floor.nbytes / GIB) for s in floor.seconds]
    out["memcpy_floor"] = {"bytes": floor.nbytes, "s_per_gib": statistics.median(per_gib),
                           "s_per_gib_range": [min(per_gib), max(per_gib)],
                           "how": "libc memmove, one thread, two warm buffers of this process; fastest of 3 per round"}
    out["ratio_to_memcpy_floor"] = {
        mode: {k: out[mode][k] / out["memcpy_floor"]["s_per_gib"] for k in ("store_s_per_gib", "retrieve_s_per_gib")}
        for mode in runs}
    out["load_1m"] = {"start": loads[0], "end": loads[-1], "min": min(loads), "max": max(loads),
                      "median": statistics.median(loads)}
    return out


def inner(args: argparse.Namespace) -> int:
    from gate import restore_gate as rg  # noqa: PLC0415
    from gate import geometry, procs  # noqa: PLC0415
    from gate.xver_outcome import preset as gate_preset  # noqa: PLC0415

    info = json.loads(os.environ.get(INNER_ENV) or "{}")
    geo = gate_preset(args.preset)
    chunk = args.chunk_blocks * geo.tokens_per_block
    # each mode keeps (1 warm-up + rounds) requests in L1; 3x head room
    full = args.chunk_blocks * (geo.num_fa_layers * geo.fa_block_bytes + geo.num_gdn_layers * geo.gdn_block_bytes)
    l1_gb = args.l1_size_gb or max(1.0, round(3 * 2 * (args.rounds + 1) * args.chunks * full / GIB, 2))
    client_log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-engine-driven-client-{os.getpid()}.log"
    code = 0
    with rg.quiet_library_output(None if args.verbose else client_log) as (out, err):
        def say(text: str) -> None:
            if not args.quiet:
                print(text, file=err, flush=True)

        try:
            report = measure(args, rg, geometry, procs, geo, chunk, l1_gb, info, say)
        except Exception as exc:  # noqa: BLE001 - one line, the exit code says error
            print(f"bench_engine_driven: ERROR: {type(exc).__name__}: {exc}", file=err, flush=True)
            if not args.verbose:
                print(f"(lmcache's client log: {client_log})", file=err, flush=True)
            return 2
        if args.json:
            out.write(json.dumps(report, indent=2) + "\n")
        else:
            out.write(text_report(report))
        code = 1 if report["failures"] else 0
    if not args.verbose and not args.keep_log:
        client_log.unlink(missing_ok=True)
    return code


def measure(args: argparse.Namespace, rg: Any, geometry: Any, procs: Any, geo: Any, chunk: int, l1_gb: float,
            info: dict[str, Any], say) -> dict[str, Any]:
    """Start the server, register a client per mode, run the rounds; the report."""
    runs: dict[str, ModeRun] = {}
    with procs.Supervisor() as sup:
        workdir = sup.tempdir(prefix="bench-engine-driven-")
        zp, hp = procs.free_ports(2)
        spec = l1_only_spec(rg, zp, hp, chunk, l1_gb, workdir / "unused-l2", workdir, transfer_mode="auto")
        server = rg.launch_server(sup, spec, "auto")
        from gate import restore_client as gc  # noqa: PLC0415 - loads while the server boots

        versions = rg.versions()
        rg.await_server(server, spec, args.server_timeout)
        say(f"lmcache {versions.get('lmcache')} ({args.build}: {len(info.get('patches', []))} patches) from "
            f"{versions.get('lmcache_dir')}; server pid {server.pid}, --supported-transfer-mode auto, "
            f"L1 {l1_gb:g} GB, no L2, chunk {chunk} tokens")
        try:
            for mode in MODES:
                runs[mode] = ModeRun(gc, geometry, geo, mode, spec, args, server.pid)
            rng = random.Random(args.seed)
            n_tok = args.chunks * chunk + geo.tokens_per_block // 2  # plus a partial chunk, never stored
            failures: list[str] = []
            floor: MemcpyFloor | None = None
            loads: list[float] = []
            for rnd in range(args.rounds + 1):
                warm = rnd == 0
                if not warm:
                    loads.append(os.getloadavg()[0])
                tokens = [rng.randrange(1, 150_000) for _ in range(n_tok)]
                order = MODES if rnd % 2 == 0 else MODES[::-1]
                for mode in order:
                    row = runs[mode].round(tokens, spec, warm)
                    problem = runs[mode].bad(row)
                    if problem:
                        failures.append(f"{mode} round {rnd}{' (warm-up)' if warm else ''}: {problem}")
                    say(f"  {'warm-up' if warm else f'round {rnd}'} {mode:14} store {row['store_s']:.3f} s, "
                        f"retrieve {row['retrieve_s']:.3f} s, {row['bytes'] / 2**20:.1f} MiB"
                        + (f"  PROBLEM: {problem}" if problem else ""))
                if floor is None:  # as many bytes as the warm-up store moved
                    floor = MemcpyFloor(max(1, int(row["bytes"])))
                if not warm:
                    floor.round()
                    say(f"  round {rnd} memcpy floor  {floor.seconds[-1]:.4f} s, load {loads[-1]:.2f}")
                if not server.alive():
                    raise RuntimeError(f"the server died:\n{server.log_tail()}")
            loads.append(os.getloadavg()[0])
        finally:
            for run in runs.values():
                run.client.close(graceful=server.alive())
    return {"tool": "bench_engine_driven", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "lmcache": versions.get("lmcache"), "build": args.build, "patches": info.get("patches", []),
            "preset": geo.name, "k": geo.k, "engine_groups": runs["engine_driven"].layout.num_groups,
            "chunk_tokens": chunk, "chunks": args.chunks, "rounds": args.rounds,
            "server": "one lmcache server, --supported-transfer-mode auto, L1 only; a client per mode",
            "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
            "torch_threads": torch_threads(), "overlay_tree": bool(info.get("tree")),
            "failures": failures, **summarise(runs, floor, loads)}


def torch_threads() -> int:
    import torch  # noqa: PLC0415 - the inner run has it

    return torch.get_num_threads()


def text_report(r: dict[str, Any]) -> str:
    build = "tree given with --overlay" if r.get("overlay_tree") else f"{r['build']} ({len(r['patches'])} patches)"
    lines = [f"lmcache {r['lmcache']} {build}, preset {r['preset']} "
             f"(k={r['k']}, {r['engine_groups']} engine groups), {r['chunks']} chunks of {r['chunk_tokens']} tokens "
             f"per request; {r['server']}",
             f"medians of {r['rounds']} interleaved rounds (after 1 warm-up round per mode), {r['cpus']} CPUs; "
             f"1-min load {r['load_1m']['start']:.2f} at the start, {r['load_1m']['end']:.2f} at the end, "
             f"{r['load_1m']['min']:.2f}-{r['load_1m']['max']:.2f} over the rounds:",
             f"  {'mode':15} {'bytes/request':>14} {'store s/GiB':>12} {'retrieve s/GiB':>15} "
             f"{'store+retr s/GiB':>17} {'store s':>8} {'retr s':>8}"]
    for mode in MODES:
        m = r[mode]
        lines.append(f"  {mode:15} {m['bytes_median']:>14,.0f} {m['store_s_per_gib']:12.3f} "
                     f"{m['retrieve_s_per_gib']:15.3f} {m['store_retrieve_s_per_gib']:17.3f} "
                     f"{m['store_s_median']:8.3f} {m['retrieve_s_median']:8.3f}")
    f = r["memcpy_floor"]
    lines.append(f"  {'memcpy floor':15} {f['bytes']:>14,.0f} {f['s_per_gib']:12.3f} {f['s_per_gib']:15.3f}"
                 f"   (one copy, one thread: {f['s_per_gib_range'][0]:.3f}-{f['s_per_gib_range'][1]:.3f})")
    lines.append("  (store+retr: the median of each round's sum, not the sum of the two medians)")
    q = r["ratio_engine_to_lmcache"]
    lines.append(f"  engine-driven / lmcache-driven: store {q['store_s_per_gib']:.2f}x, "
                 f"retrieve {q['retrieve_s_per_gib']:.2f}x, store+retrieve {q['store_retrieve_s_per_gib']:.2f}x")
    lines.append(f"  CPU seconds per GiB, worker + server processes (less sensitive to the load): "
                 + ", ".join(f"{mode} store {r[mode]['store_cpu_s_per_gib']:.3f} retrieve "
                             f"{r[mode]['retrieve_cpu_s_per_gib']:.3f}" for mode in MODES)
                 + f"; engine-driven / lmcache-driven: store {q['store_cpu_s_per_gib']:.2f}x, "
                   f"retrieve {q['retrieve_cpu_s_per_gib']:.2f}x")
    for mode in MODES:
        x = r["ratio_to_memcpy_floor"][mode]
        lines.append(f"  {mode} / memcpy floor: store {x['store_s_per_gib']:.1f}x, retrieve {x['retrieve_s_per_gib']:.1f}x")
    for mode in MODES:
        m = r[mode]
        lines.append(f"  {mode} ranges: store {m['store_s_per_gib_range'][0]:.3f}-{m['store_s_per_gib_range'][1]:.3f}"
                     f", retrieve {m['retrieve_s_per_gib_range'][0]:.3f}-{m['retrieve_s_per_gib_range'][1]:.3f}"
                     f" s/GiB; bytes per round {m['bytes_per_round']}")
    if r["failures"]:
        lines.append("FAILURES (not timing): " + "; ".join(r["failures"]))
    else:
        lines.append("every store confirmed, every retrieve hit all chunks and restored them byte-exact")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.5.6")
    ap.add_argument("--build", choices=BUILDS, default="stacked",
                    help="stacked: hybrid-fa + engine-driven (default); hybrid-fa; pristine")
    ap.add_argument("--preset", default="qwen35-0.8b", help="qwen35-0.8b (hybrid, k=17) or pure-attn-k1, ...")
    ap.add_argument("--overlay", type=Path, metavar="DIR",
                    help="run the lmcache tree in DIR (DIR/lmcache, e.g. a lab/workspace.py workspace) "
                         "instead of building --build's overlay")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=4, help="full chunks per request (default 4)")
    ap.add_argument("--chunk-blocks", type=int, default=2, help="logical blocks per chunk (default 2)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--l1-size-gb", type=float)
    ap.add_argument("--step-timeout", type=float, default=120.0)
    ap.add_argument("--server-timeout", type=float, default=180.0)
    ap.add_argument("--json", action="store_true", help="print the figures (and every round) as JSON")
    ap.add_argument("--quiet", action="store_true", help="no per-round progress on stderr")
    ap.add_argument("--verbose", action="store_true", help="let lmcache's client logging through")
    ap.add_argument("--keep-log", action="store_true", help="keep the client-side lmcache log in $TMPDIR")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.chunks < 1 or args.chunk_blocks < 1:
        ap.error("--rounds, --chunks and --chunk-blocks must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.environ.get(INNER_ENV) is None:
        return outer(args, argv)
    return inner(args)


if __name__ == "__main__":
    sys.exit(main())
