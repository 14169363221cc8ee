"""The real series' revision bump (2: 05-layout-keys, on 0.5.4+
06-state-chunk-ends, on 0.5.3-0.5.5 07-lookup-reserves-last-token, appended): an
install patched with revision 1 of the
shipped series is recognised as ``patched-older-revision``, `status` names the
command that upgrades it, `apply` brings it to revision 2 touching only the
files 05/06 change, and `revert` gives back the wheel's bytes.  Revision 1 is
rebuilt from the shipped patch files 01-04 (unchanged since revision 1), so its
post-images are exactly the ones the shipped manifest keeps in
``previous_revisions``."""

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


def revision1_root(tmp_path: Path, version: str) -> Path:
    shipped = REPO / "patches" / "hybrid-fa" / version
    d = tmp_path / "r1" / "hybrid-fa" / version
    d.mkdir(parents=True)
    for p in sorted(shipped.glob("*.patch")):
        if not p.name.startswith(("05-", "06-", "07-")):
            shutil.copy2(p, d / p.name)
    r = cli("manifest", "build", str(d), "--wheel", str(provision.wheel(version)),
            "--revision", "1", "--json")
    assert r.rc == 0, r.err
    prev = json.loads((shipped / "manifest.json").read_text())["previous_revisions"][0]
    built = json.loads((d / "manifest.json").read_text())
    assert prev["revision"] == 1
    assert {p: f["post"] for p, f in built["files"].items()} == prev["files"]
    return tmp_path / "r1"


@pytest.mark.parametrize("version", ["0.5.3", "0.5.4", "0.5.6"])
def test_revision1_install_upgrades_with_apply(tmp_path, bare_envs, version):
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    py = str(venv / "bin" / "python")
    fresh = tree_hashes(site_of(bare_envs[version]), SKIP)
    assert cli("apply", "--python", py, patches=revision1_root(tmp_path, version)).rc == 0

    st = cli("status", "--python", py, "--json").json["result"]  # the shipped patches
    assert (st["state"], st["revision"]) == ("patched-older-revision", 2), st["detail"]
    assert st["next_command"] == f"patchtool apply --python {py}"
    assert cli("verify", "--python", py).rc == 9

    r = cli("apply", "--python", py, "--json")
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert (res["state_before"], res["state_after"]) == ("patched-older-revision", "patched")
    added = set(ADDED_BY_05) | (set(ADDED_BY_06) if version != "0.5.3" else set()) \
        | (set(ADDED_BY_07) if version != "0.5.6" else set())
    assert sorted(res["changed_files"]) == sorted(added)
    assert any(n.startswith("disk-tier keys kvl1:") for n in res["notes"])
    st = cli("status", "--python", py, "--json").json["result"]
    assert (st["state"], st["disk_tier_keys"], st["next_command"]) == ("patched", "kvl1", None)
    assert cli("verify", "--python", py).rc == 0
    assert cli("revert", "--python", py).rc == 0
    assert tree_hashes(site_of(venv), SKIP) == fresh
