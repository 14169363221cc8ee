"""vLLM's KV-cache interface for code that runs where vLLM is absent.

The CPU runtime venvs carry no vLLM, yet the installed LMCache connector's
registration edits import ``vllm.v1.kv_cache_interface``. Where it does not
import, :func:`ensure_vllm_interface` installs a stub with the four names
those edits use; ``get_kv_cache_spec_kind`` returns the spec's declared kind.
Shared by ``geometry`` and ``ports_edits`` (both run the installed edits).
"""

from __future__ import annotations

import enum
import sys
import types


class _Kind(enum.Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    MLA_ATTENTION = "mla_attention"
    MAMBA = "mamba"
    CROSS_ATTENTION = "cross_attention"


def ensure_vllm_interface() -> str:
    """Import vllm.v1.kv_cache_interface, or install a minimal stub; returns which."""
    try:
        import vllm.v1.kv_cache_interface as kci  # noqa: PLC0415

        return "stub" if getattr(kci, "KVCacheSpecKind", None) is _Kind else "vllm"
    except Exception:  # noqa: BLE001 - any import failure: stub it
        pass
    for name in ("vllm", "vllm.v1"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = []  # a package
            sys.modules[name] = mod
    kci = types.ModuleType("vllm.v1.kv_cache_interface")
    kci.KVCacheSpecKind = _Kind
    kci.KVCacheConfig = type("KVCacheConfig", (), {})
    kci.KVCacheSpec = type("KVCacheSpec", (), {})
    kci.get_kv_cache_spec_kind = lambda spec: spec.kind
    sys.modules["vllm.v1.kv_cache_interface"] = kci
    sys.modules["vllm.v1"].kv_cache_interface = kci
    sys.modules["vllm"].v1 = sys.modules["vllm.v1"]
    return "stub"
