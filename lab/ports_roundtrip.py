#!/usr/bin/env python3
"""The round-trip harness (``gate/roundtrip.py``) for LMCache 0.5.3-0.5.6, with
each version's own connector-side registration edits and a selectable KV layout.

lmcache-patchtool hybrid-fa ports.  Runs the real round-trip harness
unchanged after :func:`ports_compat.install` (0.5.4+ module moves) and, with
``--edits``, replaces the registered tensors by what the version's own
``apply_kv_cache_group_edits`` makes of vLLM 0.27.1's tensors
(:mod:`ports_edits`); ``--layout NHD`` builds FlashInfer NHD tensors and
registers with ``{"kv_layout": "NHD"}`` (0.5.6's detector honours an explicit
hint on CPU; 0.5.3-0.5.5 force HND on CPU, so NHD is only meaningful there).
Every other option is roundtrip.py's::

    PYTHONPATH=<overlay>:<repo> <venv>/bin/python -m lab.ports_roundtrip --edits --layout HND --matrix fast
"""

from __future__ import annotations

import sys

from gate import geometry, harness, ports_compat, ports_edits

EDIT_REPORTS: list[dict] = []


def _install_layout(layout: str, edits: bool) -> None:
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as ldt  # noqa: PLC0415

    orig_build = geometry.build_kv_caches

    def build(geo, nb, *, fill=None, seed=None, device="cpu", pad_fill=None):
        caches = ports_edits.build_raw(geo, nb, layout=layout, fill=fill, seed=seed, device=device,
                                       pad_fill=pad_fill)
        if edits:
            EDIT_REPORTS.append(ports_edits.apply_edits(caches, layout))
        return caches

    build.__wrapped__ = orig_build
    harness.geometry.build_kv_caches = build

    cls = ldt.LMCacheDrivenTransferModule
    orig_register = cls.register_kv_cache
    if getattr(orig_register, "_ports_layout", None) is not None:
        orig_register = orig_register.__wrapped__

    def register_kv_cache(self, instance_id, kv_caches, model_name, world_size, engine_type, layout_hints,
                          engine_group_infos):
        hints = dict(layout_hints or {})
        hints["kv_layout"] = layout
        return orig_register(self, instance_id, kv_caches, model_name, world_size, engine_type, hints,
                             engine_group_infos)

    register_kv_cache.__wrapped__ = orig_register
    register_kv_cache._ports_layout = layout
    cls.register_kv_cache = register_kv_cache


def _bytewise_torch_equal() -> None:
    """Make ``torch.equal`` compare bytes (the harness's source-mutation check).

    Random bf16 bytes contain NaNs; ``torch.equal`` compares values, and on a
    non-contiguous (NHD-permuted) tensor it takes the elementwise path where
    NaN != NaN, reporting a mutation that did not happen (and the harness then
    fails on ``.view(-1)`` of the strided tensor).  Byte equality is what the
    check means.
    """
    import torch  # noqa: PLC0415

    if getattr(torch.equal, "_ports_bytewise", False):
        return
    orig = torch.equal

    def equal(a, b):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return orig(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))

    equal._ports_bytewise = True
    torch.equal = equal


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    layout = "HND"
    edits = False
    if "--edits" in argv:
        argv.remove("--edits")
        edits = True
    if "--layout" in argv:
        i = argv.index("--layout")
        layout = argv[i + 1]
        del argv[i:i + 2]
    ports_compat.install()
    _install_layout(layout, edits)
    _bytewise_torch_equal()
    return harness.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
