"""``patchtool wheel lmcache==0.5.3 --set engine-driven``: the
shipped stack (hybrid-fa, then engine-driven) built into one wheel whose local
version names both sets and revisions; pip and uv install it, and status and
verify report both sets patched.  Shipped patch sets (no override)."""

from __future__ import annotations

import json
import subprocess

import pytest

from .helpers import REPO, cli, make_venv
from .test_wheel import uv_bin  # noqa: F401  (the session fixture)

TOP = REPO / "patches" / "engine-driven" / "0.5.3"


def _revisions() -> tuple[int, int]:
    base = json.loads((REPO / "patches" / "hybrid-fa" / "0.5.3" / "manifest.json").read_text())
    top = json.loads((TOP / "manifest.json").read_text())
    return base["revision"], top["revision"]


@pytest.fixture(scope="module")
def stacked(tmp_path_factory, wheel053) -> dict:
    if not (TOP / "manifest.json").exists():
        pytest.skip("patches/engine-driven/0.5.3 is not committed yet")
    out = tmp_path_factory.mktemp("stacked-wheel")
    r = cli("wheel", "lmcache==0.5.3", "--from", str(wheel053), "--set", "engine-driven",
            "-o", str(out), "--json")
    assert r.rc == 0, r.err
    return r.json["result"]


def _both_patched(py, version: str) -> dict:
    r = cli("verify", "--python", str(py), "--json")
    assert r.rc == 0, (r.out, r.err)
    st = r.json["result"]["status"]
    assert st["state"] == "patched" and st["lmcache_version"] == version
    assert [(s["name"], s["state"]) for s in st["sets"]] == [("hybrid-fa", "patched"),
                                                              ("engine-driven", "patched")]
    return st


def test_stacked_wheel_names_both_sets(stacked, wheel053):
    base, top = _revisions()
    assert stacked["version"] == f"0.5.3+hybridfa.r{base}.enginedriven.r{top}"
    assert [(s["name"], s["revision"]) for s in stacked["sets"]] == [("hybrid-fa", base),
                                                                     ("engine-driven", top)]


def test_pip_and_uv_install_the_stacked_wheel(tmp_path, stacked, uv_bin):  # noqa: F811
    py = make_venv(tmp_path / "pip")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", stacked["path"]], check=True)
    _both_patched(py, stacked["version"])

    py = make_venv(tmp_path / "uv", with_pip=False)
    proc = subprocess.run([str(uv_bin), "pip", "install", "--no-deps", "--offline", "--python",
                           str(py), stacked["path"]], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert _both_patched(py, stacked["version"])["installer"] == "uv"


# ------------------------------------------------------------------ stacked pins


def _pin(base: int, top: int) -> str:
    return f"lmcache==0.5.3+hybridfa.r{base}.enginedriven.r{top}"


def test_wheel_reads_the_stack_from_a_pin(tmp_path, wheel053):
    if not (TOP / "manifest.json").exists():
        pytest.skip("patches/engine-driven/0.5.3 is not committed yet")
    base, top = _revisions()
    r = cli("wheel", _pin(base, top), "--from", str(wheel053), "-o", str(tmp_path / "a"), "--json")
    assert r.rc == 0, r.err
    assert r.json["result"]["version"] == f"0.5.3+hybridfa.r{base}.enginedriven.r{top}"
    assert [s["name"] for s in r.json["result"]["sets"]] == ["hybrid-fa", "engine-driven"]

    # another revision than the shipped one: refused, nothing built
    out = tmp_path / "b"
    r = cli("wheel", _pin(base - 1, top), "--from", str(wheel053), "-o", str(out))
    assert r.rc == 3 and r.err.count("\n") == 1, r.err
    assert f"this patchtool builds 0.5.3+hybridfa.r{base}.enginedriven.r{top}" in r.err
    assert not out.exists()
    # a --set that contradicts the pin, and a tag no shipped set has
    r = cli("wheel", _pin(base, top), "--set", "hybrid-fa", "--from", str(wheel053), "-o", str(out))
    assert r.rc == 2 and "pins a build of patch set engine-driven, but --set names hybrid-fa" in r.err
    r = cli("wheel", "lmcache==0.5.3+nosuchset.r1", "--from", str(wheel053), "-o", str(out))
    assert r.rc == 3 and "names the patch set tag 'nosuchset'" in r.err
    assert not out.exists()


def test_ci_reads_the_stack_from_a_pin(tmp_path, runtime_python_053):
    """The patch-set phase takes the set from the pin; the download is made to
    fail (no index) so nothing heavier runs."""
    if not (TOP / "manifest.json").exists():
        pytest.skip("patches/engine-driven/0.5.3 is not committed yet")
    base, top = _revisions()
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)}
    r = cli("ci", "--pin", _pin(base, top), "--python", str(runtime_python_053), "--json", env=env)
    phases = {p["phase"]: p for p in r.json["result"]["phases"]}
    assert phases["patch-set"]["result"] == "pass", phases["patch-set"]
    assert phases["patch-set"]["detail"].startswith(
        f"hybrid-fa revision {base} + engine-driven revision {top}")
    assert phases["fetch"]["result"] != "pass" and r.rc != 0
    r = cli("ci", "--pin", _pin(base, top), "--set", "hybrid-fa", "--python", str(runtime_python_053),
            "--json", env=env)
    assert r.rc == 2 and "pins a build of patch set engine-driven" in r.out + r.err
