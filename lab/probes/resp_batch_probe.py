"""LMCache's native RESP client (``lmcache.lmcache_redis``) with batches whose
buffers differ in size, against a real ``redis-server`` on 127.0.0.1.

Why: on a Redis tier the patched 0.5.4-0.5.6 builds restore no hybrid model
(the server logs ``[LMCache GET] key ... failed: buffer size mismatch``),
while 0.5.3 and pure attention restore. Those builds store a hybrid's
attention and state groups as separate objects of different sizes (part 06),
and one lookup's load batch then holds both sizes. This probe checks the
native client alone, with no LMCache server: two keys of 100 and 50 bytes,
set in one batch and in two, then read back one key per batch and two keys
per batch in both orders.

    PYTHONPATH=<overlay>:<repo> <venv>/bin/python -m lab.probes.resp_batch_probe \\
        [--port PORT] [--out OUT]

Without ``--port`` it starts ``redis-server`` (from ``PATH``) on a free port
with persistence off (``redis_proc``), and stops it at the end. It writes one
JSON document (stdout, or OUT); every step records the completion the client reported
(future id, ok, error, per-key results) and the first bytes of each buffer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

from lab.redis_proc import RedisStartError, running_redis_server

SIZES = {"ka": 100, "kb": 50}
FILL = {"ka": b"A", "kb": b"B"}


@contextmanager
def redis(port: int | None) -> Iterator[int]:
    """An existing server on ``port``, or a fresh one (redis_proc: no persistence)."""
    if port is not None:
        yield port
        return
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("resp_batch_probe: redis-server is not on PATH; pass --port of a running one")
    try:
        with running_redis_server(exe) as server:
            yield server.port
    except RedisStartError as exc:
        raise SystemExit(f"resp_batch_probe: {exc}") from exc


def _wait(client: Any, future_id: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for fid, ok, error, results in client.drain_completions():
            if int(fid) == int(future_id):
                return {"ok": bool(ok), "error": error or None,
                        "per_key": None if results is None else [bool(r) for r in results]}
        time.sleep(0.005)
    return {"ok": False, "error": "no completion within the timeout", "per_key": None}


def _set(client: Any, keys: list[str]) -> dict:
    bufs = [bytearray(FILL[k] * SIZES[k]) for k in keys]
    done = _wait(client, client.submit_batch_set(keys, [memoryview(b) for b in bufs]))
    return {"op": "set", "keys": keys, "sizes": [SIZES[k] for k in keys], **done}


def _get(client: Any, keys: list[str]) -> dict:
    bufs = [bytearray(SIZES[k]) for k in keys]
    done = _wait(client, client.submit_batch_get(keys, [memoryview(b) for b in bufs]))
    exact = [bytes(b) == FILL[k] * SIZES[k] for k, b in zip(keys, bufs)]
    return {"op": "get", "keys": keys, "sizes": [SIZES[k] for k in keys], **done, "bytes_exact": exact}


def run(port: int) -> dict:
    from lmcache.lmcache_redis import LMCacheRedisClient  # noqa: PLC0415

    import lmcache  # noqa: PLC0415

    client = LMCacheRedisClient("127.0.0.1", port, 2, "", "")
    steps = []
    # Mixed sizes in one SET batch, then each key in its own batch (the state
    # every later GET reads).
    steps.append(_set(client, ["ka", "kb"]))
    steps.append(_set(client, ["ka"]))
    steps.append(_set(client, ["kb"]))
    for keys in (["ka"], ["kb"], ["ka", "kb"], ["kb", "ka"]):
        steps.append(_get(client, keys))
    single = [s for s in steps if s["op"] == "get" and len(s["keys"]) == 1]
    mixed = [s for s in steps if s["op"] == "get" and len(s["keys"]) == 2]
    return {
        "lmcache": getattr(lmcache, "__version__", None),
        "steps": steps,
        "single_key_batches_exact": all(all(s["bytes_exact"]) for s in single),
        "mixed_size_batches_exact": all(all(s["bytes_exact"]) for s in mixed),
        "mixed_size_set_ok": steps[0]["ok"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, help="a running redis-server on 127.0.0.1 (default: start one)")
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    args = ap.parse_args(argv)
    with redis(args.port) as port:
        result = run(port)
    emit_json(result, args.out)
    return 0


def emit_json(result: dict, out: str | None) -> None:
    """A probe's JSON document to ``out``, or to stdout (the RESP probes share it)."""
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
