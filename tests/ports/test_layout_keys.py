"""Layout-namespaced disk-tier keys (05-layout-keys).

* The namespace function, run from each patched series in its runtime venv
  (``lab.probes.layout_keys_probe``): the same value on every
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
  version's server logs per object group, preset and chunk size, pinned, and
  the sharing this gives: all four share pure attention k = 2, and all four
  write a hybrid's groups separately (part 06; on 0.5.3 since hybrid-fa
  revision 9, before which 0.5.3 kept merged objects), all namespaced, with
  the same GDN objects.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

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
# (preset, blocks per chunk): the namespace of each object group ("" = the
# pristine key).  From part 06 (on 0.5.3 since hybrid-fa revision 9), every
# patched server writes a hybrid's groups as separate objects (GDN state,
# attention): both are namespaced, and the GDN objects are the same bytes, so
# the same namespace, on 0.5.3-0.5.6.
GDN_CN, GDN_C2N = "kvl1-905e7a3ff3d5", "kvl1-41d26fcb17e4"
S_MID = ("0.5.3", "0.5.4", "0.5.5")
REGISTERED = {
    ("qwen35-0.8b", 1): {**{v: [GDN_CN, "kvl1-2a43cf81065e"] for v in S_MID},
                         "0.5.6": [GDN_CN, "kvl1-f7a6b3a38b59"]},
    ("qwen35-0.8b", 2): {**{v: [GDN_C2N, "kvl1-802ccd5fdf07"] for v in S_MID},
                         "0.5.6": [GDN_C2N, "kvl1-b90f6612d9dd"]},
    ("control-k1", 1): {v: [GDN_CN, "kvl1-faf749e79ee7"] for v in VERSIONS},
    ("control-k1", 2): {v: [GDN_C2N, "kvl1-f2bed35273db"] for v in VERSIONS},
    ("pure-attn-bs128", 1): {v: ["kvl1-3d59b9f7a29c"] for v in VERSIONS},
}
_LOGGED = re.compile(r"Object group (\d+) of (\S+) keys objects as '([^']*)'")


def probe(version: str) -> dict:
    venv = provision.runtime_env(version)
    overlay = provision.overlay(version, series(version))
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}")
    proc = subprocess.run([str(venv / "bin" / "python"), "-m",
                           "lab.probes.layout_keys_probe"],
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
    logged = [(int(m.group(1)), m.group(3)) for m in _LOGGED.finditer(logs[0])]
    want = []
    for key in REGISTERED:  # the harness registers two instances per cell
        names = [(og, f"roundtrip-model+{ns}" if ns else "roundtrip-model")
                 for og, ns in enumerate(REGISTERED[key][version])]
        want += names + names
    assert logged == want, (logged, want)
