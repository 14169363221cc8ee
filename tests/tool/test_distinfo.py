"""The one wheel/dist-info reader (``patchtool.distinfo``): METADATA through
``email.parser``, names through ``packaging``, wheel members against the
wheel's own RECORD; and the commands that read wheels and dist-info through
it (manifest build, wheel, status) refuse bad input in one line."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest

from patchtool.distinfo import (Wheel, canonical_name, parse_metadata, project_of,
                                read_installer, read_json, read_metadata)
from patchtool.errors import Refusal
from patchtool.exitcodes import ExitCode
from patchtool.record import Record, RecordRow, record_hash
from patchtool.provenance import read_provenance

from .helpers import cli, tree_hashes

META = (b"Metadata-Version: 2.4\r\nName: LMCache\r\nVersion: 0.5.3\r\n"
        b"Summary: x\r\n\r\nVersion: 9.9.9 (the body is not headers)\r\n")


def make_wheel(path: Path, members: dict[str, bytes], *, dist_info: str = "lmcache-0.5.3.dist-info",
               metadata: bytes | None = META, newline: str = "\r\n",
               record_rows: list[RecordRow] | None = None) -> Path:
    """A small wheel whose RECORD lists ``members`` (and METADATA) correctly,
    unless ``record_rows`` says otherwise."""
    files = dict(members)
    if metadata is not None:
        files[f"{dist_info}/METADATA"] = metadata
    rows = record_rows if record_rows is not None else \
        [RecordRow(n, record_hash(d), str(len(d))) for n, d in files.items()]
    rows = rows + [RecordRow(f"{dist_info}/RECORD", "", "")]
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist_info}/RECORD", Record.from_rows(rows, newline).render())
    return path


PKG = {"lmcache/__init__.py": b"x = 1\n", "lmcache/v1/a.py": b"a = 2\n"}


# ---------------------------------------------------------------- METADATA and names


def test_metadata_is_parsed_as_email_headers():
    m = parse_metadata(META, "M")
    assert (m.name, m.version, m.project) == ("LMCache", "0.5.3", "lmcache")
    # header names are case-insensitive, values may be folded, LF or CRLF
    m = parse_metadata(b"name: lm_cache\nVERSION:\n  0.5.4\n\nVersion: 1\n", "M")
    assert (m.version, m.project) == ("0.5.4", "lm-cache")
    # a Version only in the body is no Version
    with pytest.raises(Refusal, match="has no Version header"):
        parse_metadata(b"Name: lmcache\n\nVersion: 0.5.3\n", "M")


@pytest.mark.parametrize("entry, project", [
    ("lmcache-0.5.3.dist-info", "lmcache"),
    ("LMCache-0.5.3+hybridfa.r1.dist-info", "lmcache"),
    ("lmcache-0.5.3-py3.11.egg-info", "lmcache"),
    ("LMCache.egg-link", "lmcache"),
    ("lm_cache-1.0.dist-info", "lm-cache"),
    ("lmcache", None),
    ("lmcache.dist-info", None),
    ("lmcache-0.5.3.data", None),
])
def test_project_of_site_entries(entry, project):
    assert project_of(entry) == project


@pytest.mark.parametrize("name", ["lmcache", "LMCache", "LM__Cache", "lm.-_cache", "Foo-Bar",
                                  "a..b", "vLLM", "zope.interface", "x_1-2"])
def test_canonical_name_is_packagings(name):
    from packaging.utils import canonicalize_name

    assert canonical_name(name) == canonicalize_name(name)


def test_installed_metadata_refusals(tmp_path):
    di = tmp_path / "lmcache-0.5.3.dist-info"
    di.mkdir()
    with pytest.raises(Refusal, match="missing: the distribution is incomplete"):
        read_metadata(di)
    (di / "METADATA").mkdir()
    with pytest.raises(Refusal, match="cannot read"):
        read_metadata(di)
    (di / "METADATA").rmdir()
    (di / "METADATA").write_bytes(META)
    assert read_metadata(di).version == "0.5.3"
    assert read_installer(di) == ""
    (di / "INSTALLER").write_bytes(b"uv\n")
    assert read_installer(di) == "uv"


def test_json_files_of_a_dist_info(tmp_path):
    p = tmp_path / "x.json"
    assert read_json(p) is None
    p.write_text("[1, 2]")
    with pytest.raises(Refusal, match="not an object"):
        read_json(p)
    p.write_bytes(b"\xff{}")
    with pytest.raises(Refusal, match="not valid JSON"):
        read_json(p)
    # the patched wheel's provenance goes through it
    (tmp_path / "lmcache_patchtool.json").write_text("[]")
    with pytest.raises(Refusal, match="not an object"):
        read_provenance(tmp_path)
    (tmp_path / "lmcache_patchtool.json").write_text('{"patch_set": "hybrid-fa"}')
    assert read_provenance(tmp_path) == {"patch_set": "hybrid-fa"}


# ---------------------------------------------------------------- wheels


def test_wheel_open_reads_dist_info_metadata_and_record(tmp_path):
    w = make_wheel(tmp_path / "lmcache-0.5.3-py3-none-any.whl", PKG, newline="\n")
    with Wheel.open(w) as whl:
        assert whl.dist_info == "lmcache-0.5.3.dist-info" and whl.version == "0.5.3"
        assert whl.record.newline == "\n" and whl.record_name == "lmcache-0.5.3.dist-info/RECORD"
        assert whl.member("lmcache/v1/a.py") == PKG["lmcache/v1/a.py"]
        whl.check_all()


@pytest.mark.parametrize("case, why", [
    ("not-zip", "not a readable zip"),
    ("absent", "no such wheel file"),
    ("two-dist-infos", "not a wheel: expected exactly one *.dist-info/RECORD"),
    ("no-metadata", "has no lmcache-0.5.3.dist-info/METADATA"),
    ("no-version", "has no Version header"),
    ("other-project", "is a wheel of 'vllm', not lmcache"),
    ("record-not-utf8", "not UTF-8"),
])
def test_wheel_open_refusals(tmp_path, case, why):
    w = tmp_path / "lmcache-0.5.3-py3-none-any.whl"
    if case == "not-zip":
        w.write_bytes(b"PK\x03\x04 not really")
    elif case == "two-dist-infos":
        make_wheel(w, PKG)
        with zipfile.ZipFile(w, "a") as zf:
            zf.writestr("other-1.0.dist-info/RECORD", "")
    elif case == "no-metadata":
        make_wheel(w, PKG, metadata=None)
    elif case == "no-version":
        make_wheel(w, PKG, metadata=b"Name: lmcache\n\n")
    elif case == "other-project":
        make_wheel(w, PKG, metadata=b"Name: vllm\nVersion: 0.27.1\n\n")
    elif case == "record-not-utf8":
        with zipfile.ZipFile(w, "w") as zf:
            zf.writestr("lmcache-0.5.3.dist-info/METADATA", META)
            zf.writestr("lmcache-0.5.3.dist-info/RECORD", b"lmcache/\xff.py,,\n")
    with pytest.raises(Refusal) as exc:
        Wheel.open(w)
    assert why in str(exc.value) and "\n" not in str(exc.value)


def test_wheel_members_are_checked_against_its_record(tmp_path):
    rows = [RecordRow(n, record_hash(d), str(len(d))) for n, d in PKG.items()]
    meta_row = RecordRow("lmcache-0.5.3.dist-info/METADATA", record_hash(META), str(len(META)))
    cases = {
        "modified": [rows[0], RecordRow(rows[1].path, record_hash(b"other"), rows[1].size),
                     meta_row],
        "wrong-size": [rows[0], RecordRow(rows[1].path, rows[1].hash, "999"), meta_row],
        "unlisted": [rows[0], meta_row],
        "unhashed": [rows[0], RecordRow(rows[1].path, "", ""), meta_row],
    }
    for case, record_rows in cases.items():
        w = make_wheel(tmp_path / f"{case}.whl", PKG, record_rows=record_rows)
        with Wheel.open(w) as whl:
            assert whl.member("lmcache/__init__.py") == PKG["lmcache/__init__.py"]
            with pytest.raises(Refusal) as exc:
                whl.member("lmcache/v1/a.py", ExitCode.WHEEL_MISMATCH)
            assert exc.value.code == ExitCode.WHEEL_MISMATCH
            assert str(exc.value).startswith(f"{w}: lmcache/v1/a.py ")
            want = "does not match the wheel's own RECORD" if case in ("modified", "wrong-size") \
                else "has no hashed RECORD row"
            assert want in exc.value.reason, case
            with pytest.raises(Refusal, match="lmcache/v1/a.py"):
                whl.check_all()
    # a RECORD row whose member is missing
    w = make_wheel(tmp_path / "missing.whl", PKG,
                   record_rows=rows + [meta_row, RecordRow("lmcache/gone.py", "sha256=x", "1")])
    with Wheel.open(w) as whl, pytest.raises(Refusal, match="RECORD lists lmcache/gone.py"):
        whl.check_all()


# ---------------------------------------------------------------- the commands


def _one_line_refusal(r, rc: int = 3) -> None:
    assert r.rc == rc, r.err
    assert r.err.startswith("patchtool: ") and r.err.count("\n") == 1, r.err
    assert "Traceback" not in r.err


@pytest.mark.parametrize("case", ["not-zip", "no-metadata", "other-project"])
def test_manifest_build_refuses_bad_wheels_in_one_line(tmp_path, patches_copy, case):
    d = patches_copy / "testset" / "0.5.3"
    before = (d / "manifest.json").read_bytes()
    w = tmp_path / "lmcache-0.5.3-py3-none-any.whl"
    if case == "not-zip":
        w.write_bytes(b"not a zip at all")
    elif case == "no-metadata":
        make_wheel(w, PKG, metadata=None)
    else:
        make_wheel(w, PKG, metadata=b"Name: vllm\nVersion: 0.5.3\n\n")
    r = cli("manifest", "build", str(d), "--wheel", str(w))
    _one_line_refusal(r)
    assert (d / "manifest.json").read_bytes() == before


def test_manifest_build_refuses_a_modified_member(tmp_path, patches_copy, wheel053):
    """A target file edited inside the wheel (RECORD left alone) is refused
    by the reader's member check, and the manifest is not rewritten."""
    from .conftest import F1

    d = patches_copy / "testset" / "0.5.3"
    before = (d / "manifest.json").read_bytes()
    bad = tmp_path / wheel053.name
    with zipfile.ZipFile(wheel053) as zin, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, data + b"# edited\n" if info.filename == F1 else data)
    r = cli("manifest", "build", str(d), "--wheel", str(bad))
    _one_line_refusal(r)
    assert f"{F1} does not match the wheel's own RECORD" in r.err
    assert (d / "manifest.json").read_bytes() == before


def test_status_refuses_an_unreadable_metadata_in_one_line(tmp_path, target_dir_053, test_patches):
    site = tmp_path / "site"
    shutil.copytree(target_dir_053, site, symlinks=True)
    meta = site / "lmcache-0.5.3.dist-info" / "METADATA"
    meta.unlink()
    meta.mkdir()  # a directory where METADATA should be
    before = tree_hashes(site)
    r = cli("status", "--site-packages", str(site), patches=test_patches)
    _one_line_refusal(r)
    assert "METADATA: cannot read" in r.err
    assert tree_hashes(site) == before


def test_status_reads_metadata_headers_only(tmp_path, target_dir_053, test_patches):
    """Name matching and Version come from the headers: a dist-info dir spelled
    ``LMCache-…`` and a METADATA whose body mentions another Version."""
    site = tmp_path / "site"
    shutil.copytree(target_dir_053, site, symlinks=True)
    di = site / "lmcache-0.5.3.dist-info"
    meta = di / "METADATA"
    meta.write_bytes(meta.read_bytes().replace(b"\n\n", b"\n\nVersion: 9.9.9\n", 1))
    di.rename(site / "LMCache-0.5.3.dist-info")
    r = cli("status", "--site-packages", str(site), "--json", patches=test_patches)
    assert r.rc == 0, r.err
    st = r.json["result"]
    assert st["lmcache_version"] == "0.5.3" and st["state"] == "pristine"


def test_wheel_build_keeps_an_lf_record_lf(tmp_path, wheel053, test_patches):
    """A source wheel whose RECORD has LF endings (re-zipped, so accepted on
    the per-file pre-images): the patched wheel's RECORD is LF throughout,
    its rows those of the source in order."""
    src = tmp_path / wheel053.name
    with zipfile.ZipFile(wheel053) as zin, zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = data.replace(b"\r\n", b"\n")
            zout.writestr(info, data)
    r = cli("wheel", "lmcache==0.5.3", "--from", str(src), "-o", str(tmp_path / "out"), "--json",
            patches=test_patches)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["source"]["verified_by"] == "per-file pre-images"
    with zipfile.ZipFile(res["path"]) as out, zipfile.ZipFile(src) as zin:
        new_di = f"lmcache-{res['version']}.dist-info"
        rec = out.read(f"{new_di}/RECORD")
        src_rec = Record.parse(zin.read("lmcache-0.5.3.dist-info/RECORD"))
    assert b"\r" not in rec and rec.endswith(b"\n")
    rows = Record.parse(rec).rows
    assert len(rows) == len(src_rec) + 1
    renamed = [r.path.replace("lmcache-0.5.3.dist-info", new_di, 1) for r in src_rec.rows]
    assert [r.path for r in rows if not r.path.endswith("lmcache_patchtool.json")] == renamed
    json.loads(out_prov(res["path"], new_di))


def out_prov(path: str, new_di: str) -> bytes:
    with zipfile.ZipFile(path) as zf:
        return zf.read(f"{new_di}/lmcache_patchtool.json")
