"""The shipped stack ``hybrid-fa`` + ``engine-driven`` on the
real wheels: ``apply --set engine-driven`` on a pristine install applies both
sets in one transaction, status and verify report each set, a kill half-way
recovers to the untouched install, and revert gives back the wheel's bytes,
RECORD included.  The real CLI on copies of the cached bare venvs (no
``LMCACHE_PATCHTOOL_PATCHES``: the shipped patch sets)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lab import provision
import pytest

from patchtool.fsio import CRASH_EXIT, FAULT_ENV as CRASH_ENV

from .conftest import VERSIONS
from .helpers import REPO, cli, copy_venv, site_of, tree_hashes
from .test_lifecycle import SKIP, _record_ok

TOP = "engine-driven"
BASE = "hybrid-fa"
# 0.5.7rc2's engine-driven set is one refusal (upstream's own path moves the
# CPU hybrid), so its install's restore gate runs lmcache-driven only: the
# sub-paged presets are refused in engine-driven mode by design.
GATE_MODES = {"0.5.7rc2": ["lmcache_driven"]}


def _stacked_versions() -> list[str]:
    return [v for v in VERSIONS if (REPO / "patches" / TOP / v / "manifest.json").exists()]


def _sets(result: dict) -> list[tuple[str, str]]:
    return [(s["name"], s["state"]) for s in result["sets"]]


@pytest.mark.parametrize("version", _stacked_versions() or [None],
                         ids=lambda v: "none-yet" if v is None else v)
def test_apply_status_verify_crash_and_revert_the_shipped_stack(tmp_path, bare_envs, version):
    if version is None:
        pytest.skip("no patches/engine-driven/<version>/manifest.json committed yet")
    manifest = json.loads((REPO / "patches" / TOP / version / "manifest.json").read_text())
    assert manifest["requires"] == [BASE]
    assert manifest["gate_transfer_modes"] == GATE_MODES.get(version, ["lmcache_driven", "engine_driven"])
    fresh = site_of(bare_envs[version])
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    site, py = site_of(venv), str(venv / "bin" / "python")
    pristine = tree_hashes(fresh, SKIP)

    # A kill at a write half-way through: the next command rolls back to the
    # untouched install, never to hybrid-fa alone.
    r = cli("apply", "--python", py, "--set", TOP, env={CRASH_ENV: "crash:4"})
    assert r.rc == CRASH_EXIT, (r.rc, r.err)
    st = cli("status", "--python", py, "--set", TOP, "--json")
    assert st.rc == 0, st.err
    assert _sets(st.json["result"]) == [(BASE, "pristine"), (TOP, "pristine")]
    assert tree_hashes(site, SKIP) == pristine

    r = cli("apply", "--python", py, "--set", TOP, "--json")
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["action"] == "applied" and res["state_after"] == "patched"
    assert [s["name"] for s in res["sets"]] == [BASE, TOP]
    st = cli("status", "--python", py, "--json").json["result"]  # the install's top set by default
    assert st["patch_set"] == TOP and st["state"] == "patched", st["detail"]
    assert _sets(st) == [(BASE, "patched"), (TOP, "patched")]
    n, bad = _record_ok(site)
    assert n > 700 and bad == []
    v = cli("verify", "--python", py, "--json")
    assert v.rc == 0, v.out
    assert _sets(v.json["result"]["status"]) == [(BASE, "patched"), (TOP, "patched")]

    r = cli("revert", "--python", py, "--json")
    assert r.rc == 0, r.err
    assert r.json["result"]["state_after"] == "pristine"
    assert tree_hashes(site, SKIP) == pristine  # files and RECORD, byte for byte


# Revisions 2-5 each appended one part: revision 2 zero-window-tail (03 on
# 0.5.3/0.5.5/0.5.6, 04 on 0.5.4), revision 3 staging-regions (04; 05 on
# 0.5.4), revision 4 on 0.5.6 cpu-transfer (06; 0.5.3's revision 4 is its own
# 05-state-chunk-ends, not modelled here), revision 5 on 0.5.6 warm-staging
# (07).  Revision r is the shipped parts without those added after it.
ADDED_BY_TOP = {2: "-zero-window-tail.patch", 3: "-staging-regions.patch", 4: "-cpu-transfer.patch",
                5: "-warm-staging.patch"}
# Revision 6 on 0.5.6 changed parts 06 and 07 in place (the window tail only,
# one warm-mapping helper) and added none.  The revision-5 text of those parts,
# what installs of revisions 4 and 5 carry, is kept here so that those
# revisions can still be rebuilt: {version: (first revision without it, dir)}.
OLDER_PARTS = {"0.5.6": (6, Path(__file__).parent / "older_parts" / "engine-driven-0.5.6-r5")}
# the versions whose engine-driven set went through exactly these revisions, and their shipped one
TOP_HISTORY = {"0.5.4": 3, "0.5.5": 3, "0.5.6": 6}


def _older_parts(version: str, shipped: Path, older: int) -> list[Path]:
    """The part files of ``older``: the shipped ones, with the texts changed
    in place since (OLDER_PARTS), less the parts added after it."""
    later = tuple(suffix for rev, suffix in ADDED_BY_TOP.items() if rev > older)
    parts = {p.name: p for p in shipped.glob("*.patch")}
    first_without, kept = OLDER_PARTS.get(version, (older + 1, None))
    if kept is not None and older < first_without:
        parts.update({p.name: p for p in kept.glob("*.patch")})
    return [parts[name] for name in sorted(parts) if not name.endswith(later)]


def _upgrade_cases() -> list[tuple[str, int]]:
    """CI: 0.5.4 from revision 2 and 0.5.6 from revision 5 (the revisions installs
    have today); LMCACHE_PATCHTOOL_FULL=1: every such version from every earlier revision."""
    have = [v for v in _stacked_versions() if v in TOP_HISTORY and json.loads(
        (REPO / "patches" / TOP / v / "manifest.json").read_text())["revision"] == TOP_HISTORY[v]]
    if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1":
        return [(v, r) for v in have for r in range(1, TOP_HISTORY[v])]
    return [(v, TOP_HISTORY[v] - 1) for v in have if v in ("0.5.4", "0.5.6")]


@pytest.mark.parametrize("version,older", _upgrade_cases() or [(None, None)],
                         ids=lambda v: "none-yet" if v is None else str(v))
def test_engine_driven_older_revision_install_upgrades_with_apply(tmp_path, bare_envs, version, older):
    """An install stacked with an earlier engine-driven revision (by the tool
    before the shipped one) is ``patched-older-revision`` for that set alone;
    verify exits 9, ``apply --set engine-driven`` brings it to the shipped
    revision, and revert still gives back the wheel's bytes."""
    if version is None:
        pytest.skip("no patches/engine-driven/<version>/manifest.json committed yet")
    shipped = REPO / "patches" / TOP / version
    manifest = json.loads((shipped / "manifest.json").read_text())
    assert manifest["revision"] == TOP_HISTORY[version]
    root = tmp_path / f"r{older}"
    shutil.copytree(REPO / "patches" / BASE, root / BASE)
    older_dir = root / TOP / version
    older_dir.mkdir(parents=True)
    for p in _older_parts(version, shipped, older):
        shutil.copy2(p, older_dir / p.name)
    r = cli("manifest", "build", str(older_dir), "--wheel", str(provision.wheel(version)),
            "--revision", str(older), "--requires", BASE, "--json")
    assert r.rc == 0, r.err
    built = json.loads((older_dir / "manifest.json").read_text())
    (prev,) = [p for p in manifest["previous_revisions"] if p["revision"] == older]
    assert {p: f["post"] for p, f in built["files"].items()} == prev["files"]

    fresh = site_of(bare_envs[version])
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    site, py = site_of(venv), str(venv / "bin" / "python")
    pristine = tree_hashes(fresh, SKIP)
    r = cli("apply", "--python", py, "--set", TOP, env={"LMCACHE_PATCHTOOL_PATCHES": str(root)})
    assert r.rc == 0, r.err

    st = cli("status", "--python", py, "--json").json["result"]
    assert _sets(st) == [(BASE, "patched"), (TOP, "patched-older-revision")], st["detail"]
    assert f"patched with revision {older}" in st["detail"], st["detail"]
    assert st["next_command"] == f"patchtool apply --python {py} --set {TOP}"
    assert cli("verify", "--python", py).rc == 9
    r = cli("apply", "--python", py, "--set", TOP, "--json")
    assert r.rc == 0, r.err
    assert (r.json["result"]["state_before"], r.json["result"]["state_after"]) == \
        ("patched-older-revision", "patched")
    st = cli("status", "--python", py, "--json").json["result"]
    assert _sets(st) == [(BASE, "patched"), (TOP, "patched")], st["detail"]
    assert _record_ok(site)[1] == []
    assert cli("revert", "--python", py).rc == 0
    assert tree_hashes(site, SKIP) == pristine
