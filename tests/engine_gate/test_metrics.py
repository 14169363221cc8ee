"""Prometheus text parsing and counter deltas."""

from __future__ import annotations

import math

import pytest

from gate import engine_metrics as gm

VLLM_TEXT = '''# HELP vllm:external_prefix_cache_hits_total External prefix cache hits
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 8160.0
vllm:external_prefix_cache_hits_total{engine="1",model_name="m"} 40.0
vllm:external_prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
vllm:prompt_tokens_total{engine="0",model_name="m"} 8161
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 8160
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3
weird{a="x\\"y",b="1,2"} -Inf 1700000000
'''


def test_parse_and_sum_over_labels():
    s = gm.parse_prometheus(VLLM_TEXT)
    assert s.total("vllm:external_prefix_cache_hits_total") == 8200.0
    assert s.total("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}) == 8160
    assert s.series["weird"][0][0] == {"a": 'x"y', "b": "1,2"}
    assert s.series["weird"][0][1] == -math.inf
    assert s.types["vllm:external_prefix_cache_hits_total"] == "counter"
    assert s.total("absent") is None


def test_snapshot_resolves_vllm_and_lmcache_names():
    snap = gm.snapshot(gm.parse_prometheus(VLLM_TEXT), gm.VLLM)
    assert snap.values["external_hits"] == 8200.0
    assert snap.values["prompt_tokens_external"] == 8160
    assert snap.values["local_hits"] is None
    lm = gm.parse_prometheus("lmcache_mp_l2_prefetch_hit_total 3\nlmcache_mp_num_chunks_loaded_total 2\n")
    snap = gm.snapshot(lm, gm.LMCACHE)
    assert snap.names["l2_prefetch_hit"] == "lmcache_mp_l2_prefetch_hit_total"  # no unit suffix: still found
    assert snap.values["chunks_loaded"] == 2


def test_delta_handles_missing_and_resets():
    a = gm.Snapshot({"x": 10.0, "y": None, "z": 5.0}, {})
    b = gm.Snapshot({"x": 25.0, "y": 3.0, "z": 2.0}, {})
    # y absent before: 0 (OTel omits unset counters); absent after: None
    assert gm.delta(a, b) == {"x": 15.0, "y": 3.0, "z": 2.0}
    assert gm.delta(b, a) == {"x": 10.0, "y": None, "z": 3.0}


@pytest.mark.parametrize("bad", ["metric{a=1} 3", "metric 3 4 5", "metric notanumber", '{a="1"} 2'])
def test_bad_lines_raise(bad):
    with pytest.raises(gm.MetricsParseError):
        gm.parse_prometheus(bad)
