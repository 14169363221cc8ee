"""Disk-tier integrity (part 12-l2-checksum) through the real server.

One writer phase of ``gate/restore_gate.py`` on the patched build stores a
3-chunk request of two presets, each under six model names (``--copies``:
own seed, own bytes), and is SIGKILLed:

* ``pure-attn-k1``: one object per chunk under LMCache's own (plain) key,
  the key every build shares;
* ``qwen35-0.8b``: the hybrid; 0.5.4+ write an attention and a GDN-state
  object per chunk (namespaced), 0.5.3 one merged object.

The test then damages the tier the way a disk tier is damaged between a
store and a restore, one kind per copy, every object of the damaged chunk,
and one reader phase (a fresh server over the damaged tier, a fresh client
per copy) looks every copy up and retrieves it:

=========  =====================================================  ==============
copy       what happens to the damaged chunk's objects on disk    pure-attn-k1
=========  =====================================================  ==============
intact     nothing                                                3 chunks hit
bit-rot    chunk 1: one byte flipped in place                     1 (prefix)
torn       chunk 0: second half zeros, same size (a torn copy     0
           into a pre-sized file)
cut-short  chunk 1: the file ends in the middle of its bytes      1
swap       chunks 0 and 1 exchange their objects                  0
foreign    chunk 1: replaced by another request's intact object   1
           (valid for its own key)
=========  =====================================================  ==============

The hybrid hits the same prefix where it writes merged objects (0.5.3);
from 0.5.4 a damaged chunk 1 still leaves 0 hits: the prefetch loads the
GDN state of the last chunk only, so a prefix cannot end earlier.

Every hit must be byte-exact, every refused object must be named by one
server log line, and the adapter's counter in ``GET /status`` must match.
Before the restore, ``patchtool l2 scan --verify`` must list exactly the
damaged objects as corrupt (the GDN objects the prefetch never reads
included), except the plain-key cut-short one: a shorter object under a
plain name is also what another build may write there, so its set is
reported ambiguous instead.
Without the check (``LMCACHE_PATCHTOOL_EXCLUDE_PATCH=12-l2-checksum``)
bit-rot, torn, swap and foreign restore wrong bytes and the test fails;
cut-short is a miss even then (upstream refuses a short read), and is here
to pin that it stays one.

Adapter-level cases (the real ``FSL2Adapter`` of the patched tree in the
runtime venv, real files, no server): an object without a trailer is a miss
and the next store rewrites it (upstream skips a store whose file exists);
a rejected object is rewritten too; O_DIRECT writes and reads the same
format; ``fs_native`` is refused at creation.

CI runs 0.5.6; ``LMCACHE_PATCHTOOL_FULL=1`` runs all four versions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .harness_run import REPO, provision
from .tier_damage import assert_outcomes, assert_refusals_logged, damage_copies, remove_work

from gate import tier_objects as tier  # stdlib only

GATE = REPO / "gate" / "restore_gate.py"
VERSIONS = ["0.5.3", "0.5.4", "0.5.5", "0.5.6"] if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" \
    else ["0.5.6"]
PRESETS = ("pure-attn-k1", "qwen35-0.8b")
COPIES = ("intact", "bit-rot", "torn", "cut-short", "swap", "foreign")
# copy -> (first damaged chunk, chunks hit after the restart with one object per chunk)
DAMAGE = {"intact": (None, 3), "bit-rot": (1, 1), "torn": (0, 0), "cut-short": (1, 1), "swap": (0, 0),
          "foreign": (1, 1)}


def _series(version: str) -> list[Path]:
    """The patched build: the shipped series (or LMCACHE_PATCHTOOL_SERIES_ROOT/<V>),
    minus the parts named in LMCACHE_PATCHTOOL_EXCLUDE_PATCH (comma-separated stems)."""
    root = Path(os.environ.get("LMCACHE_PATCHTOOL_SERIES_ROOT", REPO / "patches" / "hybrid-fa"))
    skip = {s for s in os.environ.get("LMCACHE_PATCHTOOL_EXCLUDE_PATCH", "").split(",") if s}
    shipped = sorted((root / version).glob("*.patch"))
    if not any(p.stem == "12-l2-checksum" for p in shipped):
        pytest.skip(f"{root / version}: no 12-l2-checksum part")
    return [p for p in shipped if p.stem not in skip]


def _env(version: str) -> tuple[Path, dict[str, str]]:
    python = provision.runtime_env(version) / "bin" / "python"
    overlay = provision.overlay(version, _series(version))
    return python, dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1")


def _phase(version: str, work: Path, *args: str) -> dict:
    python, env = _env(version)
    out = work / f"{args[1]}.json"
    presets = [a for p in PRESETS for a in ("--preset", p)]
    proc = subprocess.run([str(python), str(GATE), "--l2-dir", str(work / "l2"), "--json-out", str(out),
                           *presets, "--chunks", "3", "--chunk-blocks", "1", "--no-stay-alive",
                           "--step-timeout", "30", *args],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=900)
    if not out.exists():
        pytest.fail(f"restore_gate {args[:2]} wrote no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    report = json.loads(out.read_text())
    assert report["verdict"] != "error", report["reason"] + proc.stderr[-3000:]
    return report


def _group(path: Path) -> str:
    return path.name.split("@")[2]


def _damage(l2: Path, entries: dict[str, dict]) -> dict[str, list[str]]:
    """Damage every object of one chunk per copy (:data:`DAMAGE`); the names touched."""
    chunks = {c: tier.objects_by_chunk(l2, e["model"], e["chunk_hashes"]) for c, e in entries.items()}
    for objs in chunks.values():  # precondition: what the patched writer wrote carries a trailer
        assert all(tier.has_trailer(p) for o in objs for p in o), objs

    def apply(copy: str, p: Path, partner: Path | None) -> Path | None:
        if copy == "bit-rot":
            tier.flip_byte(p)
        elif copy == "torn":
            tier.tear(p)
        elif copy == "cut-short":
            tier.cut_short(p)
        elif copy == "swap":
            tier.swap(p, partner)
            return partner
        elif copy == "foreign":
            tier.plant(partner, p)
        return None

    touched = damage_copies(chunks, DAMAGE, _group, apply)
    return {copy: [p.name for p in paths] for copy, paths in touched.items()}


def _scan_lists_exactly_the_damaged(l2: Path, touched: dict[tuple[str, str], list[str]]) -> None:
    """``patchtool l2 scan --verify`` on the damaged tier (blake3 in the
    project venv; the scan reads it, moves nothing)."""
    proc = subprocess.run([sys.executable, "-m", "patchtool", "l2", "scan", str(l2), "--assume", "kvl1",
                           "--verify", "--json"], capture_output=True, text=True, cwd=str(REPO), timeout=600)
    res = json.loads(proc.stdout)["result"]
    plain_cut = set(touched[("pure-attn-k1", "cut-short")])
    want = {n for names in touched.values() for n in names} - plain_cut
    assert sorted(res["verify"]["corrupt_names"]) == sorted(want), res["verify"]
    assert proc.returncode == 20 and res["flagged_objects"] == len(want)
    (amb,) = [s for s in res["sets"] if s["ambiguous"]]
    assert {n.rsplit("@", 1)[0] for n in plain_cut} == {amb["set"]}


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_damaged_objects_are_misses_and_intact_ones_hit(version: str, tmp_path: Path) -> None:
    (tmp_path / "l2").mkdir()
    state_path = tmp_path / "state.json"
    store = _phase(version, tmp_path, "--phase", "store", "--state-out", str(state_path),
                   "--copies", str(len(COPIES)), "--model-prefix", "ck")
    assert store["verdict"] == "pass", store["reason"]
    state = json.loads(state_path.read_text())
    per_preset = {name: dict(zip(COPIES, [e for e in state["presets"] if e["preset"] == name], strict=True))
                  for name in PRESETS}
    touched = {(name, copy): names for name, entries in per_preset.items()
               for copy, names in _damage(tmp_path / "l2", entries).items()}
    merged = {name: len(tier.objects_by_chunk(tmp_path / "l2", e["intact"]["model"],
                                              e["intact"]["chunk_hashes"])[2]) == 1
              for name, e in per_preset.items()}
    _scan_lists_exactly_the_damaged(tmp_path / "l2", touched)

    report = _phase(version, tmp_path, "--phase", "restore", "--state-in", str(state_path), "--keep-tmp")
    try:
        assert_outcomes(report, per_preset, DAMAGE, merged)
        assert_refusals_logged(report, touched)
    finally:
        remove_work(report)


# ---------------------------------------------------------------------------
# the adapter itself (patched tree, runtime venv, real files; no server)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_adapter_heals_rewrites_and_refuses_fs_native(version: str, tmp_path: Path) -> None:
    python, env = _env(version)
    env["PYTHONPATH"] += f":{REPO}"
    proc = subprocess.run([str(python), "-m", "lab.probes.l2_checksum_probe", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    # A file without a trailer (pristine's format) is a miss, the next store
    # rewrites it in this build's format, and then it hits.
    assert doc["no_trailer"] == {"load": [], "rejected": {"no_checksum": 1}, "rewritten": True, "reload": [0]}
    # A corrupted object is a miss; its size and trailer look current, so only
    # the reader's rejection makes the next store rewrite it.
    assert doc["corrupt"] == {"load": [], "rejected": {"checksum": 1}, "rewritten": True, "reload": [0]}
    # An intact object is skipped by the store, as upstream does.
    assert doc["intact_store_skipped"] is True
    # The bytes before the trailer are exactly the KV bytes.
    assert doc["kv_prefix_exact"] is True
    if doc["odirect"] != "unsupported here":
        assert doc["odirect"] == {"stored_with_trailer": True, "load": [0], "after_flip": []}
    assert doc["fs_native"].startswith("ValueError: L2 adapter 'fs_native' (base_path ")
    assert "refused by lmcache-patchtool hybrid-fa: it cannot verify object checksums" in doc["fs_native"]
