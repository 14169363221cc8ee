#!/usr/bin/env python3
"""Export a patch-development workspace as an ordered patch series.

The workspace is a git repository whose root commit is the pristine
``lmcache/`` tree from the real wheel and whose later commits are the fix
parts, one commit per part, subject ``NN-name`` (e.g. ``02-page-ratio``).
Each commit becomes ``<out>/NN-name.patch``: a plain unified diff with paths
``a/lmcache/...`` / ``b/lmcache/...`` relative to site-packages, so it applies
with ``patch -p1 -F0`` from site-packages and with patchtool's strict applier.

    python scripts/export_series.py /tmp/lmwork patches/hybrid-fa/0.5.3

Afterwards regenerate the manifest (``patchtool manifest build``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True,
                          capture_output=True, text=True).stdout


def export(repo: Path, out: Path) -> list[Path]:
    commits = _git(repo, "rev-list", "--reverse", "HEAD").split()
    written = []
    for parent, commit in zip(commits, commits[1:]):
        subject = _git(repo, "log", "-1", "--format=%s", commit).strip()
        if not re.fullmatch(r"\d\d-[a-z0-9-]+", subject):
            raise SystemExit(f"export_series: commit {commit[:10]} subject {subject!r} is not NN-name")
        diff = _git(repo, "diff", "--no-color", "--no-ext-diff", "-U3", "--src-prefix=a/",
                    "--dst-prefix=b/", parent, commit)
        # Drop git's extended header lines; keep a plain unified diff.
        lines = [ln for ln in diff.splitlines(keepends=True)
                 if not ln.startswith(("diff --git ", "index "))]
        path = out / f"{subject}.patch"
        path.write_text("".join(lines))
        written.append(path)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspace", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in export(args.workspace, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
