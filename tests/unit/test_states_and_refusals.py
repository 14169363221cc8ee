"""Every install state and its exit codes, and the one-line refusals (stderr
``patchtool: <file>: <reason>``, ``--json`` error object, nothing written)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest
from _cli import CRASH_VAR, cli, one_line

from . import synthwheel as sw
from .synthwheel import F1, F2, SKIP, STATE_DIR, tree_hashes


def sp(site: Path) -> tuple[str, str]:
    return ("--site-packages", str(site))




def json_error(r, rc: int) -> dict:
    doc = r.json
    assert set(doc) == {"error"} and set(doc["error"]) == {"file", "reason", "exit_code"}
    assert doc["error"]["exit_code"] == rc == r.rc
    return doc["error"]


def states(site: Path, root: Path) -> tuple[str, int]:
    st = cli("status", *sp(site), "--json", patches=root)
    assert st.rc == 0, st.err
    return st.json["result"]["state"], cli("verify", *sp(site), patches=root).rc


# ------------------------------------------------------------------ states


def test_not_installed(tmp_path, patch_root):
    empty = tmp_path / "empty"
    empty.mkdir()
    st = cli("status", *sp(empty), "--json", patches=patch_root)
    assert st.rc == 0 and st.json["result"]["state"] == "not-installed"
    assert st.json["result"]["site_dirs"] == [str(empty)]
    v = cli("verify", *sp(empty), "--json", patches=patch_root)
    assert v.rc == 4 and v.json["exit_code"] == 4 and v.json["result"]["ok"] is False
    for cmd in ("apply", "revert"):
        r = cli(cmd, *sp(empty), patches=patch_root)
        one_line(r, 4, empty, "lmcache is not installed")
    assert list(empty.iterdir()) == []


def test_unsupported_version(tmp_path, patch_root):
    site = sw.install_target(sw.make_wheel(tmp_path / "w", "9.9.8"), tmp_path / "site")
    before = tree_hashes(site)
    assert states(site, patch_root) == ("unsupported-version", 7)
    dist = site / "lmcache-9.9.8.dist-info"
    one_line(cli("apply", *sp(site), patches=patch_root), 7, dist, "no patch set")
    assert cli("revert", *sp(site), "--json", patches=patch_root).json["result"]["action"] == "no-op"
    assert tree_hashes(site) == before


def test_fixed_upstream(tmp_path, site, wheel):
    d = tmp_path / "patches" / "fixedset" / sw.VERSION
    d.mkdir(parents=True)
    sw.manifest_build(d, wheel, "--fixed-upstream", "fixed in 9.9.9 by upstream PR 1")
    st = cli("status", *sp(site), "--json", patches=tmp_path / "patches").json["result"]
    assert st["state"] == "fixed-upstream" and st["detail"] == "fixed in 9.9.9 by upstream PR 1"
    assert cli("verify", *sp(site), patches=tmp_path / "patches").rc == 8
    r = cli("apply", *sp(site), "--json", patches=tmp_path / "patches")
    assert json_error(r, 8)["reason"].startswith("lmcache 9.9.9 needs no patch")


def test_drifted_file_refused_nothing_written(site, patch_root):
    f2 = site / F2
    f2.write_bytes(f2.read_bytes().replace(b"VALUE_010 = 10", b"VALUE_010 = 11"))
    before = tree_hashes(site)
    st = cli("status", *sp(site), "--json", patches=patch_root).json["result"]
    assert st["state"] == "drifted"
    files = {f["path"]: f for f in st["files"]}
    assert files[F2]["state"] == "drifted" and files[F2]["record_row"] == "mismatch"
    assert files[F1]["state"] == "pristine"
    assert cli("verify", *sp(site), patches=patch_root).rc == 6
    for args in (("apply",), ("apply", "--dry-run"), ("revert",)):
        r = cli(*args, *sp(site), patches=patch_root)
        one_line(r, 6, f2, "drifted")
    assert tree_hashes(site) == before and not (site / STATE_DIR).exists()


def test_missing_target_is_drifted(site, patch_root):
    (site / F1).unlink()
    st = cli("status", *sp(site), "--json", patches=patch_root).json["result"]
    assert st["state"] == "drifted"
    f1 = next(f for f in st["files"] if f["path"] == F1)
    assert f1["state"] == "missing" and f1["record_row"] == "missing"
    one_line(cli("apply", *sp(site), patches=patch_root), 6, site / F1, "is missing")


def test_patched_file_edited_afterwards_refuses_revert(site, patch_root):
    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    f1 = site / F1
    f1.write_bytes(f1.read_bytes() + b"# local edit\n")
    before = tree_hashes(site)
    assert states(site, patch_root) == ("drifted", 6)
    one_line(cli("revert", *sp(site), patches=patch_root), 6, f1, "was changed after")
    assert tree_hashes(site) == before


def test_unrelated_record_row_mismatch(site, patch_root):
    """Outside the target files a bad row shows only in --deep and verify (exit 11)."""
    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    other = site / sw.UNTOUCHED
    other.write_bytes(other.read_bytes() + b"# edited\n")
    st = cli("status", *sp(site), "--json", patches=patch_root).json["result"]
    assert st["state"] == "patched" and st["record"]["mismatches"] == 0
    deep = cli("status", *sp(site), "--deep", "--json", patches=patch_root).json["result"]
    assert deep["record"]["mismatches"] == 1 and deep["record"]["mismatched"] == [sw.UNTOUCHED]
    v = cli("verify", *sp(site), "--json", patches=patch_root)
    assert v.rc == 11 and v.json["result"]["verdict"].startswith("check failed")
    assert {c["name"]: c["ok"] for c in v.json["result"]["checks"]}["record"] is False


# -------------------------------------------------------------- refusals


def test_refusal_json_shape_and_single_line(tmp_path, site, patch_root):
    r = cli("apply", *sp(site), "--patch", "07", "--json", patches=patch_root)
    line = one_line(r, 3, "07", "no such patch", "01-first, 02-second")
    err = json_error(r, 3)
    assert err["file"] == "07" and line == f"patchtool: 07: {err['reason']}"
    r = cli("status", "--site-packages", str(tmp_path / "nope"), "--json", patches=patch_root)
    assert json_error(r, 3)["reason"] == "not a directory"


def test_tampered_patch_refused(site, patches_copy):
    p = patches_copy / sw.SET / sw.VERSION / "02-second.patch"
    p.write_bytes(p.read_bytes().replace(b"# unit 02", b"# unit 2"))
    before = tree_hashes(site)
    for cmd in ("status", "apply", "verify"):
        one_line(cli(cmd, *sp(site), patches=patches_copy), 3, p, "modified after the manifest")
    assert tree_hashes(site) == before


def test_unlisted_patch_refused(site, patches_copy):
    d = patches_copy / sw.SET / sw.VERSION
    shutil.copy(d / "02-second.patch", d / "03-extra.patch")
    one_line(cli("apply", *sp(site), patches=patches_copy), 3, d / "03-extra.patch",
             "not listed in manifest.json")


@pytest.mark.parametrize("damage", ["missing", "not-json", "schema", "wrong-dir"])
def test_bad_manifest_refused(site, patches_copy, damage):
    d = patches_copy / sw.SET / sw.VERSION
    m = d / "manifest.json"
    if damage == "missing":
        m.unlink()
        need = "missing"
    elif damage == "not-json":
        m.write_text("{")
        need = "not valid JSON"
    elif damage == "schema":
        doc = json.loads(m.read_text())
        doc["schema"] = "something/else"
        m.write_text(json.dumps(doc))
        need = "unknown schema"
    else:
        doc = json.loads(m.read_text())
        doc["lmcache_version"] = "9.9.7"
        m.write_text(json.dumps(doc))
        need = "directory named 9.9.9"
    one_line(cli("status", *sp(site), patches=patches_copy), 3, m, need)


def test_two_patch_sets_need_set(site, patches_copy):
    shutil.copytree(patches_copy / sw.SET, patches_copy / "otherset")
    one_line(cli("status", *sp(site), patches=patches_copy), 3, patches_copy,
             "several patch sets cover lmcache 9.9.9")
    st = cli("status", *sp(site), "--set", "otherset", "--json", patches=patches_copy)
    assert st.rc == 0 and st.json["result"]["patch_set"] == "otherset"
    one_line(cli("status", *sp(site), "--set", "nosuch", patches=patches_copy), 3,
             patches_copy / "nosuch", "no such patch set")


@pytest.mark.parametrize("direct_url, needle", [
    ({"url": "file:///src/lmcache", "dir_info": {"editable": True}}, "editable install"),
    ({"url": "https://example.invalid/lmcache.git",
      "vcs_info": {"vcs": "git", "commit_id": "0" * 40}}, "installed from VCS"),
])
def test_editable_and_vcs_installs_refused(site, patch_root, direct_url, needle):
    dist = site / f"lmcache-{sw.VERSION}.dist-info"
    (dist / "direct_url.json").write_text(json.dumps(direct_url))
    for cmd in ("status", "apply"):
        one_line(cli(cmd, *sp(site), patches=patch_root), 3, dist, needle)


def test_two_distributions_refused(site, patch_root):
    other = site / "lmcache-9.9.8.dist-info"
    shutil.copytree(site / f"lmcache-{sw.VERSION}.dist-info", other)
    r = cli("status", *sp(site), "--json", patches=patch_root)
    assert r.rc == 3 and len(r.err.splitlines()) == 1
    assert "two lmcache distributions are visible" in r.err and str(other) in r.err


def test_missing_record_refused(site, patch_root):
    rec = sw.record_path(site)
    rec.unlink()
    one_line(cli("status", *sp(site), patches=patch_root), 3, rec, "missing")


def test_usage_errors_exit_2(site, patch_root):
    r = cli("status", *sp(site), "--python", "/usr/bin/python3", patches=patch_root)
    assert r.rc == 2 and "not allowed with" in r.err
    assert cli("frobnicate", patches=patch_root).rc == 2
    r = cli("status", *sp(site), "--", "x", patches=patch_root)
    one_line(r, 2, "--", "only to verify --restore")


# ------------------------------------------------------- crash and lock


def _crash_at(n: int) -> dict:
    # The hook was renamed (one hook that counts every write);
    # tests/_cli.py names the current one.
    return {CRASH_VAR: f"crash:{n}" if CRASH_VAR.endswith("FAULT") else str(n)}


def _sampled_writes():
    """1, 3, 7, 15, 31, ...: a few crash points at every depth of the
    transaction (test_core_r2 sweeps every write with injected errors)."""
    n = 1
    while True:
        yield n
        n = 2 * n + 1


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_crash_mid_command_is_rolled_back_or_forward(tmp_path, fresh_site, patch_root, command):
    """Kill the command after its n-th write, for growing n until it
    completes: the next command (a mere ``status``) leaves the install exactly
    as before or exactly as after, with no journal or staging leftovers."""
    base = sw.copy_site(fresh_site, tmp_path / "base")
    if command == "revert":
        assert cli("apply", *sp(base), patches=patch_root).rc == 0
    done = sw.copy_site(base, tmp_path / "done")
    assert cli(command, *sp(done), patches=patch_root).rc == 0
    states_ok = {"apply": ("pristine", "patched"), "revert": ("patched", "pristine")}[command]
    before, after = tree_hashes(base, SKIP), tree_hashes(done, SKIP)
    crashed = 0
    for n in _sampled_writes():
        site = sw.copy_site(base, tmp_path / f"site{n}")
        r = cli(command, *sp(site), patches=patch_root, env=_crash_at(n), unset=())
        if r.rc == 0:
            break
        assert r.rc == 86, (n, r.rc, r.err)
        crashed += 1
        st = cli("status", *sp(site), "--json", patches=patch_root)
        assert st.rc == 0, (n, st.err)
        state = st.json["result"]["state"]
        assert state in states_ok, (n, state)
        assert tree_hashes(site, SKIP) == (before if state == states_ok[0] else after), n
        left = sorted(p.name for p in (site / STATE_DIR).iterdir()
                      if p.name.startswith(("journal", "tx"))) if (site / STATE_DIR).exists() else []
        assert left == [], (n, left)
        shutil.rmtree(site)
        assert n < 500, "the command never completed"
    assert crashed >= 3  # it really was stopped at several writes


def test_lock_held_elsewhere_exit_12(site, patch_root):
    fd = os.open(site, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = cli("apply", *sp(site), patches=patch_root,
                env={"LMCACHE_PATCHTOOL_LOCK_TIMEOUT": "0.2"})
        one_line(r, 12, site, "holds the lock")
        # a reader without a journal to recover takes no lock
        assert cli("status", *sp(site), patches=patch_root).rc == 0
    finally:
        os.close(fd)
    assert not (site / STATE_DIR).exists()
