"""The real series' revision bumps (2: 05-layout-keys, on 0.5.4+
06-state-chunk-ends, on 0.5.3-0.5.5 07-lookup-reserves-last-token, appended;
3: 08-block-state-from-vllm, appended): an install patched with an older
revision of the shipped series is recognised as ``patched-older-revision``,
`status` names the command that upgrades it, `apply` brings it to the shipped
revision touching only the files the newer parts change, and `revert` gives
back the wheel's bytes.  Each older revision is rebuilt from the shipped patch
files it consists of (unchanged since), so its post-images are exactly the
ones the shipped manifest keeps in ``previous_revisions``."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from .helpers import REPO, cli, copy_venv, site_of, tree_hashes
from .test_lifecycle import SKIP

sys.path.insert(0, str(REPO / "scripts"))
import provision  # noqa: E402

ADDED_BY_05 = ["lmcache/v1/distributed/api.py", "lmcache/v1/multiprocess/engine_context.py",
               "lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py"]
ADDED_BY_06 = ["lmcache/integration/vllm/lmcache_mp_metadata.py",
               "lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py"]
ADDED_BY_07 = ["lmcache/integration/vllm/lmcache_mp_connector.py"]  # not on 0.5.6
# 0.5.3 keeps the resync in the connector; 0.5.4+ in the metadata module too.
ADDED_BY_08 = {"0.5.3": ["lmcache/integration/vllm/lmcache_mp_connector.py"]}
ADDED_BY_08_DEFAULT = ["lmcache/integration/vllm/lmcache_mp_connector.py",
                       "lmcache/integration/vllm/lmcache_mp_metadata.py"]
SHIPPED_REVISION = 3
# The parts each later revision added, by file-name prefix.
PARTS_AFTER = {1: ("05-", "06-", "07-", "08-"), 2: ("08-",)}


def older_revision_root(tmp_path: Path, version: str, revision: int) -> Path:
    shipped = REPO / "patches" / "hybrid-fa" / version
    d = tmp_path / f"r{revision}" / "hybrid-fa" / version
    d.mkdir(parents=True)
    for p in sorted(shipped.glob("*.patch")):
        if not p.name.startswith(PARTS_AFTER[revision]):
            shutil.copy2(p, d / p.name)
    r = cli("manifest", "build", str(d), "--wheel", str(provision.wheel(version)),
            "--revision", str(revision), "--json")
    assert r.rc == 0, r.err
    manifest = json.loads((shipped / "manifest.json").read_text())
    assert manifest["revision"] == SHIPPED_REVISION
    (prev,) = [p for p in manifest["previous_revisions"] if p["revision"] == revision]
    built = json.loads((d / "manifest.json").read_text())
    assert {p: f["post"] for p, f in built["files"].items()} == prev["files"]
    assert {p["file"]: p["sha256"] for p in built["patches"]} == prev["patches"]
    return tmp_path / f"r{revision}"


def revision1_root(tmp_path: Path, version: str) -> Path:
    return older_revision_root(tmp_path, version, 1)


def upgrade_with_apply(py: str) -> dict:
    """An older-revision install as status, verify and apply see it: reported
    with the exact next command, verify exits 9, apply upgrades it."""
    st = cli("status", "--python", py, "--json").json["result"]
    assert (st["state"], st["revision"]) == ("patched-older-revision", SHIPPED_REVISION), \
        st["detail"]
    assert st["next_command"] == f"patchtool apply --python {py}"
    assert cli("verify", "--python", py).rc == 9
    r = cli("apply", "--python", py, "--json")
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert (res["state_before"], res["state_after"]) == ("patched-older-revision", "patched")
    return res


@pytest.mark.parametrize("version", ["0.5.3", "0.5.4", "0.5.6"])
def test_revision1_install_upgrades_with_apply(tmp_path, bare_envs, version):
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    py = str(venv / "bin" / "python")
    fresh = tree_hashes(site_of(bare_envs[version]), SKIP)
    assert cli("apply", "--python", py, patches=revision1_root(tmp_path, version)).rc == 0

    res = upgrade_with_apply(py)  # the shipped patches
    added = set(ADDED_BY_05) | (set(ADDED_BY_06) if version != "0.5.3" else set()) \
        | (set(ADDED_BY_07) if version != "0.5.6" else set()) \
        | set(ADDED_BY_08.get(version, ADDED_BY_08_DEFAULT))
    assert sorted(res["changed_files"]) == sorted(added)
    assert any(n.startswith("disk-tier keys kvl1:") for n in res["notes"])
    st = cli("status", "--python", py, "--json").json["result"]
    assert (st["state"], st["disk_tier_keys"], st["next_command"]) == ("patched", "kvl1", None)
    assert cli("verify", "--python", py).rc == 0
    assert cli("revert", "--python", py).rc == 0
    assert tree_hashes(site_of(venv), SKIP) == fresh


@pytest.mark.parametrize("version", ["0.5.3", "0.5.6"])
def test_revision2_install_upgrades_with_apply(tmp_path, bare_envs, version):
    """2 -> 3: only the files part 08 changes are rewritten; revert is byte-exact."""
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    py = str(venv / "bin" / "python")
    fresh = tree_hashes(site_of(bare_envs[version]), SKIP)
    assert cli("apply", "--python", py,
               patches=older_revision_root(tmp_path, version, 2)).rc == 0
    r2_site = tree_hashes(site_of(venv), SKIP)

    res = upgrade_with_apply(py)
    assert sorted(res["changed_files"]) == sorted(ADDED_BY_08.get(version, ADDED_BY_08_DEFAULT))
    r3_site = tree_hashes(site_of(venv), SKIP)
    changed = {p for p in set(r2_site) | set(r3_site) if r2_site.get(p) != r3_site.get(p)}
    # Only the 08 files' bytes and pip's RECORD (their new hashes) differ.
    assert {p for p in changed if not p.endswith("/RECORD")} == set(res["changed_files"])
    st = cli("status", "--python", py, "--json").json["result"]
    assert (st["state"], st["disk_tier_keys"], st["next_command"]) == ("patched", "kvl1", None)
    assert cli("verify", "--python", py).rc == 0
    assert cli("revert", "--python", py).rc == 0
    assert tree_hashes(site_of(venv), SKIP) == fresh
