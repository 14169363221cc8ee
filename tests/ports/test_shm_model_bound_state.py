"""lmcache-driven transfer on a CPU worker and vLLM's Mamba/GDN state (hybrid-fa
part ``09-padded-block-stride``, revision 4).

lmcache-driven on a CPU worker shares the KV cache with the server through
POSIX shared memory: ``migrate_to_shm_and_wrap`` copies a registered tensor's
storage into a segment and re-points the tensor it is handed.  vLLM's
attention layers compute on the very tensor objects the connector is handed;
its Mamba/GDN layers compute on conv/ssm state views they bound before
registration (``MambaBase.bind_kv_cache``), which nothing re-points.  Through
a real engine (EXPLAINER section 6) that is a silent wrong answer: every
stored state object is the registration-time copy, all zeros.

The part makes the connector mark every layer whose vLLM spec is a
``MambaSpec`` and the shared-memory path refuse a marked tensor before any
copy, in one line naming engine-driven; attention keeps the path.

``shm_state_probe`` (real vLLM 0.33.0 views and bind code, the installed
connector's ``register_kv_caches``, a real ``lmcache server`` on 127.0.0.1):

* patched: the hybrid (attention layer first, then a GDN state that fills its
  page, so the view is contiguous on every version) is refused with the line,
  no segment of the worker is left in ``/dev/shm`` and the server registers
  nothing for it; the pure-attention model registers and both layers compute
  on the memory the server maps;
* pristine 0.5.6: the hybrid registers, the attention layer shares the
  segment, the GDN layer's state views do not (the stale state, through
  LMCache's and vLLM's own code).

CI (``bash .ci/run``): patched 0.5.6.  ``LMCACHE_PATCHTOOL_FULL=1``: patched
0.5.3-0.5.5 and pristine 0.5.6.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .harness_run import vllm_layer_probe

FULL = os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
PATCHED = ("0.5.3", "0.5.4", "0.5.5", "0.5.6") if FULL else ("0.5.6",)
GDN, ATTN = "model.layers.0.linear_attn", "model.layers.3.self_attn.attn"
REFUSAL = (f"ValueError: migrate_to_shm_and_wrap: {GDN} is a Mamba/GDN state layer, which vLLM computes on "
           "through state views of the original memory bound before registration, so a POSIX shared-memory "
           "copy would be stale on every store and restore; use mp_transfer_mode=engine_driven on a CPU worker "
           "[lmcache-patchtool hybrid-fa]")


def shm_probe(version: str, patched: bool, tmp: Path) -> dict:
    """``shm_state_probe`` in ``version``'s runtime venv over the vLLM 0.33.0 layer."""
    return vllm_layer_probe("shm_state_probe", version, patched, tmp / f"shm-state-{version}-{patched}.json")


@pytest.mark.parametrize("version", PATCHED)
def test_patched_refuses_state_layers_and_keeps_attention(version, tmp_path):
    doc = shm_probe(version, True, tmp_path)
    hybrid, attention = doc["models"]["hybrid"], doc["models"]["attention"]
    assert hybrid["layers"] == [ATTN, GDN]  # attention first: its migration is rolled back
    assert hybrid["error"] == REFUSAL, hybrid["error"]
    assert hybrid["segments_left"] == [], hybrid  # nothing left in /dev/shm
    assert attention["error"] is None, attention["error"]
    assert attention["model_views_shared"] and all(attention["model_views_shared"].values()), attention
    assert doc["server_registrations"] == 1  # the attention model only


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: the stale state without the part")
def test_pristine_shares_attention_but_not_the_state(tmp_path):
    doc = shm_probe("0.5.6", False, tmp_path)
    hybrid = doc["models"]["hybrid"]
    assert hybrid["error"] is None, hybrid["error"]
    assert hybrid["model_views_shared"] == {ATTN: True, GDN: False}, hybrid
    assert all(doc["models"]["attention"]["model_views_shared"].values()), doc["models"]["attention"]
    assert doc["server_registrations"] == 2
