"""``patchtool wheel``: the patched wheel built from the real 0.5.3 wheel is
a correct, deterministic wheel; pip and uv install it; status, verify, apply
and revert recognise the result; a wheel that is not the manifest's is
refused."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from patchtool.record import parse_record, record_hash

from .helpers import (OTHER_FILE, TARGET_FILE, cli, flip_one_byte, make_venv, rewrite_wheel,
                      sha256, site_of, tree_digest)

OLD_DI = "lmcache-0.5.3.dist-info"
NEW_DI = "lmcache-0.5.3+hybridfa.r1.dist-info"


def test_wheel_name_version_and_pin(built, wheel053):
    assert built["version"] == "0.5.3+hybridfa.r1"
    assert built["filename"] == wheel053.name.replace("0.5.3", "0.5.3+hybridfa.r1", 1)
    assert built["sha256"] == sha256(Path(built["path"]))
    assert built["requirement"] == f"lmcache==0.5.3+hybridfa.r1 --hash=sha256:{built['sha256']}"
    assert built["source"] == {"filename": wheel053.name, "sha256": sha256(wheel053),
                               "verified_by": "wheel sha256"}
    assert built["warnings"] == []


def test_rebuild_is_byte_identical(tmp_path, patches_root, wheel053, built):
    """Two more builds (another output dir, another process) give the same
    bytes: the hash can be pinned in a requirements file."""
    shas = []
    for name in ("a", "b"):
        r = cli("wheel", "lmcache==0.5.3", "--from", str(wheel053), "-o", str(tmp_path / name),
                "--json", patches=patches_root)
        assert r.rc == 0, r.err
        shas.append(sha256(Path(r.json["result"]["path"])))
    assert shas == [built["sha256"]] * 2


def test_wheel_contents_and_record(built, wheel053, patches_root):
    manifest = json.loads((patches_root / "hybrid-fa" / "0.5.3" / "manifest.json").read_text())
    with zipfile.ZipFile(wheel053) as src, zipfile.ZipFile(built["path"]) as out:
        assert out.testzip() is None
        names = out.namelist()
        # Same members in the same order, the dist-info renamed, the
        # provenance file just before RECORD.
        expected = []
        for n in src.namelist():
            renamed = n.replace(OLD_DI, NEW_DI, 1) if n.startswith(OLD_DI) else n
            if n == f"{OLD_DI}/RECORD":
                expected.append(f"{NEW_DI}/lmcache_patchtool.json")
            expected.append(renamed)
        assert names == expected
        assert not any(n.startswith(OLD_DI) for n in names)
        assert {i.date_time for i in out.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        # Executable bits survive (the compiled extensions).
        for info in src.infolist():
            if info.filename.endswith(".so"):
                assert out.getinfo(info.filename).external_attr == info.external_attr
        assert out.read(f"{NEW_DI}/WHEEL") == src.read(f"{OLD_DI}/WHEEL")
        meta = out.read(f"{NEW_DI}/METADATA").decode()
        assert "\nVersion: 0.5.3+hybridfa.r1\n" in meta
        assert meta.replace("Version: 0.5.3+hybridfa.r1", "Version: 0.5.3", 1) == \
            src.read(f"{OLD_DI}/METADATA").decode()

        src_rec = src.read(f"{OLD_DI}/RECORD")
        rec = out.read(f"{NEW_DI}/RECORD")
        assert rec.count(b"\r\n") == len(rec.splitlines()) and src_rec.count(b"\r\n") > 0
        rows = parse_record(rec)
        assert len(rows) == len(parse_record(src_rec)) + 1
        by_path = {r.path: r for r in rows}
        # Every member has a row, and every row matches its member.
        for info in out.infolist():
            if info.is_dir():
                continue
            row = by_path[info.filename]
            if info.filename == f"{NEW_DI}/RECORD":
                assert (row.hash, row.size) == ("", "")
                continue
            data = out.read(info)
            assert (row.hash, row.size) == (record_hash(data), str(len(data))), info.filename
        # Untouched rows are the source rows verbatim, in the source order.
        changed = set(manifest["files"]) | {f"{OLD_DI}/METADATA"}
        src_rows = [r for r in parse_record(src_rec) if r.path not in changed
                    and r.path != f"{OLD_DI}/RECORD"]
        kept = [r for r in rows if r.path.replace(NEW_DI, OLD_DI, 1) in {s.path for s in src_rows}]
        assert [(r.path.replace(NEW_DI, OLD_DI, 1), r.hash, r.size) for r in kept] == \
            [(r.path, r.hash, r.size) for r in src_rows]
        # The patched files are the manifest's post-images.
        for path, entry in manifest["files"].items():
            assert record_hash(out.read(path)) == entry["post"]["hash"]


def test_provenance(built, wheel053, patches_root):
    manifest = json.loads((patches_root / "hybrid-fa" / "0.5.3" / "manifest.json").read_text())
    with zipfile.ZipFile(built["path"]) as zf:
        prov = json.loads(zf.read(f"{NEW_DI}/lmcache_patchtool.json"))
    import patchtool

    assert prov["schema"] == "lmcache-patchtool/wheel-provenance/v1"
    assert (prov["patch_set"], prov["revision"], prov["lmcache_version"], prov["version"]) == \
        ("hybrid-fa", 1, "0.5.3", "0.5.3+hybridfa.r1")
    assert prov["tool_version"] == patchtool.__version__
    assert prov["source_wheel"] == {"filename": wheel053.name, "sha256": sha256(wheel053),
                                    "verified_by": "wheel sha256"}
    assert prov["manifest_wheel"] == manifest["wheel"]
    assert [p["sha256"] for p in prov["patches"]] == [p["sha256"] for p in manifest["patches"]]
    assert prov["files"] == {p: {"pre": e["pre"], "post": e["post"]}
                             for p, e in manifest["files"].items()}
    assert "/" not in json.dumps(prov["source_wheel"]["filename"])  # no build-machine paths


def test_pip_install_is_patched_and_apply_revert_refuse(tmp_path, built, patches_root):
    py = make_venv(tmp_path / "venv")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", built["path"]],
                   check=True)
    r = cli("status", "--python", str(py), "--json", patches=patches_root)
    assert r.rc == 0, r.err
    st = r.json["result"]
    assert st["state"] == "patched" and st["lmcache_version"] == "0.5.3+hybridfa.r1"
    assert st["wheel_build"]["source_wheel"]["sha256"] == built["source"]["sha256"]
    assert "installed from the patched wheel" in st["detail"]
    assert cli("verify", "--python", str(py), patches=patches_root).rc == 0

    site = site_of(tmp_path / "venv")
    before = tree_digest(site)
    # Already patched: a plain apply is a no-op; anything else is refused.
    r = cli("apply", "--python", str(py), "--json", patches=patches_root)
    assert r.rc == 0 and r.json["result"]["action"] == "no-op", r.err
    r = cli("apply", "--python", str(py), "--patch", "01", patches=patches_root)
    assert r.rc == 3 and r.err.count("\n") == 1 and "installed from the patched wheel" in r.err
    r = cli("revert", "--python", str(py), patches=patches_root)
    assert r.rc == 3 and r.err.count("\n") == 1
    assert "reinstall the upstream wheel" in r.err and "lmcache==0.5.3)" in r.err
    assert tree_digest(site) == before  # nothing written
    assert not (site / ".lmcache-patchtool").exists()


@pytest.fixture(scope="session")
def uv_bin(tmp_path_factory) -> Path:
    """uv, pip-installed into a throwaway venv; skip when it cannot be had."""
    venv = tmp_path_factory.mktemp("uv") / "venv"
    py = make_venv(venv)
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "uv"], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0 or not (venv / "bin" / "uv").exists():
        pytest.skip(f"uv is not installable here: {proc.stderr.strip()[-200:]}")
    return venv / "bin" / "uv"


def test_uv_install_is_patched(tmp_path, built, patches_root, uv_bin):
    py = make_venv(tmp_path / "venv", with_pip=False)
    proc = subprocess.run([str(uv_bin), "pip", "install", "--no-deps", "--offline", "--python",
                           str(py), built["path"]], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    r = cli("verify", "--python", str(py), "--json", patches=patches_root)
    assert r.rc == 0, r.err
    st = r.json["result"]["status"]
    assert st["installer"] == "uv" and st["state"] == "patched"
    assert st["lmcache_version"] == "0.5.3+hybridfa.r1"


@pytest.mark.parametrize("member", [TARGET_FILE, OTHER_FILE])
def test_tampered_wheel_is_refused(tmp_path, wheel053, patches_root, member):
    """One byte changed in a member (RECORD left as it was): refused with
    WHEEL_MISMATCH, in one line, and no wheel written."""
    bad = rewrite_wheel(wheel053, tmp_path / wheel053.name, flip_one_byte(member))
    out = tmp_path / "out"
    r = cli("wheel", "--from", str(bad), "-o", str(out), patches=patches_root)
    assert r.rc == 15, r.err
    assert r.err.count("\n") == 1 and r.err.startswith(f"patchtool: {bad}: {member}")
    want = "pre-image" if member == TARGET_FILE else "does not match the wheel's own RECORD"
    assert want in r.err
    assert not out.exists() or not any(out.iterdir())


def test_rezipped_wheel_builds_with_a_warning(tmp_path, wheel053, patches_root, built):
    """Same files, another zip (so another sha256): accepted on the per-file
    pre-images, with a warning; the patched files are the same."""
    other = rewrite_wheel(wheel053, tmp_path / wheel053.name)
    assert sha256(other) != sha256(wheel053)
    r = cli("wheel", "--from", str(other), "-o", str(tmp_path / "out"), "--json",
            patches=patches_root)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["source"]["verified_by"] == "per-file pre-images"
    assert len(res["warnings"]) == 1 and "is not the wheel the manifest was built from" in \
        res["warnings"][0]
    assert res["files"] == built["files"]


def test_wheel_refusals(tmp_path, wheel053, patches_root):
    r = cli("wheel", "lmcache>=0.5.3", patches=patches_root)
    assert r.rc == 3 and "needs an exact pin" in r.err and r.err.count("\n") == 1
    r = cli("wheel", "lmcache==0.5.4", "--from", str(wheel053), patches=patches_root)
    assert r.rc == 3 and "is lmcache 0.5.3, not 0.5.4" in r.err
    r = cli("wheel", "lmcache==0.5.2", patches=patches_root)
    assert r.rc == 7 and "older than every version" in r.err
    r = cli("wheel", "lmcache==0.6.0", patches=patches_root)
    assert r.rc == 16 and "no patch set for lmcache 0.6.0" in r.err
    # A patched wheel is not a source.
    first = cli("wheel", "--from", str(wheel053), "-o", str(tmp_path), "--json",
                patches=patches_root).json["result"]["path"]
    r = cli("wheel", "--from", first, "-o", str(tmp_path / "again"), patches=patches_root)
    assert r.rc == 3 and "already a patched wheel" in r.err
    assert not (tmp_path / "again").exists()


def test_hash_pinned_requirements_install_over_upstream(tmp_path, built, wheel053, patches_root):
    """The deployment recipe of docs/ci-and-wheels.md: upstream lmcache first (it brings the
    dependencies), then the patched wheel by its pinned hash replaces it."""
    py = make_venv(tmp_path / "venv")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel053)],
                   check=True)
    req = tmp_path / "requirements-lmcache.txt"
    req.write_text(built["requirement"] + "\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--find-links",
           str(Path(built["path"]).parent), "--require-hashes", "-r", str(req)]
    subprocess.run(pip, check=True)
    r = cli("verify", "--python", str(py), "--json", patches=patches_root)
    assert r.rc == 0 and r.json["result"]["status"]["lmcache_version"] == "0.5.3+hybridfa.r1"
    # A wrong hash is rejected by pip itself (forced: the pin is satisfied now).
    req.write_text(built["requirement"][:-4] + "0000\n")
    proc = subprocess.run([*pip, "--force-reinstall"], capture_output=True, text=True)
    assert proc.returncode != 0 and "DO NOT MATCH THE HASHES" in proc.stderr
