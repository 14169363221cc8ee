"""Layout-namespaced disk-tier keys (05-layout-keys, issue 12 item 1).

* The namespace function, run from each patched series in its runtime venv
  (``lmcache_patchtool_verify.layout_keys_probe``): the same value on every
  run and every version for the same inputs, pinned here as literal digests
  (so a change of the canonical description, on any machine, fails); a
  different value when any byte-deciding input changes; "" for k = 1 groups
  and for state groups that keep one block per chunk.
* The one key constructor: a lookup (no worker id) and a store (a worker id)
  get the same namespaced model name after registration, the plain one after
  the last registration is dropped; a second registration of the model with
  another namespace map is refused.
* Real registrations through ``LMCacheDrivenTransferModule.register_kv_cache``
  (the round-trip harness, which also checks the bytes): the namespace each
  version's server logs, per preset and chunk size, pinned, and the sharing
  this gives: patched 0.5.3-0.5.5 share hybrid k = 17 objects at one block
  per chunk, all four share pure attention k = 2, 0.5.6 hybrids and every
  k = 1 hybrid at one block per chunk keep the pristine key, 0.5.3's
  all-blocks GDN at two blocks per chunk gets its own namespace.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from .harness_run import REPO, ports_harness, provision, series

VERSIONS = ("0.5.3", "0.5.4", "0.5.5", "0.5.6")

# Computed by the series' own code (the probe below); literal so that a change
# to the canonical description shows on any machine.
PROBE_DIGESTS = {
    "reference": "kvl1-c09661ee40d7",
    "k": "kvl1-24487ed53667",
    "tokens_per_block": "kvl1-8407e2684cef",
    "slots_per_block": "kvl1-cdeaf1dffff1",
    "kept_slots": "kvl1-671cc4091385",
    "dtype": "kvl1-5f4e4e7b325c",
    "shape": "kvl1-3cdef7bb4472",
    "k1_attention": "",
    "state_one_block": "",
    "state_two_blocks": "kvl1-35d7eb2a5701",
}

# What each patched server logs at registration ("keys objects as ..."), per
# (preset, blocks per chunk); "" = the pristine key.
QWEN_CN = "kvl1-1f7fbe021c73"
REGISTERED = {
    ("qwen35-0.8b", 1): {"0.5.3": QWEN_CN, "0.5.4": QWEN_CN, "0.5.5": QWEN_CN, "0.5.6": ""},
    ("qwen35-0.8b", 2): {"0.5.3": "kvl1-2e030ba9b6b5", "0.5.4": "kvl1-81070a520bbd",
                         "0.5.5": "kvl1-81070a520bbd", "0.5.6": ""},
    ("control-k1", 1): {v: "" for v in VERSIONS},
    ("control-k1", 2): {"0.5.3": "kvl1-a064d57cfd87", "0.5.4": "", "0.5.5": "", "0.5.6": ""},
    ("pure-attn-bs128", 1): {v: "kvl1-3d59b9f7a29c" for v in VERSIONS},
}
_LOGGED = re.compile(r"Object group (\d+) of (\S+) keys objects as '([^']*)'")


def probe(version: str) -> dict:
    venv = provision.runtime_env(version)
    overlay = provision.overlay(version, series(version))
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO / 'verify'}")
    proc = subprocess.run([str(venv / "bin" / "python"), "-m",
                           "lmcache_patchtool_verify.layout_keys_probe"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version", VERSIONS)
def test_namespace_function_and_key_constructor(version):
    doc = probe(version)
    ns = doc["namespaces"]
    assert ns["reference"] == ns["reference_again"]
    assert {k: ns[k] for k in PROBE_DIGESTS} == PROBE_DIGESTS
    changed = [ns[k] for k in ("k", "tokens_per_block", "slots_per_block", "kept_slots",
                               "dtype", "shape")]
    assert len(set(changed)) == len(changed) and ns["reference"] not in changed
    assert doc["format"] == 1

    namespaced = "m+" + "kvl1-000000000000"
    assert doc["before"] == ["m", "m"]
    # lookup (fans out to every rank) and store (one worker) agree per group
    assert doc["registered"] == {"lookup": [namespaced, "m"], "store": [namespaced, "m"]}
    assert doc["after_one_unregister"] == [namespaced, "m"]
    assert doc["after_last_unregister"] == ["m", "m"]
    assert doc["conflict"] and "already registered with key namespaces" in doc["conflict"]


CELLS = tuple(f"preset={p},chunk_blocks={c},num_chunks=2" for p, c in REGISTERED)


@pytest.mark.parametrize("version", VERSIONS)
def test_registered_namespaces(version):
    logs: list[str] = []
    doc = ports_harness(version, True, CELLS, ["--no-hashes", "--edits", "--no-guards"],
                        timeout=1200, stderr=logs)
    for cell in doc["cells"]:
        assert "error" not in cell, cell.get("traceback")
        assert cell["verdict"]["pass"], (cell["name"], cell["verdict"])
    logged = [m.group(3) for m in _LOGGED.finditer(logs[0])]
    # one registration (or two: the harness may register a second instance) per cell
    seen = []
    for name in logged:
        if not seen or seen[-1] != name:
            seen.append(name)
    want = [(f"roundtrip-model+{REGISTERED[key][version]}" if REGISTERED[key][version]
             else "roundtrip-model") for key in REGISTERED]
    collapsed = [w for i, w in enumerate(want) if i == 0 or want[i - 1] != w]
    assert seen == collapsed, (seen, want)
