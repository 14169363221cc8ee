"""The vLLM 0.28-0.33 geometries through the round-trip
harness, pristine and patched, with each version's real connector edits.

* ``qwen35-bs576`` (576/64, k=9), ``qwen35-tp4-bs320`` (320/64, k=5) and
  ``qwen35-fa4-bs640`` (640/128, k=5), GDN registered as vLLM 0.27.1-0.29 do:
  pristine 0.5.3-0.5.5 fail every one (FA fraction 0, FA object 1/k); pristine
  0.5.6 passes them (its connector re-views hybrids); patched passes all.
* The same with vLLM 0.30+'s GDN view (``*-v030``: ``(nb, 1, 1, content)``,
  unpadded row, padded stride(0)): pristine, no version round-trips it on CPU,
  and each refuses loudly (docs/ports.md, "vLLM 0.30+ GDN view"); patched,
  every version round-trips it (``test_padded_block_stride.py``,
  ``test_vllm030_registration.py``).  Pinned here so a change shows.

Fast tier (``bash .ci/run``): one 576/64 cell, pristine and patched, on the
oldest (0.5.3) and newest (0.5.6) series.  The rest is ``slow``; everything:
``python3 -m pytest tests/ports/test_vllm030_presets.py`` (CONTRIBUTING.md)."""

from __future__ import annotations

import pytest

from .harness_run import ports_harness

ALL = ("0.5.3", "0.5.4", "0.5.5", "0.5.6")
NEW = ("qwen35-bs576", "qwen35-tp4-bs320", "qwen35-fa4-bs640")
V030 = tuple(f"{p}-v030" for p in NEW) + ("control-k1-v030",)
K = {"qwen35-bs576": 9, "qwen35-tp4-bs320": 5, "qwen35-fa4-bs640": 5}
FAST_CELL = "preset=qwen35-bs576,chunk_blocks=2,num_chunks=3,skip_blocks=1"

_RUNS: dict = {}


def run(version: str, patched: bool, cells: tuple[str, ...]) -> dict:
    key = (version, patched, cells)
    if key in _RUNS:
        return _RUNS[key]
    doc = ports_harness(version, patched, cells,
                        ["--no-hashes", "--path", "python", "--layout", "HND", "--edits"],
                        timeout=1200)
    _RUNS[key] = {c["name"].split("/")[0] + "/" + c["name"].split("/")[1]: c for c in doc["cells"]}
    return _RUNS[key]


def assert_passes(c: dict) -> None:
    assert "error" not in c, c.get("traceback")
    assert c["verdict"]["pass"], c["verdict"]
    assert c["groups"]["fa"]["fraction"] == 1.0 and c["groups"]["fa"]["foreign_bytes"] == 0
    assert c["groups"]["gdn"]["fraction"] == 1.0 and c["groups"]["gdn"]["foreign_bytes"] == 0


def assert_one_of_k(c: dict, k: int) -> None:
    """The 0.5.3 bug: FA fraction 0 with scattered ids, object 1/k, GDN intact."""
    assert "error" not in c, c.get("traceback")
    assert not c["verdict"]["pass"]
    fa = c["groups"]["fa"]
    assert fa["fraction"] == 0.0 and fa["foreign_bytes"] > 0
    assert fa["object_ratio"] == pytest.approx(1.0 / k, abs=1e-12)
    assert c["groups"]["gdn"]["fraction"] == 1.0


@pytest.mark.parametrize("version", ["0.5.3", "0.5.6"])
@pytest.mark.parametrize("patched", [False, True], ids=["pristine", "patched"])
def test_576_fast(version, patched):
    (c,) = run(version, patched, (FAST_CELL,)).values()
    if patched or version == "0.5.6":
        assert_passes(c)
    else:
        assert_one_of_k(c, 9)


def _cells(presets) -> tuple[str, ...]:
    return tuple(f"preset={p},chunk_blocks={cb},num_chunks=3,skip_blocks={s}"
                 for p in presets for cb, s in ((1, 0), (2, 1)))


@pytest.mark.slow
@pytest.mark.parametrize("version", ALL)
@pytest.mark.parametrize("patched", [False, True], ids=["pristine", "patched"])
def test_new_presets(version, patched):
    cells = run(version, patched, _cells(NEW))
    assert len(cells) == 2 * len(NEW)
    for name, c in cells.items():
        preset = name.split("/")[0]
        if patched or version == "0.5.6":
            assert_passes(c)
        else:
            assert_one_of_k(c, K[preset])


# Patched, every version round-trips the view: 0.5.5 and 0.5.6 with part
# 09-padded-block-stride (tests/ports/test_padded_block_stride.py), 0.5.3 and
# 0.5.4 with part 10-vllm030-registration (tests/ports/test_vllm030_registration.py).
REFUSED = [(v, False) for v in ALL]


@pytest.mark.slow
@pytest.mark.parametrize("version,patched", REFUSED,
                         ids=[f"{v}-{'patched' if p else 'pristine'}" for v, p in REFUSED])
def test_vllm030_gdn_view_is_refused_loudly(version, patched):
    """Measured: 0.5.3/0.5.4 refuse at registration (576: the connector's
    ``.view(nb, 1, N, -1)`` cannot split an unpadded 1,085,440 B row into 576
    tokens; 320 and 640: the server rejects dim-0 padding on the HND format);
    pristine 0.5.5/0.5.6 register, then store and retrieve raise in the CPU
    transfer fallback (non-tight per-block strides), so nothing is written."""
    cells = run(version, patched, _cells(V030))
    for name, c in cells.items():
        assert not c["verdict"]["pass"], name
        if version in ("0.5.3", "0.5.4"):
            preset = name.split("/")[0]
            want = "RuntimeError" if preset in ("qwen35-bs576-v030", "control-k1-v030") else "ValueError"
            assert c.get("error", "").startswith(want), (name, c.get("error"))
        else:
            assert "error" not in c, c.get("traceback")
            assert c["store_ok"] is False and c["retrieve_ok"] is False
            assert c["groups"]["fa"]["foreign_bytes"] == 0 and c["groups"]["gdn"]["foreign_bytes"] == 0
            assert c["groups"]["fa"]["fraction"] == 0.0
