"""``patchtool status`` next to vLLM 0.34 (patchtool/vllm_compat.py): on a real venv with the real
lmcache wheel installed (lab/provision.py's bare env, copied), and a vLLM 0.34.0 distribution
beside it.  status reads vLLM's version from its dist-info METADATA and never imports it, so the
distribution here is that metadata alone, with a ``vllm`` package that raises on import (the
400 MB wheel would add nothing the tool reads).

Pristine: the note names the crash at the first scheduler step and the command that fixes it;
patched with the shipped set, whose manifest lists 0.34.0 from the evidence
(lab/support_table.py --check), no crash note and 0.34.0 among the verified versions."""

from __future__ import annotations

import json

import pytest

from _fake_vllm import fake_vllm

from .helpers import REPO, cli, copy_venv, site_of

VERSIONS = ("0.5.6", "0.5.3")
CRASH = "dies at the first scheduler step under vLLM 0.34.0"


@pytest.mark.parametrize("version", VERSIONS)
def test_status_names_the_crash_and_the_fix(tmp_path, bare_envs, version):
    manifest = json.loads((REPO / "patches" / "hybrid-fa" / version / "manifest.json").read_text())
    assert "0.34.0" in manifest["vllm_versions"], "the shipped set is not verified with vLLM 0.34.0"
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    fake_vllm(site_of(venv), "0.34.0")
    py = str(venv / "bin" / "python")

    st = cli("status", "--python", py, "--json").json["result"]
    assert st["state"] == "pristine" and st["vllm_version"] == "0.34.0"
    [note] = [n for n in st["notes"] if CRASH in n]
    assert note.startswith(f"pristine LMCache {version} {CRASH}, hybrid or not"), note
    assert note.endswith("patchtool apply"), note

    assert cli("apply", "--python", py).rc == 0
    st = cli("status", "--python", py, "--json").json["result"]
    assert st["state"] == "patched" and "0.34.0" in st["vllm_versions"]
    assert not [n for n in st["notes"] if CRASH in n or "not verified with vLLM" in n], st["notes"]
    assert cli("revert", "--python", py).rc == 0


def test_rc2_patched_set_serves_034_without_a_crash_note(tmp_path, bare_envs):
    """0.5.7rc2's set ships part 15 while its verified list lacks vLLM 0.34 (the 0.30+ cells wait
    for CPU evidence of the padded GDN view): the note keys on the part, so a patched install
    says nothing of a crash, only that 0.34.0 is not verified; pristine names the crash."""
    version = "0.5.7rc2"
    parts = [p["id"] for p in json.loads((REPO / "patches" / "hybrid-fa" / version / "manifest.json")
                                         .read_text())["patches"]]
    assert "15-vllm034-scheduler-output" in parts
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    fake_vllm(site_of(venv), "0.34.0")
    py = str(venv / "bin" / "python")
    st = cli("status", "--python", py, "--json").json["result"]
    [note] = [n for n in st["notes"] if CRASH in n]
    assert note.startswith(f"pristine LMCache {version} {CRASH}"), note
    assert cli("apply", "--python", py).rc == 0
    st = cli("status", "--python", py, "--json").json["result"]
    assert st["state"] == "patched" and not [n for n in st["notes"] if CRASH in n], st["notes"]
    assert cli("revert", "--python", py).rc == 0
