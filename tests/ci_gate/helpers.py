"""Helpers for the ci-gate tests: run the real CLI as a process, hash files,
and derive modified copies of a real wheel."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import _cli
from _cli import Run

REPO = Path(__file__).resolve().parents[2]
TARGET_FILE = "lmcache/v1/kv_layer_groups.py"  # edited by the 0.5.3 series
OTHER_FILE = "lmcache/v1/memory_management.py"  # not edited by it


def cli(*args: str, patches: Path | None = None, env: dict | None = None,
        timeout: float = 1800) -> Run:
    """``python -m patchtool ARGS`` as a real process (the dev venv's python),
    without ``PYTHONPATH``, from the repository root."""
    return _cli.cli(*args, patches=patches, env=env, timeout=timeout, cwd=REPO,
                    unset=(_cli.CRASH_VAR, "PYTHONPATH"))


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def rewrite_wheel(src: Path, dest: Path, edit=None) -> Path:
    """Copy ``src`` member by member with ``zipfile`` (so compression and
    timestamps differ from the original), applying ``edit(name, data)``.
    The copy's RECORD is NOT regenerated: an edited member no longer
    matches it, exactly like a wheel tampered with after it was built."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED,
                                                      compresslevel=1) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if edit is not None:
                data = edit(info.filename, data)
            new = zipfile.ZipInfo(info.filename, date_time=(2030, 1, 2, 3, 4, 6))
            new.external_attr = info.external_attr
            new.compress_type = zipfile.ZIP_STORED if info.is_dir() else zipfile.ZIP_DEFLATED
            zout.writestr(new, data)
    return dest


def flip_one_byte(target: str):
    def edit(name: str, data: bytes) -> bytes:
        if name != target:
            return data
        i = data.index(b"import")  # a byte inside real code, not a trailing newline
        return data[:i] + b"I" + data[i + 1:]
    return edit


def make_venv(dest: Path, with_pip: bool = True) -> Path:
    from lab import provision  # noqa: PLC0415

    cmd = [provision._python(), "-m", "venv", str(dest)]
    if not with_pip:
        cmd.insert(3, "--without-pip")
    subprocess.run(cmd, check=True)
    return dest / "bin" / "python"


def site_of(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def tree_digest(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
