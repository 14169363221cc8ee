"""Shared helpers for the tool tests: run the real CLI, hash real trees."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

from _cli import Run, cli  # noqa: F401  (re-exported: run the real CLI)

REPO = Path(__file__).resolve().parents[2]
STATE_DIR = ".lmcache-patchtool"


def site_of(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def tree_hashes(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """relpath -> sha256 of every file (and symlink target) under ``root``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in filenames:
            if name in skip:
                continue
            p = Path(dirpath) / name
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_venv(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def wheel_member(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(name)


def write_diff(patch_file: Path, rel: str, old: bytes, new: bytes, append: bool = False) -> None:
    """A real unified diff from GNU diff (a/ b/ prefixes, -p1 paths)."""
    tmp = patch_file.parent / ".diffwork"
    tmp.mkdir(exist_ok=True)
    (tmp / "old").write_bytes(old)
    (tmp / "new").write_bytes(new)
    proc = subprocess.run(["diff", "-u", "--label", f"a/{rel}", "--label", f"b/{rel}",
                           str(tmp / "old"), str(tmp / "new")], capture_output=True)
    assert proc.returncode == 1, proc.stderr
    with open(patch_file, "ab" if append else "wb") as fh:
        fh.write(proc.stdout)
    shutil.rmtree(tmp)


def insert_after(data: bytes, line_no: int, text: bytes) -> bytes:
    lines = data.split(b"\n")
    lines.insert(line_no, text)
    return b"\n".join(lines)


def replace_line(data: bytes, line_no: int, text: bytes) -> bytes:
    lines = data.split(b"\n")
    lines[line_no - 1] = text
    return b"\n".join(lines)
