"""Prompt construction and key placement vs chunk/page geometry (property style)."""

from __future__ import annotations

import random

import pytest

from gate import engine_prompt as gp

TOK = gp.ByteTokenizer()


def _geometries():
    rng = random.Random(7)
    out = [gp.PlacementGeometry(544, 32, 544), gp.PlacementGeometry(544, 32, 1088),
           gp.PlacementGeometry(1600, 64, 1600), gp.PlacementGeometry(192, 64, 384),
           gp.PlacementGeometry(272, 16, 544)]
    for _ in range(25):
        page = rng.choice([16, 32, 64])
        k = rng.choice([2, 3, 4, 5, 8, 17, 25])
        block = page * k
        if block - page < 80:  # a byte-tokenized key sentence (76 tokens) must fit behind the page
            continue
        out.append(gp.PlacementGeometry(block, page, block * rng.choice([1, 2, 3])))
    return out


@pytest.mark.parametrize("geo", _geometries(), ids=str)
def test_keys_never_in_a_first_kernel_page(geo):
    rng = random.Random(geo.block * 31 + geo.chunk)
    for _ in range(4):
        n_keys = rng.randint(1, 5)
        head = -(-400 // geo.chunk)  # chunks taken by the header and the question
        target = geo.chunk * rng.randint(n_keys + head + 1, n_keys + head + 12) + rng.randrange(geo.chunk)
        p = gp.build_prompt(TOK, target, geometry=geo, num_keys=n_keys, seed=rng.randrange(1000), tag="t")
        assert p.num_tokens == target // geo.chunk * geo.chunk + 1
        assert gp.placement_violations(p, tokenizer=TOK) == []
        starts = [s.start for s in p.keys]
        assert len(set(s.chunk for s in p.keys)) == n_keys, "one key per chunk"
        for s in p.keys:
            assert s.start // geo.chunk == (s.end - 1) // geo.chunk == s.chunk
            for pos in range(s.start, s.end):
                assert pos % geo.chunk >= geo.page, "inside the first kernel page of a chunk"
                if geo.k > 1:
                    assert pos % geo.block >= geo.page, "inside the first kernel page of a block"
            assert s.end <= p.restorable_tokens
            assert TOK.decode(p.ids[s.start:s.end]).count(s.key) == 1
        assert len(set(p.key_strings)) == n_keys
        assert sorted(starts) == sorted(set(starts))


def test_deterministic_and_distinct_per_length():
    geo = gp.PlacementGeometry()
    a = gp.build_prompt(TOK, 8192, geometry=geo, seed=3, tag="x")
    b = gp.build_prompt(TOK, 8192, geometry=geo, seed=3, tag="x")
    c = gp.build_prompt(TOK, 16384, geometry=geo, seed=3, tag="x")
    assert a.ids == b.ids and a.sha256 == b.sha256 and a.key_strings == b.key_strings
    assert set(a.key_strings).isdisjoint(c.key_strings)
    # the first logical block differs, so one length never gives another a local prefix hit
    assert a.ids[:geo.block] != c.ids[:geo.block]


def test_keys_spread_over_depths():
    p = gp.build_prompt(TOK, 32768, geometry=gp.PlacementGeometry(), num_keys=3, tag="d")
    depths = [s.depth for s in p.keys]
    assert depths == sorted(depths)
    assert depths[0] < 0.34 and 0.34 < depths[1] < 0.67 and depths[2] > 0.67


def test_violation_detected_when_key_sits_in_first_page():
    geo = gp.PlacementGeometry(128, 32, 128)
    p = gp.build_prompt(TOK, 2048, geometry=geo, num_keys=2, tag="v")
    s = p.keys[0]
    moved = type(s)(**{**s.__dict__, "start": s.chunk * 128 + 2, "end": s.chunk * 128 + 2 + (s.end - s.start)})
    p.keys[0] = moved
    assert any("first kernel page" in v for v in gp.placement_violations(p))


def test_observed_geometry_with_larger_page_is_checked():
    p = gp.build_prompt(TOK, 8192, geometry=gp.PlacementGeometry(544, 32, 544), tag="o")
    assert gp.placement_violations(p, gp.PlacementGeometry(544, 32, 544)) == []
    # a k=1 geometry (FlashAttention) only needs chunk containment
    assert gp.placement_violations(p, gp.PlacementGeometry(544, 544, 544)) == []


@pytest.mark.parametrize("target,geo,n", [(100, gp.PlacementGeometry(128, 32, 128), 1),
                                          (1024, gp.PlacementGeometry(64, 16, 64), 1),
                                          (600, gp.PlacementGeometry(128, 32, 128), 9)])
def test_impossible_placements_raise(target, geo, n):
    with pytest.raises(ValueError):
        gp.build_prompt(TOK, target, geometry=geo, num_keys=n)


def test_geometry_validation():
    with pytest.raises(ValueError):
        gp.PlacementGeometry(544, 48, 544)
    with pytest.raises(ValueError):
        gp.PlacementGeometry(544, 32, 600)


def test_score_answer():
    keys = ["K-" + "a" * 24, "K-" + "b" * 24]
    assert gp.score_answer(keys, f"{keys[0]}\n{keys[1]}")["all_exact"]
    s = gp.score_answer(keys, f"{keys[0]}\nK-{'b' * 23}c")
    assert not s["all_exact"] and s["missing"] == [keys[1]] and s["spurious"] == [f"K-{'b' * 23}c"]
    assert gp.score_answer(keys, "")["num_correct"] == 0
    assert not gp.score_answer(keys, f"{keys[0]} {keys[1]} K-{'c' * 24}")["all_exact"]


def test_make_tokenizer():
    assert isinstance(gp.make_tokenizer("byte", None), gp.ByteTokenizer)
    with pytest.raises(ValueError):
        gp.make_tokenizer("nope", None)
    with pytest.raises(ValueError):
        gp.make_tokenizer("hf", None)
