"""lab/provision.py on a fresh machine, offline: a runtime venv built from
a throwaway cache with fake ``torch``/``openai`` wheels, where torch is only
reachable through ``$LMCACHE_PATCHTOOL_TORCH_INDEX`` and everything else only
through ``$LMCACHE_PATCHTOOL_PIP_ARGS`` (pip's own configuration is cut off),
so the build succeeds only if each variable reaches the right pip call; and
progress lines for every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab import provision

from . import synthwheel as sw


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache root, pip cut off from this machine's configuration
    (its find-links, extra indexes and constraints), progress collected."""
    import os

    for var in [v for v in os.environ if v.startswith(("PIP_", "LMCACHE_PATCHTOOL_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("LMCACHE_PATCHTOOL_CACHE", str(tmp_path / "cache"))
    # venvs from this interpreter, whatever its version (the synthetic wheels are py3)
    monkeypatch.setattr(provision, "_python", lambda: sys.executable)
    lines: list[str] = []
    provision.set_progress_sink(lines.append)
    yield tmp_path / "cache", lines
    provision.set_progress_sink(None)


def test_pip_args_and_torch_index(monkeypatch):
    monkeypatch.setenv(provision.PIP_ARGS_ENV, "--find-links '/a dir' -q")
    monkeypatch.setenv(provision.TORCH_INDEX_ENV, "https://download.pytorch.org/whl/cpu")
    assert provision.pip_args() == ["--find-links", "/a dir", "-q"]
    assert provision.torch_index_args() == ["--index-url", "https://download.pytorch.org/whl/cpu"]
    monkeypatch.delenv(provision.PIP_ARGS_ENV)
    monkeypatch.setenv(provision.TORCH_INDEX_ENV, " ")
    assert provision.pip_args() == [] and provision.torch_index_args() == []


def test_long_step_repeats_its_progress_line(cache, monkeypatch):
    root, lines = cache
    monkeypatch.setattr(provision, "HEARTBEAT_S", 0.1)
    steps = provision.Steps("runtime 9.9.9", 2)
    steps.step("installing torch 2.13.0")
    provision._run([sys.executable, "-c", "import time; time.sleep(0.45)"], steps)
    assert lines[0] == "provision: runtime 9.9.9: installing torch 2.13.0 (step 1/2, 0 s)"
    assert any(line.startswith("provision: runtime 9.9.9: still installing torch 2.13.0 "
                               "(step 1/2, ") for line in lines[1:])
    assert (root / provision.LOG_NAME).read_text().count("provision: runtime 9.9.9") == len(lines)
    with pytest.raises(Exception) as exc:
        provision._run([sys.executable, "-c", "raise SystemExit(3)"], steps)
    assert getattr(exc.value, "returncode", None) == 3


def _simple_index(root, wheel):
    """A PEP 503 index (file://) serving one wheel."""
    project = wheel.name.split("-")[0]
    d = root / "simple" / project
    d.mkdir(parents=True)
    (d / "index.html").write_text(f'<a href="{wheel.as_uri()}">{wheel.name}</a>\n')
    return (root / "simple").as_uri()


def test_runtime_env_uses_torch_index_and_pip_args(tmp_path, cache, monkeypatch):
    root, lines = cache
    torch = sw.make_wheel(tmp_path / "torch-only", "2.13.0+cpu", {"torch/__init__.py": b""},
                          name="torch")
    links = tmp_path / "links"
    sw.make_wheel(links, "1.0.0", {"openai/__init__.py": b""}, name="openai")
    empty = tmp_path / "empty-index" / "simple"
    empty.mkdir(parents=True)
    # the lmcache wheel is found in the cache, as provision.wheel() left it
    sw.make_wheel(root / "wheels" / "lmcache-9.9.9")
    monkeypatch.setenv(provision.PIP_ARGS_ENV,
                       f"--index-url {empty.as_uri()} --find-links {links}")
    monkeypatch.setenv(provision.TORCH_INDEX_ENV, _simple_index(tmp_path / "torch-index", torch))

    monkeypatch.setattr(provision, "VERSIONS", ("9.9.9",))  # the base takes 9.9.9's dependencies
    venv = provision.runtime_env("9.9.9")

    stamp = json.loads((venv / provision.STAMP).read_text())
    assert stamp["torch_build"] == {"version": "2.13.0+cpu", "nvidia_dists": 0, "cuda": False}
    assert stamp["torch_index"].startswith("file://")
    base = Path(stamp["base"])
    assert base == root / "envs" / "runtime-base-torch2.13.0"
    # lmcache in the venv itself; torch and openai once, in the shared base, which holds no lmcache
    dists = lambda v: {p.name.split("-")[0] for p in sw.venv_site(v).glob("*.dist-info")}  # noqa: E731
    assert "lmcache" in dists(venv) and not {"torch", "openai"} & dists(venv)
    assert {"torch", "openai"} <= dists(base) and "lmcache" not in dists(base)
    seen = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import torch, openai, lmcache; print(lmcache.__file__)"],
                          capture_output=True, text=True, check=True).stdout
    assert seen.startswith(str(venv))
    steps = [line for line in lines if "(step " in line]
    assert [line.split(": ", 2)[2].split(" (step")[0] for line in steps] == [
        "creating the venv", f"installing torch 2.13.0 from {stamp['torch_index']}",
        "installing lmcache 9.9.9's dependencies and openai",
        "removing lmcache 9.9.9 (each runtime venv installs its own)",
        "creating the venv over the shared base runtime-base-torch2.13.0",
        "installing lmcache 9.9.9 and any dependency the base lacks"]
    assert [line.split("(step ")[1].split(",")[0] for line in steps] == [
        "1/4", "2/4", "3/4", "4/4", "1/2", "2/2"]
    assert lines[-1].startswith("provision: runtime 9.9.9: ready in ")
    inv = provision.inventory(("9.9.9",))
    assert inv["wheel"] == {"9.9.9": True} and inv["runtime"] == {"9.9.9": True}
    assert inv["bare"] == {"9.9.9": False}
    # cached: no second build, no progress
    lines.clear()
    assert provision.runtime_env("9.9.9") == venv and lines == []
    # a second version reuses the base: no torch install, its own lmcache
    sw.make_wheel(root / "wheels" / "lmcache-9.9.8", "9.9.8")
    other = provision.runtime_env("9.9.8")
    assert [line.split(": ", 2)[2].split(" (step")[0] for line in lines if "(step " in line] == [
        "creating the venv over the shared base runtime-base-torch2.13.0",
        "installing lmcache 9.9.8 and any dependency the base lacks"]
    assert {p.name for p in sw.venv_site(other).glob("lmcache-*.dist-info")} == {"lmcache-9.9.8.dist-info"}
    # a base that went away is noticed: the venv is rebuilt, not used half-broken
    (base / provision.STAMP).unlink()
    lines.clear()
    assert provision.runtime_env("9.9.9") == venv
    assert any("installing torch" in line for line in lines)
