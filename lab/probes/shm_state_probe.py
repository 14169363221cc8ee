"""Does lmcache-driven transfer on a CPU worker reach the memory a vLLM model
computes on?  Registration through the installed connector, a real LMCache
server, and the views vLLM binds to its layers.

lmcache-driven on a CPU worker shares the KV cache with the server through
POSIX shared memory: ``migrate_to_shm_and_wrap`` copies each registered
tensor's storage into a segment and re-points the tensor it is handed.  vLLM
binds its layers before the connector registers: an attention layer keeps the
very tensor object the connector is handed (``AttentionLayerBase.bind_kv_cache``),
a Mamba/GDN layer slices it into conv/ssm state views of its own
(``MambaBase.bind_kv_cache``).  So after a migration the attention layer
computes on the shared segment and the state views on the old memory.

Run in an LMCache runtime venv with ``PYTHONPATH = <lmcache overlay>:<vLLM
0.30+ layer>:<repo>`` (``lab/provision_vllm.py``)::

    python -m lab.probes.shm_state_probe --out result.json

It starts one ``lmcache server`` (``--supported-transfer-mode lmcache_driven``,
127.0.0.1), builds two models' KV views with vLLM's own
``create_kv_cache_views`` (layer-compact ``LBHNC``, no kernel-block split) and
binds them with vLLM's own ``bind_kv_cache`` code, then registers each through
the installed ``LMCacheMPConnector.register_kv_caches`` (on a connector object
that carries what that method reads: the KV cache config, a vLLM config
stand-in answering the resolved layout, a real ``LMCacheMPWorkerAdapter``
with ``lmcache.mp.mp_transfer_mode = lmcache_driven``):

* ``hybrid``: the attention layer first, then a GDN layer whose state fills
  its page exactly, so its registered view is contiguous on every version
  (the case the shared-memory path accepted: vLLM <= 0.29's pages, and 0.5.3/
  0.5.4's page-wide view of vLLM 0.30+'s);
* ``attention``: two attention layers.

Per model: the registration's exception (one line) or none; per layer,
whether every view vLLM's layer computes on lives in the storage the
registered tensor was re-pointed to (``model_views_shared``: the memory the
server maps); the server's count of ``Registered KV cache`` log lines; and
the segments of this process left in ``/dev/shm`` after the model's
registration (a refused registration must leave none).  Prints one JSON
object (also written to ``--out PATH``: LMCache logs to stdout).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

N = 64  # block size (tokens); the attention page is 2 * 64 * 1 * 32 * 2 B = 8,192 B
HEADS, HEAD = 1, 32
NUM_BLOCKS = 4
# GDN-like state filling the page exactly: conv (1, 2048) bf16 4,096 B + ssm (2, 32, 16) fp32 4,096 B
STATE_SHAPES = ((1, 2048), (2, 32, 16))
STATE_DTYPES = (torch.bfloat16, torch.float32)
MODEL = "shm-state-probe"


# ---------------------------------------------------------------------------
# vLLM's side: specs, views, bound layers
# ---------------------------------------------------------------------------


def _specs() -> tuple[Any, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec  # noqa: PLC0415

    attn = FullAttentionSpec(block_size=N, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=N, shapes=STATE_SHAPES, dtypes=STATE_DTYPES, mamba_cache_mode="align")
    assert mamba.page_size_bytes == attn.page_size_bytes, (mamba.page_size_bytes, attn.page_size_bytes)
    return attn, mamba


def model_views(kind: str) -> tuple[dict[str, torch.Tensor], Any]:
    """vLLM's own views (one buffer per layer, ``LBHNC``) and a KVCacheConfig."""
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415

    attn, mamba = _specs()
    if kind == "hybrid":
        groups = [(["model.layers.3.self_attn.attn"], attn), (["model.layers.0.linear_attn"], mamba)]
    else:
        groups = [(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], attn)]
    views: dict[str, torch.Tensor] = {}
    tensors = []
    for names, spec in groups:
        for name in names:
            kvt = KVCacheTensor(size=NUM_BLOCKS * spec.page_size_bytes, layers=[name],
                                layer_stride=NUM_BLOCKS * spec.page_size_bytes, block_stride=spec.page_size_bytes)
            raw = torch.zeros(kvt.size, dtype=torch.int8)
            (views[name],) = create_kv_cache_views(raw, spec, NUM_BLOCKS, KVCacheLayout.LBHNC, kvt, None)
            tensors.append(kvt)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors,
                           kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])
    return views, config


def bind(views: dict[str, torch.Tensor], config: Any) -> dict[str, list[torch.Tensor]]:
    """What each layer computes on after vLLM's ``bind_kv_cache``: the tensor
    itself for attention, vLLM's own state views for a Mamba/GDN layer."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import MambaSpec  # noqa: PLC0415

    bound: dict[str, list[torch.Tensor]] = {}
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            if isinstance(group.kv_cache_spec, MambaSpec):
                layer = types.SimpleNamespace(get_state_shape=lambda: STATE_SHAPES,
                                              get_state_dtype=lambda: STATE_DTYPES)
                MambaBase.bind_kv_cache(layer, views[name])
                bound[name] = list(layer.kv_cache)
            else:
                bound[name] = [views[name]]
    return bound


# ---------------------------------------------------------------------------
# LMCache's side: the connector's registration
# ---------------------------------------------------------------------------


def _vllm_config_stub() -> Any:
    """What 0.5.5+'s ``vllm_layout_hints(self._vllm_config)`` reads: the resolved
    layout (0.5.3/0.5.4's patched connector reads the views' strides instead)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415

    cache = types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC)
    return types.SimpleNamespace(cache_config=cache)


def connector(url: str, config: Any) -> Any:
    """The installed ``LMCacheMPConnector`` without vLLM's engine around it:
    the attributes ``register_kv_caches`` reads, a real worker adapter."""
    import zmq  # noqa: PLC0415
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector  # noqa: PLC0415
    from lmcache.integration.vllm.vllm_multi_process_adapter import (  # noqa: PLC0415
        LMCacheMPWorkerAdapter, ParallelStrategy)

    strategy = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1,
                                n_servers=1)
    conn = object.__new__(LMCacheMPConnector)
    conn._kv_cache_config = config
    conn._vllm_config = _vllm_config_stub()
    conn._dcp_size = 1
    conn.dispatcher = None
    conn.worker_adapter = LMCacheMPWorkerAdapter(
        server_url=url, context=zmq.Context(), model_name=MODEL, vllm_block_size=N, parallel_strategy=strategy,
        extra_config={"lmcache.mp.mp_transfer_mode": "lmcache_driven", "lmcache.mp.mq_timeout": 60.0})
    return conn


def _segments() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"lmcache_kv_{os.getpid()}_*"))


def register(kind: str, url: str) -> dict[str, Any]:
    views, config = model_views(kind)
    bound = bind(views, config)
    before = _segments()
    conn = connector(url, config)
    out: dict[str, Any] = {"layers": list(views)}
    try:
        conn.register_kv_caches(dict(views))
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - what an engine start would raise here
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    registered = getattr(conn.worker_adapter, "kv_caches", None) or {}
    shared = {}
    for name, model_tensors in bound.items():
        reg = registered.get(name)
        if out["error"] is not None or reg is None:
            shared[name] = None  # nothing was registered
            continue
        ptr = reg.untyped_storage().data_ptr()
        shared[name] = all(t.untyped_storage().data_ptr() == ptr for t in model_tensors)
    out["model_views_shared"] = shared
    out["segments_left"] = [s for s in _segments() if s not in before] if out["error"] else None
    shutdown = getattr(conn.worker_adapter, "shutdown", None)
    if callable(shutdown):
        shutdown()
    return out


def main() -> int:
    from gate import restore_server  # noqa: PLC0415 - the server helpers the CPU restore gate uses
    from gate import procs  # noqa: PLC0415

    doc: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shm-state-probe-") as tmp, procs.Supervisor() as sup:
        work = Path(tmp)
        zp, hp = procs.free_ports(2)
        spec = restore_server.ServerSpec(zp, hp, N, 0.1, work / "l2", work)
        (work / "l2").mkdir()
        server = restore_server.launch_server(sup, spec, "probe")
        t0 = time.monotonic()
        restore_server.await_server(server, spec, timeout=300)
        doc["server_start_s"] = round(time.monotonic() - t0, 1)
        doc["models"] = {kind: register(kind, spec.zmq_url) for kind in ("hybrid", "attention")}
        time.sleep(1.0)  # the server logs the last registration after answering it
        log = (work / "server-probe.log").read_text(errors="replace")
        doc["server_registrations"] = log.count("Registered KV cache")
        restore_server.kill_server(server)
    text = json.dumps(doc, indent=1)
    if len(sys.argv) > 2 and sys.argv[1] == "--out":
        Path(sys.argv[2]).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
