"""Crash safety (a real process killed between file replacements) and the
lock (two real processes applying at once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from patchtool.fsio import CRASH_EXIT, FAULT_ENV as CRASH_ENV

from .helpers import STATE_DIR, cli, site_of, tree_hashes

SKIP = ("__pycache__", STATE_DIR)


@pytest.mark.parametrize("after", [10, 20, 28])
def test_apply_killed_between_replacements_is_rolled_back(venv053, test_patches, after):
    """Killed after its N-th write (backups, journal, staging and the first
    replacements come first), on a real pip venv: the next command rolls the
    install back byte-exact.  tests/unit sweeps every write on a synthetic wheel."""
    py = str(venv053 / "bin" / "python")
    site = site_of(venv053)
    before = tree_hashes(site, SKIP)
    r = cli("apply", "--python", py, patches=test_patches, env={CRASH_ENV: f"crash:{after}"})
    assert r.rc == CRASH_EXIT, (r.rc, r.err)
    assert (site / STATE_DIR / "journal.json").exists()
    # the next command of any kind recovers, then reports
    st = cli("status", "--python", py, "--json", patches=test_patches)
    assert st.rc == 0, st.err
    assert st.json["result"]["state"] == "pristine"
    assert st.json["result"]["record"]["mismatches"] == 0
    assert tree_hashes(site, SKIP) == before
    assert not (site / STATE_DIR).exists()  # nothing of the tool's is left
    leftovers = [p for p in site.rglob("*.patchtool-*.tmp")]
    assert leftovers == []
    # and the install can be patched normally afterwards
    assert cli("apply", "--python", py, patches=test_patches).rc == 0
    assert cli("verify", "--python", py, patches=test_patches).rc == 0


def test_revert_killed_is_rolled_back_to_patched(venv053, test_patches):
    py = str(venv053 / "bin" / "python")
    site = site_of(venv053)
    assert cli("apply", "--python", py, patches=test_patches).rc == 0
    patched = tree_hashes(site, ("__pycache__",))
    r = cli("revert", "--python", py, patches=test_patches, env={CRASH_ENV: "crash:18"})
    assert r.rc == CRASH_EXIT
    v = cli("verify", "--python", py, "--json", patches=test_patches)
    assert v.rc == 0, v.out
    assert v.json["result"]["status"]["recovered_files"] >= 1
    assert tree_hashes(site, ("__pycache__",)) == patched


def test_two_concurrent_applies(venv053, test_patches):
    py = str(venv053 / "bin" / "python")
    env = dict(os.environ, LMCACHE_PATCHTOOL_PATCHES=str(test_patches))
    env.pop(CRASH_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-m", "patchtool", "apply", "--python", py,
                               "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    actions = sorted(json.loads(o)["result"]["action"] for o, _ in outs)
    assert actions == ["applied", "no-op"]
    v = cli("verify", "--python", py, "--json", patches=test_patches)
    assert v.rc == 0, v.out
    assert not (site_of(venv053) / STATE_DIR / "journal.json").exists()
