"""Registration-time behaviour of the hybrid-FA fix, in-process on CPU.

Registers one preset's KV caches with the real ``LMCacheDrivenTransferModule``
and reports (JSON on stdout):

* the LMCache log lines about each kernel group: pristine says
  ``group N: compressed (...)`` for a sub-paged group, patched says
  ``group N: sub-paged, k=K (...) [lmcache-patchtool hybrid-fa]``;
* with ``--break-tiling``: whether registration refuses a layout whose host
  segment does not tile into whole staging pages. The break is injected by
  making the cache context report a host segment one slot short (the only
  way to reach that state on CPU, where shapes are consistent by design).

Run as a module in the target interpreter, with the repository root on the path:
``PYTHONPATH=<site>:<repo> python -m lab.probes.registration_probe --preset qwen35-0.8b``
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys

from gate import geometry


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def probe(preset: str, break_tiling: bool) -> dict:
    import torch  # noqa: PLC0415
    from lmcache.utils import EngineType  # noqa: PLC0415
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt  # noqa: PLC0415

    from gate.harness import FakeStorageManager, _fake_server_context, _Wrapper  # noqa: PLC0415

    geo = geometry.preset(preset)
    capture = _Capture()
    for name in ("lmcache", "lmcache.v1.kv_layer_groups",
                 "lmcache.v1.multiprocess.modules.lmcache_driven_transfer"):
        logging.getLogger(name).addHandler(capture)

    if break_tiling:
        from lmcache.v1.platform.cpu.cache_context import CPUCacheContext  # noqa: PLC0415

        real = CPUCacheContext.get_kernel_group_shape_dtype

        def short_by_one_slot(self, num_tokens, kernel_group_idx):
            shape, dtype = real(self, num_tokens, kernel_group_idx)
            return torch.Size((*shape[:2], shape[2] - 1, *shape[3:])), dtype

        CPUCacheContext.get_kernel_group_shape_dtype = short_by_one_slot

    ctx = _fake_server_context(geo.tokens_per_block, FakeStorageManager(1 << 20, False))
    module = ldt.LMCacheDrivenTransferModule(ctx)
    caches = geometry.build_kv_caches(geo, 4, seed=1)
    infos = geometry.make_engine_group_infos(geometry.engine_group_infos(geo))
    error = None
    try:
        module.register_kv_cache(1, [_Wrapper(t) for t in caches.tensors], "m", 1, EngineType.VLLM,
                                 {"kv_layout": "HND"}, infos)
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        error = f"{type(exc).__name__}: {exc}"
    finally:
        close = getattr(module, "close", None)
        if callable(close):
            close()
    group_lines = [ln for ln in capture.lines if re.search(r"group \d+: (compressed|sub-paged)", ln)
                   or "sub-paged" in ln]
    return {"preset": preset, "k": geo.k, "break_tiling": break_tiling,
            "registered": error is None, "error": error, "group_lines": group_lines}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen35-0.8b")
    ap.add_argument("--break-tiling", action="store_true")
    args = ap.parse_args(argv)
    json.dump(probe(args.preset, args.break_tiling), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
