"""The cross-version gate's pure logic: outcome classification, the expected
outcome table (design doc 3.3 / 4.1) and the markdown matrix.  No servers."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

from gate import xver_outcome as xo
from gate.xver_outcome import Build, classify, expected_outcome, predicted_outcome
pytestmark = pytest.mark.standalone

P = {v: Build(v, "pristine") for v in xo.VERSIONS}
S = {v: Build(v, "patched") for v in xo.VERSIONS}
PAIRS = list(itertools.product(xo.ALL_BUILDS, xo.ALL_BUILDS))


def res(hit: int, exact: int = 0, foreign: int = 0, ok: bool | None = True, stored: int = 3) -> dict:
    return {"chunks_stored": stored, "chunks_hit": hit, "chunks_exact": exact, "foreign_bytes": foreign,
            "retrieve_ok": None if hit == 0 else ok}


# ---------------------------------------------------------------------------
# classify
# ---------------------------------------------------------------------------


def test_classify_exact_miss_wrong() -> None:
    assert classify(res(3, 3))[0] == "exact"
    assert classify(res(2, 2)) == ("exact", "2/3 chunks hit, all byte-exact, nothing foreign changed")  # prefix
    assert classify(res(0)) == ("miss", "0/3 chunks hit")
    assert classify(res(3, 2))[0] == "wrong"  # one hit chunk with wrong bytes
    assert classify(res(3, 3, foreign=1))[0] == "wrong"  # right bytes, one foreign byte
    assert classify(res(0, foreign=7))[0] == "wrong"  # no hit, yet the cache changed


def test_classify_loud_failure_is_a_miss_only_if_nothing_was_written() -> None:
    assert classify(res(3, 0, ok=False))[0] == "miss"
    assert classify(res(3, 0, foreign=10, ok=False))[0] == "wrong"
    # a retrieve that reports success with wrong bytes is a wrong hit
    assert classify(res(3, 0, ok=True))[0] == "wrong"


def test_classify_infrastructure_error() -> None:
    assert classify({"error": "restore: TimeoutError: x\ntraceback"}) == ("error", "restore: TimeoutError: x")


# ---------------------------------------------------------------------------
# the expected-outcome table
# ---------------------------------------------------------------------------


def test_build_parse_and_labels() -> None:
    assert Build.parse("0.5.6-patched") == Build("0.5.6", "patched") == Build.parse("0.5.6P")
    assert Build.parse("0.5.3p") == Build.parse("0.5.3:pristine") == P["0.5.3"]
    assert S["0.5.5"].label == "0.5.5-patched" and S["0.5.5"].short == "0.5.5P"
    for bad in ("0.5.7-patched", "0.5.6-half", "056"):
        with pytest.raises(ValueError):
            Build.parse(bad)


def test_same_build_exact_unless_it_has_the_one_of_k_bug() -> None:
    """A build reads its own objects exactly, except a pristine sub-paged one
    (the 1/k bug: its own restore is wrong, tier or no tier); 0.5.6's connector
    re-views a hybrid's attention, so pristine 0.5.6 hybrids are right."""
    for b, name, cb in itertools.product(xo.ALL_BUILDS, xo.PRESETS, xo.CHUNK_BLOCKS):
        buggy = b.state == "pristine" and xo.preset(name).k > 1 and not (
            b.generation == "new" and xo.family(name) == "hybrid")
        want = "wrong" if buggy else "exact"
        assert expected_outcome(b, b, name, cb) == want, (b, name, cb)
        assert predicted_outcome(b, b, name, cb, "today") == want, (b, name, cb)


@pytest.mark.parametrize("cb", xo.CHUNK_BLOCKS)
def test_shared_objects_hit_exactly(cb: int) -> None:
    """Design doc 3.3 + the namespaces the series logs (tests/ports/test_layout_keys.py):
    builds that share an object must hit it exactly, the others must miss."""
    for w, r in PAIRS:
        # non-hybrid k=1: one class, except that a patched reader refuses a pristine
        # object (no checksum trailer: 12-l2-checksum)
        unchecked = w.state == "pristine" and r.state == "patched"
        assert expected_outcome(w, r, "pure-attn-k1", cb) == ("miss" if unchecked else "exact"), (w, r)
        if w.state == r.state == "patched":
            assert expected_outcome(w, r, "pure-attn-bs128", cb) == "exact", (w, r)  # one fingerprint
    # 06: separate, namespaced GDN + attention objects (0.5.3: its own part 06, keys 053-06)
    sep = [S[v] for v in xo.VERSIONS]
    bare = [P[v] for v in xo.VERSIONS]
    for w, r in itertools.product(sep, sep):
        assert expected_outcome(w, r, "control-k1", cb) == "exact", (w, r)  # same GDN, same k=1 attention
        fa_same = (w.generation == "new") == (r.generation == "new")  # 0.5.6+'s attention is re-viewed
        assert expected_outcome(w, r, "qwen35-0.8b", cb) == ("exact" if fa_same else "miss"), (w, r)
    for w, r in itertools.product(sep, bare):
        for name in ("qwen35-0.8b", "control-k1"):
            assert expected_outcome(w, r, name, cb) == expected_outcome(r, w, name, cb) == "miss", (w, r, name)
    if cb == 1:  # hybrid k=1, C=N: one class for every build that keeps the bare key
        for w, r in itertools.product(bare, bare):
            unchecked = w.state == "pristine" and r.state == "patched"
            assert expected_outcome(w, r, "control-k1", cb) == ("miss" if unchecked else "exact"), (w, r)


@pytest.mark.parametrize("cb", xo.CHUNK_BLOCKS)
def test_checksums_refuse_pristine_objects_under_shared_keys(cb: int) -> None:
    """12-l2-checksum: where pristine and patched share a key (pure attention
    k=1), the patched reader refuses the pristine object (no trailer) and the
    pristine reader reads the patched one (the KV bytes, the trailer ignored);
    with 06's keys (no checksums) both ways were exact."""
    for v in xo.VERSIONS:
        assert predicted_outcome(P[v], S[v], "pure-attn-k1", cb, "06") == "exact"
        assert expected_outcome(P[v], S[v], "pure-attn-k1", cb) == "miss"
        assert expected_outcome(S[v], P[v], "pure-attn-k1", cb) == "exact"
        assert expected_outcome(S[v], S[v], "pure-attn-k1", cb) == "exact"


@pytest.mark.parametrize("cb", xo.CHUNK_BLOCKS)
def test_revision_05_keys(cb: int) -> None:
    """Up to 05-layout-keys (before 06 separated the groups): 0.5.6 hybrids keep the
    pristine key on both states, S-old = S-mid at C=N, and patched 0.5.3 hybrids at
    C>N get their own namespace, even at k=1."""
    def o(w, r, name):
        return predicted_outcome(w, r, name, cb, "05")
    assert o(P["0.5.6"], S["0.5.6"], "qwen35-0.8b") == o(S["0.5.6"], P["0.5.6"], "qwen35-0.8b") == "exact"
    for mid in ("0.5.4", "0.5.5"):
        assert o(S["0.5.3"], S[mid], "qwen35-0.8b") == o(S[mid], S["0.5.3"], "qwen35-0.8b") == \
            ("exact" if cb == 1 else "miss")
    assert o(S["0.5.3"], P["0.5.3"], "control-k1") == ("exact" if cb == 1 else "miss")
    assert o(S["0.5.4"], P["0.5.4"], "control-k1") == "exact"


def test_issue_12_wrong_hits_today_become_misses() -> None:
    """The three upstream wrong hits measured with today's keys turn into misses
    (12's keys), and the third, patched 0.5.3 -> patched 0.5.4, into an exact hit
    once 0.5.3 writes as 0.5.4 does (053-06)."""
    cases = [(S["0.5.5"], P["0.5.6"], "qwen35-0.8b", 1), (S["0.5.6"], P["0.5.6"], "pure-attn-bs128", 2),
             (S["0.5.3"], S["0.5.4"], "qwen35-0.8b", 2)]
    for w, r, name, cb in cases:
        assert predicted_outcome(w, r, name, cb, "today") == "wrong", (w, r, name, cb)
        assert predicted_outcome(w, r, name, cb, "12") == "miss", (w, r, name, cb)
    assert [expected_outcome(w, r, name, cb) for w, r, name, cb in cases] == ["miss", "miss", "exact"]


def test_wrong_is_required_only_for_upstream_pairs() -> None:
    """A wrong hit stays only where both sides write under the pristine key,
    i.e. where no change to a patched build can separate them."""
    upstream = set()
    for (w, r), name, cb in itertools.product(PAIRS, xo.PRESETS, xo.CHUNK_BLOCKS):
        if expected_outcome(w, r, name, cb) == "wrong":
            assert xo.namespace(w, name, cb) == xo.namespace(r, name, cb) == ("",), (w, r, name, cb)
            assert xo.is_upstream(w, r, name, cb)
            upstream.add((w, r, name, cb))
    # the gate's positive control is one of them: pristine 0.5.6 -> pristine 0.5.4 hybrid k=17
    assert (P["0.5.6"], P["0.5.4"], "qwen35-0.8b", 1) in upstream
    assert not any(name == "pure-attn-k1" for _, _, name, _ in upstream)
    # no patched pure-attention k=2 writer/reader is ever in a wrong hit
    assert not any(name == "pure-attn-bs128" and "patched" in (w.state, r.state) for w, r, name, _ in upstream)


def test_shorter_file_is_a_miss_longer_is_a_hit() -> None:
    # one-page pristine objects are shorter than 0.5.6's: the reader's read is incomplete
    assert expected_outcome(P["0.5.4"], P["0.5.6"], "qwen35-0.8b", 1) == "miss"
    # and the reverse reads a prefix of a longer file: an upstream wrong hit
    assert expected_outcome(P["0.5.6"], P["0.5.4"], "qwen35-0.8b", 1) == "wrong"


def test_extra_preset_is_pure_attention_k1() -> None:
    geo = xo.preset("pure-attn-k1")
    assert geo.k == 1 and geo.num_gdn_layers == 0 and geo.tokens_per_block == xo.preset("pure-attn-bs128").tokens_per_block
    assert [xo.family(p) for p in xo.PRESETS] == ["hybrid", "pure", "hybrid-k1", "pure-k1"]


# ---------------------------------------------------------------------------
# the redis tier (LMCache's resp adapter on one shared Redis)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cb", xo.CHUNK_BLOCKS)
def test_redis_pristine_and_patched_never_share_an_object(cb: int) -> None:
    """17-resp-checksum keys a patched build's objects lmcptsum1@<key>: on
    Redis a pristine and a patched build miss each other both ways, also where
    the fs tier lets a pristine reader read a patched object (pure attention k=1)."""
    for (w, r), name in itertools.product(PAIRS, xo.PRESETS):
        if w.state != r.state:
            assert expected_outcome(w, r, name, cb, "redis") == "miss", (w, r, name)
    for v in xo.VERSIONS:
        assert expected_outcome(S[v], P[v], "pure-attn-k1", cb) == "exact"  # fs: the trailer is ignored
        assert expected_outcome(S[v], P[v], "pure-attn-k1", cb, "redis") == "miss"


@pytest.mark.parametrize("cb", xo.CHUNK_BLOCKS)
def test_redis_patched_pairs_follow_the_layout_namespaces_as_on_fs(cb: int) -> None:
    """Patched -> patched across versions: the sealed key is the layout-keyed
    key with a prefix both builds spell the same, so the outcome is the fs one:
    exact where the namespaces are equal, a miss where they differ."""
    for (w, r), name in itertools.product(PAIRS, xo.PRESETS):
        if w.state == r.state == "patched":
            got = expected_outcome(w, r, name, cb, "redis")
            assert got == expected_outcome(w, r, name, cb), (w, r, name)
            assert got == ("exact" if xo.namespace(w, name, cb) == xo.namespace(r, name, cb) else "miss"), (w, r)


def test_redis_adds_no_wrong_hit_and_a_size_mismatch_is_a_miss() -> None:
    """The native RESP client reads a value only into a buffer of its exact
    size: every wrong hit on Redis is one on fs too (pristine -> pristine,
    both upstream), and the fs tier's longer-file wrong hit is a miss here."""
    for (w, r), name, cb in itertools.product(PAIRS, xo.PRESETS, xo.CHUNK_BLOCKS):
        got = expected_outcome(w, r, name, cb, "redis")
        if got == "wrong":
            assert expected_outcome(w, r, name, cb) == "wrong" and w.state == r.state == "pristine", (w, r, name)
            assert xo.is_upstream(w, r, name, cb, "redis")
    w, r, name, cb = P["0.5.6"], P["0.5.4"], "qwen35-0.8b", 1  # the fs gate's upstream control
    assert expected_outcome(w, r, name, cb) == "wrong"
    assert expected_outcome(w, r, name, cb, "redis") == "miss"
    # same size, same bare key, a lossy reader: wrong on both tiers
    assert expected_outcome(P["0.5.6"], P["0.5.6"], "pure-attn-bs128", 1, "redis") == "wrong"


def test_redis_table_is_only_for_the_series_as_it_stands() -> None:
    with pytest.raises(ValueError, match="tier redis"):
        predicted_outcome(S["0.5.6"], S["0.5.6"], "qwen35-0.8b", 1, "06", "redis")
    with pytest.raises(ValueError, match="tier 'nfs'"):
        predicted_outcome(S["0.5.6"], S["0.5.6"], "qwen35-0.8b", 1, "layout", "nfs")


# ---------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------


def test_matrix_markdown_letters_and_stars() -> None:
    cells = [{"writer": "0.5.6-patched", "reader": "0.5.6-pristine", "preset": "pure-attn-bs128", "chunk_blocks": 2,
              "outcome": "wrong"},
             {"writer": "0.5.6-patched", "reader": "0.5.6-pristine", "preset": "pure-attn-k1", "chunk_blocks": 2,
              "outcome": "exact"},
             {"writer": "0.5.6-patched", "reader": "0.5.5-patched", "preset": "pure-attn-bs128", "chunk_blocks": 2,
              "outcome": "exact"}]
    md = xo.matrix_markdown(cells, ["pure-attn-bs128", "pure-attn-k1"], 2, expected="layout")
    lines = md.splitlines()
    assert lines[0] == "| writer \\ reader | 0.5.5P | 0.5.6p |"
    assert lines[2] == "| 0.5.6P | E. | W*E |"  # the wrong hit differs from the required miss
    assert "W*" not in xo.matrix_markdown(cells, ["pure-attn-bs128", "pure-attn-k1"], 2, expected="today")


# ---------------------------------------------------------------------------
# the phase arguments of restore_gate.py (no torch needed to refuse them)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv, msg", [
    (["--phase", "store"], "needs --l2-dir"),
    (["--phase", "store", "--l2-dir", "."], "needs --state-out"),
    (["--phase", "restore", "--l2-dir", "."], "needs at least one --state-in"),
    (["--phase", "store", "--l2-dir", ".", "--state-out", "s", "--model-prefix", "a+b"], "may not contain"),
])
def test_phase_arguments_are_refused_loudly(argv: list[str], msg: str) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "gate" / "restore_gate.py"), *argv],
                          capture_output=True, text=True, cwd=str(REPO))
    assert proc.returncode == 2 and msg in proc.stderr, proc.stderr


def test_edges_for_selects_the_ci_edges_of_a_version() -> None:
    from lab import xver_gate  # noqa: PLC0415

    assert len(xver_gate.CI_EDGES) == 6
    assert {(w.label, r.label) for w, r in xver_gate.edges_for("0.5.4")} == {("0.5.3-patched", "0.5.4-patched")}
    assert len(xver_gate.edges_for("0.5.6")) == 4
    assert xver_gate.edges_for("0.5.2") == []


@pytest.mark.parametrize("argv, msg", [
    (["--ci", "--tier", "fs", "--redis-url", "redis://127.0.0.1:6379"], "cannot be combined with --tier fs"),
    (["--ci", "--redis-url", "http://127.0.0.1:6379"], "expected redis://HOST:PORT"),
    (["--ci", "--tier", "redis", "--expect", "today"], "only --expect layout"),
])
def test_xver_tier_arguments_are_refused_loudly(argv: list[str], msg: str) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "lab" / "xver_gate.py"), *argv],
                          capture_output=True, text=True, cwd=str(REPO))
    assert proc.returncode == 2 and msg in proc.stderr.splitlines()[-1], proc.stderr


def test_restore_gate_names_stale_segments_of_its_own_pid(tmp_path: Path) -> None:
    """A dead process with this pid left /dev/shm/lmcache_kv_<pid>_<n>: the
    phase refuses before starting (xver_gate then runs it again, another pid);
    segments of other pids are not its business."""
    import os  # noqa: PLC0415

    from gate import restore_gate  # noqa: PLC0415  (no torch at import)
    from lab import xver_gate  # noqa: PLC0415

    (tmp_path / f"lmcache_kv_{os.getpid()}_0").write_bytes(b"")
    (tmp_path / f"lmcache_kv_{os.getpid() + 1}_0").write_bytes(b"")
    assert restore_gate.stale_client_segments(tmp_path) == [f"lmcache_kv_{os.getpid()}_0"]
    assert xver_gate.STALE_SHM == restore_gate.STALE_SHM
