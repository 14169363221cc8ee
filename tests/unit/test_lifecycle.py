"""status / apply / revert / verify end to end, through the real CLI, on a
``--target`` install of the synthetic wheel."""

from __future__ import annotations

import json
from pathlib import Path

from _cli import cli

from . import synthwheel as sw
from .synthwheel import F1, F2, F3, SKIP, STATE_DIR, UNTOUCHED, tree_hashes


def sp(site: Path) -> tuple[str, str]:
    return ("--site-packages", str(site))


def files_by_path(result: dict) -> dict[str, dict]:
    return {f["path"]: f for f in result["files"]}


def record_rows(site: Path) -> dict[str, tuple[str, str]]:
    text = sw.record_path(site).read_bytes().decode()
    return {line.split(",")[0]: tuple(line.split(",")[1:]) for line in text.splitlines()}


def test_status_pristine_json_shape(site, patch_root):
    r = cli("status", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    doc = r.json
    assert set(doc) == {"command", "exit_code", "result"}
    assert doc["command"] == "status" and doc["exit_code"] == 0
    res = doc["result"]
    assert res["state"] == "pristine"
    assert res["lmcache_version"] == sw.VERSION and res["installer"] == "pip"
    assert res["patch_set"] == sw.SET and res["revision"] == 1
    assert res["vllm_versions"] == ["0.27.1"]
    assert res["python"] is None  # --site-packages: no interpreter
    assert res["site"] == str(site)
    assert Path(res["dist_info"]).name == f"lmcache-{sw.VERSION}.dist-info"
    assert res["install_source"].startswith("file://")
    files = files_by_path(res)
    assert sorted(files) == sorted([F1, F2, F3])
    for f in files.values():
        assert f["state"] == "pristine" and f["record_row"] == "ok"
        assert f["hash"] == f["pristine_hash"] != f["patched_hash"]
        assert f["hash"].startswith("sha256=") and f["size"] > 0
    assert files[F1]["hash"] == sw.record_hash((site / F1).read_bytes())
    rec = res["record"]
    assert rec["checked"] == 3 and rec["mismatches"] == 0 and rec["deep"] is False
    assert rec["rows"] == len(record_rows(site))
    # status is a pure reader: no state dir, no lock file, nothing changed
    assert not (site / STATE_DIR).exists()


def test_status_deep_checks_every_row(site, patch_root):
    res = cli("status", *sp(site), "--deep", "--json", patches=patch_root).json["result"]
    rec = res["record"]
    assert rec["deep"] is True and rec["mismatches"] == 0
    hashed = [k for k, (h, _) in record_rows(site).items() if h]
    assert rec["checked"] == len(hashed) > 3


def test_status_human_output(site, patch_root):
    r = cli("status", *sp(site), patches=patch_root)
    assert r.rc == 0 and r.err == ""
    assert f"lmcache     : {sw.VERSION}" in r.out
    assert f"patch set   : {sw.SET} revision 1" in r.out
    assert "state       : pristine" in r.out


def test_apply_verify_revert_byte_exact(site, fresh_site, patch_root):
    (site / "lmcache" / "v1" / "__pycache__").mkdir(exist_ok=True)
    stale = site / "lmcache" / "v1" / "__pycache__" / "kv_layer_groups.cpython-311.pyc"
    stale.write_bytes(b"stale")
    kept = site / "lmcache" / "v1" / "__pycache__" / "untouched.cpython-311.pyc"
    kept.write_bytes(b"keep")

    r = cli("apply", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    assert r.json["command"] == "apply" and r.json["exit_code"] == 0
    res = r.json["result"]
    assert res["action"] == "applied" and res["state_before"] == "pristine"
    assert res["state_after"] == "patched" and res["through"] == "02-second"
    assert res["changed_files"] == sorted([F1, F2, F3])
    assert [(h["patch"], h["path"]) for h in res["hunks"]] == [
        ("01-first", F1), ("01-first", F2), ("02-second", F3), ("02-second", F1)]
    assert all(h["status"] == "applies" for f in res["hunks"] for h in f["hunks"])
    assert len(res["hunks"][0]["hunks"]) == 2  # 01 edits F1 in two hunks
    assert not stale.exists() and kept.exists()
    assert any("kv_layer_groups" in p for p in res["removed_pyc"])

    # only the three targets and RECORD changed, and RECORD stays CRLF with its row order
    before, after = tree_hashes(fresh_site, SKIP), tree_hashes(site, SKIP)
    rec = str(sw.record_path(site).relative_to(site))
    assert {k for k in before if before[k] != after.get(k)} == {F1, F2, F3, rec}
    assert set(before) == set(after)
    data = sw.record_path(site).read_bytes()
    assert data.count(b"\r\n") == data.count(b"\n")
    fresh_rows, rows = record_rows(fresh_site), record_rows(site)
    assert list(rows) == list(fresh_rows)
    for path in (F1, F2, F3):
        body = (site / path).read_bytes()
        assert rows[path] == (sw.record_hash(body), str(len(body)))
    assert rows[UNTOUCHED] == fresh_rows[UNTOUCHED]
    assert (site / STATE_DIR / "state.json").is_file()

    v = cli("verify", *sp(site), "--json", patches=patch_root)
    assert v.rc == 0, v.out
    assert v.json["result"]["ok"] is True and v.json["result"]["verdict"] == "patched"
    assert {c["name"]: c["ok"] for c in v.json["result"]["checks"]} == {"files": True,
                                                                        "record": True}
    st = cli("status", *sp(site), "--deep", "--json", patches=patch_root).json["result"]
    assert st["state"] == "patched" and st["record"]["mismatches"] == 0
    assert {f["state"] for f in st["files"]} == {"patched"}
    assert any("disk-tier" in n for n in st["notes"])

    r = cli("revert", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["action"] == "reverted" and res["source"] == "saved originals"
    assert res["restored_files"] == sorted([F1, F2, F3]) and res["state_after"] == "pristine"
    # files AND RECORD byte-identical to a fresh install of the same wheel
    assert tree_hashes(site, SKIP) == tree_hashes(fresh_site, SKIP)
    assert not (site / STATE_DIR / "state.json").exists()
    assert not list((site / STATE_DIR).glob("originals/**/*.py"))
    assert cli("verify", *sp(site), patches=patch_root).rc == 5  # pristine


def test_apply_is_idempotent(site, patch_root):
    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    before = tree_hashes(site)
    r = cli("apply", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["action"] == "no-op" and res["changed_files"] == []
    assert res["state_before"] == "patched"
    assert tree_hashes(site) == before


def test_noop_apply_table_says_already_applied(site, patch_root):
    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    res = cli("apply", *sp(site), "--json", patches=patch_root).json["result"]
    assert res["action"] == "no-op"
    assert [h["status"] for f in res["hunks"] for h in f["hunks"]] == ["already-applied"] * 5


def test_dry_runs_write_nothing(site, patch_root):
    before = tree_hashes(site)
    r = cli("apply", "--dry-run", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["action"] == "dry-run" and res["changed_files"] == sorted([F1, F2, F3])
    assert all(h["status"] == "applies" for f in res["hunks"] for h in f["hunks"])
    human = cli("apply", "--dry-run", *sp(site), patches=patch_root)
    assert human.rc == 0 and "would change" in human.out and "applies" in human.out
    assert tree_hashes(site) == before  # no state dir, no lock file, nothing

    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    patched = tree_hashes(site)
    r = cli("revert", "--dry-run", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    assert r.json["result"]["action"] == "dry-run"
    assert r.json["result"]["restored_files"] == sorted([F1, F2, F3])
    assert tree_hashes(site) == patched


def test_revert_pristine_is_noop(site, patch_root):
    before = tree_hashes(site)
    r = cli("revert", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    assert r.json["result"]["action"] == "no-op"
    assert tree_hashes(site) == before


def test_partial_then_full_then_revert(site, fresh_site, patch_root):
    r = cli("apply", *sp(site), "--patch", "01", "--json", patches=patch_root)
    assert r.rc == 0, r.err
    assert r.json["result"]["through"] == "01-first"
    assert r.json["result"]["changed_files"] == sorted([F1, F2])
    st = cli("status", *sp(site), "--json", patches=patch_root).json["result"]
    assert st["state"] == "partially-patched" and st["applied_through"] == "01-first"
    files = files_by_path(st)
    assert files[F1]["state"] == "partial" and files[F1]["step"] == "01-first"
    assert files[F3]["state"] == "pristine"
    assert cli("verify", *sp(site), patches=patch_root).rc == 10
    # the same prefix again is a no-op; a shorter one than applied is refused
    assert cli("apply", *sp(site), "--patch", "01-first", "--json",
               patches=patch_root).json["result"]["action"] == "no-op"

    r = cli("apply", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0 and r.json["result"]["changed_files"] == sorted([F1, F3])
    assert r.json["result"]["state_after"] == "patched"
    bad = cli("apply", *sp(site), "--patch", "01", patches=patch_root)
    assert bad.rc == 3 and "revert first" in bad.err

    assert cli("revert", *sp(site), patches=patch_root).rc == 0
    assert tree_hashes(site, SKIP) == tree_hashes(fresh_site, SKIP)


def test_revert_from_partial(site, fresh_site, patch_root):
    assert cli("apply", *sp(site), "--patch", "01-first.patch", patches=patch_root).rc == 0
    r = cli("revert", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    assert r.json["result"]["restored_files"] == sorted([F1, F2])
    assert tree_hashes(site, SKIP) == tree_hashes(fresh_site, SKIP)


def test_revert_without_saved_state_reverses_series(site, fresh_site, patch_root):
    import shutil

    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    shutil.rmtree(site / STATE_DIR)
    r = cli("revert", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    assert r.json["result"]["source"] == "reverse patch"
    assert tree_hashes(site, SKIP) == tree_hashes(fresh_site, SKIP)


def test_older_revision_recognised_upgraded_reverted(site, fresh_site, patch_root,
                                                     patch_root_r2):
    assert cli("apply", *sp(site), patches=patch_root).rc == 0  # revision 1
    st = cli("status", *sp(site), "--json", patches=patch_root_r2).json["result"]
    assert st["state"] == "patched-older-revision" and st["revision"] == 2
    files = files_by_path(st)
    # 02 changed only F1 and F3; F2's revision-1 post-image is also revision 2's
    assert files[F1]["state"] == "patched-older-revision" and files[F1]["revision"] == 1
    assert files[F2]["state"] == "patched"
    assert cli("verify", *sp(site), patches=patch_root_r2).rc == 9

    r = cli("apply", *sp(site), "--json", patches=patch_root_r2)
    assert r.rc == 0, r.err
    assert r.json["result"]["state_before"] == "patched-older-revision"
    assert r.json["result"]["state_after"] == "patched"
    assert r.json["result"]["changed_files"] == sorted([F1, F3])
    assert cli("verify", *sp(site), patches=patch_root_r2).rc == 0
    # the revision-1 tool no longer recognises the revision-2 files
    assert cli("status", *sp(site), "--json",
               patches=patch_root).json["result"]["state"] == "drifted"

    assert cli("revert", *sp(site), patches=patch_root_r2).rc == 0
    assert tree_hashes(site, SKIP) == tree_hashes(fresh_site, SKIP)


def test_revision_that_appends_a_patch_is_an_older_revision(site, fresh_site, patch_root,
                                                          patch_root_r2_appended):
    """Revision 1 applied, revision 2 = revision 1 + one more patch on a new file:
    the install is 'patched-older-revision' (not 'partial'), apply upgrades it,
    revert gives back the wheel's bytes."""
    root = patch_root_r2_appended
    assert cli("apply", *sp(site), patches=patch_root).rc == 0  # revision 1
    st = cli("status", *sp(site), "--json", patches=root).json["result"]
    assert (st["state"], st["revision"]) == ("patched-older-revision", 2), st["detail"]
    files = files_by_path(st)
    assert files[F1]["state"] == "patched"  # 03 leaves F1 as revision 1 had it
    assert files[sw.UNTOUCHED]["state"] == "pristine"
    assert cli("verify", *sp(site), patches=root).rc == 9

    r = cli("apply", *sp(site), "--json", patches=root)
    assert r.rc == 0, r.err
    assert (r.json["result"]["state_before"], r.json["result"]["state_after"]) == \
        ("patched-older-revision", "patched")
    assert r.json["result"]["changed_files"] == [sw.UNTOUCHED]
    assert cli("verify", *sp(site), patches=root).rc == 0
    assert cli("revert", *sp(site), patches=root).rc == 0
    assert tree_hashes(site, SKIP) == tree_hashes(fresh_site, SKIP)


def test_list_json(patch_root, patch_root_r2):
    r = cli("list", "--json", patches=patch_root_r2)
    assert r.rc == 0, r.err
    [row] = r.json["result"]
    assert (row["set"], row["lmcache_version"], row["state"]) == (sw.SET, sw.VERSION, "patch")
    assert row["revision"] == 2 and row["patches"] == 2
    assert row["files"] == sorted([F1, F2, F3])


def test_manifest_rebuild_is_reproducible(tmp_path, patch_root, wheel):
    import shutil

    d = Path(shutil.copytree(patch_root, tmp_path / "p")) / sw.SET / sw.VERSION
    before = (d / "manifest.json").read_bytes()
    sw.manifest_build(d, wheel)  # no options: keeps every field
    assert (d / "manifest.json").read_bytes() == before
    m = json.loads(before)
    assert m["schema"] == "lmcache-patchtool/manifest/v1"
    assert m["wheel"]["filename"] == wheel.name
    assert [p["id"] for p in m["patches"]] == ["01-first", "02-second"]
    with_steps = m["files"][F1]
    assert list(with_steps["steps"]) == ["01-first", "02-second"]
    assert with_steps["pre"]["hash"] == sw.record_hash(sw.wheel_files(wheel)[F1])
    assert with_steps["post"] == with_steps["steps"]["02-second"]
    assert list(m["files"][F2]["steps"]) == ["01-first"]


def test_manifest_build_refusals(tmp_path, patch_root, wheel):
    import shutil

    d = Path(shutil.copytree(patch_root, tmp_path / "p")) / sw.SET / sw.VERSION
    other = d.parent / "9.9.7"
    shutil.copytree(d, other)
    r = cli("manifest", "build", str(other), "--wheel", str(wheel))
    assert r.rc == 3 and r.err.count("\n") == 1
    assert "is lmcache 9.9.9, but the patch set directory is for 9.9.7" in r.err
    r = cli("manifest", "build", str(d), "--wheel", str(wheel), "--revision", "0")
    assert r.rc == 3 and "older revision" in r.err
    r = cli("manifest", "build", str(d), "--wheel", str(tmp_path / "nope.whl"))
    assert r.rc == 3 and "no such wheel file" in r.err
