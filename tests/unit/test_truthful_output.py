"""What the human output says is what happened, whole.

A dry run says what it WOULD remove; a revert with nothing to restore says
so without naming a source it did not use; a run whose output is a pipe or
a log (not a terminal) prints every path and hash whole (rich lays such
output out at 80 columns and cut cells with an ellipsis, so two files could
print the same); an interpreter that is not Python is refused in one short
line, not with the probe script it was given quoted back."""

from __future__ import annotations

from pathlib import Path

from _cli import CRASH_VAR, cli, one_line

from .synthwheel import F1, F2, F3


def sp(site: Path) -> tuple[str, str]:
    return ("--site-packages", str(site))


def plain(*args: str, **kw):
    """The CLI with stdout a pipe and no COLUMNS (as under cron, CI or `| tee`)."""
    return cli(*args, unset=(CRASH_VAR, "COLUMNS"), **kw)


def test_dry_run_says_would_remove_the_stale_bytecode(site, patch_root):
    res = cli("apply", "--dry-run", *sp(site), "--json", patches=patch_root).json["result"]
    n = len(res["removed_pyc"])
    assert n > 0  # pip byte-compiled the modules the series edits
    r = plain("apply", "--dry-run", *sp(site), patches=patch_root)
    assert r.rc == 0, r.err
    assert f"would remove {n} stale .pyc file(s)" in r.out, r.out
    assert not [ln for ln in r.out.splitlines() if ln.startswith("removed")], r.out
    assert list(site.rglob("*.pyc"))  # and nothing was removed
    r = plain("apply", *sp(site), patches=patch_root)
    assert r.rc == 0 and f"removed {n} stale .pyc file(s)" in r.out, r.out


def test_revert_of_a_pristine_install_names_no_source(site, patch_root):
    r = plain("revert", *sp(site), patches=patch_root)
    assert r.rc == 0, r.err
    assert r.out.splitlines()[0] == "lmcache 9.9.9: nothing to revert (pristine)", r.out
    r = plain("revert", "--dry-run", *sp(site), patches=patch_root)
    assert r.out.splitlines()[0] == "lmcache 9.9.9: nothing to revert (pristine)", r.out


def test_output_to_a_pipe_prints_paths_and_hashes_whole(site, patch_root):
    st = cli("status", *sp(site), "--json", patches=patch_root).json["result"]
    r = plain("status", *sp(site), patches=patch_root)
    assert r.rc == 0, r.err
    assert "…" not in r.out, r.out
    for f in st["files"]:  # each file's row holds its whole path and whole hash
        row = next(ln for ln in r.out.splitlines() if ln.startswith(f["path"] + " "))
        assert f["hash"] in row, r.out
    r = plain("apply", "--dry-run", *sp(site), patches=patch_root)
    assert "…" not in r.out and all(p in r.out for p in (F1, F2, F3)), r.out


def test_a_narrow_terminal_width_folds_and_never_cuts(site, patch_root):
    for args in (("status",), ("apply", "--dry-run"), ("list",)):
        r = cli(*args, *sp(site)[: 2 if args[0] != "list" else 0], patches=patch_root,
                env={"COLUMNS": "50"})
        assert r.rc == 0, r.err
        assert "…" not in r.out, r.out


def test_an_interpreter_that_is_not_python_is_refused_in_one_short_line(site, patch_root):
    r = cli("status", "--python", "/bin/ls", patches=patch_root)
    line = one_line(r, 3, "/bin/ls")
    assert len(line) < 200, line
    assert "import json" not in line, line  # the probe script is not quoted back
    # the restore checks' probe of --python, with the install given by --site-packages
    for prog in ("/bin/ls", "/bin/echo"):  # fails, or exits 0 having printed no JSON
        r = cli("verify", *sp(site), "--python", prog, "--roundtrip", patches=patch_root)
        assert len(one_line(r, 3, prog)) < 200, r.err
