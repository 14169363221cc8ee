"""The strict applier on real files, with GNU patch (-F0) as the oracle."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from patchtool.applier import ALREADY, APPLIES, CONFLICT, apply_series, parse_patch, split_lines
from patchtool.errors import PatchParseError

from .conftest import F1, real_series_dir
from .helpers import REPO, insert_after, write_diff


def _gnu_patch(tree: Path, patches: list[Path]) -> None:
    for p in patches:
        subprocess.run(["patch", "-p1", "-F0", "--no-backup-if-mismatch", "-s", "-d", str(tree),
                        "-i", str(p)], check=True)


def _series_matches_gnu_patch(tmp_path: Path, wheel: Path, series_dir: Path) -> None:
    patches = sorted(series_dir.glob("*.patch"))
    tree = tmp_path / "gnu"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tree)
        parsed = [parse_patch(p) for p in patches]
        res = apply_series(parsed, lambda path: zf.read(path))
    assert res.ok and all(r.status == APPLIES for r in res.results)
    _gnu_patch(tree, patches)
    for path, data in res.files.items():
        assert data == (tree / path).read_bytes(), path


def test_test_series_matches_gnu_patch(tmp_path, wheel053, test_patches):
    _series_matches_gnu_patch(tmp_path, wheel053, test_patches / "testset" / "0.5.3")


def test_real_series_matches_gnu_patch(tmp_path, wheel053):
    d = REPO / "patches" / "hybrid-fa" / "0.5.3"
    if not any(d.glob("*.patch")):
        pytest.skip("the hybrid-fa 0.5.3 series is not in the tree yet")
    _series_matches_gnu_patch(tmp_path, wheel053, d)


def _one_file_patch(tmp_path: Path, old: bytes, new: bytes, rel: str = "pkg/mod.py") -> Path:
    p = tmp_path / "t.patch"
    write_diff(p, rel, old, new)
    return p


def _run(patch: Path, data: bytes):
    parsed = parse_patch(patch)
    res = apply_series([parsed], lambda _: data)
    return res.results[0], res.files[parsed.files[0].path]


@pytest.fixture
def real_file(wheel053) -> bytes:
    with zipfile.ZipFile(wheel053) as zf:
        return zf.read(F1)


def test_zero_offset_refused(tmp_path, real_file):
    """GNU patch would apply this one line lower ("offset 1"); we must not."""
    new = insert_after(real_file, 200, b"# added")
    patch = _one_file_patch(tmp_path, real_file, new)
    shifted = b"# a line the patch did not expect\n" + real_file
    fr, out = _run(patch, shifted)
    assert fr.status == CONFLICT and out == shifted
    assert "line 198" in fr.hunks[0].detail
    # sanity: GNU patch with its default offset search accepts it
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_bytes(shifted)
    proc = subprocess.run(["patch", "-p1", "-F0", "--dry-run", "-d", str(tmp_path), "-i",
                           str(patch)], capture_output=True, text=True)
    assert proc.returncode == 0 and "offset" in proc.stdout


def test_fuzz_refused(tmp_path, real_file):
    new = insert_after(real_file, 200, b"# added")
    patch = _one_file_patch(tmp_path, real_file, new)
    lines = split_lines(real_file)
    lines[198] = lines[198].rstrip(b"\n") + b"  # edited context\n"
    fr, _ = _run(patch, b"".join(lines))
    assert fr.status == CONFLICT and "line 199" in fr.hunks[0].detail


def test_already_applied_detected(tmp_path, real_file):
    new = insert_after(real_file, 200, b"# added")
    patch = _one_file_patch(tmp_path, real_file, new)
    fr, out = _run(patch, new)
    assert fr.status == ALREADY and out == new


@pytest.mark.parametrize("old,new", [
    (b"a\nb\nc", b"a\nB\nc"),          # no newline at EOF on both sides
    (b"a\nb\nc", b"a\nb\nc\n"),        # newline added at EOF
    (b"a\nb\nc\n", b"a\nb\nc"),        # newline removed at EOF
    (b"a\r\nb\r\nc\r\n", b"a\r\nX\r\nc\r\n"),  # CRLF kept byte-exactly
    (b"a\nb\r\nc\n", b"a\nb\r\nc\nd\n"),       # mixed endings
])
def test_line_endings_exact(tmp_path, old, new):
    patch = _one_file_patch(tmp_path, old, new)
    if b"\n" not in old[-1:] or b"\n" not in new[-1:]:
        assert b"No newline at end of file" in patch.read_bytes()
    fr, out = _run(patch, old)
    assert fr.status == APPLIES and out == new
    fr, out = _run(patch, new)
    assert fr.status == ALREADY


def test_missing_final_newline_is_not_ignored(tmp_path):
    patch = _one_file_patch(tmp_path, b"a\nb\nc", b"a\nB\nc")
    fr, _ = _run(patch, b"a\nb\nc\n")  # the file has a newline the patch says is absent
    assert fr.status == CONFLICT


def test_split_lines_roundtrip():
    for data in (b"", b"x", b"x\n", b"a\r\nb", b"\n\n", b"a\rb\n"):
        assert b"".join(split_lines(data)) == data


def test_unsupported_patches_refused(tmp_path):
    p = tmp_path / "add.patch"
    p.write_text("--- /dev/null\n+++ b/pkg/new.py\n@@ -0,0 +1 @@\n+x\n")
    with pytest.raises(PatchParseError, match="only modifications"):
        parse_patch(p)
    p.write_text("--- a/../evil.py\n+++ b/../evil.py\n@@ -1 +1 @@\n-x\n+y\n")
    with pytest.raises(PatchParseError, match="not a plain path"):
        parse_patch(p)
    p.write_text("--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n-x\n+y\n")
    with pytest.raises(PatchParseError):
        parse_patch(p)
