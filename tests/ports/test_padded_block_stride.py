"""The padded per-block stride on CPU (hybrid-fa part ``09-padded-block-stride``,
LMCache 0.5.5 and 0.5.6).

vLLM 0.30+ registers a Mamba/GDN layer as an unpadded state row inside a
padded page (``(nb, 1, 1, content)`` int8, ``stride(0)`` = the page).  0.5.5+'s
connector keeps that stride (``desc.block_stride_elems``); LMCache's CUDA
kernels copy the tight block at ``block_id * stride``, while the non-CUDA
fallback refused it (``NotImplementedError: Non-tight per-block strides``).
The part makes the fallback address it as the kernels do, refuses at
registration a layer whose strided span leaves its storage, and makes the CPU
shared-memory path (lmcache-driven on a CPU worker) refuse the view in one
line that names engine-driven.

* ``padded_stride_probe`` (the real fallback, raw layer pointers, HND and NHD
  fused formats and an MLA-style one, int8 and bf16, separate padded buffers
  and a blocks-first pool whose "padding" is the other layers): patched, the
  host objects equal the tight block bytes read by the CUDA addressing, and an
  H2D restore writes exactly the destination blocks' tight bytes (every other
  byte of the pool, padding and siblings included, unchanged); the span check
  names the layer and the numbers; the SHM refusal names engine_driven.
  Pristine: the transfer raises ``NotImplementedError``, no span check, SHM
  "requires a contiguous tensor".
* the ``*-v030`` presets (576/64 k = 9, 320/64 k = 5, 640/128 k = 5, the k = 1
  control; C = N and C = 2N with a skip) through the round-trip harness with
  each version's own connector edits: patched, every cell passes (pristine's
  loud refusal stays pinned in ``test_vllm030_presets.py``).
* tight strides keep their bytes and keys: the existing presets through the
  harness without this part and with it give the same object sha256s and the
  same logged object keys; the ``*-v030`` registrations log the same keys too (the part changes no key: a GPU build already stores
  these bytes under them), and vLLM 0.30+'s GDN view keys differently from
  vLLM <= 0.29's (``qwen35-bs576`` vs ``qwen35-bs576-v030``).
* the CPU restore gate: hybrid-fa + engine-driven restores every ``*-v030``
  preset byte-exact from the fs L2 after a SIGKILL; lmcache-driven stops at
  registration with the SHM refusal.

CI (``bash .ci/run``): the probe on both versions patched and on 0.5.6
pristine; the v030 harness cells on both versions; the byte/key identity on
0.5.6; the engine-driven gate on 0.5.6 with ``qwen35-bs576-v030`` and
``control-k1-v030`` (one server pair).  ``LMCACHE_PATCHTOOL_FULL=1`` adds
0.5.5's pristine probe, identity and gates, the NHD and native-path harness
cells, the other two gate presets and the lmcache-driven refusal in the gate.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .harness_run import REPO, ports_harness, provision, series

sys.path.insert(0, str(REPO / "tests" / "gate"))
from test_restore_gate import assert_clean_pass, by_preset, run_gate
FULL = os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
VERSIONS = ("0.5.5", "0.5.6")
PART = "09-padded-block-stride"
V030 = ("qwen35-bs576-v030", "qwen35-tp4-bs320-v030", "qwen35-fa4-bs640-v030", "control-k1-v030")
REFUSAL = "Non-tight per-block strides"
SHM_ENGINE_DRIVEN = "use mp_transfer_mode=engine_driven on a CPU worker"
_LOGGED = re.compile(r"Object group (\d+) of (\S+) keys objects as '([^']*)'")
_PROGRESS = re.compile(r"roundtrip: \[\d+/\d+\] ")


def without_this_part(version: str) -> list[Path]:
    """The shipped series without this part (revision 3's parts, plus any other
    part revision 4 added)."""
    parts = [p for p in series(version) if p.stem != PART]
    assert len(parts) == len(series(version)) - 1, f"{PART} missing from patches/hybrid-fa/{version}"
    return parts


def probe(version: str, patched: bool) -> dict:
    venv = provision.runtime_env(version)
    overlay = provision.overlay(version, series(version) if patched else None)
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}")
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "lab.probes.padded_stride_probe"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


# ---------------------------------------------------------------------------
# The fallback itself
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_fallback_moves_exactly_the_bytes_cuda_moves(version):
    doc = probe(version, patched=True)
    assert len(doc["transfer"]) == 5
    for case in doc["transfer"]:
        assert "error" not in case, case
        assert case["d2h_objects_exact"] == case["d2h_objects"] == 2, case
        assert case["d2h_source_unchanged"], case
        # The restore wrote the destination blocks' tight bytes and nothing else:
        # padding, other blocks and (interleaved) the other layers kept their bytes.
        assert case["h2d_pool_exact"] and case["h2d_bytes_differing"] == 0, case
        assert case["h2d_bytes_written"] > 0, case
    span = doc["span"]
    assert span["control"] is None
    assert span["short"].startswith("ValueError: layer 1 (kernel group 0): 5 blocks of 384 elements at a "
                                    "padded stride of 512 end at byte 2432 of a 1920-byte storage"), span
    assert span["stride"].startswith("ValueError: layer 1 (kernel group 0): stride(0) 576 differs from the "
                                     "group's padded block stride 512"), span
    for msg in (span["short"], span["stride"], doc["shm"]):
        assert "\n" not in msg and msg.endswith("[lmcache-patchtool hybrid-fa]"), msg
    assert SHM_ENGINE_DRIVEN in doc["shm"], doc["shm"]


@pytest.mark.parametrize("version", VERSIONS if FULL else ("0.5.6",))
def test_pristine_fallback_refuses_the_stride(version):
    doc = probe(version, patched=False)
    for case in doc["transfer"]:
        assert case.get("error", "").startswith(f"NotImplementedError: {REFUSAL}"), case
    assert doc["span"] == {"control": None, "short": None, "stride": None}  # nothing checks the span
    assert doc["shm"] == "migrate_to_shm_and_wrap requires a contiguous tensor"


# ---------------------------------------------------------------------------
# The *-v030 presets through the round-trip harness
# ---------------------------------------------------------------------------


def v030_cells(presets=V030) -> tuple[str, ...]:
    return tuple(f"preset={p},chunk_blocks={cb},num_chunks=3,skip_blocks={s}"
                 for p in presets for cb, s in ((1, 0), (2, 1)))


def assert_cells_pass(doc: dict, n: int) -> None:
    assert len(doc["cells"]) == n
    for c in doc["cells"]:
        assert "error" not in c, c.get("traceback")
        assert c["store_ok"] and c["retrieve_ok"], c["name"]
        assert c["verdict"]["pass"], (c["name"], c["verdict"])
        for kind in ("fa", "gdn"):
            g = c["groups"][kind]
            assert g["fraction"] == 1.0 and g["foreign_bytes"] == 0, (c["name"], kind, g)
            assert g["slots_restored"] == g["slots_expected"] > 0, (c["name"], kind, g)
        gdn_segs = [s for o in c["objects"] if o for s in o["segments"] if s["kind"] == "gdn"]
        # The state segment holds exactly the registered rows (the tight blocks);
        # with C = 2N the CPU cache context keeps the chunk-end row at the
        # segment's head (the harness's "gdn-rows-window-head").
        assert gdn_segs and all(s["layout_matches"] in (["gdn-rows"], ["gdn-rows-window-head"])
                                for s in gdn_segs), c["name"]


@pytest.mark.parametrize("version", VERSIONS)
def test_v030_presets_round_trip_patched(version):
    cells = v030_cells()
    doc = ports_harness(version, True, cells, ["--no-hashes", "--path", "python", "--layout", "HND", "--edits"],
                        timeout=1200)
    assert_cells_pass(doc, len(cells))


# NHD only on 0.5.6: 0.5.3-0.5.5's detector forces HND on CPU (ports_roundtrip),
# and the harness's NHD build of the 1-head TP=4 presets then overflows its fake
# L1 on 0.5.5 (qwen35-tp4-bs320 as well as its -v030 view: not this part).
OTHER_PATHS = [("0.5.5", "native", "HND"), ("0.5.6", "native", "HND"), ("0.5.6", "python", "NHD")]


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: NHD and the emulated native plan path")
@pytest.mark.parametrize("version,path,layout", OTHER_PATHS)
def test_v030_presets_round_trip_patched_other_paths(version, path, layout):
    cells = v030_cells()
    doc = ports_harness(version, True, cells, ["--no-hashes", "--path", path, "--layout", layout, "--edits"],
                        timeout=1200)
    assert_cells_pass(doc, len(cells))


# ---------------------------------------------------------------------------
# Tight strides keep their bytes and keys
# ---------------------------------------------------------------------------

TIGHT_CELLS = ("preset=qwen35-0.8b,chunk_blocks=2,num_chunks=3,skip_blocks=1",
               "preset=control-k1,chunk_blocks=1,num_chunks=2",
               "preset=pure-attn-bs128,chunk_blocks=2,num_chunks=3,skip_blocks=1",
               "preset=qwen35-bs576,chunk_blocks=1,num_chunks=2")
TIGHT_CELLS_FULL = ("preset=qwen35-0.8b,chunk_blocks=1,num_chunks=3",
                    "preset=control-k1,chunk_blocks=2,num_chunks=2",
                    "preset=gdn-27b,chunk_blocks=1,num_chunks=2",
                    "preset=qwen35-tp4-bs320,chunk_blocks=2,num_chunks=3,skip_blocks=1",
                    "preset=qwen35-fa4-bs640,chunk_blocks=1,num_chunks=3",
                    "preset=qwen35-0.8b@float16,chunk_blocks=1,num_chunks=2")
# Registered for their keys (without the part their store is refused on CPU); the first
# is qwen35-bs576 (in TIGHT_CELLS) as vLLM 0.30+ registers it.
KEY_CELLS = ("preset=qwen35-bs576-v030,chunk_blocks=1,num_chunks=2",)
KEY_CELLS_FULL = ("preset=control-k1-v030,chunk_blocks=2,num_chunks=2",)


def objects_and_keys(version: str, patches: list[Path], cells: tuple[str, ...]) -> tuple[list, list]:
    """Per cell: the cell and its objects' (chunk, size, sha256 of the bytes
    the server wrote); then every logged ``(object group, key)``, in order."""
    logs: list[str] = []
    doc = ports_harness(version, True, cells, ["--path", "python", "--layout", "HND", "--edits"],
                        timeout=1200, stderr=logs, patches=patches)
    per_cell = [(c, [(o["chunk"], o["size"], o["sha256_used"]) if o else None for o in c.get("objects", [])])
                for c in doc["cells"]]
    # The harness prints "roundtrip: [i/n] ..." after each cell: the keys logged
    # before it are that cell's.
    keys: list[list[tuple[int, str]]] = [[]]
    for line in logs[0].splitlines():
        m = _LOGGED.search(line)
        if m:
            keys[-1].append((int(m.group(1)), m.group(3)))
        elif _PROGRESS.search(line):
            keys.append([])
    assert len(keys) == len(cells) + 1 and not keys[-1], "keys logged outside a cell"
    return per_cell, keys[:-1]


@pytest.mark.parametrize("version", VERSIONS if FULL else ("0.5.6",))
def test_tight_strides_keep_their_bytes_and_keys(version):
    tight = TIGHT_CELLS + (TIGHT_CELLS_FULL if FULL else ())
    keyed = KEY_CELLS + (KEY_CELLS_FULL if FULL else ())
    old, old_keys = objects_and_keys(version, without_this_part(version), tight + keyed)
    new, new_keys = objects_and_keys(version, series(version), tight + keyed)
    for (cell, old_objs), (_, new_objs) in zip(old[:len(tight)], new[:len(tight)]):
        assert cell["verdict"]["pass"], (cell["name"], cell["verdict"])
        assert old_objs and all(old_objs), cell["name"]
        assert new_objs == old_objs, cell["name"]  # the sha256 of every object, unchanged
    # Every registration logged the same key per object group, without the part and with it
    # (two object groups per hybrid, one for pure attention).
    assert all(len({og for og, _ in cell}) in (1, 2) for cell in old_keys), old_keys
    assert new_keys == old_keys
    # The v030 cells: without the part nothing is stored on CPU; with it they round-trip.
    for cell, _ in old[len(tight):]:
        assert cell["store_ok"] is False, cell["name"]
    for cell, _ in new[len(tight):]:
        assert cell["verdict"]["pass"], (cell["name"], cell["verdict"])
    # vLLM 0.30+'s GDN state is keyed apart from vLLM <= 0.29's (its segment is
    # 1888, not 2048, bytes per token at N = 576); the attention objects share a key.
    k029 = dict(new_keys[tight.index("preset=qwen35-bs576,chunk_blocks=1,num_chunks=2")])
    k030 = dict(new_keys[len(tight)])
    assert k029[0] != k030[0] and "+kvl1-" in k030[0] and k029[1] == k030[1], (k029, k030)


# ---------------------------------------------------------------------------
# The CPU restore gate
# ---------------------------------------------------------------------------


def _python(version: str) -> Path:
    return provision.runtime_env(version) / "bin" / "python"


def _stacked(version: str) -> Path:
    return provision.overlay(version, series(version)
                             + sorted((REPO / "patches" / "engine-driven" / version).glob("*.patch")))


@pytest.mark.parametrize("version", VERSIONS if FULL else ("0.5.6",))
def test_restore_gate_engine_driven_restores_v030(version):
    presets = list(V030) if FULL else ["qwen35-bs576-v030", "control-k1-v030"]
    proc, report, took = run_gate(_python(version), _stacked(version), presets,
                                  "--transfer-mode", "engine_driven", timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = by_preset(report)
    assert sorted(got) == sorted(presets)
    for name in presets:
        assert_clean_pass(got[name])
        assert got[name]["fidelity"]["gdn"]["blocks_total"] > 0


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: the probe shows the same refusal in CI")
@pytest.mark.parametrize("version", VERSIONS)
def test_restore_gate_lmcache_driven_refuses_v030_naming_engine_driven(version):
    overlay = provision.overlay(version, series(version))
    proc, report, took = run_gate(_python(version), overlay, ["qwen35-bs576-v030"], timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (p,) = report["presets"]
    assert p["verdict"] == "error", p
    (reason,) = p["reasons"]
    assert reason.startswith("register+fill: ValueError: migrate_to_shm_and_wrap: a KV view with a padded "
                             "block stride") and SHM_ENGINE_DRIVEN in reason, reason
