"""Operator notes in `patchtool status`: the disk-tier warning once patched,
and the manifest's per-version notes (what upstream fixed and what not)."""

from __future__ import annotations

import shutil

from .helpers import cli

from patchtool.classify import DISK_TIER_WARNING


def test_disk_tier_warning_only_once_patched(tmp_path, target_dir_053, test_patches):
    site = tmp_path / "site"
    shutil.copytree(target_dir_053, site, symlinks=True)
    before = cli("status", "--json", "--site-packages", str(site), patches=test_patches).json
    assert before["result"]["state"] == "pristine"
    assert DISK_TIER_WARNING not in before["result"]["notes"]

    assert cli("apply", "--site-packages", str(site), patches=test_patches).rc == 0
    after = cli("status", "--json", "--site-packages", str(site), patches=test_patches).json
    assert after["result"]["state"] == "patched"
    assert DISK_TIER_WARNING in after["result"]["notes"]
    human = cli("status", "--site-packages", str(site), patches=test_patches)
    assert "must be discarded" in human.out.replace("\n", " ")


def test_manifest_notes_are_shown_and_kept_on_rebuild(tmp_path, wheel053, test_patches,
                                                         target_dir_053):
    patches = tmp_path / "patches"
    shutil.copytree(test_patches, patches)
    (set_dir,) = [d for d in patches.glob("*/0.5.3")]
    note = "upstream fixed X; not Y"
    assert cli("manifest", "build", str(set_dir), "--wheel", str(wheel053), "--note", note).rc == 0
    # A rebuild without --note keeps the note (and is byte-identical).
    first = (set_dir / "manifest.json").read_bytes()
    assert cli("manifest", "build", str(set_dir), "--wheel", str(wheel053)).rc == 0
    assert (set_dir / "manifest.json").read_bytes() == first

    site = tmp_path / "site"
    shutil.copytree(target_dir_053, site, symlinks=True)
    st = cli("status", "--json", "--site-packages", str(site), patches=patches).json["result"]
    assert st["notes"] == [note]


def test_pristine_056_status_names_what_upstream_fixed_and_not(bare_envs):
    """Against the shipped 0.5.6 manifest (no patches override)."""
    py = str(bare_envs["0.5.6"] / "bin" / "python")
    st = cli("status", "--json", "--python", py).json["result"]
    assert st["state"] == "pristine" and st["lmcache_version"] == "0.5.6"
    notes = " ".join(st["notes"])
    assert "upstream 0.5.6 fixed" in notes and "did NOT fix" in notes
    assert "pure-attention" in notes
