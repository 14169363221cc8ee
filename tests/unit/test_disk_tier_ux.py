"""What the operator is told about the disk tier and the next step:
`status` names the key scheme in force, `apply` prints the disk-tier
note, and `status`/`verify` give the exact `patchtool apply` command when the
install is pristine (after `pip install -U lmcache`) or on an older revision."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _cli import cli

from . import synthwheel as sw


def sp(site: Path) -> tuple[str, str]:
    return ("--site-packages", str(site))


@pytest.fixture(scope="module")
def patch_root_kvl(tmp_path_factory, patch_root, wheel) -> Path:
    """The unit set with ``l2_format: 1`` in its manifest (a namespaced series)."""
    root = tmp_path_factory.mktemp("patches-kvl")
    shutil.copytree(patch_root, root, dirs_exist_ok=True)
    sw.manifest_build(root / sw.SET / sw.VERSION, wheel, "--l2-format", "1")
    return root


def test_manifest_l2_format_round_trips(patch_root_kvl, patch_root):
    m = json.loads((patch_root_kvl / sw.SET / sw.VERSION / "manifest.json").read_text())
    assert m["l2_format"] == 1
    plain = json.loads((patch_root / sw.SET / sw.VERSION / "manifest.json").read_text())
    assert "l2_format" not in plain


def test_pristine_status_and_verify_name_the_next_command(site, patch_root_kvl):
    st = cli("status", *sp(site), "--json", patches=patch_root_kvl).json["result"]
    assert st["state"] == "pristine"
    assert st["disk_tier_keys"] == "pristine"
    assert st["next_command"] == f"patchtool apply --site-packages {site}"
    r = cli("verify", *sp(site), patches=patch_root_kvl)
    assert r.rc != 0
    # rich wraps long lines at the terminal width: compare without whitespace
    assert f"next:patchtoolapply--site-packages{site}" in "".join(r.out.split())


def test_patched_namespaced_install(site, patch_root_kvl):
    r = cli("apply", *sp(site), "--json", patches=patch_root_kvl)
    assert r.rc == 0, r.err
    [note] = r.json["result"]["notes"]
    assert note.startswith("disk-tier keys kvl1:") and "<model>+kvl1-<digest>" in note
    human = cli("apply", *sp(site), patches=patch_root_kvl)  # a no-op prints it too
    assert human.rc == 0 and "disk-tierkeyskvl1:" in "".join(human.out.split())
    st = cli("status", *sp(site), "--json", patches=patch_root_kvl).json["result"]
    assert (st["state"], st["disk_tier_keys"], st["next_command"]) == ("patched", "kvl1", None)
    assert any(n.startswith("disk-tier keys kvl1:") for n in st["notes"])
    assert "diskkeys:kvl1" in "".join(cli("status", *sp(site), patches=patch_root_kvl).out.split())


def test_series_without_namespaces_keeps_the_discard_warning(site, patch_root):
    r = cli("apply", *sp(site), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    assert any(n.startswith("disk-tier data written before this patch") for n in
               r.json["result"]["notes"])
    st = cli("status", *sp(site), "--json", patches=patch_root).json["result"]
    assert st["disk_tier_keys"] == "pristine"


def test_older_revision_names_the_upgrade_command(site, patch_root, patch_root_r2):
    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    st = cli("status", *sp(site), "--json", patches=patch_root_r2).json["result"]
    assert st["state"] == "patched-older-revision"
    assert st["next_command"] == f"patchtool apply --site-packages {site}"


def test_python_target_command_uses_the_interpreter(venv, patch_root_kvl):
    py = str(venv / "bin" / "python")
    st = cli("status", "--python", py, "--json", patches=patch_root_kvl).json["result"]
    assert st["next_command"] == f"patchtool apply --python {py}"
