"""vLLM 0.30+'s strided KV views on LMCache 0.5.3 and 0.5.4 (hybrid-fa parts
``09-padded-block-stride`` and ``10-vllm030-registration``).

Pristine 0.5.3/0.5.4 (and revision 3) cannot start on vLLM 0.30+: the
connector asks vLLM for ``get_kv_cache_layout``, which 0.30 removed, gets no
hint, and its GDN edit raises ``Unsupported kv_layout: none``.  With a hint the
edit's ``.view`` cannot split an unpadded state row that the block size does
not divide, and the server rejects a dim-0-padded view.  Part 10 reads the
layout from the views' strides where vLLM no longer says it, re-views the
state row page-wide (the bytes vLLM <= 0.29 registered, so the same objects
and keys), and lets the server take the two rank-4 formats with a padded
block step (blocks-first pools).  Part 09 makes the CPU transfer fallback
honour that step, as the CUDA kernels do; 0.5.3/0.5.4 have no refusal there,
so without it such a pool is read and written at packed offsets, silently.
Part 09 is the same part as on 0.5.5/0.5.6 (``test_padded_block_stride.py``,
whose helpers these tests use).

* ``vllm030_registration_probe`` with the real vLLM 0.33.0 (its own
  ``create_kv_cache_views``) and the connector's own registration steps:
  patched takes HND from LBHNC/BLHNC and NHD from LBNHC and edits the GDN row
  to the page-wide view (on layer-compact pools exactly vLLM <= 0.29's,
  blocks-first with the two-page step); pristine raises what an engine start
  would.  With vLLM 0.27.1 the hint is vLLM's own answer, whatever the
  strides say.
* ``padded_stride_probe`` (the real fallback against the CUDA addressing):
  patched moves exactly the tight blocks; pristine moves wrong bytes without
  an error.
* the ``*-v030`` presets through the round-trip harness, patched: every cell.
* tight strides keep bytes and keys: the existing presets give the same
  object sha256s and logged keys without and with parts 09-11, and vLLM
  0.30+'s registration of a model gets the keys and object sizes of vLLM
  0.29's (``qwen35-bs576-v030`` against ``qwen35-bs576``), and a disk tier
  written by the one restores byte-exact into the other.
* (the CPU restore gate of hybrid-fa + engine-driven on every ``*-v030``
  preset is test_padded_block_stride's; lmcache-driven on a CPU worker
  refuses Mamba/GDN state layers, test_shm_model_bound_state.)

CI (``bash .ci/run``): 0.5.4 only (the registration probe patched and
pristine on vLLM 0.33.0, the fallback probe, four harness cells, the identity
run).  ``LMCACHE_PATCHTOOL_FULL=1``: 0.5.3 too, vLLM 0.27.1, every cell, the
native path, pristine's fallback, the gate and the tier across a vLLM upgrade.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from .harness_run import REPO, ports_harness, provision, series, vllm_layer_probe
from .test_padded_block_stride import (SHM_ENGINE_DRIVEN, TIGHT_CELLS, TIGHT_CELLS_FULL,
                                       assert_cells_pass, objects_and_keys, probe, v030_cells)

sys.path.insert(0, str(REPO / "tests" / "gate"))
from test_restore_gate import run_gate
FULL = os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
VERSIONS = ("0.5.3", "0.5.4") if FULL else ("0.5.4",)
OURS = ("09-", "10-", "11-")  # the parts revision 4 adds for vLLM 0.30+ and local hits
V030 = ("qwen35-bs576-v030", "qwen35-tp4-bs320-v030", "qwen35-fa4-bs640-v030", "control-k1-v030")


def without(version: str, prefixes: tuple[str, ...]) -> list[Path]:
    parts = [p for p in series(version) if not p.name.startswith(prefixes)]
    assert len(parts) < len(series(version)), f"no {prefixes} parts in patches/hybrid-fa/{version}"
    return parts


def registration(version: str, patched: bool, tmp: Path, vllm: str = "0.33.0") -> dict:
    """``vllm030_registration_probe`` in ``version``'s runtime venv over the vLLM layer."""
    doc = vllm_layer_probe("vllm030_registration_probe", version, patched,
                           tmp / f"registration-{version}-{patched}-{vllm}.json", vllm=vllm, timeout=600)
    assert doc["vllm"] == vllm, doc
    return doc


# ---------------------------------------------------------------------------
# Registration with a real vLLM's views
# ---------------------------------------------------------------------------

PAGE = 1_179_648  # the attention page (576 tokens x 2 heads x 512 B x 2), the GDN state padded to it


@pytest.mark.parametrize("version", VERSIONS)
def test_patched_registers_vllm_030_views(version, tmp_path):
    layouts = registration(version, True, tmp_path)["layouts"]
    gdn, attn = "model.layers.1.linear_attn", "model.layers.7.self_attn.attn"
    for name, hint, step, shape, inner in (
            ("LBHNC", "HND", PAGE, [5, 1, 576, 2048], [576 * 2048, 2048, 1]),
            ("LBNHC", "NHD", PAGE, [5, 576, 1, 2048], [2048, 2048, 1]),
            ("BLHNC", "HND", 2 * PAGE, [5, 1, 576, 2048], [576 * 2048, 2048, 1])):
        got = layouts[name]
        assert "error" not in got, (name, got["error"])
        assert got["hints"] == {"kv_layout": hint}, (name, got)
        # vLLM's view: (nb, 1, 1, 1,085,440) int8, the block step as stride(0).
        assert got["registered"][gdn] == {"shape": [5, 1, 1, 1_085_440], "stride": [step, 1_085_440,
                                          1_085_440, 1], "dtype": "torch.int8"}, got["registered"]
        # Page-wide 2048-byte tokens: on a layer-compact pool (step = page)
        # vLLM <= 0.29's contiguous (nb, 1, 576, 2048) registration, byte for
        # byte; blocks-first, the same rows two pages apart.  Attention
        # passes through (rank 4).
        assert got["edited"][gdn] == {"shape": shape, "stride": [step, *inner], "dtype": "torch.int8"}, got
        assert got["edited"][attn] == got["registered"][attn]
        assert got["engine_groups"] == 2


@pytest.mark.parametrize("version", VERSIONS)
def test_pristine_cannot_start_on_vllm_030(version, tmp_path):
    """As measured in the issue: no hint (vLLM 0.30 has no get_kv_cache_layout),
    and the GDN edit raises at registration, which vLLM does not catch."""
    for name, got in registration(version, False, tmp_path)["layouts"].items():
        assert got["hints"] == {}, (name, got)
        assert got["error"] == "ValueError: Unsupported kv_layout: none. Only NHD and HND are supported.", got


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: the vLLM 0.27.1 hint path")
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("patched", [False, True], ids=["pristine", "patched"])
def test_vllm_029_hint_is_vllms_own(version, patched, tmp_path):
    """vLLM <= 0.29 still says the layout: the hint is its answer, also when the
    views' strides say the other layout (nothing changes there)."""
    doc = registration(version, patched, tmp_path, vllm="0.27.1")
    assert doc["older_vllm"]["hint_for_vllm_answer"] == {"NHD": "NHD", "HND": "HND"}, doc


# ---------------------------------------------------------------------------
# The CPU fallback (the other versions' probe)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_fallback_moves_exactly_the_bytes_cuda_moves(version):
    doc = probe(version, patched=True)
    assert len(doc["transfer"]) == 5
    for case in doc["transfer"]:
        assert "error" not in case, case
        assert case["d2h_objects_exact"] == case["d2h_objects"] == 2, case
        assert case["h2d_pool_exact"] and case["h2d_bytes_differing"] == 0 < case["h2d_bytes_written"], case
    assert doc["span"]["control"] is None and "end at byte 2432 of a 1920-byte storage" in doc["span"]["short"]
    assert SHM_ENGINE_DRIVEN in doc["shm"], doc["shm"]


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: pristine's silent fallback")
@pytest.mark.parametrize("version", VERSIONS)
def test_pristine_fallback_moves_wrong_bytes_silently(version):
    """0.5.3/0.5.4 have no refusal: given a padded stride (the MLA format's is
    accepted pristine), the fallback reads and writes every block but the first
    at the packed offset, and nothing raises."""
    doc = probe(version, patched=False)
    for case in doc["transfer"]:
        assert "error" not in case, case
        assert case["d2h_objects_exact"] == 0 and case["h2d_bytes_differing"] > 0, case


# ---------------------------------------------------------------------------
# The *-v030 presets through the round-trip harness
# ---------------------------------------------------------------------------

CI_PRESETS = ("qwen35-bs576-v030", "control-k1-v030")
HARNESS = ["--no-hashes", "--path", "python", "--layout", "HND", "--edits"]


@pytest.mark.parametrize("version", VERSIONS)
def test_v030_presets_round_trip_patched(version):
    cells = v030_cells(V030 if FULL else CI_PRESETS)
    doc = ports_harness(version, True, cells, HARNESS, timeout=1200)
    assert_cells_pass(doc, len(cells))


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: the emulated native plan path")
@pytest.mark.parametrize("version", VERSIONS)
def test_v030_presets_round_trip_patched_native_path(version):
    """HND only: 0.5.3/0.5.4's CPU detector forces HND whatever the hint, and
    vLLM's CPU attention takes only LBHNC (HND), so an NHD view never meets a
    CPU server (docs/ports.md)."""
    cells = v030_cells()
    doc = ports_harness(version, True, cells, ["--no-hashes", "--path", "native", "--layout", "HND", "--edits"],
                        timeout=1200)
    assert_cells_pass(doc, len(cells))


# ---------------------------------------------------------------------------
# Tight strides keep their bytes and keys
# ---------------------------------------------------------------------------

# qwen35-bs576 (in TIGHT_CELLS) as vLLM 0.30+ registers it.
TWIN, KEYED = TIGHT_CELLS[3], ("preset=qwen35-bs576-v030,chunk_blocks=1,num_chunks=2",)


@pytest.mark.parametrize("version", VERSIONS)
def test_tight_strides_keep_their_bytes_and_keys(version):
    tight = TIGHT_CELLS + (TIGHT_CELLS_FULL if FULL else ())
    old, old_keys = objects_and_keys(version, without(version, OURS), tight)
    new, new_keys = objects_and_keys(version, series(version), tight + KEYED)
    for (cell, old_objs), (_, new_objs) in zip(old, new[:len(tight)]):
        assert cell["verdict"]["pass"], (cell["name"], cell["verdict"])
        assert old_objs and all(old_objs), cell["name"]
        assert new_objs == old_objs, cell["name"]  # the sha256 of every object, unchanged
    assert new_keys[:len(tight)] == old_keys
    # The model as vLLM 0.30+ registers it: the same keys and object sizes as
    # vLLM 0.29's registration (the page-wide rows: a disk tier written
    # before a vLLM upgrade is read after it); its bytes differ only in the
    # page padding, which the harness fills with another byte for 0.30+.
    ((cell, objs),) = new[len(tight):]
    (_, twin_objs) = new[tight.index(TWIN)]
    assert cell["verdict"]["pass"], (cell["name"], cell["verdict"])
    assert new_keys[len(tight)] == new_keys[tight.index(TWIN)], (new_keys[len(tight)], new_keys)
    assert [(o[0], o[1]) for o in objs] == [(o[0], o[1]) for o in twin_objs], (objs, twin_objs)


# ---------------------------------------------------------------------------
# The CPU restore gate
# ---------------------------------------------------------------------------


def _python(version: str) -> Path:
    return provision.runtime_env(version) / "bin" / "python"


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: a disk tier across a vLLM upgrade")
@pytest.mark.parametrize("version", VERSIONS)
def test_disk_tier_written_on_vllm_029_restores_on_vllm_030(version, tmp_path):
    """One fs L2 tier across a vLLM upgrade: a writer registered as vLLM <=
    0.29 does (``qwen35-bs576``), SIGKILLed; a fresh server and client that
    register the same model as vLLM 0.30+ does (``qwen35-bs576-v030``: the
    page-wide view) find every chunk and restore it byte-exact."""
    overlay, tier = provision.overlay(version, series(version)), tmp_path / "tier"
    tier.mkdir()
    proc, _, _ = run_gate(_python(version), overlay, ["qwen35-bs576"], "--phase", "store", "--chunk-blocks", "1",
                          "--l2-dir", str(tier), "--state-out", str(tmp_path / "v029.json"),
                          "--model-prefix", "v029writer", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "v029.json").read_text())
    (entry,) = state["presets"]
    entry["preset"] = "qwen35-bs576-v030"  # the same model, tokens and expected bytes
    (tmp_path / "v030.json").write_text(json.dumps(state))
    proc, report, _ = run_gate(_python(version), overlay, [], "--phase", "restore", "--l2-dir", str(tier),
                               "--state-in", str(tmp_path / "v030.json"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (got,) = report["presets"]
    assert (got["preset"], got["verdict"], got["outcome"]) == ("qwen35-bs576-v030", "pass", "exact"), got
