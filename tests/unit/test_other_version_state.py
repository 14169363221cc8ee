"""Patchtool state left by another lmcache version.

An operator patches lmcache 9.9.9, then installs 9.9.8 over it (``pip
install lmcache==9.9.8``: pip replaces the package and its dist-info and
never looks at ``site-packages/.lmcache-patchtool/``).  The state dir then
holds 9.9.9's record and the pristine 9.9.9 files it saved.  ``status`` and
``verify`` report them; ``apply`` and ``revert`` remove them in the same
transaction as their own changes and say so; after revert no state dir is
left.  The 9.9.8 series here edits F1 only, so 9.9.9's saved F2 and F3 are
another version's alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _cli import cli

from . import synthwheel as sw
from .synthwheel import F1, F2, F3, STATE_DIR, tree_hashes

OTHER = "9.9.8"


def sp(site: Path) -> tuple[str, str]:
    return ("--site-packages", str(site))


@pytest.fixture(scope="session")
def other_site(tmp_path_factory) -> Path:
    """``pip install --target`` of a synthetic lmcache 9.9.8 (never modify it)."""
    wheel = sw.make_wheel(tmp_path_factory.mktemp("wheel-998"), version=OTHER)
    return sw.install_target(wheel, tmp_path_factory.mktemp("fresh-998") / "site")


@pytest.fixture(scope="session")
def two_versions(tmp_path_factory, patch_root, other_site) -> Path:
    """synthset for 9.9.9 (F1, F2, F3) and for 9.9.8 (one patch, F1 only)."""
    root = Path(shutil.copytree(patch_root, tmp_path_factory.mktemp("patches-2v"),
                                dirs_exist_ok=True))
    wheel = sw.make_wheel(tmp_path_factory.mktemp("wheel-998b"), version=OTHER)
    base = sw.wheel_files(wheel)
    d = sw.write_series(root / sw.SET / OTHER, base,
                        [("01-only.patch", {F1: sw.insert_after(base[F1], 12, b"# 9.9.8 fix")})])
    sw.manifest_build(d, wheel)
    return root


def install_other(site: Path, other_site: Path) -> None:
    """What ``pip install lmcache==9.9.8`` does to a 9.9.9 site dir: the
    package and its dist-info replaced, the state dir left alone."""
    shutil.rmtree(site / "lmcache")
    for d in site.glob("lmcache-*.dist-info"):
        shutil.rmtree(d)
    sw.copy_site(other_site, site)


def state_files(site: Path) -> list[str]:
    root = site / STATE_DIR
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def patched_then_other(site: Path, root: Path, other_site: Path) -> list[str]:
    assert cli("apply", *sp(site), patches=root).rc == 0
    install_other(site, other_site)
    left = state_files(site)
    assert left == sorted(["state.json"] + [f"originals/{p}" for p in (F1, F2, F3)])
    return left


def test_apply_then_revert_after_a_downgrade_leaves_no_state_dir(site, other_site,
                                                                 two_versions):
    """The sequence of the report: patched newer version, older installed,
    apply, revert: no saved file of either version is left."""
    left = patched_then_other(site, two_versions, other_site)
    r = cli("status", *sp(site), "--json", patches=two_versions)
    assert r.rc == 0, r.err
    st = r.json["result"]
    assert st["state"] == "pristine" and st["lmcache_version"] == OTHER
    assert st["leftover_state"] == {"dir": str(site / STATE_DIR), "lmcache_version": "9.9.9",
                                    "files": left}
    human = cli("status", *sp(site), patches=two_versions, env={"COLUMNS": "300"})
    assert f"{len(left)} file(s) of patchtool state left by lmcache 9.9.9" in human.out, human.out

    dry = cli("apply", "--dry-run", *sp(site), "--json", patches=two_versions)
    assert dry.rc == 0 and dry.json["result"]["leftover_state"]["files"] == left
    assert state_files(site) == left  # a dry run writes nothing

    r = cli("apply", *sp(site), "--json", patches=two_versions)
    assert r.rc == 0, r.err
    assert r.json["result"]["leftover_state"] == st["leftover_state"]
    assert state_files(site) == ["originals/" + F1, "state.json"]  # 9.9.8's own, nothing else
    assert cli("status", *sp(site), "--json",
               patches=two_versions).json["result"]["leftover_state"] is None

    r = cli("revert", *sp(site), patches=two_versions)
    assert r.rc == 0, r.err
    assert not (site / STATE_DIR).exists()
    assert tree_hashes(site, ("__pycache__",)) == tree_hashes(other_site, ("__pycache__",))


def test_revert_right_after_a_downgrade_removes_the_other_versions_state(site, other_site,
                                                                        two_versions):
    left = patched_then_other(site, two_versions, other_site)
    r = cli("revert", *sp(site), patches=two_versions, env={"COLUMNS": "300"})
    assert r.rc == 0, r.err
    assert "from none" not in r.out
    assert f"removed {len(left)} file(s) of patchtool state left by lmcache 9.9.9" in r.out, r.out
    assert not (site / STATE_DIR).exists()
    assert tree_hashes(site, ("__pycache__",)) == tree_hashes(other_site, ("__pycache__",))


def test_verify_after_a_downgrade_names_the_leftover(site, other_site, two_versions):
    patched_then_other(site, two_versions, other_site)
    r = cli("verify", *sp(site), patches=two_versions, env={"COLUMNS": "300"})
    assert r.rc == 5, r.err  # pristine, as before: the leftover does not change the verdict
    assert "patchtool state left by lmcache 9.9.9" in r.out, r.out


def test_orphaned_saved_files_are_reported_and_removed(site, other_site, two_versions):
    """A patchtool before this fix, applying 9.9.8 over 9.9.9's state,
    replaced state.json and left 9.9.9's saved F2 and F3 behind with no
    record naming them: they are found by walking the state dir."""
    assert cli("apply", *sp(site), patches=two_versions).rc == 0
    install_other(site, other_site)
    assert cli("apply", *sp(site), patches=two_versions).rc == 0
    orphans = sorted(f"originals/{p}" for p in (F2, F3))
    for rel in orphans:
        (site / STATE_DIR / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / STATE_DIR / rel).write_bytes(b"saved by another version\n")
    st = cli("status", *sp(site), "--json", patches=two_versions).json["result"]
    assert st["state"] == "patched"
    assert st["leftover_state"] == {"dir": str(site / STATE_DIR), "lmcache_version": None,
                                    "files": orphans}
    assert cli("verify", *sp(site), patches=two_versions).rc == 0  # still patched, still OK
    r = cli("revert", *sp(site), "--json", patches=two_versions)
    assert r.rc == 0, r.err
    assert r.json["result"]["leftover_state"]["files"] == orphans
    assert not (site / STATE_DIR).exists()


def test_a_link_in_the_state_dir_is_refused(site, other_site, two_versions, tmp_path):
    """The state dir is the tool's own: a symbolic link there is not guessed
    about (deleting through it would restore a regular file on rollback)."""
    patched_then_other(site, two_versions, other_site)
    outside = tmp_path / "outside.py"
    outside.write_bytes(b"x\n")
    link = site / STATE_DIR / "originals" / "lmcache" / "linked.py"
    link.symlink_to(outside)
    before = tree_hashes(site)
    r = cli("revert", *sp(site), patches=two_versions)
    assert r.rc == 3, (r.rc, r.err)
    lines = r.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"patchtool: {link}: ")
    assert "symbolic link" in lines[0] and len(lines[0].replace(str(link), "")) < 150  # one line, whatever the tmp path
    assert tree_hashes(site) == before and outside.read_bytes() == b"x\n"
