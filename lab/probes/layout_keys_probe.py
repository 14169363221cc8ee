"""Probe of the series' layout-namespaced keys (05-layout-keys), run in a
runtime venv with a patched overlay first on PYTHONPATH::

    PYTHONPATH=<overlay>:<repo> <runtime>/bin/python -m lab.probes.layout_keys_probe

Prints one JSON object:

* ``namespaces``: the namespace of a reference sub-paged object group and of
  the same group with each byte-deciding input changed (k, page order via k,
  tokens and slots per block, the slots kept per chunk, dtype, shape), of a
  k = 1 group (must be ""), and of state groups that keep one block or two;
* ``keys``: ObjectKey model names built by the one key constructor for a
  lookup (no worker id) and a store (a worker id) after registration, and
  after the last registration is dropped;
* ``conflict``: the error a second registration with another namespace map
  raises (None if it did not raise).

Fakes stand in only for the registration-time objects (the cache context and
its layer-groups manager); the functions under test are the installed ones.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch

import lmcache.v1.multiprocess.modules.lmcache_driven_transfer as ldt
from lmcache.v1.distributed import api
from lmcache.v1.multiprocess.engine_context import LayoutDescRegistry


def _group(**kw: Any) -> SimpleNamespace:
    g = dict(pages_per_block=1, tokens_per_block=544, slots_per_block=544, sw_size_tokens=-1,
             engine_group_idx=0, recurrent_state=False)
    g.update(kw)
    return SimpleNamespace(**g)


def _context(groups: list[SimpleNamespace], kept: list[int]) -> SimpleNamespace:
    manager = SimpleNamespace(
        kernel_groups=groups,
        object_groups=[SimpleNamespace(kernel_group_indices=list(range(len(groups))))],
        get_slots_per_chunk_in_sw=lambda i: kept[i])
    return SimpleNamespace(kv_layer_groups_manager=manager)


def _layout(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> Any:
    return SimpleNamespace(shapes=[torch.Size(s) for s in shapes], dtypes=dtypes)


def namespace(groups, kept, shapes, dtypes) -> str:
    return ldt.layout_key_namespace(_context(groups, kept), 0, _layout(shapes, dtypes))


def namespaces() -> dict[str, str]:
    # Reference: one sub-paged FA group (k = 17, 544/32) in its object group.
    fa = dict(pages_per_block=17, tokens_per_block=544, slots_per_block=32, engine_group_idx=1)
    ref = ([_group(**fa)], [32], [(2, 1, 544, 512)], [torch.bfloat16])
    out = {"reference": namespace(*ref), "reference_again": namespace(*ref)}
    out["k"] = namespace([_group(**{**fa, "pages_per_block": 16})], *ref[1:])
    out["tokens_per_block"] = namespace([_group(**{**fa, "tokens_per_block": 576})], *ref[1:])
    out["slots_per_block"] = namespace([_group(**{**fa, "slots_per_block": 64})], *ref[1:])
    out["kept_slots"] = namespace(ref[0], [64], *ref[2:])
    out["dtype"] = namespace(ref[0], ref[1], ref[2], [torch.float16])
    out["shape"] = namespace(ref[0], ref[1], [(2, 2, 544, 512)], ref[3])
    out["k1_attention"] = namespace([_group(engine_group_idx=0)], [544], [(2, 1, 544, 512)],
                                    [torch.bfloat16])
    # A hybrid's state group next to a k = 1 attention group: "" while it keeps
    # one block per chunk, namespaced when it keeps two (0.5.3's all-blocks GDN
    # before its part 19).
    state = dict(engine_group_idx=0, sw_size_tokens=544, recurrent_state=True)
    attn = dict(engine_group_idx=1)
    shapes = [(1, 3, 544, 2048), (2, 1, 544, 512)]
    dtypes = [torch.int8, torch.bfloat16]
    out["state_one_block"] = namespace([_group(**state), _group(**attn)], [544, 544],
                                       shapes, dtypes)
    out["state_two_blocks"] = namespace([_group(**state), _group(**attn)], [1088, 1088],
                                        [(1, 3, 1088, 2048), (2, 1, 1088, 512)], dtypes)
    return out


def keys() -> dict[str, Any]:
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    def names(ipc_key) -> list[str]:
        rows = api.ipc_key_to_object_keys(ipc_key, [b"\x01" * 8], [0, 1])
        return [k.model_name for row in rows for k in row]

    fields = set(getattr(IPCCacheServerKey, "__struct_fields__", ()) or
                 getattr(IPCCacheServerKey, "__dataclass_fields__", {}))
    base = dict(model_name="m", world_size=1, worker_id=None, token_ids=(1, 2), start=0, end=2,
                request_id="r")
    lookup = IPCCacheServerKey(**{k: v for k, v in base.items() if k in fields})
    store = IPCCacheServerKey(**{k: v for k, v in {**base, "worker_id": 0}.items() if k in fields})
    reg = LayoutDescRegistry()
    layout = api.MemoryLayoutDesc(shapes=[torch.Size((2, 1, 544, 512))], dtypes=[torch.bfloat16])
    before = names(lookup)
    reg.register("m", 1, layout, key_namespaces={0: "kvl1-000000000000", 1: ""})
    registered = {"lookup": names(lookup), "store": names(store)}
    reg.register("m", 1, layout, key_namespaces={0: "kvl1-000000000000", 1: ""})  # same: ok
    conflict = None
    try:
        reg.register("m", 1, layout, key_namespaces={})
    except ValueError as exc:
        conflict = str(exc)
    reg.unregister("m", 1)
    still = names(lookup)  # one registration left
    reg.unregister("m", 1)
    return {"before": before, "registered": registered, "after_one_unregister": still,
            "after_last_unregister": names(lookup), "conflict": conflict,
            "format": ldt.LAYOUT_KEY_FORMAT}


def main() -> int:
    print(json.dumps({"namespaces": namespaces(), **keys()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
