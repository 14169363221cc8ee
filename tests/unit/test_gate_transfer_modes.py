"""``gate_transfer_modes``: a set that fixes LMCache's
engine-driven path declares that the CPU restore gate must pass in that mode
too, and ``verify --restore cpu`` then runs the gate once per declared mode.
The gate here is a stand-in script (``LMCACHE_PATCHTOOL_GATE``) that records
its argv and fails on demand, so the test sees exactly what ran."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _cli import cli, one_line, stand_in_python

from . import synthwheel as sw
from .test_stacked_sets import TOP, make_stack, manifest, sp

BOTH = ("--gate-transfer-mode", "lmcache_driven", "--gate-transfer-mode", "engine_driven")

STAND_IN_GATE = '''
import json, os, sys
argv = sys.argv[1:]
out = argv[argv.index("--json-out") + 1]
mode = argv[argv.index("--transfer-mode") + 1] if "--transfer-mode" in argv else "lmcache_driven"
with open(os.environ["GATE_LOG"], "a") as log:
    log.write(json.dumps(argv[:argv.index("--json-out")]) + "\\n")
failing = mode in os.environ.get("GATE_FAIL", "").split(",")
json.dump({"verdict": "fail" if failing else "pass",
           "reason": f"stand-in {mode} " + ("wrong bytes" if failing else "byte-exact")}, open(out, "w"))
sys.exit(1 if failing else 0)
'''


@pytest.fixture(scope="module")
def modes_root(tmp_path_factory, patch_root, wheel) -> Path:
    root = tmp_path_factory.mktemp("patches-modes")
    shutil.copytree(patch_root, root, dirs_exist_ok=True)
    return make_stack(root, wheel, *BOTH)


@pytest.fixture
def gate(tmp_path) -> dict:
    """A verify root with the stand-in gate, and an interpreter the runner accepts."""
    vroot = tmp_path / "verify"
    vroot.mkdir()
    (vroot / "restore_gate.py").write_text(STAND_IN_GATE)
    py = stand_in_python(tmp_path)
    return {"root": vroot, "python": str(py), "log": tmp_path / "gate.log"}


def verify_cpu(site: Path, root: Path, gate: dict, fail: str = "") -> tuple:
    r = cli("verify", *sp(site), "--restore", "cpu", "--python", gate["python"], "--json",
            "--preset", "p1", patches=root,
            env={"LMCACHE_PATCHTOOL_GATE": str(gate["root"]), "GATE_LOG": str(gate["log"]),
                 "GATE_FAIL": fail})
    runs = [json.loads(ln) for ln in gate["log"].read_text().splitlines()] \
        if gate["log"].exists() else []
    gate["log"].unlink(missing_ok=True)
    return r, runs


def restore_check(r) -> dict:
    return next(c for c in r.json["result"]["checks"] if c["name"] == "restore-cpu")


def test_manifest_keeps_and_validates_the_modes(tmp_path, site, modes_root, wheel):
    assert manifest(modes_root, TOP)["gate_transfer_modes"] == ["lmcache_driven", "engine_driven"]
    assert "gate_transfer_modes" not in manifest(modes_root, sw.SET)  # omitted when not given
    d = modes_root / TOP / sw.VERSION
    before = (d / "manifest.json").read_bytes()
    sw.manifest_build(d, wheel)  # a rebuild without options keeps them
    assert (d / "manifest.json").read_bytes() == before
    bad = tmp_path / "bad"
    shutil.copytree(modes_root, bad)
    m = bad / TOP / sw.VERSION / "manifest.json"
    doc = json.loads(m.read_text())
    doc["gate_transfer_modes"] = ["engine_driven", "engine_driven"]
    m.write_text(json.dumps(doc))
    one_line(cli("status", "--set", TOP, *sp(site), patches=bad), 3, m,
             "malformed gate_transfer_modes")


def test_verify_runs_the_gate_in_every_declared_mode(site, modes_root, gate):
    assert cli("apply", *sp(site), "--set", TOP, patches=modes_root).rc == 0
    r, runs = verify_cpu(site, modes_root, gate)
    assert r.rc == 0, (r.out, r.err)
    assert runs == [["--preset", "p1", "--quiet"],
                    ["--preset", "p1", "--transfer-mode", "engine_driven", "--quiet"]]
    c = restore_check(r)
    assert c["ok"] and sorted(c["data"]["modes"]) == ["engine_driven", "lmcache_driven"]
    assert c["detail"].startswith("lmcache_driven: restore gate PASS")

    # one mode failing fails the check, and both still ran
    r, runs = verify_cpu(site, modes_root, gate, fail="engine_driven")
    assert r.rc != 0 and len(runs) == 2
    c = restore_check(r)
    assert not c["ok"] and "engine_driven: restore gate FAIL: stand-in engine_driven wrong bytes" \
        in c["detail"]


def test_a_set_without_modes_runs_the_gate_once_as_before(site, patch_root, gate):
    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    r, runs = verify_cpu(site, patch_root, gate)
    assert r.rc == 0, (r.out, r.err)
    assert runs == [["--preset", "p1", "--quiet"]]
    c = restore_check(r)
    assert c["ok"] and "modes" not in c["data"] and c["detail"].startswith("restore gate PASS")
