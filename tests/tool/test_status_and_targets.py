"""status / verify / list on real installs of every supported LMCache version,
and the target-discovery refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .conftest import VERSIONS, build
from .helpers import cli, site_of


@pytest.mark.parametrize("version", VERSIONS)
def test_status_on_each_version(bare_envs, test_patches, version):
    """Read-only on the cached envs: status and verify never write."""
    py = str(bare_envs[version] / "bin" / "python")
    r = cli("status", "--python", py, "--json", "--deep", patches=test_patches)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["lmcache_version"] == version and res["installer"] == "pip"
    assert res["record"]["deep"] and res["record"]["mismatches"] == 0
    assert res["record"]["checked"] > 700
    if version == "0.5.3":
        assert res["state"] == "pristine" and res["revision"] == 1
        assert {f["state"] for f in res["files"]} == {"pristine"}
        assert {f["record_row"] for f in res["files"]} == {"ok"}
    else:
        assert res["state"] == "unsupported-version"
        assert cli("verify", "--python", py, patches=test_patches).rc == 7
    human = cli("status", "--python", py, patches=test_patches)
    assert human.rc == 0 and f"lmcache     : {version}" in human.out


def test_not_installed(tmp_path, test_patches):
    empty = tmp_path / "site"
    empty.mkdir()
    r = cli("status", "--site-packages", str(empty), "--json", patches=test_patches)
    assert r.rc == 0 and r.json["result"]["state"] == "not-installed"
    r = cli("verify", "--site-packages", str(empty), patches=test_patches)
    assert r.rc == 4
    r = cli("apply", "--site-packages", str(empty), patches=test_patches)
    assert r.rc == 4 and r.err.startswith(f"patchtool: {empty}: lmcache is not installed")


def test_fixed_upstream_manifest(tmp_path, bare_envs, test_patches):
    from lab import provision

    root = tmp_path / "patches"
    shutil.copytree(test_patches, root)
    d = root / "testset" / "0.5.6"
    d.mkdir()
    build(d, provision.wheel("0.5.6"), "--fixed-upstream", "upstream PR #1234 ships the fix")
    py = str(bare_envs["0.5.6"] / "bin" / "python")
    st = cli("status", "--python", py, "--json", patches=root).json["result"]
    assert st["state"] == "fixed-upstream" and "PR #1234" in st["detail"]
    assert cli("verify", "--python", py, patches=root).rc == 8
    r = cli("apply", "--python", py, patches=root)
    assert r.rc == 8 and "needs no patch" in r.err
    rows = cli("list", "--json", patches=root).json["result"]
    assert [(r["lmcache_version"], r["state"]) for r in rows] == [("0.5.3", "patch"),
                                                                  ("0.5.6", "fixed-upstream")]


def test_list_and_verify_restore_hook(bare_envs, test_patches):
    r = cli("list", patches=test_patches)
    assert r.rc == 0 and "testset" in r.out and "0.5.3" in r.out
    r = cli("verify", "--restore", "cpu", "--python", str(bare_envs["0.5.3"] / "bin" / "python"),
            patches=test_patches)
    # A bare venv (lmcache installed --no-deps) cannot run the gate: refused
    # in one line, before anything runs.
    assert r.rc == 3
    assert "has no torch" in r.err and r.err.count("\n") == 1


def _site_copy(target_dir: Path, dest: Path) -> Path:
    shutil.copytree(target_dir, dest, symlinks=True)
    return dest


def test_editable_and_vcs_installs_refused(tmp_path, target_dir_053, test_patches):
    site = _site_copy(target_dir_053, tmp_path / "site")
    dist = site / "lmcache-0.5.3.dist-info"
    (dist / "direct_url.json").write_text(json.dumps(
        {"url": "file:///src/LMCache", "dir_info": {"editable": True}}))
    r = cli("apply", "--site-packages", str(site), patches=test_patches)
    assert r.rc == 3 and r.err.startswith(f"patchtool: {dist}: editable install")
    assert "source checkout" in r.err and r.err.count("\n") == 1
    (dist / "direct_url.json").write_text(json.dumps(
        {"url": "https://github.com/LMCache/LMCache", "vcs_info": {"vcs": "git",
                                                                   "commit_id": "abc"}}))
    r = cli("status", "--site-packages", str(site), patches=test_patches)
    assert r.rc == 3 and "installed from VCS" in r.err and "cannot be trusted" in r.err


def test_two_distributions_refused(tmp_path, target_dir_053, test_patches):
    site = _site_copy(target_dir_053, tmp_path / "site")
    shutil.copytree(site / "lmcache-0.5.3.dist-info", site / "lmcache-0.5.4.dist-info")
    r = cli("status", "--site-packages", str(site), patches=test_patches)
    assert r.rc == 3 and "two lmcache distributions are visible" in r.err


def test_two_distributions_across_site_dirs_refused(tmp_path, bare_envs, target_dir_053,
                                                    test_patches):
    """A venv whose interpreter also sees a second site dir (via a .pth line)."""
    from .helpers import copy_venv

    venv = copy_venv(bare_envs["0.5.4"], tmp_path / "v")
    extra = _site_copy(target_dir_053, tmp_path / "extra")
    (site_of(venv) / "zz-extra.pth").write_text(str(extra) + "\n")
    r = cli("status", "--python", str(venv / "bin" / "python"), patches=test_patches)
    # .pth dirs are on sys.path but not site dirs: only the venv's own is searched
    assert r.rc == 0 and "0.5.4" in r.out
    # a second dist-info inside the venv's own site dir is refused
    shutil.copytree(extra / "lmcache-0.5.3.dist-info", site_of(venv) / "lmcache-0.5.3.dist-info")
    r = cli("status", "--python", str(venv / "bin" / "python"), patches=test_patches)
    assert r.rc == 3 and "two lmcache distributions" in r.err


def test_bad_interpreter_refused(tmp_path, test_patches):
    r = cli("status", "--python", str(tmp_path / "nope"), patches=test_patches)
    assert r.rc == 3 and r.err == f"patchtool: {tmp_path / 'nope'}: no such interpreter\n"
