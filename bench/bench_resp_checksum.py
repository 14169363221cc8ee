#!/usr/bin/env python3
"""What the RESP tier's object checksum (part 17-resp-checksum) costs, side by side.

One worker process in a version's runtime venv, with the shipped hybrid-fa
series on ``PYTHONPATH``, drives two REAL ``NativeConnectorL2Adapter``s
against one real ``redis-server`` (started here on 127.0.0.1, a free port,
``--save "" --appendonly no``, in a temporary directory, stopped at the end):

* sealed -- built by LMCache's own ``resp`` factory (``object_checksum=True``:
  KV bytes + the 64-byte blake3 trailer bound to the key, keys prefixed
  ``lmcptsum1@``; a load reads into a staging buffer, verifies, copies into
  the L1 object);
* unsealed -- the same class over the same native client type
  (``lmcache.lmcache_redis.LMCacheRedisClient``, same ``num_workers``),
  constructed as the factory does but with ``object_checksum=False``.

The objects are real ``TensorMemoryObj``s carved from one CPU uint8 pool, as
the round-trip harness's L1 stand-in makes them (``gate/harness.py``).  Sizes are one chunk of
``qwen35-0.8b`` at C = 2N (attention 2,228,224 B, GDN state 6,684,672 B) and
of ``pure-attn-bs128`` (256 tokens, 2 layers: 2,097,152 B).  Cases, each one
store task and one load task of ``--chunks`` chunks:

* ``attn``, ``state``, ``pure``: the objects of one size (one object group,
  as the server stores it: one call per group);
* ``hybrid``: every chunk's attention and state object in one task (what a
  hybrid's lookup loads; part 16 splits it into one native batch per size).

Per round and case both arms run back to back, in ABBA order (which arm goes
first alternates by round and case).  Per arm: the store task is timed from
``submit_store_task`` until its completion is popped (the sealed arm seals in
the submit call, so that is inside), then the load task from
``submit_load_task`` until its bitmap is there (the wait is the adapter's own
event fd, as the server waits); every key must load, and the bytes are
compared with the source afterwards (untimed), then the keys are deleted.
Besides wall time, the CPU seconds of the worker process (every thread:
native client, demux, hashing) and of redis-server (``/proc/<pid>/task/*/
schedstat``) per task, and the time and CPU time of the submit call alone (the
sealed store seals there, the sealed load allocates its staging buffers
there): on a loaded machine the wall clock swings, CPU seconds less so.

In the same rounds, over the same bytes (best of 3, untimed elsewhere): a
plain copy into the L1 object (the memcpy floor), blake3 alone (the
adapter's ``_object_digest``), ``_seal`` (what a sealed store adds: a fresh
n + 64 B buffer, copy, hash), ``_unseal`` of a sealed value into the L1
object (what a sealed load adds after the read: trailer check, hash, copy)
and the staging buffers' allocation alone (``bytearray(n + 64)``).

Prints medians, sealed/unsealed ratios per case (wall and CPU), where the
extra time goes, and the load average before and after.  No timing is
asserted anywhere; exit 1 if a store or load failed or a loaded byte was
wrong, 2 on an infrastructure error.  Usage:

    .venv/bin/python bench/bench_resp_checksum.py [--version 0.5.6] [--rounds 41] [--chunks 3]
                                                  [--json [FILE]]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTS = ("16-native-l2-size-batches", "17-resp-checksum")
ATTN, STATE, PURE = 2228224, 6684672, 2097152  # qwen35-0.8b C=2N; pure-attn-bs128, 256 tokens
ARMS = ("unsealed", "sealed")
TIMED = ("store_s", "load_s", "store_cpu_s", "load_cpu_s", "store_server_cpu_s", "load_server_cpu_s",
         "store_submit_s", "load_submit_s", "store_submit_cpu_s", "load_submit_cpu_s")
MICRO = ("copy_s", "blake3_s", "seal_s", "unseal_s", "alloc_s")


# ---------------------------------------------------------------------------
# plan and summary (stdlib only; tests/unit/test_bench_resp_checksum.py)
# ---------------------------------------------------------------------------


def plan(attn: int, state: int, pure: int, chunks: int) -> dict[str, list[tuple[int, int]]]:
    """Case name -> its objects in key order, as (object_group_id, size).

    The hybrid's groups are numbered as the server keys them (state 0,
    attention 1); its task is chunk-major: chunk 0's attention and state,
    then chunk 1's, so both sizes alternate in one task."""
    return {"attn": [(1, attn)] * chunks, "state": [(0, state)] * chunks, "pure": [(0, pure)] * chunks,
            "hybrid": [obj for _ in range(chunks) for obj in ((1, attn), (0, state))]}


def order(round_no: int, case_no: int) -> tuple[str, str]:
    """Which arm runs first: alternates by round and by case (ABBA)."""
    return ARMS if (round_no + case_no) % 2 == 0 else ARMS[::-1]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds, per case: each arm's timed fields, the micro
    timings, sealed/unsealed ratios of the medians (and the median of the
    per-round paired ratios), and the sealed arm's extra time."""
    out: dict[str, Any] = {}
    for case in rounds[0]["cases"]:
        got = [r["cases"][case] for r in rounds]
        med = {arm: {f: statistics.median(g[arm][f] for g in got) for f in TIMED} for arm in ARMS}
        micro = {f: statistics.median(g["micro"][f] for g in got) for f in MICRO}
        ratio, paired = {}, {}
        for f in TIMED:
            if med["unsealed"][f] > 0:
                ratio[f] = med["sealed"][f] / med["unsealed"][f]
            pairs = [g["sealed"][f] / g["unsealed"][f] for g in got if g["unsealed"][f] > 0]
            if pairs:
                paired[f] = statistics.median(pairs)
        for f in ("store_s", "load_s"):  # client + server CPU seconds
            s, u = (med[a][f.replace("_s", "_cpu_s")] + med[a][f.replace("_s", "_server_cpu_s")] for a in
                    ("sealed", "unsealed"))
            if u > 0:
                ratio[f.replace("_s", "_all_cpu_s")] = s / u
        out[case] = {"objects": got[0]["objects"], "bytes": got[0]["bytes"], "median_s": med, "micro_s": micro,
                     "ratio_sealed_over_unsealed": ratio, "paired_ratio_sealed_over_unsealed": paired,
                     "extra_s": {"store": med["sealed"]["store_s"] - med["unsealed"]["store_s"],
                                 "load": med["sealed"]["load_s"] - med["unsealed"]["load_s"]},
                     "micro_over_copy": {f: micro[f] / micro["copy_s"] for f in MICRO if micro["copy_s"] > 0}}
    return out


# ---------------------------------------------------------------------------
# worker (target interpreter, lmcache on PYTHONPATH)
# ---------------------------------------------------------------------------


def _cpu_of(pid: int) -> float:
    """CPU seconds all threads of ``pid`` have run (the engine-driven bench's reader)."""
    from bench.bench_engine_driven import cpu_seconds  # noqa: PLC0415 - loads the engine-driven bench only here

    return cpu_seconds(pid)


def _wait_fd(fd: int, fetch, what: str) -> Any:
    """Wait on an adapter's event fd (as the server does) until ``fetch`` answers."""
    from lmcache.v1.platform.event_notifier import consume_fd  # noqa: PLC0415

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + 60
    while True:
        got = fetch()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_resp_checksum: no {what} completion in 60 s")
        if poller.poll(1000):
            consume_fd(fd)


def _best(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def worker(port: int, server_pid: int, cases: dict[str, list[tuple[int, int]]], num_workers: int | None) -> int:
    import torch  # noqa: PLC0415

    import lmcache  # noqa: PLC0415
    from lmcache.lmcache_redis import LMCacheRedisClient  # noqa: PLC0415
    from lmcache.v1.distributed.api import ObjectKey  # noqa: PLC0415
    from lmcache.v1.distributed.l2_adapters import native_connector_l2_adapter as nca  # noqa: PLC0415
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class  # noqa: PLC0415
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry  # noqa: PLC0415
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: PLC0415

    if not (hasattr(nca, "_SEALED_KEY_PREFIX") and hasattr(nca, "_size_batches")):
        print("bench_resp_checksum: this lmcache tree has no parts 16/17 (no _size_batches/_SEALED_KEY_PREFIX)",
              file=sys.stderr)
        return 2
    cfg_dict: dict[str, Any] = {"host": "127.0.0.1", "port": port}
    if num_workers:
        cfg_dict["num_workers"] = num_workers
    cfg = get_l2_adapter_config_class("resp").from_dict(cfg_dict)
    adapters = {"sealed": create_l2_adapter_from_registry(cfg),
                "unsealed": nca.NativeConnectorL2Adapter(
                    LMCacheRedisClient(cfg.host, cfg.port, cfg.num_workers, cfg.username, cfg.password),
                    max_capacity_gb=cfg.max_capacity_gb, object_checksum=False)}
    s, u = adapters["sealed"], adapters["unsealed"]
    if not (type(s) is type(u) is nca.NativeConnectorL2Adapter and type(s._client) is type(u._client)
            is LMCacheRedisClient and s._object_checksum is True and u._object_checksum is False):
        print(f"bench_resp_checksum: the resp factory built {type(s).__name__} over {type(s._client).__name__} "
              f"(object_checksum={getattr(s, '_object_checksum', None)}), not the sealed NativeConnectorL2Adapter "
              "over LMCacheRedisClient", file=sys.stderr)
        return 2

    # L1 stand-in: real TensorMemoryObj carved from one uint8 pool (harness.py's FakeStorageManager).
    gap = 4096
    need = sum(2 * (size + gap) for objs in cases.values() for _, size in objs) + gap
    pool = torch.randint(0, 256, (need,), dtype=torch.uint8)
    nxt = gap

    def carve(size: int) -> Any:
        nonlocal nxt
        addr = nxt
        nxt = (addr + size + gap + 4095) // 4096 * 4096
        shape = torch.Size([size // 2])
        meta = MemoryObjMetadata(shape=shape, dtype=torch.bfloat16, address=addr, phy_size=size, ref_count=1,
                                 shapes=[shape], dtypes=[torch.bfloat16])
        return TensorMemoryObj(pool[addr:addr + size], meta, None)

    objs = {c: ([carve(size) for _, size in spec], [carve(size) for _, size in spec]) for c, spec in cases.items()}
    for src, _ in objs.values():
        for o in src:
            if o.get_size() != o.byte_array.nbytes:
                raise SystemExit("bench_resp_checksum: byte_array does not span the object")

    def keys(round_no: int, case_no: int) -> list[Any]:
        return [ObjectKey(chunk_hash=round_no.to_bytes(4, "big") + case_no.to_bytes(2, "big") + i.to_bytes(2, "big"),
                          model_name="bench/resp-checksum", kv_rank=0x01000100, object_group_id=g)
                for i, (g, _) in enumerate(cases[list(cases)[case_no]])]

    def arm(adapter: Any, ks: list[Any], src: list[Any], dst: list[Any]) -> dict[str, float]:
        for d in dst:
            d.raw_data.zero_()
        done: dict[int, Any] = {}

        def stored(task: int) -> Any:
            done.update(adapter.pop_completed_store_tasks())
            return done.pop(task, None)

        c0, k0, t0 = _cpu_of(server_pid), time.process_time(), time.perf_counter()
        h0 = time.thread_time()
        store_task = adapter.submit_store_task(ks, src)
        t_store_submit, h_store_submit = time.perf_counter() - t0, time.thread_time() - h0
        result = _wait_fd(adapter.get_store_event_fd(), lambda: stored(store_task), "store")
        t_store, k_store, c_store = time.perf_counter() - t0, time.process_time() - k0, _cpu_of(server_pid) - c0
        if int(result) < 0:
            raise _Failed(f"store failed ({len(ks)} keys)")
        c0, k0, t0 = _cpu_of(server_pid), time.process_time(), time.perf_counter()
        h0 = time.thread_time()
        load_task = adapter.submit_load_task(ks, dst)
        t_load_submit, h_load_submit = time.perf_counter() - t0, time.thread_time() - h0
        bitmap = _wait_fd(adapter.get_load_event_fd(), lambda: adapter.query_load_result(load_task), "load")
        t_load, k_load, c_load = time.perf_counter() - t0, time.process_time() - k0, _cpu_of(server_pid) - c0
        missed = len(ks) - len(bitmap.get_indices_list())
        if missed:
            raise _Failed(f"{missed} of {len(ks)} keys did not load")
        wrong = sum(not torch.equal(a.raw_data, b.raw_data) for a, b in zip(src, dst))
        if wrong:
            raise _Failed(f"{wrong} of {len(ks)} loaded objects differ from what was stored")
        adapter.delete(ks)
        return {"store_s": t_store, "load_s": t_load, "store_cpu_s": k_store, "load_cpu_s": k_load,
                "store_server_cpu_s": c_store, "load_server_cpu_s": c_load,
                "store_submit_s": t_store_submit, "load_submit_s": t_load_submit,
                "store_submit_cpu_s": h_store_submit, "load_submit_cpu_s": h_load_submit}

    def micro(case: str, ks: list[Any]) -> dict[str, float]:
        src, dst = objs[case]
        views = [o.byte_array.cast("B") for o in src]  # "<B" views: memoryview copies need plain "B"
        dviews = [o.byte_array.cast("B") for o in dst]
        names = [s._wire_key(k) for k in ks]
        sealed = [nca._seal(n, v) for n, v in zip(names, views)]
        out = {"copy_s": _best(lambda: [d.__setitem__(slice(None), v) for d, v in zip(dviews, views)]),
               "blake3_s": _best(lambda: [nca._object_digest(n, v) for n, v in zip(names, views)]),
               "seal_s": _best(lambda: [nca._seal(n, v) for n, v in zip(names, views)]),
               "unseal_s": _best(lambda: [s._unseal(n, b, d) or _bad() for n, b, d in zip(names, sealed, dviews)]),
               "alloc_s": _best(lambda: [bytearray(len(v) + nca.SUM_TRAILER_LEN) for v in views])}
        return out

    print(json.dumps({"ready": True, "lmcache": getattr(lmcache, "__version__", None),
                      "num_workers": cfg.num_workers, "torch_threads": torch.get_num_threads(),
                      "trailer_len": nca.SUM_TRAILER_LEN}), flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            r = int(cmd[1])
            out: dict[str, Any] = {"cases": {}}
            for ci, case in enumerate(cases):
                ks = keys(r, ci)
                src, dst = objs[case]
                got: dict[str, Any] = {"objects": [size for _, size in cases[case]],
                                       "bytes": sum(size for _, size in cases[case]),
                                       "first": order(r, ci)[0]}
                try:
                    for name in order(r, ci):
                        got[name] = arm(adapters[name], ks, src, dst)
                except _Failed as exc:
                    print(json.dumps({"failed": f"{case}, {name}: {exc}"}), flush=True)
                    return 1
                got["micro"] = micro(case, ks)
                out["cases"][case] = got
            print(json.dumps(out), flush=True)
    finally:
        for a in adapters.values():
            a.close()
    return 0


class _Failed(Exception):
    pass


def _bad() -> None:
    raise SystemExit("bench_resp_checksum: an intact sealed value did not verify")


# ---------------------------------------------------------------------------
# orchestrator (any Python 3.11; provisions the environments)
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
            c.sendall(b"PING\r\n")
            return c.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _start_redis(workdir: Path) -> tuple[subprocess.Popen, int, str]:
    from lab.provision_redis import RedisUnavailable, redis_server  # noqa: PLC0415

    try:
        exe = redis_server()
    except RedisUnavailable as exc:
        raise SystemExit(f"bench_resp_checksum: no redis-server: {exc}") from exc
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True).stdout.strip()
    for _ in range(3):  # a free port can be taken between the probe and the bind
        port = _free_port()
        proc = subprocess.Popen([str(exe), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(workdir), "--logfile",
                                 str(workdir / "redis.log"), "--daemonize", "no"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            if _ping(port):
                return proc, port, version
            time.sleep(0.05)
        _stop(proc)
    raise SystemExit(f"bench_resp_checksum: redis-server did not start (log: {workdir / 'redis.log'})")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def _series(root: Path, version: str) -> list[Path]:
    patches = sorted((root / version).glob("*.patch"))
    missing = [p for p in PARTS if not any(x.stem == p for x in patches)]
    if missing:
        raise SystemExit(f"bench_resp_checksum: {root / version} has no {', '.join(missing)}")
    return patches


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _ask(proc: subprocess.Popen, cmd: str) -> dict[str, Any]:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"bench_resp_checksum: the worker died on {cmd!r} (rc {proc.wait()})")
    return json.loads(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.5.6")
    ap.add_argument("--rounds", type=int, default=41, help="timed rounds after one warm-up (default 41: 1-2 "
                                                           "minutes on 2 busy cores)")
    ap.add_argument("--chunks", type=int, default=3, help="chunks per task (default 3)")
    ap.add_argument("--attn", type=int, default=ATTN, help=f"attention object bytes (default {ATTN:,})")
    ap.add_argument("--state", type=int, default=STATE, help=f"GDN state object bytes (default {STATE:,})")
    ap.add_argument("--pure", type=int, default=PURE, help=f"pure-attention object bytes (default {PURE:,})")
    ap.add_argument("--num-workers", type=int, help="the native client's threads (default: the resp config's)")
    ap.add_argument("--series-root", default=str(REPO / "patches" / "hybrid-fa"),
                    help="where <version>/*.patch are (default: the shipped hybrid-fa set)")
    ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                    help="write every figure as JSON to FILE (or stdout, instead of the table)")
    ap.add_argument("--worker", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.attn, args.state, args.pure) <= 0 or any(x % 2 for x in (args.attn, args.state, args.pure)):
        ap.error("object sizes must be positive and even (bfloat16 objects)")
    cases = plan(args.attn, args.state, args.pure, args.chunks)
    if args.worker:
        return worker(args.worker, args.server_pid, cases, args.num_workers)

    from lab import provision  # noqa: PLC0415

    series = _series(Path(args.series_root), args.version)
    python = provision.runtime_env(args.version) / "bin" / "python"
    overlay = provision.overlay(args.version, series)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    loads: list[float] = []
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-resp-checksum-") as tmp:
        redis, port, redis_version = _start_redis(Path(tmp))
        try:
            env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", LMCACHE_LOG_LEVEL="WARNING",
                       PYTHONWARNINGS="ignore::FutureWarning")  # google-cloud's Python 3.11 notice
            argv_w = [str(python), __file__, "--worker", str(port), "--server-pid", str(redis.pid),
                      "--chunks", str(args.chunks), "--attn", str(args.attn), "--state", str(args.state),
                      "--pure", str(args.pure)] + (["--num-workers", str(args.num_workers)] if args.num_workers else [])
            proc = subprocess.Popen(argv_w, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            try:
                ready = json.loads(proc.stdout.readline() or "{}")
                if not ready.get("ready"):
                    return proc.wait(timeout=60) or 2
                _ask(proc, "round 1000000")  # warm-up (first keys, allocator), not counted
                for r in range(args.rounds):
                    loads.append(os.getloadavg()[0])
                    got = _ask(proc, f"round {r}")
                    if "failed" in got:
                        print(f"bench_resp_checksum: {got['failed']}", file=sys.stderr)
                        return 1
                    rounds.append(got)
            finally:
                if proc.poll() is None:
                    proc.stdin.write("quit\n")
                    proc.stdin.flush()
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=20)
        finally:
            _stop(redis)
    load_after = os.getloadavg()
    if not rounds:
        raise SystemExit("bench_resp_checksum: --rounds must be at least 1")

    summary = summarize(rounds)
    res = {"command": [Path(sys.executable).name] + sys.argv if argv is None else ["bench_resp_checksum.py", *argv],
           "date": started.isoformat(timespec="seconds"),
           "git_head": _git("rev-parse", "HEAD"),
           "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
           "version": args.version, "lmcache": ready.get("lmcache"),
           "series": [p.name for p in series],
           "series_sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in series if p.stem in PARTS},
           "redis": redis_version, "num_workers": ready.get("num_workers"), "trailer_len": ready.get("trailer_len"),
           "rounds": args.rounds, "chunks": args.chunks, "sizes": {"attn": args.attn, "state": args.state,
                                                                 "pure": args.pure},
           "cpus": os.cpu_count(),
           "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
           "loadavg_1m_per_round": [round(x, 2) for x in loads],
           "cases": summary, "raw_rounds": rounds}
    if args.json == "-":
        print(json.dumps(res, indent=1))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    _print(res)
    return 0


def _print(res: dict[str, Any]) -> None:
    ms = 1e3
    print(f"lmcache {res['lmcache']} (hybrid-fa incl. {', '.join(PARTS)}), {res['redis'].split(' sha=')[0]} on "
          f"127.0.0.1, num_workers {res['num_workers']}; {res['rounds']} rounds (ABBA) + 1 warm-up, "
          f"{res['chunks']} chunks per task, {res['cpus']} CPUs, load average {res['loadavg_before'][0]:.2f} -> "
          f"{res['loadavg_after'][0]:.2f} (1-min, per round {min(res['loadavg_1m_per_round']):.2f}-"
          f"{max(res['loadavg_1m_per_round']):.2f})")
    print(f"  git {res['git_head'][:12]}{' (dirty)' if res['git_dirty'] else ''}, {res['date']}")
    print("  median ms per task; ratio = sealed / unsealed (of the medians; paired = median of per-round ratios)")
    print(f"  {'case':7} {'MiB':>6} | {'store u':>8} {'store s':>8} {'ratio':>6} {'paired':>6} | {'load u':>8} "
          f"{'load s':>8} {'ratio':>6} {'paired':>6} | {'CPU st':>6} {'CPU ld':>6}")
    for case, c in res["cases"].items():
        m, r, p = c["median_s"], c["ratio_sealed_over_unsealed"], c["paired_ratio_sealed_over_unsealed"]
        print(f"  {case:7} {c['bytes'] / 2**20:6.2f} | {m['unsealed']['store_s'] * ms:8.2f} "
              f"{m['sealed']['store_s'] * ms:8.2f} {r['store_s']:6.3f} {p['store_s']:6.3f} | "
              f"{m['unsealed']['load_s'] * ms:8.2f} {m['sealed']['load_s'] * ms:8.2f} {r['load_s']:6.3f} "
              f"{p['load_s']:6.3f} | {r.get('store_all_cpu_s', float('nan')):6.3f} "
              f"{r.get('load_all_cpu_s', float('nan')):6.3f}")
    print("  (CPU st/ld: sealed/unsealed CPU seconds of worker + redis-server per task)")
    print("  where the sealed arm's extra time goes, median ms per task, sealed - unsealed: +wall; +wCPU = CPU of "
          "the worker (all threads);")
    print("  +sCPU = CPU of the submit call's thread (a sealed store runs _seal there; a sealed load allocates its "
          "staging buffers there")
    print("  and runs _unseal later in the demux thread).  Same bytes, best of 3 per round (a floor: warm caches, "
          "memory the allocator")
    print("  reuses): memcpy into the L1 objects, blake3 alone, _seal, _unseal, staging alloc (bytearray(n + 64))")
    print(f"  {'case':7} | {'+wall':>6} {'+wCPU':>6} {'+sCPU':>6} | {'+wall':>6} {'+wCPU':>6} {'+sCPU':>6} | "
          f"{'memcpy':>6} {'blake3':>6} {'seal':>6} {'unseal':>6} {'alloc':>6} | {'b3/cp':>5}")
    print(f"  {'':7} | {'store':^20} | {'load':^20} |")
    for case, c in res["cases"].items():
        mi, m = c["micro_s"], c["median_s"]

        def extra(field: str) -> float:
            return (m["sealed"][field] - m["unsealed"][field]) * ms  # noqa: B023

        cols = " | ".join(" ".join(f"{extra(f'{op}_{f}'):+6.2f}" for f in ("s", "cpu_s", "submit_cpu_s"))
                          for op in ("store", "load"))
        print(f"  {case:7} | {cols} | " + " ".join(f"{mi[f] * ms:6.2f}" for f in MICRO)
              + f" | {mi['blake3_s'] / mi['copy_s']:5.2f}")
    print("  memcpy and blake3 GB/s: " + ", ".join(
        f"{case} {c['bytes'] / c['micro_s']['copy_s'] / 1e9:.1f} / {c['bytes'] / c['micro_s']['blake3_s'] / 1e9:.1f}"
        for case, c in res["cases"].items()))
    rate = min(c["bytes"] / c["median_s"]["unsealed"]["store_s"] for c in res["cases"].values())
    print(f"  the trailer: {res['trailer_len']} B more per object "
          f"({res['trailer_len'] / min(res['sizes'].values()) * 100:.4f} % of the smallest); at the slowest "
          f"unsealed store rate measured ({rate / 1e9:.2f} GB/s) that is {res['trailer_len'] / rate * 1e9:.0f} ns "
          "per object (computed, not timed)")


if __name__ == "__main__":
    sys.exit(main())
