"""The CPU restore gate in engine-driven mode (``--transfer-mode engine_driven``:
the server runs ``--supported-transfer-mode engine_driven``, the clients
``lmcache.mp.mp_transfer_mode = engine_driven``; the worker gathers KV into CPU
bytes and the server never maps the KV caches), pinned to what was measured on
every released version, pristine and with the hybrid-fa series (revision 3,
which does not touch this path). docs/design/engine-driven.md has the table and
the code paths.

* every hybrid preset (k = 17, k = 25, and the k = 1 hybrid control) fails
  LOUDLY: 0.5.3-0.5.5 at the first store (``_single_group_block_ids``),
  0.5.6 already at registration (``EngineDrivenTransferContext.register``);
  the gate reports that as a ``fail`` with ``loud_refusal``, not an error;
* pure attention k = 1 restores byte-exact from the fs L2 after a SIGKILL;
* pure attention k = 2 (FlashInfer, ``--block-size 128``): engine-driven has
  its own 1/k bug. 0.5.3, 0.5.5 and 0.5.6 store, find every chunk on disk after
  the restart and report a successful retrieve, but no kernel page is right
  and other blocks are overwritten (silent corruption); 0.5.4 refuses the
  store (the server answers False, nothing reaches the disk).

With the stacked ``engine-driven`` set (hybrid-fa + engine-driven)
every preset restores byte-exact in engine-driven mode, and the fs L2 objects
it leaves are byte-identical, name for name, to those of an lmcache-driven
store by the same build.

The fast tier runs 0.5.6 pristine (one hybrid, the pure k = 1 control).
``bash .ci/run`` also runs 0.5.6 stacked (every preset but gdn-27b, and the identity of
the two modes' objects); ``LMCACHE_PATCHTOOL_FULL=1`` runs every version and
build, pristine and hybrid-fa rows included (the silent k = 2 corruption
survives the hybrid-fa series), and the pristine k = 1 identity.
``lab/evidence/engine-driven-gate.json`` records all of it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gate"))

from lab import provision
from test_restore_gate import assert_clean_pass, by_preset, run_gate
VERSIONS = ["0.5.3", "0.5.4", "0.5.5", "0.5.6"]
HYBRIDS = ["qwen35-0.8b", "gdn-27b", "control-k1"]
ALL_PRESETS = [*HYBRIDS, "pure-attn-bs128", "pure-attn-k1"]
# What the identity of the two modes is checked on: a sub-paged hybrid
# (k = 17: separate FA/GDN objects, part 05's key namespace), sub-paged
# pure attention (k = 2, engine-driven's own 1/k bug before the set) and the
# k = 1 control (pristine keys and bytes).
IDENTITY_PRESETS = ["qwen35-0.8b", "pure-attn-bs128", "pure-attn-k1"]
STACKED = "stacked"  # hybrid-fa + engine-driven
# The gate client (the engine-driven worker) fills new memory with 0xA5
# instead of zeros: an object byte no transfer writes (a windowed group's
# staging tail before part zero-window-tail) then differs from the
# lmcache-driven server's every time, not only when the allocator reuses.
CLIENT_PERTURB = ("--client-malloc-perturb", "0x5A")
# Revision 3 gathers into a shared-memory staging region, not heap memory: a
# new region then starts as this byte instead of zeros (posix_shm.
# staging_fill_byte), so the same unwritten byte shows there too.
STAGING_FILL = ("LMCACHE_PATCHTOOL_STAGING_FILL", "0xA5")
MODE = ("--transfer-mode", "engine_driven")


def _python(version: str) -> Path:
    return provision.runtime_env(version) / "bin" / "python"


def _series(name: str, version: str) -> list[Path]:
    return sorted((REPO / "patches" / name / version).glob("*.patch"))


def _stacked_versions() -> list[str]:
    return [v for v in VERSIONS if (REPO / "patches" / "engine-driven" / v / "manifest.json").exists()]


# A tree to run as the stacked build instead (a workspace while authoring a
# part, or a broken copy: the identity check must fail on it).
STACKED_OVERLAY_ENV = "LMCACHE_PATCHTOOL_ED_GATE_OVERLAY"


def _overlay(version: str, state: str) -> Path:
    if state == STACKED and os.environ.get(STACKED_OVERLAY_ENV):
        return Path(os.environ[STACKED_OVERLAY_ENV])
    if state == "pristine":
        return provision.overlay(version)
    if state == STACKED:
        return provision.overlay(version, _series("hybrid-fa", version) + _series("engine-driven", version))
    return provision.overlay(version, _series("hybrid-fa", version))


def _gate(version: str, state: str, presets: list[str]) -> dict[str, dict]:
    proc, report, _ = run_gate(_python(version), _overlay(version, state), presets, *MODE,
                               "--no-stay-alive", "--step-timeout", "20")
    assert report["versions"]["lmcache"] == version
    assert report["transfer_mode"] == "engine_driven"
    assert "--supported-transfer-mode" in report["server"]["argv"]
    argv = report["server"]["argv"]
    assert argv[argv.index("--supported-transfer-mode") + 1] == "engine_driven"
    assert proc.returncode == (0 if report["verdict"] == "pass" else 1), (report["reason"], proc.stderr[-3000:])
    return by_preset(report)


def assert_loud_refusal(p: dict, version: str) -> None:
    """The hybrid's engine-driven refusal: a loud fail, nothing stored."""
    assert p["verdict"] == "fail" and p.get("loud_refusal") is True, p["reasons"]
    if version == "0.5.6":  # EngineDrivenTransferContext.register, before any store
        assert "register+fill: ValueError: engine-driven transfer does not support multiple KV transfer groups" \
            in p["reasons"][0], p["reasons"]
        assert "stored" not in p
    else:  # _single_group_block_ids at the first store
        assert "store: RuntimeError: engine-driven transfer does not support hybrid KV cache groups" \
            in p["reasons"][0], p["reasons"]
        assert "on_disk" not in p  # the store raised: nothing was flushed for it
    assert "after_restart" not in p


def assert_k2_outcome(p: dict, version: str) -> None:
    """Pure attention k = 2 in engine-driven mode: the path's own 1/k bug."""
    assert p["verdict"] == "fail", p["reasons"]
    assert not p.get("loud_refusal")
    if version == "0.5.4":
        # The store is refused (COMMIT_STORE answers False): nothing on disk, no hit.
        assert p["stored"]["ok"] is False
        assert p["on_disk"]["objects"] == 0
        assert p["after_restart"]["hit_tokens"] == 0
        assert p["reasons"][0] == "the server did not confirm the store"
        return
    # Silent corruption: stored, on disk, found after the restart, retrieve "ok", bytes wrong.
    assert p["stored"]["ok"] is True and p["on_disk"]["objects"] == 3
    ar = p["after_restart"]
    assert ar["chunks_found"] == 3 and ar["l2_hits"] == 3
    assert p["restored"]["retrieve"]["ok"] is True
    fa = p["fidelity"]["fa"]
    assert fa["pages_total"] == 24 and fa["pages_exact"] == 0
    assert p["foreign_writes"]["bytes"] > 0
    assert "wrong FA bytes" in p["reasons"][0]


def test_engine_driven_056_pristine_hybrid_refused_k1_restores():
    presets = _gate("0.5.6", "pristine", ["qwen35-0.8b", "pure-attn-k1"])
    assert_loud_refusal(presets["qwen35-0.8b"], "0.5.6")
    assert_clean_pass(presets["pure-attn-k1"])


def _rows() -> list[tuple[str, str]]:
    if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1":
        return [(v, st) for v in VERSIONS for st in ("pristine", "patched")]
    # CI: the fast tier's 0.5.6 pristine refusal and the stacked row cover the
    # path; lab/evidence/engine-driven-gate.json records every build.
    return []


@pytest.mark.slow
@pytest.mark.parametrize("version,state", _rows() or [(None, None)],
                         ids=lambda v: v or "full-only")
def test_engine_driven_outcomes(version, state):
    if version is None:
        pytest.skip("LMCACHE_PATCHTOOL_FULL=1 runs every pristine and hybrid-fa build")
    presets = _gate(version, state, [*HYBRIDS, "pure-attn-bs128", "pure-attn-k1"])
    for name in HYBRIDS:
        assert_loud_refusal(presets[name], version)
    assert_k2_outcome(presets["pure-attn-bs128"], version)
    assert_clean_pass(presets["pure-attn-k1"])


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LMCACHE_PATCHTOOL_FULL") != "1",
                    reason="LMCACHE_PATCHTOOL_FULL=1: CI checks k = 1 identity on the stacked build")
def test_engine_driven_objects_identical_to_lmcache_driven_k1(tmp_path):
    """The engine-driven baseline: for pure attention k = 1 (the one geometry
    every release runs in both modes) the fs L2 objects an engine-driven store
    leaves are byte-identical to an lmcache-driven store's (same key but the
    gate's per-run model name, same bytes)."""
    import hashlib
    import json
    import shutil

    digests = {}
    for mode in ("lmcache_driven", "engine_driven"):
        out = tmp_path / f"{mode}.json"
        proc, report, _ = run_gate(_python("0.5.6"), _overlay("0.5.6", "pristine"), ["pure-attn-k1"],
                                   "--transfer-mode", mode, "--no-stay-alive", "--keep-tmp",
                                   "--json-out", str(out))
        workdirs = [c["workdir"] for c in report["cycles"]]
        try:
            assert proc.returncode == 0, report["reason"]
            model = report["presets"][0]["model_name"]
            files = sorted(Path(workdirs[0], "l2").glob("*.data"))
            assert len(files) == 3
            digests[mode] = {f.name.replace(model, "MODEL"): hashlib.sha256(f.read_bytes()).hexdigest()
                             for f in files}
        finally:
            for w in workdirs:
                shutil.rmtree(w, ignore_errors=True)
            if report.get("client_log"):  # --keep-tmp keeps the client log too
                Path(report["client_log"]).unlink(missing_ok=True)
        json.loads(out.read_text())  # the report file was written
    assert digests["engine_driven"] == digests["lmcache_driven"]


# ---------------------------------------------------------------------------
# the stacked engine-driven set
# ---------------------------------------------------------------------------


def _l2_digests(report: dict, preset: str) -> dict[str, str]:
    """File name (the run's model name replaced) -> sha256 of the KV bytes of
    one preset's fs L2 objects after the store (the first cycle's directory),
    and whether the file ends in a checksum trailer.  The trailer (hybrid-fa
    part 12-l2-checksum) binds the file name, which holds the gate's per-run
    model name, so it differs between any two runs; the KV bytes must not."""
    import hashlib

    from gate.tier_objects import has_trailer, kv_bytes  # noqa: PLC0415
    from gate.restore_server import l2_objects  # noqa: PLC0415 - only this test reads the server's objects

    (p,) = [x for x in report["presets"] if x["preset"] == preset]
    model = p["model_name"]
    # The gate runs one server pair per chunk size: the preset's own cycle.
    (cycle,) = [c for c in report["cycles"] if preset in c["presets"]]
    files = l2_objects(Path(cycle["workdir"], "l2"), model)
    return {f.name.replace(model, "MODEL"): hashlib.sha256(kv_bytes(f)).hexdigest()
            + (" +trailer" if has_trailer(f) else "") for f in files}


def _cleanup(report: dict) -> None:
    import shutil

    for c in report.get("cycles", []):
        shutil.rmtree(c["workdir"], ignore_errors=True)
    if report.get("client_log"):
        Path(report["client_log"]).unlink(missing_ok=True)


def _stacked_rows() -> list[str]:
    have = _stacked_versions()
    if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1":
        return have or [None]
    return [v for v in have if v == "0.5.6"] or [None]


def _need(version: str | None) -> str:
    if version is None:
        pytest.skip("no patches/engine-driven/<version>/manifest.json committed yet")
    return version


@pytest.mark.slow
@pytest.mark.parametrize("version", _stacked_rows(), ids=lambda v: v or "none-yet")
def test_engine_driven_stacked_restores_every_preset_with_lmcache_driven_objects(version, monkeypatch):
    """The stacked build: with hybrid-fa + engine-driven every preset
    restores byte-exact in engine-driven mode, and the same request stored by
    the same build in either mode leaves the same fs L2 objects, name for
    name and byte for byte, so an operator can switch modes over a
    persistent tier."""
    version = _need(version)
    monkeypatch.setenv(*STAGING_FILL)
    reports = {}
    try:
        # CI leaves out gdn-27b (a server pair of its own); FULL=1 and the evidence run it.
        ed_presets = ALL_PRESETS if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" \
            else [p for p in ALL_PRESETS if p != "gdn-27b"]
        for mode, presets in (("engine_driven", ed_presets), ("lmcache_driven", IDENTITY_PRESETS)):
            proc, reports[mode], _ = run_gate(_python(version), _overlay(version, STACKED), presets,
                                              "--transfer-mode", mode, "--no-stay-alive", "--keep-tmp",
                                              "--step-timeout", "30", *CLIENT_PERTURB)
            assert reports[mode]["versions"]["lmcache"] == version
            assert proc.returncode == 0, (mode, reports[mode]["reason"])
        for name, p in by_preset(reports["engine_driven"]).items():
            assert_clean_pass(p)
        for preset in IDENTITY_PRESETS:
            mine = _l2_digests(reports["engine_driven"], preset)
            assert len(mine) >= 3, mine
            assert mine == _l2_digests(reports["lmcache_driven"], preset), preset
    finally:
        for report in reports.values():
            _cleanup(report)
