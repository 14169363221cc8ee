#!/usr/bin/env python3
"""Check the upstream proposals (``upstream/*.patch``) against the LMCache
source they target: each applies cleanly, its own test passes patched and
fails pristine, and the series applies and passes as a whole.

A proposal is a ``git format-patch`` file against the Python source of the
newest published LMCache (:data:`TARGET`, read from its wheel: the wheel's
tree is LMCache's ``lmcache/`` package, so a patch made in the upstream repo
applies with ``patch -p1``). It carries its code change and a GPU-free pytest
file under ``tests/``, written the way LMCache's own tests are.

Per proposal:

* **clean**: ``patch -p1 -F0 --dry-run`` on the pristine tree reports no
  offset and no fuzz (a hunk that moved is a proposal to re-make, not to
  force);
* **patched**: its tests run in the target's runtime venv over the
  proposal applied to the pristine tree: every test passes, none skipped
  (the tests skip without vLLM: a vacuous pass must not count);
* **pristine**: the same test files over the pristine tree: at least one
  test fails, and none errors (an import error in collection would be a test
  that fails for the wrong reason).

Then the series: every proposal applied in file order, every test passing.

Trees are ``lab/provision.py`` overlays (the wheel extracted, patches
applied, keyed by content); tests run with ``PYTHONPATH = <tree>:<vLLM
layer>``, the layer of :data:`VLLM` from ``lab/provision_vllm.py``.

Command line: ``python -m lab.upstream_check [--json] [--out FILE]
[--proposal NAME]``; exit 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lab import provision
from lab import provision_vllm
from patchtool.upstream import subject_of  # the one format-patch subject reader

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "upstream"
# The newest published LMCache source (a pre-release counts: it is what
# upstream's development branch shipped last).
TARGET = "0.5.7rc2"
# The vLLM whose scheduler and spec classes the tests import.
VLLM = "0.34.0"
TEST_TIMEOUT_S = 600


class ProposalError(Exception):
    """A proposal file that is not a usable patch (one line, names the file)."""


@dataclass(frozen=True)
class Proposal:
    path: Path
    subject: str
    code_files: tuple[str, ...]
    test_files: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.path.stem


@dataclass
class TestRun:
    """One pytest run over some test files in one tree."""

    tree: str
    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)
    rc: int | None = None
    tail: str = ""

    @property
    def all_passed(self) -> bool:
        return self.tests > 0 and self.failures == self.errors == self.skipped == 0

    @property
    def fails_cleanly(self) -> bool:
        """At least one assertion-style failure and no collection error."""
        return self.failures > 0 and self.errors == 0


def proposals(directory: Path = UPSTREAM) -> list[Proposal]:
    """The proposals in file order (``NNNN-*.patch``)."""
    return [parse(p) for p in sorted(directory.glob("[0-9][0-9][0-9][0-9]-*.patch"))]


def parse(path: Path) -> Proposal:
    """Read one format-patch file: its subject and the files it touches."""
    from unidiff import PatchSet  # noqa: PLC0415

    text = path.read_text()
    subject = subject_of(text)
    if not subject:
        raise ProposalError(f"{path}: no 'Subject:' header (not a git format-patch file)")
    files = [f.path for f in PatchSet(text)]
    tests = tuple(f for f in files if f.startswith("tests/"))
    code = tuple(f for f in files if not f.startswith("tests/"))
    if not tests:
        raise ProposalError(f"{path}: carries no test file under tests/")
    if not code:
        raise ProposalError(f"{path}: changes no LMCache source file")
    return Proposal(path=path, subject=subject, code_files=code, test_files=tests)


def tests_only(proposal: Proposal, dest: Path) -> Path:
    """A patch holding only ``proposal``'s test files (to run them pristine)."""
    from unidiff import PatchSet  # noqa: PLC0415

    kept = [str(f) for f in PatchSet(proposal.path.read_text()) if f.path.startswith("tests/")]
    dest.write_text("".join(kept))
    return dest


def dry_run_problems(patch: Path, tree: Path) -> list[str]:
    """Why ``patch`` does not apply exactly to ``tree`` (empty when it does)."""
    proc = subprocess.run(["patch", "-p1", "-F0", "--dry-run", "-d", str(tree), "-i", str(patch)],
                          capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    problems = [line.strip() for line in out.splitlines()
                if re.search(r"offset|fuzz|FAILED|reversed|can't find", line, re.IGNORECASE)]
    if proc.returncode != 0 and not problems:
        problems.append(f"patch exited {proc.returncode}: {out.strip()[-300:]}")
    return problems


def run_tests(tree: Path, test_files: tuple[str, ...], python: Path, layer: Path) -> TestRun:
    """pytest over ``test_files`` (relative to ``tree``), imports from ``tree``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{layer}",
               "PYTHONDONTWRITEBYTECODE": "1", "LMCACHE_DISABLE_BANNER": "1"}
        proc = subprocess.run(
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree),
             f"--junitxml={report}", *test_files],
            cwd=tree, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
        run = TestRun(tree=tree.name, rc=proc.returncode,
                      tail="\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
        if report.exists():
            _read_junit(report, run)
        return run


def _read_junit(report: Path, run: TestRun) -> None:
    root = ET.parse(report).getroot()
    for suite in root.iter("testsuite"):
        run.tests += int(suite.get("tests", 0))
        run.failures += int(suite.get("failures", 0))
        run.errors += int(suite.get("errors", 0))
        run.skipped += int(suite.get("skipped", 0))
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            run.failed.append(case.get("name", "?"))


@dataclass
class Verdict:
    proposal: str
    subject: str
    code_files: list[str]
    test_files: list[str]
    clean: list[str]          # dry-run problems; empty = applies exactly
    patched: TestRun
    pristine: TestRun

    @property
    def ok(self) -> bool:
        return not self.clean and self.patched.all_passed and self.pristine.fails_cleanly

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok,
                "patched_all_passed": self.patched.all_passed,
                "pristine_fails_cleanly": self.pristine.fails_cleanly}


def check(proposal: Proposal, python: Path, layer: Path, scratch: Path) -> Verdict:
    pristine = provision.overlay(TARGET)
    clean = dry_run_problems(proposal.path, pristine)
    patched_run = TestRun(tree="(not applied)")
    if not clean:
        patched_run = run_tests(provision.overlay(TARGET, [proposal.path]), proposal.test_files,
                                python, layer)
    tests_tree = provision.overlay(TARGET, [tests_only(proposal, scratch / f"{proposal.name}.tests.patch")])
    pristine_run = run_tests(tests_tree, proposal.test_files, python, layer)
    return Verdict(proposal=proposal.name, subject=proposal.subject,
                   code_files=list(proposal.code_files), test_files=list(proposal.test_files),
                   clean=clean, patched=patched_run, pristine=pristine_run)


def check_series(items: list[Proposal], python: Path, layer: Path) -> TestRun:
    tree = provision.overlay(TARGET, [p.path for p in items])
    tests = tuple(t for p in items for t in p.test_files)
    return run_tests(tree, tests, python, layer)


def render(result: dict) -> str:
    lines = [f"upstream proposals against lmcache {result['target']} (vLLM {result['vllm']} layer)"]
    for v in result["proposals"]:
        p, q = v["patched"], v["pristine"]
        lines.append(
            f"  {'ok  ' if v['ok'] else 'FAIL'} {v['proposal']}: "
            f"{'applies exactly' if not v['clean'] else 'does not apply: ' + '; '.join(v['clean'])}; "
            f"patched {p['tests'] - p['failures'] - p['errors'] - p['skipped']}/{p['tests']} pass"
            f"{', ' + str(p['skipped']) + ' skipped' if p['skipped'] else ''}; "
            f"pristine {q['failures']}/{q['tests']} fail"
            f"{', ' + str(q['errors']) + ' error' if q['errors'] else ''}")
    s = result["series"]
    lines.append(f"  {'ok  ' if result['series_ok'] else 'FAIL'} series: "
                 f"{s['tests'] - s['failures'] - s['errors']}/{s['tests']} pass with every proposal applied")
    return "\n".join(lines)


def run(names: list[str] | None = None) -> dict:
    started = time.monotonic()
    items = proposals()
    if names:
        items = [p for p in items if p.name in names or p.path.name in names]
    python = provision.runtime_env(TARGET) / "bin" / "python"
    layer = provision_vllm.vllm_layer(TARGET, vllm=VLLM)
    with tempfile.TemporaryDirectory() as tmp:
        verdicts = [check(p, python, layer, Path(tmp)) for p in items]
    series = check_series(items, python, layer)
    return {"target": TARGET, "vllm": VLLM,
            "proposals": [v.as_dict() for v in verdicts],
            "series": asdict(series), "series_ok": series.all_passed,
            "ok": all(v.ok for v in verdicts) and series.all_passed,
            "seconds": round(time.monotonic() - started, 1)}


# ------------------------------------------------------------------ evidence
#
# What each proposal changes, measured with this project's own harnesses on the
# pristine tree and on the series tree (``--evidence``): the in-process round
# trip (lab.ports_roundtrip: the real
# registration edits and transfer module, bytes compared), the CPU restore
# gate (gate/restore_gate.py: a real server, fs tier, restart) and the
# scheduler simulation under vLLM's real Scheduler (sched_sim; pure attention
# at three block sizes, and the CI hybrid set).

ROUNDTRIP_MATRICES = ("full", "vllm030")
# The CPU restore gate (a real ``lmcache server``, fs L2, SIGKILL, a fresh
# server, restore into other blocks), registering through the connector's own
# kv_cache_group_edits as vLLM's connector does.
GATE_PRESETS = ("pure-attn-bs128", "qwen35-0.8b", "control-k1")
SCHED_RUNS = (("attn", 64), ("attn", 128), ("attn", 256), ("ci", None))


def _lab(python: Path, tree: Path, layer: Path | None, module: str, args: list[str]) -> dict:
    """Run one lab module (``lab.<module>``) with ``tree`` first on the path; its JSON."""
    path = os.pathsep.join(str(p) for p in (tree, layer, REPO) if p is not None)
    proc = subprocess.run([str(python), "-m", f"lab.{module}", *args, "--json"],
                          env={**os.environ, "PYTHONPATH": path, "LMCACHE_DISABLE_BANNER": "1"},
                          capture_output=True, text=True, timeout=1800, cwd=REPO)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"{module} {' '.join(args)} gave no JSON (rc {proc.returncode}): "
                           f"{proc.stderr.strip()[-400:]}") from exc


def roundtrip_summary(report: dict) -> dict[str, dict]:
    """Per geometry preset: cells passed, and the attention bytes restored /
    written into other blocks (sums over the preset's cells)."""
    out: dict[str, dict] = {}
    for cell in report["cells"]:
        preset = cell["cell"]["preset"]
        row = out.setdefault(preset, {"cells": 0, "passed": 0, "fa_requested_bytes": 0,
                                      "fa_restored_bytes": 0, "fa_foreign_bytes": 0})
        row["cells"] += 1
        row["passed"] += int(bool(cell.get("verdict", {}).get("pass")))
        fa = (cell.get("groups") or {}).get("fa") or {}
        row["fa_requested_bytes"] += int(fa.get("requested_bytes", 0))
        row["fa_restored_bytes"] += int(fa.get("restored_bytes", 0))
        row["fa_foreign_bytes"] += int(fa.get("foreign_bytes", 0))
    return out


def sched_summary(report: dict | list) -> list[dict]:
    """Per scenario: crash (step, error) or stored / wrong stores / hit vs ideal."""
    results = report.get("results", report) if isinstance(report, dict) else report
    rows = []
    for r in results if isinstance(results, list) else [results]:
        row = {"scenario": r["scenario"], "crashed": bool(r.get("crashed"))}
        if r.get("crashed") or not r.get("constructed"):
            row.update(step=r.get("crashed_at_step"), error=r.get("error"), at=r.get("error_at"))
        else:
            second = (r.get("second") or {}).values()
            row.update({k: r.get(k) for k in ("chunks_stored", "divergences", "wrong_block_stores",
                                              "wrong_state_hits", "wrong_state_restores")})
            row.update(hit_tokens=sum(x["hit_tokens"] for x in second),
                       ideal_tokens=sum(x["ideal_tokens"] for x in second))
            if r.get("two_request"):
                row.update(stored_tokens=r["two_request"]["stored_tokens"],
                           stored_ideal_tokens=r["two_request"]["ideal_tokens"])
        rows.append(row)
    return rows


def restore_gate(python: Path, tree: Path) -> dict[str, dict]:
    """Per preset: the gate's verdict, chunks found after the restart, attention
    pages restored exact, and bytes written outside the destination blocks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gate.json"
        args = [str(python), str(REPO / "gate" / "restore_gate.py"), "--connector-edits", "--json-out", str(out)]
        for preset in GATE_PRESETS:
            args += ["--preset", preset]
        subprocess.run(args, env={**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}",
                                  "LMCACHE_DISABLE_BANNER": "1"},
                       capture_output=True, text=True, timeout=1800, cwd=REPO)
        if not out.exists():
            raise RuntimeError(f"restore_gate over {tree.name} wrote no report")
        report = json.loads(out.read_text())
    rows = {}
    for p in report["presets"]:
        fa = (p.get("fidelity") or {}).get("fa") or {}
        rows[p["preset"]] = {"verdict": p.get("verdict"),
                             "chunks_found": (p.get("after_restart") or {}).get("chunks_found"),
                             "chunks_stored": (p.get("after_restart") or {}).get("chunks_stored"),
                             "fa_pages_exact": fa.get("pages_exact"), "fa_pages": fa.get("pages_total"),
                             "foreign_bytes": (p.get("foreign_writes") or {}).get("bytes"),
                             "reasons": p.get("reasons")}
    return rows


def evidence(items: list[Proposal]) -> dict:
    python = provision.runtime_env(TARGET) / "bin" / "python"
    layer = provision_vllm.vllm_layer(TARGET, vllm=VLLM)
    trees = {"pristine": provision.overlay(TARGET),
             "series": provision.overlay(TARGET, [p.path for p in items])}
    out: dict = {"roundtrip": {}, "sched": {}, "restore_gate": {}}
    for build, tree in trees.items():
        out["restore_gate"][build] = restore_gate(python, tree)
        out["roundtrip"][build] = {
            m: roundtrip_summary(_lab(python, tree, None, "ports_roundtrip",
                                      ["--edits", "--layout", "HND", "--matrix", m]))
            for m in ROUNDTRIP_MATRICES}
        out["sched"][build] = {
            f"{scenario}" + (f"-{bs}" if bs else ""): sched_summary(_lab(
                python, tree, layer, "sched_sim",
                ["--scenario", scenario] + (["--block-size", str(bs)] if bs else [])))
            for scenario, bs in SCHED_RUNS}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON result")
    ap.add_argument("--out", help="also write the JSON result to this file")
    ap.add_argument("--proposal", action="append", help="only this proposal (repeatable)")
    ap.add_argument("--evidence", action="store_true",
                    help="also measure pristine vs the series with the round-trip harness and "
                         "the scheduler simulation (minutes)")
    args = ap.parse_args(argv)
    try:
        result = run(args.proposal)
        if args.evidence:
            result["evidence"] = evidence(proposals())
    except ProposalError as exc:
        print(f"upstream_check: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else render(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
