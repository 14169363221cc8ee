"""What the vLLM installed next to lmcache means for it:
``status`` reads vLLM's version from its ``vllm-*.dist-info/METADATA`` in the
site dirs it searched for lmcache (never imports vLLM), reports it
(``vllm_version``), and notes a vLLM >= 0.33 (torch 2.14 pin: LMCache's native
extensions unchecked) and a vLLM the patch set's manifest does not list."""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli import cli
from _fake_vllm import fake_vllm

from . import synthwheel as sw
from .test_no_heavy_imports import attempted, guard, guarded_venv  # noqa: F401 (fixtures)

TORCH_NEEDLE = "not checked under torch 2.14"


def status(site: Path, patch_root: Path, *extra: str) -> dict:
    r = cli("status", "--site-packages", str(site), "--json", *extra, patches=patch_root)
    assert r.rc == 0, r.err
    return r.json["result"]


def torch_notes(res: dict) -> list[str]:
    return [n for n in res["notes"] if TORCH_NEEDLE in n]


def unverified_notes(res: dict) -> list[str]:
    return [n for n in res["notes"] if n.startswith("not verified with vLLM")]


def test_vllm_033_gets_the_torch_214_note(site, patch_root):
    fake_vllm(site, "0.33.0")
    res = status(site, patch_root)
    assert res["state"] == "pristine"
    assert res["vllm_version"] == "0.33.0"
    [note] = torch_notes(res)
    assert "vLLM 0.33.0" in note and "torch 2.14" in note
    for needle in ("lmcache_native", "cuda_ops", "c_ops", "patchtool verify --restore gpu",
                   "lab/gpu_roundtrip_device.sh"):
        assert needle in note, needle
    # 0.33.0 is not in the synthetic manifest's vllm_versions (0.27.1) either
    assert unverified_notes(res) == ["not verified with vLLM 0.33.0; verified: 0.27.1"]


def test_vllm_0271_gets_no_vllm_note(site, patch_root):
    fake_vllm(site, "0.27.1")
    res = status(site, patch_root)
    assert res["vllm_version"] == "0.27.1" and not [n for n in res["notes"] if "resumed_req_ids" in n]
    assert res["vllm_versions"] == ["0.27.1"]
    assert torch_notes(res) == [] and unverified_notes(res) == []


def test_vllm_0280_is_not_verified_but_has_no_torch_note(site, patch_root):
    fake_vllm(site, "0.28.0")
    res = status(site, patch_root)
    assert res["vllm_version"] == "0.28.0"
    assert unverified_notes(res) == ["not verified with vLLM 0.28.0; verified: 0.27.1"]
    assert torch_notes(res) == []


def test_no_vllm_no_note_field_still_there(site, patch_root):
    res = status(site, patch_root)
    assert "vllm_version" in res and res["vllm_version"] is None
    assert torch_notes(res) == [] and unverified_notes(res) == []


def test_unreadable_vllm_metadata_is_not_a_refusal(site, patch_root):
    fake_vllm(site, "0.33.0", metadata="Name: vllm\n")  # no Version header
    res = status(site, patch_root)
    assert res["vllm_version"] is None and torch_notes(res) == []


def test_human_status_and_verify_show_it(site, patch_root):
    fake_vllm(site, "0.33.0")
    r = cli("status", "--site-packages", str(site), patches=patch_root)
    assert r.rc == 0, r.err
    assert "vllm        : 0.33.0" in r.out
    assert TORCH_NEEDLE in " ".join(r.out.split())
    # verify shows the same status (exit 5: pristine), human and JSON
    r = cli("verify", "--site-packages", str(site), patches=patch_root)
    assert r.rc == 5 and "vllm        : 0.33.0" in r.out
    r = cli("verify", "--site-packages", str(site), "--json", patches=patch_root)
    st = r.json["result"]["status"]
    assert st["vllm_version"] == "0.33.0" and torch_notes(st)


def test_patched_install_keeps_the_vllm_notes(site, patch_root):
    fake_vllm(site, "0.33.0")
    assert cli("apply", "--site-packages", str(site), patches=patch_root).rc == 0
    res = status(site, patch_root)
    assert res["state"] == "patched" and torch_notes(res) and unverified_notes(res)
    assert cli("verify", "--site-packages", str(site), patches=patch_root).rc == 0


def test_status_with_vllm_imports_nothing_heavy(site, patch_root, guard):  # noqa: F811
    fake_vllm(site, "0.33.0")
    _, env = guard
    for args in (("status", "--json"), ("status",), ("verify",)):
        r = cli(*args, "--site-packages", str(site), patches=patch_root, env=env)
        assert r.rc in (0, 5), (args, r.err)
    assert attempted(env) == []


def test_status_python_reads_vllm_in_the_target_venv(guarded_venv, patch_root, guard):  # noqa: F811
    _, env = guard
    fake_vllm(sw.venv_site(guarded_venv.parent.parent), "0.33.0")
    r = cli("status", "--python", str(guarded_venv), "--json", patches=patch_root, env=env)
    assert r.rc == 0, r.err
    assert r.json["result"]["vllm_version"] == "0.33.0" and torch_notes(r.json["result"])
    assert attempted(env) == []


@pytest.mark.parametrize("version, verified, torch, unverified", [
    ("0.33.0", ["0.27.1"], True, True),
    ("0.33.0rc1+cu129", ["0.33.0rc1"], True, False),  # the local part is ignored
    ("0.34.2", ["0.34.2"], True, False),
    ("1.0.0", [], True, True),
    ("0.32.9", ["0.27.1", "0.32.9"], False, False),
    ("0.27.1+cu128", ["0.27.1"], False, False),
    ("0.28.0", None, False, False),  # no patch set: nothing to be verified against
    ("0.33.0", None, True, False),
    ("garbage", ["0.27.1"], False, True),
])
def test_vllm_notes_pure(version, verified, torch, unverified):
    from patchtool.vllm_compat import vllm_notes

    notes = vllm_notes(version, verified)
    assert any(TORCH_NEEDLE in n for n in notes) is torch
    assert any(n.startswith(f"not verified with vLLM {version}; verified: ") for n in notes) \
        is unverified
    assert vllm_notes(None, ["0.27.1"]) == []


def test_verify_restore_gpu_reports_the_native_preflight_abort(tmp_path, site, patch_root):
    """``patchtool verify --restore gpu`` runs gate/engine_gate.py, whose preflight
    loads LMCache's native extensions under the deployment's torch (here a fake
    CUDA torch 2.14.0; the synthetic lmcache has no extension at all): the check
    fails as an error, with the gate's one-line reason in its detail."""
    import json
    import stat
    import sys

    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        "__version__ = '2.14.0'\nclass version:\n    cuda = '13.0'\n")
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{fake}" '
                  f'exec {sys.executable} "$@"\n')
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Fake"]}))
    assert cli("apply", "--site-packages", str(site), patches=patch_root).rc == 0
    r = cli("verify", "--site-packages", str(site), "--python", str(py), "--restore", "gpu",
            "--json", "--", "--model", str(model), "--tokenizer", "byte", "--lengths", "1024",
            "--block-size", "128", "--page-tokens", "32", "--nvidia-smi", "none",
            "--work-dir", str(tmp_path / "work"), patches=patch_root)
    check = r.json["result"]["checks"][-1]
    assert check["name"] == "restore-gpu" and check["error"], check
    assert check["data"]["exit_code"] == 22
    assert "aborted in PREFLIGHT: no native extension (c_ops / lmcache_native)" in check["detail"]
    native = check["data"]["report"]["environment"]["native_extensions"]
    assert native["torch"] == "2.14.0" and native["lmcache_root"] == str(site / "lmcache")
    assert r.rc == 14 and r.json["result"]["verdict"] == "restore check error: restore-gpu"


SCHED_NEEDLE = "dies at the first scheduler step under vLLM"


def sched_notes(res: dict) -> list[str]:
    return [n for n in res["notes"] if SCHED_NEEDLE in n]


def test_vllm_034_pristine_names_the_crash_at_the_first_step(site, patch_root):
    """The synthetic patch set is verified with vLLM 0.27.1 only: nothing serves 0.34 yet."""
    fake_vllm(site, "0.34.0")
    res = status(site, patch_root)
    [note] = sched_notes(res)
    assert note.startswith("pristine LMCache 9.9.9 dies at the first scheduler step under vLLM 0.34.0"), note
    assert "keep vLLM <= 0.33" in note and "pure-attention" not in note, note


def test_vllm_034_patched_names_the_pure_attention_crash(site, patch_root):
    fake_vllm(site, "0.34.0")
    assert cli("apply", "--site-packages", str(site), patches=patch_root).rc == 0
    [note] = sched_notes(status(site, patch_root))
    assert note.startswith("this patched LMCache 9.9.9 dies") and "pure-attention model" in note, note


@pytest.mark.parametrize("vllm, verified, state, expect", [
    ("0.33.0", ["0.27.1"], "pristine", None),
    ("0.34.0", None, None, "keep vLLM <= 0.33"),
    ("0.34.1+cu129", ["0.33.0"], "patched", "pure-attention"),
    ("0.34.0", ["0.33.0", "0.34.0"], "patched", None),  # verified with it: evidence says it serves
    ("0.35.0", ["0.34.0"], "patched", None),  # carries part 15; NOT_VERIFIED_NOTE names 0.35
    ("0.34.0", ["0.34.0"], "pristine", "apply the patch set verified with vLLM 0.34.0: patchtool apply"),
    ("0.34.0", ["0.34.0"], "patched-older-revision", "patchtool apply upgrades it"),
    ("0.34.0", ["0.34.0"], "drifted", "unless its files carry hybrid-fa part 15"),
])
def test_scheduler_output_note(vllm, verified, state, expect):
    from patchtool.vllm_compat import scheduler_output_note
    note = scheduler_output_note(vllm, verified, lmcache="0.5.6", state=state)
    assert (note is None) if expect is None else (expect in note), note


@pytest.mark.parametrize("verified, carries, state, expect", [
    # 0.5.7rc2: part 15 shipped, verified with vLLM 0.27.1/0.28.0 only (the 0.30+ cells wait for
    # CPU evidence of the padded GDN view): a patched install serves 0.34, says nothing
    (["0.27.1", "0.28.0"], True, "patched", None),
    (["0.27.1", "0.28.0"], True, "pristine", "patchtool apply: this patch set reads vLLM 0.34"),
    (["0.27.1", "0.28.0"], True, "patched-older-revision", "patchtool apply upgrades it"),
    # a set without the part, whatever its list says, leaves a patched pure-attention install dying
    (["0.27.1", "0.34.0"], False, "patched", "pure-attention"),
])
def test_scheduler_output_note_keys_on_the_part(verified, carries, state, expect):
    """The note asks whether the set ships the scheduler-output part, not whether its
    verified list happens to name a vLLM >= 0.34."""
    from patchtool.vllm_compat import scheduler_output_note
    note = scheduler_output_note("0.34.0", verified, lmcache="0.5.7rc2", state=state, carries_sched_fix=carries)
    assert (note is None) if expect is None else (expect in note), note


def test_carries_sched_output_fix_reads_the_shipped_parts():
    from types import SimpleNamespace as NS

    from patchtool.vllm_compat import carries_sched_output_fix

    def pset(*ids):
        return NS(manifest=NS(patches=[NS(id=i) for i in ids]))

    assert carries_sched_output_fix([pset("01-a", "15-vllm034-scheduler-output")])
    assert carries_sched_output_fix([pset("01-a"), pset("15-vllm034-scheduler-output")])
    assert not carries_sched_output_fix([pset("01-a", "02-b")])
