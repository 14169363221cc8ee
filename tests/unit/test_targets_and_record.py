"""Targets other than ``--site-packages`` (a venv's ``--python``), RECORD line
endings (pip's CRLF, uv's LF), the patched-wheel path, and the factory's own
guarantees (real RECORD hashes, deterministic wheels)."""

from __future__ import annotations

import zipfile

import pytest
from _cli import cli

from . import synthwheel as sw
from .synthwheel import F1, F2, F3, SKIP, tree_hashes


# ------------------------------------------------------------- factory


@pytest.mark.parametrize("ending", ["\r\n", "\n"])
def test_factory_wheel_record_is_real(tmp_path, ending):
    w = sw.make_wheel(tmp_path / "a", record_line_ending=ending)
    assert w.name == f"lmcache-{sw.VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(w) as zf:
        rec = zf.read(f"lmcache-{sw.VERSION}.dist-info/RECORD")
        rows = [line.split(",") for line in rec.decode().split(ending) if line]
        assert rec.count(b"\n") == len(rows) and rec.count(ending.encode()) == len(rows)
        assert sorted(r[0] for r in rows) == sorted(zf.namelist())
        for path, h, size in rows:
            if path.endswith("/RECORD"):
                assert (h, size) == ("", "")
            else:
                data = zf.read(path)
                assert (h, size) == (sw.record_hash(data), str(len(data)))
    # deterministic: same arguments, same bytes
    assert sw.make_wheel(tmp_path / "b", record_line_ending=ending).read_bytes() == w.read_bytes()


def test_factory_install_is_pip_shaped(fresh_site):
    dist = fresh_site / f"lmcache-{sw.VERSION}.dist-info"
    assert (dist / "INSTALLER").read_text().strip() == "pip"
    rec = sw.record_path(fresh_site).read_bytes()
    assert rec.count(b"\r\n") == rec.count(b"\n") > 6  # pip writes CRLF
    assert sorted(sw.wheel_files(sw.make_wheel(fresh_site.parent / "again"))) == sorted(
        str(p.relative_to(fresh_site)) for p in (fresh_site / "lmcache").rglob("*.py"))


# --------------------------------------------------------------- --python


def test_python_target_lifecycle(venv, venv_template, patch_root):
    py = str(venv / "bin" / "python")
    site = sw.venv_site(venv)
    st = cli("status", "--python", py, "--json", patches=patch_root)
    assert st.rc == 0, st.err
    res = st.json["result"]
    assert res["state"] == "pristine" and res["python"] == py
    assert res["python_version"].startswith("3.") and res["site"] == str(site)
    assert str(site) in res["site_dirs"]
    assert cli("apply", "--python", py, patches=patch_root).rc == 0
    assert cli("verify", "--python", py, patches=patch_root).rc == 0
    assert cli("revert", "--python", py, patches=patch_root).rc == 0
    assert tree_hashes(site, SKIP) == tree_hashes(sw.venv_site(venv_template), SKIP)


def test_python_without_lmcache_is_not_installed(tmp_path, patch_root):
    py = str(sw.make_venv(tmp_path / "empty"))
    st = cli("status", "--python", py, "--json", patches=patch_root)
    assert st.rc == 0 and st.json["result"]["state"] == "not-installed"
    r = cli("apply", "--python", py, patches=patch_root)
    assert r.rc == 4 and len(r.err.splitlines()) == 1 and "not installed" in r.err


def test_python_that_does_not_exist_is_refused(tmp_path, patch_root):
    missing = tmp_path / "nope" / "bin" / "python"
    r = cli("status", "--python", str(missing), "--json", patches=patch_root)
    assert r.rc == 3 and len(r.err.splitlines()) == 1
    assert r.err.startswith(f"patchtool: {missing}: ")
    assert r.json["error"]["exit_code"] == 3


# ----------------------------------------------------- RECORD endings


@pytest.mark.parametrize("ending", ["\r\n", "\n"], ids=["crlf-pip", "lf-uv"])
def test_record_line_endings_round_trip(site, patch_root, ending):
    """apply keeps RECORD's line endings and row order; revert gives it back
    byte for byte (uv writes LF, pip CRLF)."""
    rec = sw.set_record_line_ending(site, ending)
    before_tree, before_rec = tree_hashes(site, SKIP), rec.read_bytes()
    assert cli("apply", *("--site-packages", str(site)), patches=patch_root).rc == 0
    after = rec.read_bytes()
    assert after.count(ending.encode()) == after.count(b"\n") == before_rec.count(b"\n")
    assert [line.split(b",")[0] for line in after.splitlines()] == \
        [line.split(b",")[0] for line in before_rec.splitlines()]
    st = cli("status", "--site-packages", str(site), "--deep", "--json", patches=patch_root)
    assert st.json["result"]["state"] == "patched"
    assert st.json["result"]["record"]["mismatches"] == 0
    assert cli("revert", "--site-packages", str(site), patches=patch_root).rc == 0
    assert rec.read_bytes() == before_rec
    assert tree_hashes(site, SKIP) == before_tree


# ----------------------------------------------------- patched wheel


def test_patched_wheel_install_is_patched_and_not_revertible(tmp_path, wheel, patch_root):
    out = tmp_path / "dist"
    r = cli("wheel", "--from", str(wheel), "-o", str(out), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    [built] = sorted(out.glob("*.whl"))
    assert built.name == f"lmcache-{sw.VERSION}+{sw.SET}.r1-py3-none-any.whl"
    again = cli("wheel", "--from", str(wheel), "-o", str(tmp_path / "dist2"), patches=patch_root)
    assert again.rc == 0
    assert (tmp_path / "dist2" / built.name).read_bytes() == built.read_bytes()  # deterministic

    site = sw.install_target(built, tmp_path / "site")
    st = cli("status", "--site-packages", str(site), "--deep", "--json", patches=patch_root)
    assert st.rc == 0, st.err
    res = st.json["result"]
    assert res["state"] == "patched" and res["record"]["mismatches"] == 0
    assert res["wheel_build"]["patch_set"] == sw.SET
    assert {f["path"] for f in res["files"]} == {F1, F2, F3}
    assert cli("verify", "--site-packages", str(site), patches=patch_root).rc == 0
    noop = cli("apply", "--site-packages", str(site), "--json", patches=patch_root)
    assert noop.rc == 0 and noop.json["result"]["action"] == "no-op"
    r = cli("revert", "--site-packages", str(site), patches=patch_root)
    assert r.rc == 3 and len(r.err.splitlines()) == 1 and "reinstall the upstream wheel" in r.err


def test_wheel_refuses_a_wheel_that_does_not_match(tmp_path, patch_root):
    files = sw.default_files()
    files[F2] = files[F2].replace(b"VALUE_005 = 5", b"VALUE_005 = 6")
    other = sw.make_wheel(tmp_path / "w", files=files)
    r = cli("wheel", "--from", str(other), "-o", str(tmp_path / "dist"), patches=patch_root)
    assert r.rc == 15 and len(r.err.splitlines()) == 1 and F2 in r.err
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())
