#!/usr/bin/env python3
"""Generate README's support table from the shipped manifests.

The table (LMCache version x vLLM versions verified x state) sits between
``<!-- support-table:start -->`` and ``<!-- support-table:end -->`` in
README.md. It is never edited by hand: run

    python scripts/support_table.py          # rewrite README.md in place
    python scripts/support_table.py --check  # exit 1 if README is stale (tests run this)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from packaging.version import Version  # noqa: E402

from patchtool.manifest import list_patch_sets  # noqa: E402

START = "<!-- support-table:start -->"
END = "<!-- support-table:end -->"


def render(patches_root: Path) -> str:
    rows = sorted(list_patch_sets(patches_root), key=lambda r: (Version(r.lmcache_version), r.set))
    out = [
        "| LMCache | patch set | vLLM verified | state | patches | files patched |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.state == "patch":
            state = f"patch, revision {row.revision}"
        else:
            state = row.state
        files = ", ".join(f"`{Path(f).name}`" for f in row.files) or "-"
        vllm = ", ".join(row.vllm_versions) or "-"
        out.append(f"| {row.lmcache_version} | {row.set} | {vllm} | {state} | {row.patches} | {files} |")
    out.append("")
    out.append("Any other LMCache version is reported as `unsupported-version` by `patchtool status`.")
    return "\n".join(out)


def updated_readme(readme: str, table: str) -> str:
    head, sep, rest = readme.partition(START)
    if not sep or END not in rest:
        raise SystemExit(f"support_table: README.md: markers {START} / {END} not found")
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    readme_path = REPO / "README.md"
    readme = readme_path.read_text()
    new = updated_readme(readme, render(REPO / "patches"))
    if args.check:
        if new != readme:
            print("support_table: README.md: support table is stale; run python scripts/support_table.py",
                  file=sys.stderr)
            return 1
        return 0
    readme_path.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
