"""Manifests (generated from real wheels, reproducible) and RECORD handling."""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest

from lab import provision
from patchtool.manifest import SCHEMA, load_manifest
from patchtool.manifest_build import build_manifest
from patchtool.record import parse_record, record_hash, render_record, replace_rows, RecordRow

from .conftest import F1, F2, F3, make_series
from .helpers import REPO, cli


def test_manifest_content(test_patches, wheel053):
    m = json.loads((test_patches / "testset" / "0.5.3" / "manifest.json").read_text())
    assert m["schema"] == SCHEMA and m["lmcache_version"] == "0.5.3"
    assert m["vllm_versions"] == ["0.27.1"] and m["revision"] == 1
    assert m["wheel"]["sha256"] == __import__("hashlib").sha256(wheel053.read_bytes()).hexdigest()
    assert [p["id"] for p in m["patches"]] == ["01-first", "02-second"]
    assert sorted(m["files"]) == sorted([F1, F2, F3])
    # pre-images are the wheel's own RECORD rows
    with zipfile.ZipFile(wheel053) as zf:
        rows = {r.path: r for r in parse_record(zf.read("lmcache-0.5.3.dist-info/RECORD"))}
    for path, entry in m["files"].items():
        assert (entry["pre"]["hash"], str(entry["pre"]["size"])) == (rows[path].hash,
                                                                     rows[path].size)
    assert list(m["files"][F1]["steps"]) == ["01-first", "02-second"]
    assert m["files"][F1]["post"] == m["files"][F1]["steps"]["02-second"]


def test_rebuild_is_reproducible(tmp_path, test_patches, wheel053):
    d = tmp_path / "testset" / "0.5.3"
    shutil.copytree(test_patches / "testset" / "0.5.3", d)
    before = (d / "manifest.json").read_bytes()
    assert cli("manifest", "build", str(d), "--wheel", str(wheel053)).rc == 0
    assert (d / "manifest.json").read_bytes() == before


def _committed_manifests():
    return sorted((REPO / "patches").glob("*/*/manifest.json"))


@pytest.mark.parametrize("path", _committed_manifests() or [None],
                         ids=lambda p: "none-yet" if p is None else f"{p.parent.parent.name}-{p.parent.name}")
def test_committed_manifests_reproducible(tmp_path, path):
    """Rebuilding a shipped manifest from the real wheel gives identical JSON."""
    if path is None:
        pytest.skip("no committed manifests yet")
    m = load_manifest(path)
    # The whole patches root: a stacked set is built over its required sets.
    shutil.copytree(path.parents[2], tmp_path / "patches")
    d = tmp_path / "patches" / path.parent.parent.name / path.parent.name
    rebuilt = build_manifest(d, provision.wheel(m.lmcache_version), write=False)
    assert rebuilt.dumps() == path.read_text(), (
        f"{path} is stale: rebuild it with `patchtool manifest build {path.parent} --wheel ...`")


def test_manifest_refuses_wrong_wheel_and_unapplicable_series(tmp_path, wheel053):
    d = make_series(tmp_path / "s" / "0.5.3", wheel053)
    r = cli("manifest", "build", str(d), "--wheel", str(provision.wheel("0.5.4")))
    assert r.rc == 3 and "is lmcache 0.5.4" in r.err
    d4 = tmp_path / "s" / "0.5.4"
    shutil.copytree(d, d4)
    r = cli("manifest", "build", str(d4), "--wheel", str(provision.wheel("0.5.4")))
    assert r.rc == 3 and "does not apply to the pristine wheel" in r.err
    assert not (d4 / "manifest.json").exists()


def test_revision_bump_keeps_previous(tmp_path, wheel053):
    d = make_series(tmp_path / "s" / "0.5.3", wheel053)
    m1 = build_manifest(d, wheel053)
    make_series(d, wheel053, variant="b")
    m2 = build_manifest(d, wheel053, revision=2)
    assert m2.previous_revisions[0].revision == 1
    assert m2.previous_revisions[0].files[F1] == m1.files[F1].post
    with pytest.raises(Exception, match="older revision"):
        build_manifest(d, wheel053, revision=1)


def test_record_roundtrip_and_rewrite(wheel053):
    with zipfile.ZipFile(wheel053) as zf:
        raw = zf.read("lmcache-0.5.3.dist-info/RECORD")
        data = zf.read(F1)
    rows = parse_record(raw)
    assert render_record(rows) == raw  # CRLF, order, the ",," own row: all kept
    own = [r for r in rows if r.path.endswith("/RECORD")]
    assert own == [RecordRow("lmcache-0.5.3.dist-info/RECORD", "", "")]
    assert {r.path: r.hash for r in rows}[F1] == record_hash(data)
    new = replace_rows(raw, {F1: RecordRow(F1, "sha256=xyz", "3")})
    old_lines, new_lines = raw.split(b"\r\n"), new.split(b"\r\n")
    changed = [i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b]
    assert len(old_lines) == len(new_lines) and len(changed) == 1
    assert new_lines[changed[0]] == f"{F1},sha256=xyz,3".encode()
    with pytest.raises(KeyError):
        replace_rows(raw, {"lmcache/nope.py": RecordRow("lmcache/nope.py", "", "")})


def test_real_series_lifecycle(tmp_path, bare_envs):
    """Once the lead's hybrid-fa 0.5.3 series and its manifest are committed,
    apply -> verify -> revert must work on it too."""
    from .conftest import real_series_dir
    from .helpers import STATE_DIR, copy_venv, site_of, tree_hashes

    if real_series_dir() is None:
        pytest.skip("patches/hybrid-fa/0.5.3/manifest.json not committed yet")
    venv = copy_venv(bare_envs["0.5.3"], tmp_path / "v")
    py = str(venv / "bin" / "python")
    skip = ("__pycache__", STATE_DIR)
    before = tree_hashes(site_of(venv), skip)
    env = {"LMCACHE_PATCHTOOL_PATCHES": str(REPO / "patches")}
    assert cli("apply", "--python", py, env=env).rc == 0
    assert cli("verify", "--python", py, env=env).rc == 0
    assert cli("revert", "--python", py, env=env).rc == 0
    assert tree_hashes(site_of(venv), skip) == before
