"""The gate's native-extension preflight: before any server
starts, ``gate/engine_gate.py`` loads LMCache's compiled extensions (``c_ops`` on
0.5.3, ``lmcache_native``/``cuda_ops`` on 0.5.4+) in the target interpreter
under its torch, records each in ``environment.native_extensions``, and aborts
in one line when the one LMCache's transfer imports does not load.

Stand-ins: a fake ``torch`` (a CUDA build, or a CPU one) and a fake ``lmcache``
whose "extension" is either a Python module or a file that is not a shared
object, put on PYTHONPATH by a wrapper interpreter."""

from __future__ import annotations

import importlib.machinery
import os
import stat
from pathlib import Path

from gate import engine_system as gsys

from .conftest import PY

GARBAGE = b"\x7fNOT-AN-ELF\n"  # a file by the extension's name that no loader accepts


def fake_env(root: Path, *, version: str = "0.5.4", native: str = "ok", cuda: str | None = "13.0",
             with_lmcache: bool = True) -> str:
    """A wrapper interpreter whose PYTHONPATH holds a fake torch 2.14.0 and a
    fake lmcache; ``native`` is ``ok`` (a module that loads), ``garbage`` (not
    loadable) or ``crash`` (kills the interpreter).  Returns its path."""
    site = root / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        f"__version__ = '2.14.0'\nclass version:\n    cuda = {cuda!r}\n")
    if with_lmcache:
        pkg = site / "lmcache"
        mods = pkg / "v1" / "multiprocess" / "modules"
        mods.mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('the preflight must not run lmcache/__init__')\n")
        required = "c_ops" if version == "0.5.3" else "lmcache_native"
        (mods / "lmcache_driven_transfer.py").write_text(f"import lmcache.{required} as ops\n")
        ext = importlib.machinery.EXTENSION_SUFFIXES[0]
        if native == "garbage":
            (pkg / f"{required}{ext}").write_bytes(GARBAGE)
        elif native == "crash":
            (pkg / f"{required}.py").write_text("import os\nos._exit(139)\n")
        else:
            (pkg / f"{required}.py").write_text("import torch\nexecute_object_group_transfer = None\n")
        if version != "0.5.3":
            (pkg / "cuda_ops.py").write_text("import torch\n")
    wrapper = root / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {PY} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def test_gate_aborts_before_any_server_when_the_extension_does_not_load(gate, tmp_path):
    py = fake_env(tmp_path / "env", native="garbage")
    res, result = gate.run("--target-python", py)
    assert res.returncode == 22, res.stderr[-2000:]
    assert result["verdict"]["status"] == "error"
    [reason] = result["verdict"]["reasons"]
    assert reason.startswith("aborted in PREFLIGHT: lmcache.lmcache_native does not load under the "
                             "deployment's torch") and "torch 2.14.0" in reason and "\n" not in reason
    native = result["environment"]["native_extensions"]
    assert native["torch"] == "2.14.0" and native["required"] == ["lmcache_native"]
    assert native["modules"]["lmcache_native"]["loaded"] is False
    assert native["modules"]["lmcache_native"]["error"].startswith("ImportError")
    assert native["modules"]["cuda_ops"] == {"file": native["modules"]["cuda_ops"]["file"],
                                             "loaded": True, "error": None}
    entered = [t["state"] for t in result["trace"] if t["what"] == "enter"]
    assert entered == ["PREFLIGHT", "ABORT", "VERDICT"]  # no server was started
    assert result["processes"] == []
    # loud, one line each: the abort as it happens, and the verdict's reason
    lines = [ln for ln in res.stderr.splitlines() if "lmcache.lmcache_native does not load" in ln]
    assert len(lines) == 2 and lines[0].startswith("[engine-gate] PREFLIGHT: ABORT: GateAbort: ")


def test_loadable_extensions_pass_the_preflight(tmp_path):
    for version, required in (("0.5.3", "c_ops"), ("0.5.4", "lmcache_native")):
        probe = gsys.probe_native_extensions(fake_env(tmp_path / version, version=version))
        assert probe["required"] == [required]
        assert probe["modules"][required]["loaded"] is True
        assert ("cuda_ops" in probe["modules"]) is (version != "0.5.3")
        assert gsys.native_extension_verdict(probe) == (None, [])


def test_a_crash_while_loading_is_recorded_against_its_module(tmp_path):
    probe = gsys.probe_native_extensions(fake_env(tmp_path / "e", native="crash"))
    m = probe["modules"]["lmcache_native"]
    assert m["loaded"] is False and "died loading it (exit 139)" in m["error"]
    problem, _ = gsys.native_extension_verdict(probe)
    assert problem.startswith("lmcache.lmcache_native does not load")


def test_cpu_torch_and_missing_lmcache_are_warnings_not_aborts(tmp_path):
    probe = gsys.probe_native_extensions(fake_env(tmp_path / "cpu", native="garbage", cuda=None))
    problem, warnings = gsys.native_extension_verdict(probe)
    assert problem is None and warnings[0].startswith("native extension preflight not judged: CPU torch")
    probe = gsys.probe_native_extensions(fake_env(tmp_path / "none", with_lmcache=False))
    assert probe["lmcache_root"] is None and probe["modules"] == {}
    problem, warnings = gsys.native_extension_verdict(probe)
    assert problem is None and "finds no lmcache" in warnings[0]


def test_optional_cuda_ops_failing_is_a_warning(tmp_path):
    py = fake_env(tmp_path / "e")
    site = Path(py).parent / "site" / "lmcache"
    os.remove(site / "cuda_ops.py")
    (site / f"cuda_ops{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(GARBAGE)
    problem, warnings = gsys.native_extension_verdict(gsys.probe_native_extensions(py))
    assert problem is None and warnings[0].startswith("lmcache.cuda_ops does not load")
    assert "torch fallback" in warnings[0]


def test_no_torch_next_to_lmcache_is_a_problem(tmp_path):
    py = fake_env(tmp_path / "e")
    (Path(py).parent / "site" / "torch" / "__init__.py").write_text("raise ImportError('libc10.so')\n")
    problem, _ = gsys.native_extension_verdict(gsys.probe_native_extensions(py))
    assert problem.startswith("lmcache is installed but torch does not import") and "libc10.so" in problem


def test_a_probe_that_cannot_run_is_a_problem(tmp_path):
    problem, _ = gsys.native_extension_verdict(gsys.probe_native_extensions(str(tmp_path / "nope")))
    assert problem.startswith("native extension preflight failed: ")
