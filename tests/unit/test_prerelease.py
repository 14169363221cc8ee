"""Pre-release lmcache builds (``X.Y.ZrcN``) are first-class: a set built for the
rc wheel serves that install with a one-line pre-release note, and an rc
install is never served a final's set (or the reverse) by version alone.  The
sha256 pins decide: a "final" whose files equal the rc's still gets no set,
and an rc install whose files differ from the rc set's pins is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import cli

from patchtool.prerelease import is_prerelease, prerelease_note

from . import synthwheel as sw

RC, FINAL = "9.9.10rc1", "9.9.10"


@pytest.mark.parametrize("version,pre", [
    ("0.5.7rc2", True), ("0.5.7", False), ("0.5.7.dev3", True), ("1.0a1", True), ("1.0b2", True),
    ("0.5.7-rc1", True), ("0.5.7rc2+cu129", True), ("0.5.7+rc", False), ("0.5.6.post1", False),
    ("", False), (None, False),
])
def test_is_prerelease(version, pre):
    assert is_prerelease(version) is pre
    assert (prerelease_note(version) is not None) is pre


def _install(tmp: Path, version: str, files: dict[str, bytes]) -> Path:
    wheel = sw.make_wheel(tmp / f"w-{version}", version, files)
    return sw.install_target(wheel, tmp / f"site-{version}")


def _status(site: Path, root: Path) -> dict:
    r = cli("status", "--site-packages", str(site), "--json", patches=root)
    assert r.rc == 0, r.err
    return r.json["result"]


def test_rc_set_serves_the_rc_build_only(tmp_path):
    files = sw.default_files(RC)
    rc_wheel = sw.make_wheel(tmp_path / "rcwheel", RC, files)
    root = sw.make_patch_root(tmp_path / "patches", rc_wheel)
    rc_site = _install(tmp_path, RC, files)

    st = _status(rc_site, root)
    assert st["lmcache_version"] == RC and st["state"] == "pristine", st["detail"]
    (note,) = [n for n in st["notes"] if "pre-release" in n]
    assert note == prerelease_note(RC) and "\n" not in note
    r = cli("apply", "--site-packages", str(rc_site), "--json", patches=root)
    assert r.rc == 0, r.err
    assert _status(rc_site, root)["state"] == "patched"
    assert cli("revert", "--site-packages", str(rc_site), patches=root).rc == 0

    # The final release, byte for byte the rc's files: no set serves it.
    final_site = _install(tmp_path, FINAL, files)
    st = _status(final_site, root)
    assert st["state"] == "unsupported-version", st
    assert not [n for n in st["notes"] if "pre-release" in n]


def test_rc_install_with_other_files_than_the_pins_is_refused(tmp_path):
    files = sw.default_files(RC)
    root = sw.make_patch_root(tmp_path / "patches", sw.make_wheel(tmp_path / "rcwheel", RC, files))
    # Another build published under the same rc version: one touched file differs.
    other = dict(files)
    manifest = json.loads(next(root.glob(f"*/{RC}/manifest.json")).read_text())
    touched = sorted(manifest["files"])[0]
    other[touched] = other[touched] + b"# another rc build\n"
    site = _install(tmp_path, RC, other)
    before = sw.tree_hashes(site)
    r = cli("apply", "--site-packages", str(site), patches=root)
    assert r.rc != 0
    assert sw.tree_hashes(site) == before  # nothing written
    assert _status(site, root)["state"] not in ("pristine", "patched")
