"""A synthetic lmcache-like wheel, its install and a patch series for it:
everything the offline unit tier needs, made in a few milliseconds, with no
network, no torch and no real lmcache.

API (all paths are ``pathlib.Path``; file contents are ``bytes``):

``VERSION``, ``SET``, ``F1``, ``F2``, ``F3``, ``UNTOUCHED``
    The synthetic version (``9.9.9``: no real patch set uses it), the test
    patch set's name, and the member paths the default series touches (F1 is
    touched by both patches) or leaves alone.
``default_files(version=VERSION) -> dict[str, bytes]``
    The ``lmcache/...`` members of the default wheel (a few ~60-line modules).
``make_wheel(dest_dir, version=VERSION, files=None, *, record_line_ending="\\r\\n",
name="lmcache", tag="py3-none-any", metadata_extra="") -> Path``
    Write ``<name>-<version>-<tag>.whl`` into ``dest_dir``: the members, a
    dist-info with METADATA, WHEEL and a RECORD with real sha256 rows (CRLF as
    wheel builders and pip write it; pass ``"\\n"`` for an LF RECORD).
    Deterministic: the same arguments give the same bytes.
``install_target(wheel, dest, *, python=sys.executable) -> Path``
    ``pip install --no-deps --no-index --target dest wheel`` (offline, real
    pip: INSTALLER, direct_url.json, a CRLF RECORD with the .pyc rows pip adds
    or not, byte-compiled modules).  Returns ``dest``.
``make_venv(dest) -> Path``
    ``python -m venv --without-pip dest``; returns its ``bin/python``.
    ``venv_site(venv)`` is its site-packages dir.
``copy_site(src, dest) -> Path``
    Copy an installed tree (cheaper than installing again: install once per
    session, copy per test).
``tree_hashes(root, skip=()) -> dict[str, str]``
    relpath -> sha256 (or ``link:<target>``) of every file under ``root``,
    skipping any file or directory named in ``skip``: compare trees byte for
    byte (``SKIP`` = ``("__pycache__", ".lmcache-patchtool")``).
``set_record_line_ending(site, ending) -> Path``
    Rewrite the installed RECORD with ``ending`` (``"\\n"`` is what uv
    writes); returns the RECORD path.
``write_series(dest, base, steps) -> Path``
    Write ``NN-name.patch`` files with GNU ``diff -u`` into ``dest`` (a
    ``<root>/<set>/<version>`` dir).  ``base`` is the pristine content of
    every path a step touches; ``steps`` is a list of ``(file name,
    {path: new full content})``, each diffed against that path's content
    after the previous steps (cumulative, like a git series).
``default_steps(base, variant="a") -> list``
    The 2-patch series the tests use: ``01-first.patch`` edits F1 (two hunks)
    and F2, ``02-second.patch`` edits F1 again and F3.  ``variant`` changes
    02's text, which makes a new revision.
``manifest_build(dest, wheel, *extra) -> dict``
    Run the tool's own ``patchtool manifest build DEST --wheel WHEEL --json``
    (extra options after) and return its result; asserts exit 0.
``wheel_files(wheel) -> dict[str, bytes]``
    A wheel's package members (everything outside its dist-info).
``make_patch_root(root, wheel, *, set_name=SET, variant="a", extra=()) -> Path``
    ``root/<set>/<version>`` with the default series written against the
    wheel's own members, and its manifest (``extra``: more ``manifest
    build`` options, e.g. ``("--revision", "2")``): a
    directory to pass as ``LMCACHE_PATCHTOOL_PATCHES`` (``cli(...,
    patches=root)``).  Returns ``root``.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "9.9.9"
SET = "synthset"
F1 = "lmcache/v1/kv_layer_groups.py"
F2 = "lmcache/v1/transfer.py"
F3 = "lmcache/integration/connector.py"
UNTOUCHED = "lmcache/v1/untouched.py"

# 1980-01-01, the zip epoch: members carry no build-time timestamp.
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def _module(name: str, lines: int = 60) -> bytes:
    body = [f'"""Synthetic module {name} for the patchtool unit tier."""', "", "import os", ""]
    for i in range(1, lines - len(body) + 1):
        body.append(f"VALUE_{i:03d} = {i}  # {name} line {i}")
    return ("\n".join(body) + "\n").encode()


def default_files(version: str = VERSION) -> dict[str, bytes]:
    return {
        "lmcache/__init__.py": f'__version__ = "{version}"\n'.encode(),
        "lmcache/v1/__init__.py": b"",
        F1: _module("kv_layer_groups", 80),
        F2: _module("transfer", 60),
        F3: _module("connector", 50),
        UNTOUCHED: _module("untouched", 20),
    }


def record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _record(rows: list[tuple[str, str, str]], line_ending: str) -> bytes:
    out = io.StringIO(newline="")
    writer = csv.writer(out, lineterminator=line_ending)
    for row in rows:
        writer.writerow(row)
    return out.getvalue().encode()


def make_wheel(dest_dir: Path, version: str = VERSION, files: dict[str, bytes] | None = None, *,
               record_line_ending: str = "\r\n", name: str = "lmcache", tag: str = "py3-none-any",
               metadata_extra: str = "") -> Path:
    files = default_files(version) if files is None else files
    dist_info = f"{name}-{version}.dist-info"
    members = dict(sorted(files.items()))
    members[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        f"Summary: synthetic lmcache-like wheel for the patchtool unit tests\n{metadata_extra}\n"
    ).encode()
    members[f"{dist_info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: patchtool-tests\nRoot-Is-Purelib: true\nTag: {tag}\n\n"
    ).encode()
    rows = [(path, record_hash(data), str(len(data))) for path, data in members.items()]
    rows.append((f"{dist_info}/RECORD", "", ""))
    members[f"{dist_info}/RECORD"] = _record(rows, record_line_ending)
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    wheel = dest_dir / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in members.items():
            info = zipfile.ZipInfo(path, _ZIP_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)
    return wheel


def install_target(wheel: Path, dest: Path, *, python: str = sys.executable) -> Path:
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "--target", str(dest), str(wheel)],
                   check=True, capture_output=True)
    return Path(dest)


def make_venv(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    return Path(dest) / "bin" / "python"


def venv_site(venv: Path) -> Path:
    return next((Path(venv) / "lib").glob("python3*/site-packages"))


def copy_site(src: Path, dest: Path) -> Path:
    """Copy a site tree into ``dest`` (created, or merged into an existing dir)."""
    shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
    return Path(dest)


def record_path(site: Path) -> Path:
    found = sorted(Path(site).glob("lmcache-*.dist-info/RECORD"))
    assert len(found) == 1, found
    return found[0]


STATE_DIR = ".lmcache-patchtool"
SKIP = ("__pycache__", STATE_DIR)


def tree_hashes(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in filenames:
            if name in skip:
                continue
            p = Path(dirpath) / name
            rel = os.path.relpath(p, root)
            out[rel] = ("link:" + os.readlink(p) if p.is_symlink()
                        else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def set_record_line_ending(site: Path, ending: str) -> Path:
    rec = record_path(site)
    lines = rec.read_bytes().decode().splitlines()
    rec.write_bytes("".join(line + ending for line in lines).encode())
    return rec


def _diff(rel: str, old: bytes, new: bytes, work: Path) -> bytes:
    (work / "old").write_bytes(old)
    (work / "new").write_bytes(new)
    proc = subprocess.run(["diff", "-u", "--label", f"a/{rel}", "--label", f"b/{rel}",
                           str(work / "old"), str(work / "new")], capture_output=True)
    assert proc.returncode == 1, (rel, proc.stderr)
    return proc.stdout


def write_series(dest: Path, base: dict[str, bytes], steps: list[tuple[str, dict[str, bytes]]]) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    current = dict(base)
    work = dest.parent / f".{dest.name}.diffwork"
    work.mkdir(exist_ok=True)
    try:
        for file_name, edits in steps:
            text = b"".join(_diff(rel, current[rel], new, work) for rel, new in sorted(edits.items()))
            (dest / file_name).write_bytes(text)
            current.update(edits)
    finally:
        shutil.rmtree(work)
    return dest


def insert_after(data: bytes, line_no: int, text: bytes) -> bytes:
    lines = data.split(b"\n")
    lines.insert(line_no, text)
    return b"\n".join(lines)


def default_steps(base: dict[str, bytes], variant: str = "a") -> list[tuple[str, dict[str, bytes]]]:
    f1_a = insert_after(insert_after(base[F1], 10, b"# unit 01: first hunk"), 60,
                        b"# unit 01: second hunk")
    f2_a = insert_after(base[F2], 30, b"# unit 01: transfer")
    f1_b = insert_after(f1_a, 40, b"# unit 02 variant " + variant.encode())
    f3_b = insert_after(base[F3], 20, b"# unit 02: connector " + variant.encode())
    return [("01-first.patch", {F1: f1_a, F2: f2_a}),
            ("02-second.patch", {F1: f1_b, F3: f3_b})]


def manifest_build(dest: Path, wheel: Path, *extra: str) -> dict:
    from _cli import cli  # tests/ is on sys.path (pytest rootdir)

    r = cli("manifest", "build", str(dest), "--wheel", str(wheel), "--json", *extra)
    assert r.rc == 0, r.err
    return r.json["result"]


def wheel_files(wheel: Path) -> dict[str, bytes]:
    """The ``lmcache/...`` members of a wheel (not its dist-info)."""
    with zipfile.ZipFile(wheel) as zf:
        return {n: zf.read(n) for n in zf.namelist() if ".dist-info/" not in n}


def make_patch_root(root: Path, wheel: Path, *, set_name: str = SET, variant: str = "a",
                    extra: tuple[str, ...] = ()) -> Path:
    base = wheel_files(wheel)
    version = Path(wheel).name.split("-")[1]
    dest = write_series(Path(root) / set_name / version, base, default_steps(base, variant))
    manifest_build(dest, wheel, *extra)
    return Path(root)
