"""End-to-end: the real CLI as a subprocess on copies of real venvs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from patchtool.record import check_rows, parse_record

from .conftest import F1, F2, F3, build, make_series
from .helpers import STATE_DIR, cli, site_of, tree_hashes

SKIP = ("__pycache__", STATE_DIR)


def _py(venv: Path) -> str:
    return str(venv / "bin" / "python")


def _record_ok(site: Path) -> tuple[int, list]:
    rec = next(site.glob("lmcache-*.dist-info")) / "RECORD"
    checks = [c for c in check_rows(site, parse_record(rec.read_bytes())) if c.status != "unhashed"]
    return len(checks), [c for c in checks if c.status != "ok"]


def test_apply_verify_revert_roundtrip(venv053, test_patches, fresh_site053):
    site = site_of(venv053)
    py = _py(venv053)
    pyc = sorted((site / F1).parent.glob("__pycache__/kv_layer_groups.*.pyc"))
    assert pyc, "pip should have compiled the module"
    other_pyc = sorted((site / "lmcache/v1/__pycache__").glob("memory_management.*.pyc"))

    r = cli("apply", "--python", py, "--json", patches=test_patches)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["action"] == "applied" and res["state_after"] == "patched"
    assert res["changed_files"] == sorted([F1, F2, F3])
    assert all(h["status"] == "applies" for f in res["hunks"] for h in f["hunks"])
    # stale bytecode of touched modules is gone, the rest is kept
    assert not any(p.exists() for p in pyc)
    assert all(p.exists() for p in other_pyc)
    assert any("kv_layer_groups" in p for p in res["removed_pyc"])
    # every RECORD row verifies after apply (touched rows were rewritten)
    n, bad = _record_ok(site)
    assert n > 700 and bad == []
    # the RECORD keeps CRLF row endings and its row order
    rec = (next(site.glob("lmcache-*.dist-info")) / "RECORD").read_bytes()
    assert rec.count(b"\r\n") == rec.count(b"\n")

    v = cli("verify", "--python", py, "--json", patches=test_patches)
    assert v.rc == 0, v.out
    assert v.json["result"]["ok"] is True

    r = cli("revert", "--python", py, "--json", patches=test_patches)
    assert r.rc == 0, r.err
    assert r.json["result"]["state_after"] == "pristine"
    assert r.json["result"]["source"] == "saved originals"
    # files AND RECORD byte-identical to a fresh install of the same wheel
    assert tree_hashes(site, SKIP) == tree_hashes(fresh_site053, SKIP)
    n, bad = _record_ok(site)
    assert bad == []
    v = cli("verify", "--python", py, patches=test_patches)
    assert v.rc == 5  # pristine


def test_reapply_is_noop(venv053, test_patches):
    py = _py(venv053)
    assert cli("apply", "--python", py, patches=test_patches).rc == 0
    before = tree_hashes(venv053)
    r = cli("apply", "--python", py, "--json", patches=test_patches)
    assert r.rc == 0, r.err
    assert r.json["result"]["action"] == "no-op"
    assert all(h["status"] == "already-applied" for f in r.json["result"]["hunks"]
               for h in f["hunks"])
    assert tree_hashes(venv053) == before


def test_dry_run_writes_nothing(venv053, test_patches):
    before = tree_hashes(venv053)
    r = cli("apply", "--dry-run", "--python", _py(venv053), patches=test_patches)
    assert r.rc == 0, r.err
    assert "applies" in r.out and "would change" in r.out
    assert tree_hashes(venv053) == before


def test_drifted_target_refused_nothing_written(venv053, test_patches):
    site = site_of(venv053)
    f2 = site / F2
    f2.write_bytes(f2.read_bytes().replace(b"import", b"import ", 1))  # a local edit
    before = tree_hashes(venv053)
    st = cli("status", "--python", _py(venv053), "--json", patches=test_patches)
    assert st.json["result"]["state"] == "drifted"
    assert {f["path"]: f["state"] for f in st.json["result"]["files"]}[F2] == "drifted"
    r = cli("apply", "--python", _py(venv053), patches=test_patches)
    assert r.rc == 6
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"patchtool: {f2}: ") and "drifted" in lines[0]
    assert tree_hashes(venv053) == before
    assert not (site / STATE_DIR).exists()
    assert cli("verify", "--python", _py(venv053), patches=test_patches).rc == 6


def test_wrong_version_refused(tmp_path, bare_envs, test_patches):
    from .helpers import copy_venv

    venv = copy_venv(bare_envs["0.5.4"], tmp_path / "v054")
    before = tree_hashes(venv)
    r = cli("apply", "--python", _py(venv), patches=test_patches)
    assert r.rc == 7, r.err
    assert len(r.err.strip().splitlines()) == 1 and "no patch set" in r.err
    assert "lmcache-0.5.4.dist-info" in r.err
    assert tree_hashes(venv) == before


def test_tampered_patch_refused(venv053, patches_copy):
    patch = patches_copy / "testset" / "0.5.3" / "02-second.patch"
    patch.write_bytes(patch.read_bytes().replace(b"variant a", b"variant X"))
    before = tree_hashes(venv053)
    for cmd in ("apply", "status", "verify"):
        r = cli(cmd, "--python", _py(venv053), patches=patches_copy)
        assert r.rc == 3, (cmd, r.err)
        assert r.err == f"patchtool: {patch}: " + r.err.split(": ", 2)[2]
        assert "differs from manifest.json" in r.err and r.err.count("\n") == 1
    assert tree_hashes(venv053) == before


def test_unlisted_patch_refused(venv053, patches_copy):
    extra = patches_copy / "testset" / "0.5.3" / "03-extra.patch"
    shutil.copy(patches_copy / "testset" / "0.5.3" / "01-first.patch", extra)
    r = cli("apply", "--python", _py(venv053), patches=patches_copy)
    assert r.rc == 3 and f"{extra}: not listed in manifest.json" in r.err


def test_partial_then_full_then_revert(venv053, test_patches, fresh_site053):
    py = _py(venv053)
    r = cli("apply", "--patch", "01", "--python", py, "--json", patches=test_patches)
    assert r.rc == 0, r.err
    assert r.json["result"]["changed_files"] == sorted([F1, F2])
    st = cli("status", "--python", py, "--json", patches=test_patches).json["result"]
    assert st["state"] == "partially-patched" and st["applied_through"] == "01-first"
    assert cli("verify", "--python", py, patches=test_patches).rc == 10
    r = cli("apply", "--python", py, "--json", patches=test_patches)
    assert r.rc == 0, r.err
    assert r.json["result"]["changed_files"] == sorted([F1, F3])
    assert cli("verify", "--python", py, patches=test_patches).rc == 0
    assert cli("revert", "--python", py, patches=test_patches).rc == 0
    assert tree_hashes(site_of(venv053), SKIP) == tree_hashes(fresh_site053, SKIP)


def test_older_revision_recognised_and_upgraded(venv053, patches_copy, wheel053, fresh_site053):
    py = _py(venv053)
    assert cli("apply", "--python", py, patches=patches_copy).rc == 0
    d = patches_copy / "testset" / "0.5.3"
    make_series(d, wheel053, variant="b")  # the maintainers revise 02
    build(d, wheel053, "--revision", "2")
    st = cli("status", "--python", py, "--json", patches=patches_copy).json["result"]
    assert st["state"] == "patched-older-revision", st
    assert cli("verify", "--python", py, patches=patches_copy).rc == 9
    r = cli("apply", "--python", py, "--json", patches=patches_copy)
    assert r.rc == 0, r.err
    assert r.json["result"]["state_after"] == "patched"
    assert cli("verify", "--python", py, patches=patches_copy).rc == 0
    assert cli("revert", "--python", py, patches=patches_copy).rc == 0
    assert tree_hashes(site_of(venv053), SKIP) == tree_hashes(fresh_site053, SKIP)


def test_revert_without_saved_state_reverses_series(venv053, test_patches, fresh_site053):
    py = _py(venv053)
    assert cli("apply", "--python", py, patches=test_patches).rc == 0
    shutil.rmtree(site_of(venv053) / STATE_DIR)
    r = cli("revert", "--python", py, "--json", patches=test_patches)
    assert r.rc == 0, r.err
    assert r.json["result"]["source"] == "reverse patch"
    assert tree_hashes(site_of(venv053), SKIP) == tree_hashes(fresh_site053, SKIP)


def test_site_packages_target_dir(tmp_path, target_dir_053, test_patches):
    site = tmp_path / "site"
    shutil.copytree(target_dir_053, site, symlinks=True)
    fresh = tree_hashes(site)
    st = cli("status", "--site-packages", str(site), "--json", patches=test_patches)
    assert st.rc == 0 and st.json["result"]["state"] == "pristine"
    assert cli("apply", "--site-packages", str(site), patches=test_patches).rc == 0
    assert cli("verify", "--site-packages", str(site), patches=test_patches).rc == 0
    assert cli("revert", "--site-packages", str(site), patches=test_patches).rc == 0
    assert tree_hashes(site, SKIP) == {k: v for k, v in fresh.items() if "__pycache__" not in k}


def test_default_interpreter_is_the_running_one(venv053, test_patches):
    """Without --python the tool inspects its own interpreter.  Run it inside
    the bare venv (which has no rich/unidiff): status --json must need neither."""
    from .helpers import REPO

    r = cli("status", "--json", patches=test_patches, python=_py(venv053),
            env={"PYTHONPATH": str(REPO)})
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["state"] == "pristine" and res["lmcache_version"] == "0.5.3"
    assert res["python"].startswith(str(venv053))
