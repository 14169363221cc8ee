"""The real series' revision bumps (2: 05-layout-keys, on 0.5.4+
06-state-chunk-ends, on 0.5.3-0.5.5 07-lookup-reserves-last-token, appended;
3: 08-block-state-from-vllm, appended; 4: 09-padded-block-stride,
10-vllm030-registration on 0.5.3/0.5.4, 11-local-hit-count on 0.5.3-0.5.5,
12-l2-checksum, appended; 5: 13-scheduler-heartbeat on 0.5.3-0.5.5; 6:
14-lookup-wait-while-healthy on 0.5.3/0.5.4; 7/6/5: 15-vllm034-scheduler-output;
8/8/7/6: 16-native-l2-size-batches and 17-resp-checksum, and on 0.5.3-0.5.5
18-failed-load-discard; 9 on 0.5.3: 19-state-chunk-ends, the 0.5.4+ series'
06 appended; 7 on 0.5.6: 20-fs-load-jobs): an install patched with an older
revision of the shipped series is recognised as ``patched-older-revision``,
`status` names the command that upgrades it, `apply` brings it to the shipped
revision touching only the files the newer parts change, and `revert` gives
back the wheel's bytes.  Each older revision is rebuilt from the shipped patch
files the manifest lists for it in ``previous_revisions`` (unchanged since),
and its post-images must be exactly the ones kept there.  The shipped
revision is each version's own manifest's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from .helpers import REPO, cli, copy_venv, site_of, tree_hashes
from .test_lifecycle import SKIP

from lab import provision
ADDED_BY_05 = ["lmcache/v1/distributed/api.py", "lmcache/v1/multiprocess/engine_context.py",
               "lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py"]
ADDED_BY_06 = ["lmcache/integration/vllm/lmcache_mp_metadata.py",
               "lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py"]
ADDED_BY_07 = ["lmcache/integration/vllm/lmcache_mp_connector.py"]  # not on 0.5.6
# 0.5.3 keeps the resync in the connector; 0.5.4+ in the metadata module too.
ADDED_BY_08 = {"0.5.3": ["lmcache/integration/vllm/lmcache_mp_connector.py"]}
ADDED_BY_08_DEFAULT = ["lmcache/integration/vllm/lmcache_mp_connector.py",
                       "lmcache/integration/vllm/lmcache_mp_metadata.py"]
# (the connector marks the Mamba/GDN state layers the shared-memory path refuses)
_ADDED_BY_09_CPU = ["lmcache/integration/vllm/lmcache_mp_connector.py",
                    "lmcache/v1/platform/cpu/cache_context.py", "lmcache/v1/platform/cpu/shm.py",
                    "lmcache/v1/platform/torch_ops.py"]
ADDED_BY_09 = {"0.5.3": _ADDED_BY_09_CPU, "0.5.4": _ADDED_BY_09_CPU, "0.5.5": _ADDED_BY_09_CPU,
               "0.5.6": ["lmcache/integration/vllm/lmcache_mp_connector.py",
                         "lmcache/v1/platform/devices/cpu/cache_context.py",
                         "lmcache/v1/platform/devices/cpu/shm.py",
                         "lmcache/v1/platform/torch_ops/mp_mem_kernels.py"]}
# 10-vllm030-registration (revision 4, 0.5.3 and 0.5.4): the layout from the
# views' strides, the state edit for vLLM 0.30+'s view, the server's
# block-axis formats.
ADDED_BY_10 = ["lmcache/integration/vllm/kv_cache_group_edits.py",
               "lmcache/integration/vllm/lmcache_mp_connector.py",
               "lmcache/integration/vllm/utils.py",
               "lmcache/integration/vllm/vllm_multi_process_adapter.py",
               "lmcache/v1/gpu_connector/utils.py"]
# 11-local-hit-count (revision 4, 0.5.3-0.5.5): the connector's lookup result.
ADDED_BY_11 = ["lmcache/integration/vllm/lmcache_mp_connector.py"]
# 12-l2-checksum (revision 4, every version): the fs L2 adapter's checksum
# trailer, and the fs_native adapter's refusal.
ADDED_BY_12 = ["lmcache/v1/distributed/l2_adapters/fs_l2_adapter.py",
               "lmcache/v1/distributed/l2_adapters/fs_native_l2_adapter.py"]
# 13-scheduler-heartbeat (revision 5, 0.5.3-0.5.5): the scheduler adapter's
# heartbeat start.
ADDED_BY_13 = ["lmcache/integration/vllm/vllm_multi_process_adapter.py"]
# 14-lookup-wait-while-healthy (revision 6, 0.5.3/0.5.4): the scheduler
# adapter's reply waits.
ADDED_BY_14 = ["lmcache/integration/vllm/vllm_multi_process_adapter.py"]
# 15-vllm034-scheduler-output (revision 7 on 0.5.3/0.5.4, 6 on 0.5.5, 5 on
# 0.5.6): the connector's reads of vLLM's scheduler output (and, 0.5.4+, the
# request tracker's prompt copy in the metadata module).
ADDED_BY_15 = {"0.5.3": ["lmcache/integration/vllm/lmcache_mp_connector.py"]}
ADDED_BY_15_DEFAULT = ["lmcache/integration/vllm/lmcache_mp_connector.py",
                       "lmcache/integration/vllm/lmcache_mp_metadata.py"]
# 16-native-l2-size-batches and 17-resp-checksum (revision 8 on 0.5.3/0.5.4, 7
# on 0.5.5, 6 on 0.5.6): the native L2 adapter's per-size batches and the RESP
# adapter's seal.
ADDED_BY_16 = ["lmcache/v1/distributed/l2_adapters/native_connector_l2_adapter.py"]
ADDED_BY_17 = ["lmcache/v1/distributed/l2_adapters/native_connector_l2_adapter.py",
               "lmcache/v1/distributed/l2_adapters/resp_l2_adapter.py"]
# 18-failed-load-discard (the same revision, 0.5.3-0.5.5): the L1 manager's
# atomic discard and the prefetch controller's failed-load path.
ADDED_BY_18 = ["lmcache/v1/distributed/l1_manager.py",
               "lmcache/v1/distributed/storage_controllers/prefetch_controller.py"]
# 19-state-chunk-ends (revision 9, 0.5.3 only: the 0.5.4+ series' 06 with the
# 0.5.4 server rules it needs): the connector's GDN window, its chunk-end ids
# and step rule, the server's null-chunk skip, window reads and separation.
ADDED_BY_19 = ["lmcache/integration/vllm/kv_cache_groups.py",
               "lmcache/integration/vllm/lmcache_mp_connector.py",
               "lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py"]
# 20-fs-load-jobs (revision 7, 0.5.6): the fs L2 adapter's lookup and load,
# one executor job per object (issue 39, the restore's L2 prefetch).
ADDED_BY_20 = ["lmcache/v1/distributed/l2_adapters/fs_l2_adapter.py"]
# the shipped hybrid-fa revision per version
SHIPPED = {"0.5.3": 9, "0.5.4": 8, "0.5.5": 7, "0.5.6": 7}
# the revision each version shipped before part 15, and before parts 16-18
BEFORE_15 = {"0.5.3": 6, "0.5.4": 6, "0.5.5": 5, "0.5.6": 4}
BEFORE_SHARED_TIER = {"0.5.3": 7, "0.5.4": 7, "0.5.5": 6, "0.5.6": 5}


def shared_tier_files(version: str) -> set[str]:
    """What the revision after part 15 changes: 16, 17 and (0.5.3-0.5.5) 18,
    and what later revisions add (0.5.3: 19; 0.5.6: 20)."""
    return set(ADDED_BY_16) | set(ADDED_BY_17) | (set(ADDED_BY_18) if version != "0.5.6" else set()) \
        | (set(ADDED_BY_19) if version == "0.5.3" else set()) | (set(ADDED_BY_20) if version == "0.5.6" else set())


def part_files(version: str) -> dict[str, list[str]]:
    """Each part's number -> the files it changes on ``version`` (pinned above)."""
    return {"05": ADDED_BY_05, "06": ADDED_BY_06, "07": ADDED_BY_07,
            "08": ADDED_BY_08.get(version, ADDED_BY_08_DEFAULT), "09": ADDED_BY_09[version],
            "10": ADDED_BY_10, "11": ADDED_BY_11, "12": ADDED_BY_12, "13": ADDED_BY_13, "14": ADDED_BY_14,
            "15": ADDED_BY_15.get(version, ADDED_BY_15_DEFAULT), "16": ADDED_BY_16, "17": ADDED_BY_17,
            "18": ADDED_BY_18, "19": ADDED_BY_19, "20": ADDED_BY_20}


def shipped_manifest(version: str) -> dict:
    return json.loads((REPO / "patches" / "hybrid-fa" / version / "manifest.json").read_text())


def shipped_revision(version: str) -> int:
    return shipped_manifest(version)["revision"]


def added_files(version: str, revision: int) -> list[str]:
    """The files the parts shipped after ``revision`` change (pinned per part)."""
    (prev,) = [p for p in shipped_manifest(version)["previous_revisions"] if p["revision"] == revision]
    newer = [p["file"] for p in shipped_manifest(version)["patches"] if p["file"] not in prev["patches"]]
    files: set[str] = set()
    for name in newer:
        pinned = part_files(version).get(name[:2])
        if pinned is None:
            raise AssertionError(f"{version}: part {name} has no pinned file list here")
        files |= set(pinned)
    return sorted(files)


def older_revision_root(tmp_path: Path, version: str, revision: int) -> Path:
    shipped = REPO / "patches" / "hybrid-fa" / version
    d = tmp_path / f"r{revision}" / "hybrid-fa" / version
    d.mkdir(parents=True)
    manifest = shipped_manifest(version)
    assert manifest["revision"] > revision
    (prev,) = [p for p in manifest["previous_revisions"] if p["revision"] == revision]
    for p in sorted(shipped.glob("*.patch")):
        if p.name in prev["patches"]:
            shutil.copy2(p, d / p.name)
    r = cli("manifest", "build", str(d), "--wheel", str(provision.wheel(version)),
            "--revision", str(revision), "--json")
    assert r.rc == 0, r.err
    built = json.loads((d / "manifest.json").read_text())
    assert {p: f["post"] for p, f in built["files"].items()} == prev["files"]
    assert {p["file"]: p["sha256"] for p in built["patches"]} == prev["patches"]
    return tmp_path / f"r{revision}"


def revision1_root(tmp_path: Path, version: str) -> Path:
    return older_revision_root(tmp_path, version, 1)


def upgrade_with_apply(py: str, version: str) -> dict:
    """An older-revision install as status, verify and apply see it: reported
    with the exact next command, verify exits 9, apply upgrades it."""
    st = cli("status", "--python", py, "--json").json["result"]
    assert (st["state"], st["revision"]) == ("patched-older-revision", shipped_revision(version)), \
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

    res = upgrade_with_apply(py, version)  # the shipped patches
    added = set(ADDED_BY_05) | (set(ADDED_BY_06) if version != "0.5.3" else set()) \
        | (set(ADDED_BY_07) if version != "0.5.6" else set()) \
        | set(ADDED_BY_08.get(version, ADDED_BY_08_DEFAULT))
    assert added <= set(res["changed_files"])
    assert sorted(res["changed_files"]) == added_files(version, 1)
    assert any(n.startswith("disk-tier keys kvl1:") for n in res["notes"])
    st = cli("status", "--python", py, "--json").json["result"]
    assert (st["state"], st["disk_tier_keys"], st["next_command"]) == ("patched", "kvl1", None)
    assert cli("verify", "--python", py).rc == 0
    assert cli("revert", "--python", py).rc == 0
    assert tree_hashes(site_of(venv), SKIP) == fresh


@pytest.mark.parametrize("version", ["0.5.3", "0.5.6"])
def test_revision2_install_upgrades_with_apply(tmp_path, bare_envs, version):
    """2 -> shipped: only the files parts 08 (and 09) change are rewritten;
    revert is byte-exact."""
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    py = str(venv / "bin" / "python")
    fresh = tree_hashes(site_of(bare_envs[version]), SKIP)
    assert cli("apply", "--python", py,
               patches=older_revision_root(tmp_path, version, 2)).rc == 0
    r2_site = tree_hashes(site_of(venv), SKIP)

    res = upgrade_with_apply(py, version)
    assert sorted(res["changed_files"]) == added_files(version, 2)
    assert set(ADDED_BY_08.get(version, ADDED_BY_08_DEFAULT)) <= set(res["changed_files"])
    r3_site = tree_hashes(site_of(venv), SKIP)
    changed = {p for p in set(r2_site) | set(r3_site) if r2_site.get(p) != r3_site.get(p)}
    # Only the 08 files' bytes and pip's RECORD (their new hashes) differ.
    assert {p for p in changed if not p.endswith("/RECORD")} == set(res["changed_files"])
    st = cli("status", "--python", py, "--json").json["result"]
    assert (st["state"], st["disk_tier_keys"], st["next_command"]) == ("patched", "kvl1", None)
    assert cli("verify", "--python", py).rc == 0
    assert cli("revert", "--python", py).rc == 0
    assert tree_hashes(site_of(venv), SKIP) == fresh


def upgrade_from(tmp_path: Path, bare_envs, version: str, older: int) -> dict:
    """An install of revision ``older`` upgraded by ``apply`` to the shipped one:
    only the files the newer parts change (and pip's RECORD) are rewritten, the
    install is then ``patched`` at the shipped revision, and revert gives back the
    wheel's bytes.  Returns apply's result."""
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    py = str(venv / "bin" / "python")
    fresh = tree_hashes(site_of(bare_envs[version]), SKIP)
    assert cli("apply", "--python", py,
               patches=older_revision_root(tmp_path, version, older)).rc == 0
    before = tree_hashes(site_of(venv), SKIP)

    res = upgrade_with_apply(py, version)
    assert sorted(res["changed_files"]) == added_files(version, older)
    after = tree_hashes(site_of(venv), SKIP)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert {p for p in changed if not p.endswith("/RECORD")} == set(res["changed_files"])
    st = cli("status", "--python", py, "--json").json["result"]
    assert (st["state"], st["revision"], st["next_command"]) == ("patched", shipped_revision(version), None)
    assert cli("verify", "--python", py).rc == 0
    assert cli("revert", "--python", py).rc == 0
    assert tree_hashes(site_of(venv), SKIP) == fresh
    return res


@pytest.mark.parametrize("version", ["0.5.6"] + (["0.5.3", "0.5.4", "0.5.5"]
                                                  if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" else []))
def test_revision3_install_upgrades_with_apply(tmp_path, bare_envs, version):
    """3 -> shipped (09-padded-block-stride, 12-l2-checksum; 11-local-hit-count
    on 0.5.3-0.5.5, 10-vllm030-registration on 0.5.3/0.5.4; 13 on 0.5.3-0.5.5)."""
    assert shipped_revision(version) == SHIPPED[version]
    res = upgrade_from(tmp_path, bare_envs, version, 3)
    assert set(ADDED_BY_09[version] + ADDED_BY_12) <= set(res["changed_files"])


@pytest.mark.parametrize("version", ["0.5.5"] + (["0.5.3", "0.5.4"]
                                                  if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" else []))
def test_revision4_install_upgrades_with_apply(tmp_path, bare_envs, version):
    """4 -> shipped (13-scheduler-heartbeat, 0.5.3-0.5.5; 14-lookup-wait-while-healthy, 0.5.3/0.5.4;
    15-vllm034-scheduler-output; 16-18): the adapter, the connector's scheduler-output reads and
    the shared-tier files change."""
    assert shipped_revision(version) == SHIPPED[version]
    res = upgrade_from(tmp_path, bare_envs, version, 4)
    assert sorted(res["changed_files"]) == sorted(
        set(ADDED_BY_13) | set(ADDED_BY_15_DEFAULT) | shared_tier_files(version))


@pytest.mark.parametrize("version", ["0.5.4"] + (["0.5.3"] if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" else []))
def test_revision5_install_upgrades_with_apply(tmp_path, bare_envs, version):
    """5 -> shipped (14-lookup-wait-while-healthy, 0.5.3/0.5.4; 15-vllm034-scheduler-output; 16-18)."""
    assert shipped_revision(version) == SHIPPED[version]
    res = upgrade_from(tmp_path, bare_envs, version, 5)
    assert sorted(res["changed_files"]) == sorted(
        set(ADDED_BY_14) | set(ADDED_BY_15.get(version, ADDED_BY_15_DEFAULT)) | shared_tier_files(version))


@pytest.mark.parametrize("version", ["0.5.6"] + (["0.5.3", "0.5.4", "0.5.5"]
                                                  if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" else []))
def test_previous_revision_upgrades_to_serve_vllm_034(tmp_path, bare_envs, version):
    """The revision shipped before part 15 -> shipped: part 15's files (the connector, and on
    0.5.4+ the metadata module) and the shared-tier parts' change; revert stays byte-exact
    (upgrade_from)."""
    assert shipped_revision(version) == SHIPPED[version]
    res = upgrade_from(tmp_path, bare_envs, version, BEFORE_15[version])
    assert sorted(res["changed_files"]) == sorted(
        set(ADDED_BY_15.get(version, ADDED_BY_15_DEFAULT)) | shared_tier_files(version))


@pytest.mark.parametrize("version", ["0.5.6", "0.5.5"] + (["0.5.3", "0.5.4"]
                                                         if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" else []))
def test_previous_revision_upgrades_to_the_shared_tier_parts(tmp_path, bare_envs, version):
    """The revision shipped before parts 16-18 -> shipped: only the L2 adapters' files (and on
    0.5.3-0.5.5 the L1 manager and the prefetch controller) change."""
    assert shipped_revision(version) == SHIPPED[version]
    res = upgrade_from(tmp_path, bare_envs, version, BEFORE_SHARED_TIER[version])
    assert sorted(res["changed_files"]) == sorted(shared_tier_files(version))


def test_053_revision8_upgrades_to_multi_block_steps(tmp_path, bare_envs):
    """0.5.3's revision 8 -> 9 (19-state-chunk-ends appended): only the connector's
    two modules and the lmcache-driven transfer module change; revert stays byte-exact."""
    assert shipped_revision("0.5.3") == SHIPPED["0.5.3"] == 9
    res = upgrade_from(tmp_path, bare_envs, "0.5.3", 8)
    assert sorted(res["changed_files"]) == sorted(ADDED_BY_19)


@pytest.mark.parametrize("version", ["0.5.6"])
def test_previous_revision_upgrades_to_fs_load_jobs(tmp_path, bare_envs, version):
    """The revision shipped before 20-fs-load-jobs -> shipped: only the fs L2 adapter changes
    (the objects on disk do not: the same trailer, the same checks); revert stays byte-exact."""
    assert shipped_revision(version) == SHIPPED[version]
    res = upgrade_from(tmp_path, bare_envs, version, SHIPPED[version] - 1)
    assert sorted(res["changed_files"]) == ADDED_BY_20
