"""EngineGroupInfo as each LMCache version's connector builds it.

``geometry.engine_group_infos`` asks the installed LMCache's own
``lmcache.integration.vllm.kv_cache_groups`` helpers for the window fields:
pristine 0.5.3's connector gives an align-mode Mamba (GDN) group no window
(patched 0.5.3's part 19 gives it 0.5.4's); 0.5.4's
(``_is_mamba_align_spec``) gives it ``sw_size_tokens = N``, so the server keeps
only the chunk-end GDN slot of each chunk; 0.5.5+ also set
``recurrent_state = True``.  FA groups never get a window.  The pure helpers
(``kept_blocks_per_chunk`` / ``kept_positions``) say which block positions the
server stores, and are pinned without LMCache.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

from lab import provision
from gate import geometry
# (sw_size_tokens of the GDN group, recurrent_state of the GDN group; None = no such field)
EXPECTED = {"0.5.3": (-1, None), "0.5.4": (544, None), "0.5.5": (544, True), "0.5.6": (544, True)}

PROBE = """
import json
from gate import geometry as g
out = {}
for name in ("qwen35-0.8b", "pure-attn-bs128"):
    infos = g.engine_group_infos(g.preset(name))
    objs = g.make_engine_group_infos(infos)
    out[name] = [{"kind": i["kind"], "sw": i.get("sw_size_tokens"), "rec": i.get("recurrent_state"),
                  "obj_sw": getattr(o, "sw_size_tokens", None), "obj_rec": getattr(o, "recurrent_state", None)}
                 for i, o in zip(infos, objs)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", list(EXPECTED))
def test_connector_window_fields_per_version(version):
    py = provision.runtime_env(version) / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=f"{provision.overlay(version)}:{REPO}")
    proc = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    sw, rec = EXPECTED[version]
    gdn, fa = got["qwen35-0.8b"]
    assert (gdn["kind"], gdn["sw"], gdn["rec"]) == ("gdn", sw, rec)
    assert (gdn["obj_sw"], gdn["obj_rec"]) == (sw, rec)  # what is really registered
    assert (fa["kind"], fa["sw"], fa["obj_sw"]) == ("fa", -1, -1)
    assert fa["rec"] in (None, False)
    (pure,) = got["pure-attn-bs128"]
    assert pure["sw"] == -1 and pure["rec"] in (None, False)


def test_patched_053_connector_gives_gdn_a_window():
    """0.5.3's part 19 (the 0.5.4+ series' 06): the patched connector gives the GDN
    group 0.5.4's one-block window, so its server keeps only the chunk-end slot."""
    series = sorted((REPO / "patches" / "hybrid-fa" / "0.5.3").glob("*.patch"))
    py = provision.runtime_env("0.5.3") / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=f"{provision.overlay('0.5.3', series)}:{REPO}")
    proc = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gdn, fa = json.loads(proc.stdout.strip().splitlines()[-1])["qwen35-0.8b"]
    assert (gdn["kind"], gdn["sw"], gdn["obj_sw"]) == ("gdn", 544, 544)
    assert (fa["sw"], fa["obj_sw"]) == (-1, -1)


def test_kept_positions():
    gdn_end = {"tokens_per_block": 544, "sw_size_tokens": 544}
    gdn_none = {"tokens_per_block": 544, "sw_size_tokens": -1}
    fa = {"tokens_per_block": 544}
    assert geometry.kept_blocks_per_chunk(gdn_end, 1) == 1
    assert geometry.kept_blocks_per_chunk(gdn_end, 2) == 1
    assert geometry.kept_blocks_per_chunk(gdn_end, 4) == 1
    assert geometry.kept_blocks_per_chunk(gdn_none, 4) == 4
    assert geometry.kept_blocks_per_chunk(fa, 4) == 4
    # 5 chunks of 2 blocks, prefix skip of 3 blocks: positions 3..9 requested,
    # the chunk ends among them are 3, 5, 7, 9
    assert geometry.kept_positions(gdn_end, 2, range(3, 10)) == [3, 5, 7, 9]
    assert geometry.kept_positions(gdn_none, 2, range(3, 10)) == list(range(3, 10))
    assert geometry.kept_positions(gdn_end, 1, range(4)) == [0, 1, 2, 3]


def test_window_rules_without_lmcache():
    geo = geometry.preset("qwen35-0.8b")
    end = {i["kind"]: i for i in geometry.engine_group_infos(geo, "end")}
    assert end["gdn"]["sw_size_tokens"] == 544 and end["fa"]["sw_size_tokens"] == -1
    none = {i["kind"]: i for i in geometry.engine_group_infos(geo, "none")}
    assert none["gdn"]["sw_size_tokens"] == -1
    with pytest.raises(ValueError):
        geometry.engine_group_infos(geo, "bogus")
