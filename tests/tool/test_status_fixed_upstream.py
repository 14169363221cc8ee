"""``patchtool status`` on an LMCache release that already contains one of this
project's upstream proposals (patchtool/upstream.py): the proposal and the
part it stands for are named as fixed upstream, in a note and in the JSON.

The "later release" is the real 0.5.7rc2 install (lab/provision.py's bare
env, copied) with the proposal applied to its site-packages, which is what a
release shipping it looks like on disk; the same install without it, and with
the fix written differently by one line, names nothing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lab import provision
from patchtool import upstream

from .helpers import REPO, cli, copy_venv, site_of

TARGET = "0.5.7rc2"  # the newest published LMCache, which the proposals target
PROPOSAL = REPO / "upstream" / "0003-vllm034-scheduler-output.patch"


@pytest.fixture
def venv(tmp_path) -> Path:
    return copy_venv(provision.bare_env(TARGET), tmp_path / "venv")


def _apply(site: Path, patch: Path) -> None:
    subprocess.run(["patch", "-p1", "-F0", "-s", "-d", str(site), "-i", str(patch)], check=True)


def _status(venv: Path) -> dict:
    return cli("status", "--python", str(venv / "bin" / "python"), "--json").json["result"]


def test_release_with_the_proposal_names_it_and_its_part(venv):
    _apply(site_of(venv), PROPOSAL)

    st = _status(venv)

    assert [f["proposal"] for f in st["fixed_upstream"]] == [PROPOSAL.stem]
    assert st["fixed_upstream"][0]["parts"] == ["hybrid-fa/15-vllm034-scheduler-output"]
    [note] = [n for n in st["notes"] if "upstream proposal" in n]
    assert note.startswith(f"lmcache {TARGET} contains this project's upstream proposal {PROPOSAL.stem}")
    assert "is fixed upstream in this release" in note
    # the human output keeps the subject's brackets (rich markup would eat "[vLLM]")
    human = cli("status", "--python", str(venv / "bin" / "python")).out
    assert "[Integration][vLLM] Read scheduler output" in human


def test_release_without_it_names_nothing(venv):
    assert _status(venv)["fixed_upstream"] == []


def test_a_fix_written_differently_is_not_claimed(venv):
    """Exact post-images only: one changed line and the release is not said
    to contain the proposal (status stays silent rather than guess)."""
    site = site_of(venv)
    _apply(site, PROPOSAL)
    path = site / "lmcache" / "integration" / "vllm" / "lmcache_mp_connector.py"
    text = path.read_text()
    line = '    return getattr(cached_reqs, "resumed_req_ids", None) or ()\n'
    assert line in text
    path.write_text(text.replace(line, '    return getattr(cached_reqs, "resumed_req_ids", ()) or ()\n'))

    assert _status(venv)["fixed_upstream"] == []


@pytest.mark.parametrize("version", ["0.5.3", "0.5.6"])
def test_released_versions_pristine_and_patched_claim_nothing(tmp_path, bare_envs, version):
    venv = copy_venv(bare_envs[version], tmp_path / "venv")
    assert _status(venv)["fixed_upstream"] == []
    assert cli("apply", "--python", str(venv / "bin" / "python")).rc == 0
    assert _status(venv)["fixed_upstream"] == []


def test_every_shipped_proposal_parses_and_names_a_shipped_part():
    proposals = upstream.load(REPO / "upstream")
    assert [p.name for p in proposals] == sorted(p.stem for p in (REPO / "upstream").glob("0*.patch"))
    for p in proposals:
        assert p.hunks and all(not h.path.startswith("tests/") for h in p.hunks), p.name
        assert p.subject and p.parts, p.name
        for part in p.parts:
            series, name = part.split()[0].split("/")
            assert list((REPO / "patches" / series).glob(f"*/{name}.patch")), part


def test_hunk_post_images_are_counted_from_the_headers(tmp_path):
    """A format-patch signature ('-- ') after the last hunk is not a removed
    line, and removed lines are not in the post-image."""
    text = ("Subject: [PATCH] x\n\n---\n"
            "--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,3 @@\n a\n-b\n+c\n d\n"
            "-- \n2.39.5\n")
    (hunk,) = upstream.parse_hunks(text, tmp_path / "p.patch")
    assert hunk.path == "m.py" and hunk.post_image == ("a", "c", "d")
