"""The upstream proposals (``upstream/``) against the LMCache source they
target (``lab/upstream_check.py``): each applies exactly, its own test
passes patched and fails pristine, the series passes as a whole; and the
check itself can fail (a proposal without its fix, a moved hunk, a test that
only skips)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lab import provision
from lab import provision_vllm
from lab import upstream_check as uc

REPO = Path(__file__).resolve().parents[2]
EVIDENCE = REPO / "lab" / "evidence" / "upstream-check.json"
README = REPO / "upstream" / "README.md"
# What the issue asks for at least: the pure-attention rule, the CPU stride
# path, vLLM 0.34's scheduler output.
REQUIRED = ("pure-attention", "padded-block-stride", "scheduler-output")


@pytest.fixture(scope="module")
def result() -> dict:
    return uc.run()


@pytest.fixture(scope="module")
def runtime() -> tuple[Path, Path]:
    return (provision.runtime_env(uc.TARGET) / "bin" / "python",
            provision_vllm.vllm_layer(uc.TARGET, vllm=uc.VLLM))


def test_required_proposals_exist() -> None:
    names = [p.name for p in uc.proposals()]
    for needle in REQUIRED:
        assert any(needle in n for n in names), (needle, names)


def test_readme_describes_every_proposal() -> None:
    text = README.read_text()
    for p in uc.proposals():
        assert p.path.name in text, p.path.name
        assert "None of these has been submitted upstream" in text


@pytest.mark.parametrize("proposal", uc.proposals(), ids=lambda p: p.name)
def test_proposal_meets_its_contract(result: dict, proposal: uc.Proposal) -> None:
    (verdict,) = [v for v in result["proposals"] if v["proposal"] == proposal.name]
    assert verdict["clean"] == [], verdict["clean"]
    assert verdict["patched_all_passed"], verdict["patched"]["tail"]
    assert verdict["pristine_fails_cleanly"], verdict["pristine"]["tail"]


def test_series_passes_as_a_whole(result: dict) -> None:
    assert result["series_ok"], result["series"]["tail"]


def test_recorded_evidence_matches_the_proposals(result: dict) -> None:
    """lab/evidence/upstream-check.json is a run over these proposals,
    with the same per-proposal counts as this run."""
    recorded = json.loads(EVIDENCE.read_text())
    assert recorded["ok"] and recorded["target"] == uc.TARGET
    counts = lambda r: {v["proposal"]: (v["patched"]["tests"], v["pristine"]["failures"])  # noqa: E731
                        for v in r["proposals"]}
    assert counts(recorded) == counts(result)


# ------------------------------------------------------------ negative controls


def test_a_proposal_without_its_fix_is_rejected(tmp_path: Path, runtime) -> None:
    """The 0.34 proposal with its code hunks removed: its test must fail on
    both trees, and the verdict must say so."""
    real = next(p for p in uc.proposals() if "scheduler-output" in p.name)
    bare = tmp_path / real.path.name
    uc.tests_only(real, bare)
    bare.write_text("Subject: [PATCH] tests only\n\n" + bare.read_text())
    verdict = uc.check(uc.Proposal(bare, "tests only", real.code_files, real.test_files),
                       *runtime, tmp_path)
    assert not verdict.ok
    assert not verdict.patched.all_passed and verdict.patched.failures > 0


def test_a_moved_hunk_is_reported(tmp_path: Path) -> None:
    """Zero fuzz, zero offset: one line added above the patched code makes
    the dry run report an offset, and the proposal is not 'clean'."""
    real = next(p for p in uc.proposals() if "scheduler-output" in p.name)
    (target,) = real.code_files
    tree = tmp_path / "tree"
    src = provision.overlay(uc.TARGET) / target
    (tree / target).parent.mkdir(parents=True)
    shutil.copy(src, tree / target)
    (tree / target).write_text("# moved\n" + src.read_text())
    assert uc.dry_run_problems(real.path, provision.overlay(uc.TARGET)) == []
    problems = uc.dry_run_problems(real.path, tree)
    assert problems and any("offset" in p for p in problems), problems


def test_tests_that_only_skip_do_not_pass(runtime, tmp_path: Path) -> None:
    """Without vLLM on the path the vLLM-importing tests skip: that is not a pass."""
    python, _ = runtime
    real = next(p for p in uc.proposals() if "pure-attention" in p.name)
    empty = tmp_path / "no-vllm"
    empty.mkdir()
    run = uc.run_tests(provision.overlay(uc.TARGET, [real.path]), real.test_files, python, empty)
    assert run.skipped > 0 and not run.all_passed
