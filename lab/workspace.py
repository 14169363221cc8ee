#!/usr/bin/env python3
"""Rebuild a patch-development workspace from the real wheel and the shipped series.

The workspace is what ``lab/export_series.py`` reads: a git repository
whose root commit is the pristine ``lmcache/`` tree of the real wheel and
whose later commits are the shipped parts, one commit per part, subject
``NN-name``, in stack order (the required set's parts first).  A part is
applied with GNU ``patch -p1 -F0`` (zero fuzz), exactly as the overlay and
patchtool's applier would.

    python -m lab.workspace 0.5.6 /tmp/lmwork-0.5.6
    python -m lab.workspace 0.5.6 /tmp/lmwork-0.5.6 --sets hybrid-fa

Then add or amend commits there and export with ``export_series.py``
(``--after <last part of the required set>`` for a stacked set).  The target
directory must not exist: a workspace holds work, so it is never replaced.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from lab import provision  # a sibling script, not a package

DEFAULT_SETS = ("hybrid-fa", "engine-driven")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def _commit(repo: Path, subject: str) -> None:
    _git(repo, "add", "-A", ".")
    _git(repo, "-c", "user.name=workspace", "-c", "user.email=workspace@localhost",
         "commit", "-q", "--allow-empty", "-m", subject)


def series(version: str, set_name: str, root: Path = REPO / "patches") -> list[Path]:
    """The parts of one shipped set, in the manifest's order."""
    manifest = json.loads((root / set_name / version / "manifest.json").read_text())
    return [root / set_name / version / p["file"] for p in manifest["patches"]]


def build(version: str, dest: Path, sets: tuple[str, ...] = DEFAULT_SETS) -> list[str]:
    if dest.exists():
        raise SystemExit(f"workspace: {dest}: exists; remove it or pick another path")
    dest.mkdir(parents=True)
    with zipfile.ZipFile(provision.wheel(version)) as zf:
        members = [m for m in zf.namelist() if m.startswith("lmcache/")]
        zf.extractall(dest, members)
    _git(dest, "init", "-q")
    _commit(dest, f"lmcache {version} (wheel)")
    subjects = []
    for set_name in sets:
        for patch in series(version, set_name):
            subprocess.run(["patch", "-p1", "-F0", "--no-backup-if-mismatch", "-s",
                            "-d", str(dest), "-i", str(patch)], check=True)
            _commit(dest, patch.stem)
            subjects.append(f"{set_name}/{patch.stem}")
    return subjects


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version")
    ap.add_argument("dest", type=Path)
    ap.add_argument("--sets", default=",".join(DEFAULT_SETS),
                    help="comma-separated sets in stack order (default: %(default)s)")
    args = ap.parse_args()
    parts = build(args.version, args.dest, tuple(s for s in args.sets.split(",") if s))
    print(f"workspace: {args.dest}: lmcache {args.version} + {len(parts)} parts: "
          + ", ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
