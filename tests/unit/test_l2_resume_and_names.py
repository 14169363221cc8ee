"""``patchtool l2 scan``: a killed quarantine resumes for the same target
however its path is spelled (the journal keys the reader by what the target
is: resolved site dir, dist-info, hashes), and names are matched with the
grammar's whole character set (``@`` is the only byte a model name cannot
hold), with directories named like objects reported as foreign."""

from __future__ import annotations

import os
from pathlib import Path

from _cli import CRASH_VAR, cli, one_line

from patchtool.l2 import names as l2names

from . import synthwheel as sw
from .l2tier import FLAGGED, JOURNAL, NS1, NS2, check_split, name, put, scan_json, tree


def _never_read_tier(d: Path, n: int = 600) -> dict[str, str]:
    """Namespaced objects a pristine reader never reads (two journal batches)."""
    d.mkdir(parents=True)
    for i in range(n):
        put(d, name(0, i, NS1), 16)
    put(d, name(1, 0), 16)
    return tree(d)


def _kill_then_resume(tmp_path, first: tuple[str, ...], second: tuple[str, ...],
                      patches: Path, cwd: Path) -> None:
    d, q = tmp_path / "tier", tmp_path / "q"
    before = _never_read_tier(d)
    args = ("l2", "scan", str(d), "--quarantine", str(q), "--json")
    r = cli(*args, *first, env={CRASH_VAR: "crash:3"}, unset=(), patches=patches, cwd=cwd)
    assert r.rc == 86, (r.rc, r.err)
    r = cli(*args, *second, patches=patches, cwd=cwd)
    assert r.rc == 0, r.err
    assert r.json["result"]["quarantine"]["resumed"] is True
    assert set(tree(d)) == {name(1, 0)}
    check_split(d, q, before)


def test_resume_with_the_target_spelled_differently(tmp_path, site, patch_root):
    """Killed with ``--site-packages site`` typed relative to its parent,
    finished with the absolute path, a trailing slash, and a symlink to it."""
    alias = tmp_path / "alias"
    alias.symlink_to(site)
    for i, spelled in enumerate((f"{site}/", str(alias))):
        _kill_then_resume(tmp_path / f"run{i}", ("--site-packages", site.name),
                          ("--site-packages", spelled), patch_root, cwd=site.parent)


def test_resume_across_python_and_site_packages(tmp_path, venv, patch_root):
    """The same install reached through its interpreter and through its site dir."""
    _kill_then_resume(tmp_path, ("--site-packages", str(sw.venv_site(venv))),
                      ("--python", str(venv / "bin" / "python")), patch_root, cwd=tmp_path)


def test_resume_refused_for_another_install(tmp_path, site, patch_root, fresh_site):
    """Another copy of the same wheel is another target: refused, one line."""
    d, q = tmp_path / "tier", tmp_path / "q"
    _never_read_tier(d)
    args = ("l2", "scan", str(d), "--quarantine", str(q))
    r = cli(*args, "--site-packages", str(site), env={CRASH_VAR: "crash:3"}, unset=(),
            patches=patch_root)
    assert r.rc == 86
    other = sw.copy_site(fresh_site, tmp_path / "other-site")
    j = (q / JOURNAL).read_bytes()
    line = one_line(cli(*args, "--site-packages", str(other), patches=patch_root), 3,
                    q / JOURNAL, "unfinished quarantine")
    assert len(line) < 200 and (q / JOURNAL).read_bytes() == j


def test_newline_in_a_model_name(tmp_path):
    """``@`` is the only character a model name cannot hold: a name with a
    newline still carries its namespace, and the human line stays one line."""
    model = "org/odd\nname"
    fname = name(0, 1, NS2, model=model)
    p = l2names.parse(fname)
    assert (p.key.model, p.key.namespace, p.key.layout_format) == (model, NS2, 2)
    d = tmp_path / "t"
    d.mkdir()
    put(d, fname, 16)
    put(d, name(0, 2, NS1, model=model), 16)
    rc, doc = scan_json(d, "--assume", "kvl1")
    assert rc == FLAGGED and doc["result"]["flagged"]["never-read"]["objects"] == 1
    rows = {s["namespace"]: s for s in doc["result"]["sets"]}
    assert rows[NS2]["model"] == model and rows[NS2]["readable"] is False
    r = cli("l2", "scan", str(d), "--assume", "kvl1")
    assert r.rc == FLAGGED
    lines = r.out.splitlines()
    assert not any(x.startswith("name") or x.startswith("name+") for x in lines), r.out
    assert sum("org/odd\\nname" in x for x in lines) == 2, r.out  # one line per set, escaped


def test_markup_and_control_bytes_in_names_are_shown_literally(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    model = "org/[bold]m\x1b[31m"
    put(d, name(0, 1, NS2, model=model), 16)
    r = cli("l2", "scan", str(d), "--assume", "kvl1")
    assert r.rc == FLAGGED and "\x1b" not in r.out
    assert "org/[bold]m\\x1b[31m" in r.out, r.out


def test_directory_named_like_an_object_is_foreign(tmp_path):
    """docs/disk-tier.md: a link or a directory named like an object is foreign (listed);
    other directories (the adapter's tmp dir) are skipped subdirs."""
    d = tmp_path / "t"
    d.mkdir()
    (d / "tmp").mkdir()
    (d / name(0, 9)).mkdir()
    os.symlink("/etc/hostname", d / name(0, 2))
    res = scan_json(d, "--assume", "pristine")[1]["result"]
    assert (res["objects"], res["subdirs"], res["foreign"]) == (0, 1, 2)
    assert res["foreign_names"] == sorted([name(0, 9), name(0, 2)])
