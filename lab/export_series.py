#!/usr/bin/env python3
"""Export a patch-development workspace as an ordered patch series.

The workspace is a git repository whose root commit is the pristine
``lmcache/`` tree from the real wheel and whose later commits are the fix
parts, one commit per part, subject ``NN-name`` (e.g. ``02-page-ratio``).
Each commit becomes ``<out>/NN-name.patch``: a plain unified diff with paths
``a/lmcache/...`` / ``b/lmcache/...`` relative to site-packages, so it applies
with ``patch -p1 -F0`` from site-packages and with patchtool's strict applier.

    python -m lab.export_series /tmp/lmwork patches/hybrid-fa/0.5.3

A stacked set (one that ``requires`` another) is developed on top of the
required set's commits in the same workspace; ``--after REV`` exports only
the commits after REV (the required set's last part), so its patches'
pre-images are the required set's post-images:

    python -m lab.export_series /tmp/lmwork patches/engine-driven/0.5.3 \
        --after 08-block-state-from-vllm

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


def _commit_of(repo: Path, rev: str) -> str:
    """A revision, or the one commit whose subject is ``rev`` (e.g. a part name)."""
    log = _git(repo, "log", "--format=%H %s", "HEAD").splitlines()
    matches = [line.split(" ", 1)[0] for line in log if line.split(" ", 1)[1:] == [rev]]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise SystemExit(f"export_series: {len(matches)} commits have the subject {rev!r}")
    try:
        return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"export_series: {rev!r} is neither a commit nor a part subject in {repo}") from None


def export(repo: Path, out: Path, after: str | None = None) -> list[Path]:
    commits = _git(repo, "rev-list", "--reverse", "HEAD").split()
    if after is not None:
        base = _commit_of(repo, after)
        if base not in commits:
            raise SystemExit(f"export_series: {after!r} is not an ancestor of HEAD")
        commits = commits[commits.index(base):]
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
    ap.add_argument("--after", metavar="REV",
                    help="export only the commits after REV (a revision or a commit subject): "
                         "a stacked set on top of the required set's parts")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in export(args.workspace, args.out, args.after):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
