"""vLLM 0.34's extensible KV cache and LMCache's CUDA-IPC access (stdlib only).

vLLM 0.34 turns the *extensible KV cache* on by default on CUDA and ROCm
(``config/cache.py``, ``enable_extensible_kv_cache``): the cache's address
range is reserved with device virtual memory (VMM) and its pages committed
after warmup.  A connector that exports the cache to another process must say
so through ``KVConnectorBase_V1.kv_cache_access``; LMCache's connector (every
release up to 0.5.7rc2) does not override it, and hands the LMCache server the
cache through CUDA IPC, which driver-mapped VMM memory cannot export.

vLLM's factory (``distributed/kv_transfer/kv_connector/factory.py``,
``kv_cache_access``) forces the legacy CUDA-IPC access for
``LMCacheMPConnector`` **only when ``kv_connector_module_path`` is unset**.
The engine gate always sets it (engine_servers.kv_transfer_config: it must load
LMCache's class, never vLLM's in-tree fallback), so on vLLM >= 0.34 with CUDA
the gate passes ``--no-enable-extensible-kv-cache`` and refuses an explicit
``--enable-extensible-kv-cache``.  Read from the 0.34.0 wheel; **not run on a
GPU by this project** (docs/operate.md, "vLLM 0.34 on CUDA").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SINCE = (0, 34)
ON, OFF = "--enable-extensible-kv-cache", "--no-enable-extensible-kv-cache"
# vLLM leaves the extensible cache off when the KV cache size is given in bytes.
SIZED = "--kv-cache-memory-bytes"
UNVERIFIED = "read from the vLLM 0.34.0 wheel, not yet run on a GPU by this project"


class ExtensibleKvCacheRefused(ValueError):
    """The vLLM arguments ask for a KV cache LMCache's connector cannot share."""


@dataclass(frozen=True)
class Decision:
    add_args: tuple[str, ...]  # what the gate appends to vLLM's arguments
    note: str | None  # one line for the trace; None: nothing applies


def release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string (``0.34.1+cu130`` -> (0, 34)), or None."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _given(args: tuple[str, ...] | list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def decide(vllm_version: str | None, device: str, vllm_args: tuple[str, ...] | list[str],
           *, module_path_set: bool = True) -> Decision:
    """What the gate must do about the extensible KV cache for vLLM ``vllm_version`` on
    ``device`` ("gpu" or "cpu") given the extra vLLM arguments; raises
    :class:`ExtensibleKvCacheRefused` (one line) for a combination that cannot work."""
    rel = release(vllm_version)
    if device != "gpu" or rel is None or rel < SINCE or not module_path_set:
        return Decision((), None)
    if _given(vllm_args, ON):
        raise ExtensibleKvCacheRefused(
            f"vLLM {vllm_version} on CUDA with {ON} and kv_connector_module_path set: LMCache's "
            "connector shares the KV cache through CUDA IPC, which the extensible cache's "
            f"driver-mapped memory cannot export; pass {OFF} ({UNVERIFIED})")
    if _given(vllm_args, OFF):
        return Decision((), f"vLLM {vllm_version}: {OFF} as passed ({UNVERIFIED})")
    if _given(vllm_args, SIZED):
        return Decision((), f"vLLM {vllm_version}: {SIZED} given, so vLLM leaves the extensible "
                            f"KV cache off ({UNVERIFIED})")
    return Decision((OFF,), f"vLLM {vllm_version} on CUDA: {OFF} added (its default extensible KV "
                            "cache cannot be shared by LMCache's CUDA-IPC export while "
                            f"kv_connector_module_path is set; {UNVERIFIED})")
