#!/usr/bin/env python3
"""Stand-in for ``vllm serve`` (OpenAI server) for the engine gate's CPU tests.

Serves ``/health``, ``/metrics`` (vLLM 0.27.1 counter names, Prometheus text)
and a streaming ``/v1/completions`` that takes token ids.  It spawns a child
process standing for ``VLLM::EngineCore`` that "holds GPU memory": it writes
``<pid>`` into ``$FAKE_GPU_STATE`` (read by ``fake_nvidia_smi.py``).

The "model": the prompt's KV is its token ids.  Whole chunks may come from the
LMCache stand-in (``--kv-transfer-config`` -> ``lmcache.mp.host/port``); the
answer lists every ``K-<24 hex>`` readable in that KV (byte tokenizer) and a
digest of the KV, so a restore that returns wrong bytes gives wrong keys and a
different continuation.  Prefill "costs" ``--fake-prefill-us`` per computed token
and ``--fake-restore-us`` per restored one, which makes TTFT meaningful.

``--fake-mode``: ``normal`` | ``leaky`` (the EngineCore child leaves the process
group and ignores SIGTERM) | ``crash`` (exit 3 at start) | ``hang`` (never
healthy) | ``corrupt`` (keys read from restored chunks come back wrong) |
``slowstop`` (ignores SIGTERM; needs SIGKILL) | ``gpu-leak`` (GPU memory is
never given back: ``$FAKE_GPU_STATE/stuck``) | ``unhealthy-after=N`` (/health
and requests fail after N completions; ``unhealthy-after-hits=N``: after N
completions served with LMCache hits) | ``nohits`` (never asks LMCache) |
``uniform`` (every logprob -ln 512: a model whose logits ignore the KV).

With ``logprobs: k`` in a request every output token carries its logprob and
the top-k (``token_id:N`` keys, as ``return_tokens_as_token_ids`` gives),
derived from the digest of the KV, so a wrong restore changes them too.

The model is hybrid (Mamba/GDN + attention) unless its ``config.json`` says
``"fake_pure_attention": true``.  As in vLLM 0.27.1, prefix caching is off for a
hybrid model unless ``--enable-prefix-caching`` is given, and the Mamba cache
mode is then ``none`` unless ``--mamba-cache-mode`` says otherwise; with an
LMCache connector and mode ``none`` the start fails with LMCache's refusal.
Without prefix caching there are no local (APC) hits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import chunk_hashes, die, log, post, serve
KEY_RE = re.compile(r"K-[0-9a-f]{24}")

ENGINE_CORE = r"""
import os, signal, sys, time
from pathlib import Path
if sys.argv[1] == "leaky":
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
state = os.environ.get("FAKE_GPU_STATE")
if state:
    Path(state).mkdir(parents=True, exist_ok=True)
    (Path(state) / str(os.getpid())).write_text(sys.argv[2])
while True:
    time.sleep(0.5)
"""


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] == "serve":
        argv = argv[1:]
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--kv-transfer-config", default=None)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true", default=None)
    ap.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    ap.add_argument("--mamba-cache-mode", default=None)
    ap.add_argument("--fake-mode", default=os.environ.get("FAKE_VLLM_MODE", "normal"))
    ap.add_argument("--fake-block", type=int, default=int(os.environ.get("FAKE_VLLM_BLOCK", "544")))
    ap.add_argument("--fake-prefill-us", type=float, default=float(os.environ.get("FAKE_PREFILL_US", "40")))
    ap.add_argument("--fake-restore-us", type=float, default=float(os.environ.get("FAKE_RESTORE_US", "2")))
    ap.add_argument("--fake-gpu-mib", type=int, default=40000)
    args, _unknown = ap.parse_known_args(argv)
    mode = args.fake_mode
    N = args.fake_block
    backend = (args.attention_backend or "FLASH_ATTN").upper()
    P = 32 if backend == "FLASHINFER" and N % 32 == 0 else N
    unhealthy_after = int(mode.split("=")[1]) if mode.startswith("unhealthy-after=") else None
    # unhealthy-after-hits=N: after N completions served with external (LMCache) hits: a restore arm
    hits_limit = int(mode.split("=")[1]) if mode.startswith("unhealthy-after-hits=") else None

    log(f"INFO vLLM stand-in: model {args.model}, mode {mode}")
    try:
        model_cfg = json.loads((Path(args.model) / "config.json").read_text())
    except (OSError, ValueError):
        model_cfg = {}
    hybrid = not model_cfg.get("fake_pure_attention", False)
    # vLLM 0.27.1: prefix caching defaults off for hybrid models (engine/arg_utils.py), and then
    # the Mamba cache mode resolves to 'none' (model_executor/models/config.py).
    prefix_caching = args.prefix_caching if args.prefix_caching is not None else not hybrid
    mamba_mode = args.mamba_cache_mode or ("align" if prefix_caching else "none")
    log(f"INFO prefix caching {'enabled' if prefix_caching else 'disabled'}, "
        f"mamba_cache_mode={mamba_mode if hybrid else 'n/a'}")
    if args.kv_transfer_config and hybrid and mamba_mode == "none":
        die("ValueError: LMCache cannot serve this model's KV cache groups: the model has Mamba layers "
            "and mamba_cache_mode='none' (enable prefix caching, or pass --mamba-cache-mode align).")
    if mode == "crash":
        die("RuntimeError: simulated engine startup failure", 3)
    core = subprocess.Popen([sys.executable, "-c", ENGINE_CORE, "leaky" if mode == "leaky" else "normal",
                             str(args.fake_gpu_mib), "VLLM::EngineCore"])
    log(f"INFO EngineCore pid {core.pid}")
    if os.environ.get("FAKE_GPU_STATE"):  # handshake: the core is up (and, if leaky, detached)
        ready = Path(os.environ["FAKE_GPU_STATE"]) / str(core.pid)
        deadline = time.monotonic() + 60
        while not ready.exists() and core.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    if mode == "gpu-leak" and os.environ.get("FAKE_GPU_STATE"):
        Path(os.environ["FAKE_GPU_STATE"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["FAKE_GPU_STATE"]) / "stuck").write_text(str(args.fake_gpu_mib))
    log(f"INFO Setting attention block size to {N} tokens to ensure that attention page size is >= mamba page size.")
    log(f"INFO Using AttentionBackendEnum.{backend} backend.")
    if mode == "hang":
        while True:
            time.sleep(1)

    lm_url = None
    C = N
    if args.kv_transfer_config:
        kv = json.loads(args.kv_transfer_config)
        if kv.get("kv_connector") != "LMCacheMPConnector":
            die(f"unexpected connector {kv.get('kv_connector')}")
        extra = kv.get("kv_connector_extra_config") or {}
        host = str(extra.get("lmcache.mp.host", "tcp://localhost")).split("://")[-1]
        port = int(extra.get("lmcache.mp.port", 5555))
        mnbt = args.max_num_batched_tokens or 2048
        if not N <= mnbt < 2 * N:
            die(f"ValueError: Mamba-hybrid models with LMCache require block_size <= max_num_batched_tokens < "
                f"2 * block_size; got max_num_batched_tokens={mnbt}, block_size={N}.")
        lm_url = f"http://{host}:{port}"
        try:
            C = int(post(lm_url + "/fake/register", {"tokens_per_block": N, "slots_per_block": P})["chunk_size"])
        except OSError as exc:
            die(f"ConnectionError: Cannot reach the LMCache MP server at '{lm_url}': {exc}")
        log(f"INFO Creating v1 connector with name: LMCacheMPConnector (chunk size {C})")

    lock = threading.Lock()
    apc: dict[str, list[int]] = {}
    served = {"n": 0, "hit": 0}
    counters = {"external_hits": 0, "external_queries": 0, "local_hits": 0, "local_queries": 0,
                "prompt_tokens": 0, "src_external": 0, "src_local": 0, "src_compute": 0}

    def healthy() -> bool:
        return (unhealthy_after is None or served["n"] < unhealthy_after) and \
            (hits_limit is None or served["hit"] < hits_limit)

    def health(_h, _b):
        return (200, "text/plain", "") if healthy() else (500, "text/plain", "engine dead")

    def metrics(_h, _b):
        lab = f'engine="0",model_name="{args.served_model_name or args.model}"'
        with lock:
            c = dict(counters)
        rows = [("vllm:external_prefix_cache_hits_total", c["external_hits"]),
                ("vllm:external_prefix_cache_queries_total", c["external_queries"]),
                ("vllm:prefix_cache_hits_total", c["local_hits"]),
                ("vllm:prefix_cache_queries_total", c["local_queries"]),
                ("vllm:prompt_tokens_total", c["prompt_tokens"])]
        lines = []
        for name, v in rows:
            lines += [f"# HELP {name} x", f"# TYPE {name} counter", f"{name}{{{lab}}} {float(v)}"]
        lines += ["# TYPE vllm:prompt_tokens_by_source_total counter"]
        for src, key in (("external_kv_transfer", "src_external"), ("local_cache_hit", "src_local"),
                         ("local_compute", "src_compute")):
            lines.append(f'vllm:prompt_tokens_by_source_total{{{lab},source="{src}"}} {float(c[key])}')
        return 200, "text/plain; version=0.0.4", "\n".join(lines) + "\n"

    def completions(h, body):
        if not healthy():
            return 500, "application/json", {"error": "engine dead"}
        ids = body.get("prompt")
        if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
            return 400, "application/json", {"error": "the stand-in takes token ids only"}
        t0 = time.perf_counter()
        T = len(ids)
        full = (T - 1) // C  # vLLM always computes the last token
        hashes = chunk_hashes(ids, C, T // C)
        salt = body.get("cache_salt")
        if salt:  # as vLLM: the salt enters every block hash (and so LMCache's keys): no shared hit
            hashes = [f"{salt}|{x}" for x in hashes]
        view = list(ids)
        local = 0
        with lock:
            while prefix_caching and local < full and hashes[local] in apc:
                local += 1
        ext = 0
        if lm_url and mode != "nohits" and full > local:
            n = post(lm_url + "/fake/lookup", {"hashes": hashes[:full]})["hit_chunks"]
            n = min(n, full)
            if n > local:
                got = post(lm_url + "/fake/retrieve", {"hashes": hashes[local:n]})["chunks"]
                for j, chunk in enumerate(got, start=local):
                    if chunk is None:
                        break
                    if mode == "corrupt":
                        text = bytes(x for x in chunk if 0 <= x < 256).decode("utf-8", "replace")
                        text = KEY_RE.sub(lambda m: m.group(0)[:-1] + ("0" if m.group(0)[-1] != "0" else "1"), text)
                        chunk = list(text.encode("utf-8"))[:C] + [0] * max(0, C - len(text.encode("utf-8")))
                    view[j * C:(j + 1) * C] = chunk
                    ext += 1
        computed = T - (local + ext) * C
        time.sleep((computed * args.fake_prefill_us + ext * C * args.fake_restore_us) / 1e6)
        # store what was computed here (whole chunks only) and remember it locally
        if lm_url:
            todo = [{"hash": hashes[j], "ids": view[j * C:(j + 1) * C]} for j in range(local + ext, T // C)]
            if todo:
                post(lm_url + "/fake/store", {"chunks": todo})
        with lock:
            for j in range(T // C):
                apc[hashes[j]] = view[j * C:(j + 1) * C]
            counters["prompt_tokens"] += T
            counters["local_queries"] += T
            counters["local_hits"] += local * C
            counters["external_queries"] += T - local * C
            counters["external_hits"] += ext * C
            counters["src_local"] += local * C
            counters["src_external"] += ext * C
            counters["src_compute"] += computed
        text_view = bytes(x for x in view if 0 <= x < 256).decode("utf-8", "replace")
        keys = KEY_RE.findall(text_view)
        digest = hashlib.sha256(json.dumps(view).encode()).hexdigest()[:12]
        answer = "\n".join(keys) + f"\n#{digest}" if keys else f"No key found. #{digest}"
        out_ids = list(answer.encode("utf-8"))[: int(body.get("max_tokens") or 16)]
        served["n"] += 1
        served["hit"] += 1 if ext else 0
        k = int(body.get("logprobs") or 0)

        def logprobs(i: int, tok: int) -> tuple[float, dict[str, float]]:
            if mode == "uniform":
                v = -6.238325  # -ln 512
                return v, {f"token_id:{t}": v for t in range(k)}
            h = int(hashlib.sha256(f"{digest}:{i}".encode()).hexdigest(), 16)
            top = {f"token_id:{tok}": -0.05 - (h % 997) / 4000}
            for j in range(1, k):
                top[f"token_id:{(tok + j) % 512}"] = -1.0 - j - ((h >> (10 * j)) % 1000) / 1000
            return top[f"token_id:{tok}"], top

        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        model = body.get("model")

        def send(obj) -> None:
            h.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            h.wfile.flush()

        pieces = [out_ids[i:i + 8] for i in range(0, len(out_ids), 8)] or [[]]
        for n, piece in enumerate(pieces):
            ch = {"index": 0, "text": bytes(piece).decode("utf-8", "replace"), "token_ids": piece,
                  "finish_reason": "length" if n == len(pieces) - 1 else None}
            if k:
                lps = [logprobs(8 * n + i, t) for i, t in enumerate(piece)]
                ch["logprobs"] = {"tokens": [f"token_id:{t}" for t in piece],
                                  "token_logprobs": [a for a, _ in lps], "top_logprobs": [b for _, b in lps]}
            if n == 0 and body.get("return_token_ids"):
                ch["prompt_token_ids"] = ids
            send({"id": "cmpl-fake", "object": "text_completion", "model": model, "choices": [ch]})
        send({"id": "cmpl-fake", "object": "text_completion", "model": model, "choices": [],
              "usage": {"prompt_tokens": T, "completion_tokens": len(out_ids), "total_tokens": T + len(out_ids),
                        "elapsed_s": round(time.perf_counter() - t0, 4)}})
        h.wfile.write(b"data: [DONE]\n\n")
        h.wfile.flush()
        h.close_connection = True
        return None

    serve(args.host, args.port, {("GET", "/health"): health, ("GET", "/metrics"): metrics,
                                 ("POST", "/v1/completions"): completions})
    log("INFO Application startup complete. (stand-in)")

    stop = threading.Event()
    if mode == "slowstop":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.2):
        if core.poll() is not None and mode != "slowstop":
            die("EngineCore died")
    if core.poll() is None and mode != "leaky":
        core.terminate()
    log("INFO Shutting down (stand-in)")


if __name__ == "__main__":
    main()
