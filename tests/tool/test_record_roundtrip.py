"""RECORD round trips: apply and revert keep a RECORD byte-identical whatever
its line ending, on real installs of the real 0.5.3 wheel by pip (CRLF) and
by uv (LF); an unreadable RECORD is a one-line refusal; ``Record`` unit
tests."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import provision
from patchtool.errors import Refusal
from patchtool.record import (Record, RecordRow, check_rows, parse_record, render_record,
                              replace_rows)

from .conftest import F1, F2, F3
from .helpers import STATE_DIR, cli, copy_venv, site_of, tree_hashes

SKIP = ("__pycache__", STATE_DIR)
OWN = "lmcache-0.5.3.dist-info/RECORD"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _record(site: Path) -> Path:
    return next(site.glob("lmcache-*.dist-info")) / "RECORD"


@pytest.fixture(scope="session")
def uv_env(tmp_path_factory, wheel053) -> Path:
    """A venv (no pip) into which uv installed the real 0.5.3 wheel, offline
    from the local file.  uv comes from the ``test`` extra."""
    if importlib.util.find_spec("uv") is None:
        pytest.fail("uv is in the test extra: pip install -e '.[test]'")
    base = tmp_path_factory.mktemp("uvenv")
    venv = base / "venv"
    subprocess.run([provision._python(), "-m", "venv", "--without-pip", str(venv)], check=True)
    env = dict(os.environ, UV_CACHE_DIR=str(base / "uv-cache"), UV_NO_CONFIG="1",
               UV_PYTHON_DOWNLOADS="never")
    proc = subprocess.run([sys.executable, "-m", "uv", "pip", "install", "--offline", "--no-deps",
                           "--link-mode", "copy", "--python", str(venv / "bin" / "python"),
                           str(wheel053)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return venv


@pytest.fixture(params=["pip", "uv"])
def installed(request, tmp_path, bare_envs) -> tuple[str, Path]:
    """(installer, a private venv copy) for each installer."""
    src = bare_envs["0.5.3"] if request.param == "pip" else request.getfixturevalue("uv_env")
    return request.param, copy_venv(src, tmp_path / f"venv-{request.param}")


def test_installers_write_the_line_endings_this_test_is_about(installed):
    installer, venv = installed
    site = site_of(venv)
    dist = next(site.glob("lmcache-*.dist-info"))
    assert (dist / "INSTALLER").read_text().strip() == installer
    data = _record(site).read_bytes()
    assert data.count(b"\n") > 700 and data.endswith(b"\n")
    if installer == "pip":
        assert data.count(b"\r\n") == data.count(b"\n")  # CRLF throughout
    else:
        assert b"\r" not in data  # LF throughout
    assert Record.parse(data).newline == ("\r\n" if installer == "pip" else "\n")


def test_apply_revert_keeps_record_byte_identical(installed, test_patches):
    """apply (first patch, then the rest) and revert: RECORD's sha256 after
    revert is the original's, and the whole site is as installed; while
    patched, only the target rows differ and every line keeps its ending."""
    installer, venv = installed
    site = site_of(venv)
    py = str(venv / "bin" / "python")
    rec = _record(site)
    before = rec.read_bytes()
    tree_before = tree_hashes(site, SKIP)
    ending = b"\r\n" if installer == "pip" else b"\n"

    r = cli("apply", "--python", py, "--patch", "01", patches=test_patches)
    assert r.rc == 0, r.err
    r = cli("apply", "--python", py, "--json", patches=test_patches)
    assert r.rc == 0, r.err
    assert r.json["result"]["state_after"] == "patched"

    patched = rec.read_bytes()
    old_lines, new_lines = before.split(ending), patched.split(ending)
    assert len(new_lines) == len(old_lines) and new_lines[-1] == b""  # final newline kept
    if installer == "uv":
        assert b"\r" not in patched  # the bug: apply rewrote every line to CRLF
    else:
        assert patched.count(b"\r\n") == patched.count(b"\n")
    changed = {a.split(b",")[0].decode() for a, b in zip(old_lines, new_lines) if a != b}
    assert changed == {F1, F2, F3}
    bad = [c for c in check_rows(site, Record.parse(patched).rows) if c.status not in ("ok", "unhashed")]
    assert bad == []

    r = cli("revert", "--python", py, "--json", patches=test_patches)
    assert r.rc == 0, r.err
    assert r.json["result"]["state_after"] == "pristine"
    after = rec.read_bytes()
    assert _sha(after) == _sha(before)
    assert tree_hashes(site, SKIP) == tree_before


def test_revert_without_saved_state_keeps_record_byte_identical(installed, test_patches):
    """The reverse-patch path (state deleted by hand) rewrites the rows from
    the manifest: still in the file's own line ending."""
    import shutil

    installer, venv = installed
    site = site_of(venv)
    py = str(venv / "bin" / "python")
    before = _record(site).read_bytes()
    assert cli("apply", "--python", py, patches=test_patches).rc == 0
    shutil.rmtree(site / STATE_DIR)
    r = cli("revert", "--python", py, "--json", patches=test_patches)
    assert r.rc == 0, r.err
    assert r.json["result"]["source"] == "reverse patch"
    assert _sha(_record(site).read_bytes()) == _sha(before), installer


@pytest.mark.parametrize("damage", ["not-utf8", "bad-csv"])
def test_unreadable_record_is_a_one_line_refusal(venv053, test_patches, damage):
    site = site_of(venv053)
    py = str(venv053 / "bin" / "python")
    rec = _record(site)
    data = rec.read_bytes()
    if damage == "not-utf8":
        rec.write_bytes(data + b"lmcache/caf\xe9.py,sha256=AAAA,1\r\n")
        why = "not UTF-8"
    else:
        rec.write_bytes(data + b'"lmcache/unterminated.py,sha256=AAAA,1\r\n')
        why = "not valid CSV"
    tree_before = tree_hashes(site)
    for args in (("status",), ("apply",), ("apply", "--dry-run"), ("revert",), ("verify",)):
        r = cli(*args, "--python", py, patches=test_patches)
        assert r.rc == 3, (args, r.err)
        assert "Traceback" not in r.err and r.err.count("\n") == 1, (args, r.err)
        assert r.err.startswith("patchtool: ") and "RECORD" in r.err and why in r.err, r.err
    assert tree_hashes(site) == tree_before  # nothing written


# ---------------------------------------------------------------- Record unit tests


def _csv_rows(rows: list[tuple[str, str, str]], newline: str) -> bytes:
    out = io.StringIO(newline="")
    csv.writer(out, lineterminator=newline).writerows(rows)
    return out.getvalue().encode()


ROWS = [("pkg/__init__.py", "sha256=AAA", "10"),
        ("pkg/with,comma.py", "sha256=BBB", "20"),
        ('pkg/with"quote.py', "sha256=CCC", "30"),
        ("pkg/__pycache__/x.cpython-311.pyc", "", ""),
        ("pkg-1.0.dist-info/RECORD", "", "")]


ENDINGS = pytest.mark.parametrize("newline, final", [
    ("\r\n", True), ("\n", True), ("\r\n", False), ("\n", False)],
    ids=["crlf", "lf", "crlf-no-final-newline", "lf-no-final-newline"])


def _sample(rows, newline: str, final: bool) -> bytes:
    data = _csv_rows(rows, newline)
    return data if final else data[: -len(newline)]


@ENDINGS
def test_record_parses_and_renders_byte_identically(newline, final):
    data = _sample(ROWS, newline, final)
    rec = Record.parse(data, "x/RECORD")
    assert rec.render() == data
    assert rec.newline == newline and rec.final_newline is final
    assert [(r.path, r.hash, r.size) for r in rec.rows] == ROWS
    assert rec.row("pkg/with,comma.py") == RecordRow("pkg/with,comma.py", "sha256=BBB", "20")
    assert rec.row("pkg-1.0.dist-info/RECORD") == RecordRow("pkg-1.0.dist-info/RECORD", "", "")
    assert rec.row("nope") is None and "nope" not in rec and len(rec) == len(ROWS)


@ENDINGS
def test_record_replaces_rows_in_the_files_own_line_ending(newline, final):
    data = _sample(ROWS, newline, final)
    rec = Record.parse(data)
    new = rec.with_rows({"pkg/with,comma.py": RecordRow("pkg/with,comma.py", "sha256=NEW", "21"),
                         "pkg-1.0.dist-info/RECORD": RecordRow("pkg-1.0.dist-info/RECORD", "",
                                                               "")})
    want = [r if r[0] != "pkg/with,comma.py" else ("pkg/with,comma.py", "sha256=NEW", "21")
            for r in ROWS]
    assert new.render() == _sample(want, newline, final)
    assert rec.render() == data  # the original is not changed
    # ... and putting the old row back gives the original bytes
    back = new.with_rows({"pkg/with,comma.py": rec.row("pkg/with,comma.py")})
    assert back.render() == data


def test_record_keeps_odd_lines_it_does_not_touch():
    """Blank lines, mixed endings, non-minimal quoting, a quoted newline:
    untouched lines keep their exact bytes; a replaced row keeps its own
    line's ending."""
    data = (b'"a.py",sha256=A,1\r\n'  # quoted although it need not be
            b"\r\n"
            b"b.py,sha256=B,2\n"
            b'"c\nd.py",sha256=C,3\r\n'
            b"e.py,sha256=E,")
    rec = Record.parse(data)
    assert rec.render() == data
    assert [r.path for r in rec.rows] == ["a.py", "b.py", "c\nd.py", "e.py"]
    assert rec.row("e.py").size == ""
    new = rec.with_rows({"b.py": RecordRow("b.py", "sha256=X", "9"),
                         "e.py": RecordRow("e.py", "sha256=Y", "")})
    assert new.render() == (b'"a.py",sha256=A,1\r\n\r\nb.py,sha256=X,9\n'
                            b'"c\nd.py",sha256=C,3\r\ne.py,sha256=Y,')
    # A row replaced by an equal row keeps its original (non-minimal) bytes.
    assert rec.with_rows({"a.py": RecordRow("a.py", "sha256=A", "1")}).render() == data


def test_record_inserts_and_renames_for_wheel_builds():
    data = _csv_rows(ROWS, "\n")
    rec = Record.parse(data)
    new = rec.with_rows({"pkg-1.0.dist-info/RECORD": RecordRow("pkg-1.1.dist-info/RECORD", "", "")},
                        insert_before={"pkg-1.0.dist-info/RECORD":
                                       [RecordRow("pkg-1.1.dist-info/extra.json", "sha256=P", "5")]})
    assert new.render() == _csv_rows(ROWS[:-1] + [("pkg-1.1.dist-info/extra.json", "sha256=P", "5"),
                                                  ("pkg-1.1.dist-info/RECORD", "", "")], "\n")


def test_record_refuses_missing_rows_and_bad_bytes():
    rec = Record.parse(_csv_rows(ROWS, "\r\n"), "site/x.dist-info/RECORD")
    with pytest.raises(Refusal) as exc:
        rec.with_rows({"pkg/absent.py": RecordRow("pkg/absent.py", "sha256=Z", "1")})
    assert str(exc.value) == "site/x.dist-info/RECORD: has no row for pkg/absent.py"
    with pytest.raises(KeyError):  # the old replace_rows contract still holds
        replace_rows(_csv_rows(ROWS, "\r\n"), {"pkg/absent.py": RecordRow("pkg/absent.py", "", "")})
    for bad, why in [(b"a.py,sha256=A,1\r\nb\xff.py,,\r\n", "not UTF-8 (byte 0xff on line 2)"),
                     (b'a.py,sha256=A,1\n"b.py,,\n', "not valid CSV"),
                     (b"a.py,sha256=A,1\rb.py,,\n", "not valid CSV")]:
        with pytest.raises(Refusal) as exc:
            Record.parse(bad, "R")
        assert exc.value.file == "R" and why in exc.value.reason and "\n" not in str(exc.value)


def test_old_functions_are_wrappers(wheel053):
    import zipfile

    with zipfile.ZipFile(wheel053) as zf:
        raw = zf.read(OWN)
    rows = parse_record(raw)
    assert rows == Record.parse(raw).rows and render_record(rows) == raw
    lf = raw.replace(b"\r\n", b"\n")
    assert render_record(parse_record(lf), "\n") == lf
    new = replace_rows(lf, {F1: RecordRow(F1, "sha256=xyz", "3")})
    assert b"\r" not in new and new.count(b"\n") == lf.count(b"\n")


def test_record_of_real_wheel_and_installs(wheel053, bare_envs, uv_env):
    """The real wheel's RECORD (CRLF, its own row last with empty fields) and
    the installed ones render back byte for byte."""
    import zipfile

    with zipfile.ZipFile(wheel053) as zf:
        raw = zf.read(OWN)
    for data in (raw, _record(site_of(bare_envs["0.5.3"])).read_bytes(),
                 _record(site_of(uv_env)).read_bytes()):
        rec = Record.parse(data)
        assert rec.render() == data
        assert rec.row(OWN) == RecordRow(OWN, "", "")
