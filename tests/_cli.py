"""Run the real ``python -m patchtool`` CLI as a process (shared by the tool
and ci-gate suites; ``tests/`` is on ``sys.path`` as their rootdir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CRASH_VAR = "LMCACHE_PATCHTOOL_FAULT"


@dataclass
class Run:
    rc: int
    out: str
    err: str

    @property
    def json(self) -> dict:
        return json.loads(self.out)


def cli(*args: str, patches: Path | None = None, env: dict | None = None, python: str | None = None,
        timeout: float = 300, cwd: Path | None = None, unset: tuple[str, ...] = (CRASH_VAR,)) -> Run:
    """``python -m patchtool ARGS`` as a real process: ``unset`` dropped from the
    environment, ``patches`` as ``LMCACHE_PATCHTOOL_PATCHES``, then ``env``."""
    e = dict(os.environ)
    for var in unset:
        e.pop(var, None)
    if patches is not None:
        e["LMCACHE_PATCHTOOL_PATCHES"] = str(patches)
    if env:
        e.update(env)
    proc = subprocess.run([python or sys.executable, "-m", "patchtool", *args], capture_output=True,
                          text=True, env=e, timeout=timeout, cwd=cwd)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def one_line(r, rc: int, file: object, *needles: str) -> str:
    """Assert a refusal: exit ``rc``, exactly one stderr line naming ``file``."""
    assert r.rc == rc, (r.rc, r.out, r.err)
    lines = r.err.splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith(f"patchtool: {file}: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def stand_in_python(tmp_path: Path) -> Path:
    """An interpreter the tool's up-front torch probe accepts without a real
    torch: this one, with an empty ``torch`` package on PYTHONPATH.  Enough
    for phases that only run scripts the tests replace or expect to fail."""
    fake = tmp_path / "faketorch"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("")
    py = tmp_path / "python"
    py.write_text(f'#!/bin/sh\nexport PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{fake}"\n'
                  f'exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return py
