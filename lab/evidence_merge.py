"""Merge a partial evidence run into a committed evidence file.

A change to one series (say a part added to three versions) stales only the
cells whose patches changed.  Rerunning just those cells and merging keeps
the others as they were measured, and the file says which run measured
which cell: ``runs`` lists every run that contributed, newest first, with the
cells it wrote.  A cell is identified by ``key`` (e.g. lmcache, vllm, build);
the new run's cell replaces the old one with the same identity.
"""

from __future__ import annotations

from typing import Any

PROVENANCE = ("command", "git_head", "generated", "seconds", "scenario_set")


def cell_id(cell: dict[str, Any], key: tuple[str, ...]) -> str:
    return "/".join(str(cell.get(k)) for k in key)


def _old_runs(old: dict[str, Any], key: tuple[str, ...]) -> list[dict[str, Any]]:
    if "runs" in old:
        return list(old["runs"])
    run = {k: old[k] for k in PROVENANCE if k in old}
    run["cells"] = [cell_id(c, key) for c in old.get("cells", [])]
    return [run]


def merge(old: dict[str, Any] | None, new: dict[str, Any], key: tuple[str, ...]) -> dict[str, Any]:
    """``new`` (a whole evidence document from a partial run) with the cells
    of ``old`` it did not rerun kept, in ``old``'s order, and ``runs`` saying
    which run wrote which cell.  A run left with no cell is dropped."""
    if old is None:
        return new
    if old.get("schema") != new.get("schema"):
        raise ValueError(f"cannot merge evidence of schema {new.get('schema')!r} into "
                         f"{old.get('schema')!r}: regenerate the whole file")
    fresh = {cell_id(c, key): c for c in new["cells"]}
    cells = [fresh.pop(cell_id(c, key), c) for c in old["cells"]]
    cells += list(fresh.values())
    this_run = {k: new[k] for k in PROVENANCE if k in new}
    this_run["cells"] = [cell_id(c, key) for c in new["cells"]]
    replaced = set(this_run["cells"])
    runs = [this_run]
    for run in _old_runs(old, key):
        kept = [c for c in run["cells"] if c not in replaced]
        if kept:
            runs.append(dict(run, cells=kept))
    return dict(new, cells=cells, runs=runs)
