#!/usr/bin/env python3
"""Probe: a DCP attention group (LMCache 0.5.5+) under the sub-paged rule.

lmcache-patchtool hybrid-fa ports.  From 0.5.5 the vLLM connector reports an
attention group's ``tokens_per_block`` as ``block_size * dcp_size`` under
decode context parallelism (``kv_cache_groups.get_tokens_per_block``), while
the tensor each rank registers keeps ``block_size`` slots per block: the group
arrives as "tokens > slots, non-MLA, rank-4 fused format" -- the same
signature as a sub-paged group.  Pristine LMCache handles it as a slot ratio
(each rank holds 1/dcp of every block's tokens).  This probe registers such a
group (block_size 64, dcp 2: tokens_per_block 128) and round-trips whole
blocks from scattered ids into other ids; it prints JSON with the restored
fraction and foreign bytes.  Run in a version's runtime venv with the overlay
on PYTHONPATH::

    PYTHONPATH=<overlay>:<repo> <venv>/bin/python -m lab.probes.ports_dcp_probe
"""
import json
import time

import torch
from lmcache.utils import EngineType
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt
from gate import ports_compat
ports_compat.install()  # the harness's fake server context, adapted to this version

from gate import harness as roundtrip  # after install(): 0.5.6 swaps its storage manager in


def main() -> None:
    B, dcp, H, D = 64, 2, 8, 128
    N = B * dcp  # tokens_per_block as 0.5.5+'s connector reports it
    C = N  # one logical block per chunk
    nchunks, nb = 3, 12
    T = C * nchunks
    sm = roundtrip.FakeStorageManager(8 << 20, False)
    ctx = roundtrip._fake_server_context(C, sm)
    mod = ldt.LMCacheDrivenTransferModule(ctx)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (nb * H * B * 2 * D * 2,), dtype=torch.uint8, generator=g)
    dst = torch.full_like(src, 0xA5)
    shape = (nb, H, B, 2 * D)
    s_t, d_t = src.view(torch.bfloat16).view(shape), dst.view(torch.bfloat16).view(shape)
    infos = [EngineGroupInfo(engine_group_id=0, layer_indices=(0,), tokens_per_block=N)]
    hints = {"kv_layout": "HND"}
    result = {"lmcache_file": ldt.__file__, "block_size": B, "dcp": dcp, "tokens_per_block": N}
    try:
        mod.register_kv_cache(1, [roundtrip._Wrapper(s_t)], "m", 1, EngineType.VLLM, hints, infos)
        mod.register_kv_cache(2, [roundtrip._Wrapper(d_t)], "m", 1, EngineType.VLLM, hints, infos)
        ids_a, ids_b = [3, 5, 7], [10, 2, 8]
        key = IPCCacheServerKey(model_name="m", world_size=1, worker_id=0, token_ids=tuple(range(T)), start=0,
                                end=T, request_id="r")
        try:
            st = mod.store(key, 1, [list(ids_a)], b"stub_ipc_handle")[1]
            time.sleep(0.3)
            rt = mod.retrieve(key, 2, [list(ids_b)], b"stub_ipc_handle")[1]
            time.sleep(0.3)
        except Exception as exc:  # noqa: BLE001
            st = rt = f"raised {type(exc).__name__}: {exc}"
        blk = H * B * 2 * D * 2
        ok = sum(int((src[a * blk:(a + 1) * blk] == dst[b * blk:(b + 1) * blk]).sum()) for a, b in zip(ids_a, ids_b))
        foreign = sum(int((dst[L * blk:(L + 1) * blk] != 0xA5).sum()) for L in range(nb) if L not in ids_b)
        obj = next(iter(sm.objs.values()), None)
        result.update(store_ok=st, retrieve_ok=rt, fraction=ok / (blk * len(ids_a)), foreign_bytes=foreign,
                      object_bytes=obj.get_size() if obj else None, block_bytes=blk)
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        mod.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
