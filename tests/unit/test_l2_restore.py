"""``patchtool l2 restore DEST``: the undo of ``l2 scan --quarantine``.

It moves each quarantined object back into the DIR it came from (the
journal says which) only where DIR holds no entry of that name, and keeps the
others aside in DEST, reported.  The case that matters: after a quarantine
the server stores a key again (the fs adapter writes a key whose file is
gone), so DIR holds a new, correct object under a quarantined name; a plain
``mv DEST/*.data DIR/`` would replace it with the quarantined one.  Crash
safety as for the quarantine: every write is counted by the fault hook, a
kill after any of them loses nothing, the same command finishes the job."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from _cli import CRASH_VAR, cli, one_line

from .l2tier import FLAGGED, JOURNAL, NS1, NS2, name, put, tree

BATCH = 512


def _quarantined(tmp_path: Path, n: int = 4) -> SimpleNamespace:
    """A tier whose ``n`` never-read objects (for kvl1) were quarantined into
    ``q``; ``before`` is the tier as it was."""
    d, q = tmp_path / "t", tmp_path / "q"
    d.mkdir(parents=True)
    moved = [put(d, name(0, i, NS2), 40 + i).name for i in range(n)]
    kept = [put(d, name(0, 1000 + i, NS1), 64).name for i in range(2)]
    before = tree(d)
    r = cli("l2", "scan", str(d), "--assume", "kvl1", "--quarantine", str(q))
    assert r.rc == 0, r.err
    assert set(tree(q)) - {JOURNAL} == set(moved)
    return SimpleNamespace(dir=d, q=q, moved=moved, kept=kept, before=before)


def test_restore_puts_everything_back(tmp_path):
    t = _quarantined(tmp_path)
    r = cli("l2", "restore", str(t.q), "--json")
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert r.json["command"] == "l2 restore"
    assert (res["restored"], res["kept"], res["kept_names"], res["resumed"]) == (4, 0, [], False)
    assert res["dirs"] == [os.path.realpath(t.dir)]
    assert tree(t.dir) == t.before and set(tree(t.q)) == {JOURNAL}
    # again: nothing to do, nothing written
    j = (t.q / JOURNAL).read_bytes()
    r = cli("l2", "restore", str(t.q), "--json")
    assert r.rc == 0 and r.json["result"]["restored"] == 0 and r.json["result"]["run"] is None
    assert (t.q / JOURNAL).read_bytes() == j


def test_restore_never_overwrites_a_restored_key(tmp_path):
    """The server stored a quarantined key again: the new object stays in
    DIR, the quarantined one stays in DEST and is reported."""
    t = _quarantined(tmp_path)
    again = t.moved[1]
    (t.dir / again).write_bytes(b"the server's new, correct object")
    r = cli("l2", "restore", str(t.q), "--json")
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert (res["restored"], res["kept"], res["kept_names"]) == (3, 1, [again])
    assert (t.dir / again).read_bytes() == b"the server's new, correct object"
    assert tree(t.q)[again] == t.before[again]  # the quarantined bytes, kept aside
    human = cli("l2", "restore", str(t.q))
    assert human.rc == 0 and "kept aside  : 1 object(s)" in human.out and again in human.out


def test_restore_keeps_aside_for_any_entry_of_that_name(tmp_path):
    t = _quarantined(tmp_path)
    (t.dir / t.moved[0]).mkdir()  # a directory named like the object
    os.symlink("/nonexistent", t.dir / t.moved[2])  # a dangling link
    res = cli("l2", "restore", str(t.q), "--json").json["result"]
    assert (res["restored"], sorted(res["kept_names"])) == (2, sorted([t.moved[0], t.moved[2]]))
    assert (t.dir / t.moved[0]).is_dir() and os.path.islink(t.dir / t.moved[2])


def test_restore_leaves_what_the_journal_never_moved(tmp_path):
    t = _quarantined(tmp_path)
    put(t.q, "notes.txt", 3)
    stranger = put(t.q, name(0, 7777, NS2), 9).name  # named like an object, never moved here
    res = cli("l2", "restore", str(t.q), "--json").json["result"]
    assert res["restored"] == 4 and res["untracked"] == 1
    assert {"notes.txt", stranger} <= set(tree(t.q)) and stranger not in tree(t.dir)


def test_restore_then_scan_then_quarantine_again(tmp_path):
    """Quarantine, restore, quarantine again into the same DEST: the journal
    holds both runs, and each object ends in exactly one place."""
    t = _quarantined(tmp_path)
    assert cli("l2", "restore", str(t.q)).rc == 0
    assert cli("l2", "scan", str(t.dir), "--assume", "kvl1").rc == FLAGGED
    r = cli("l2", "scan", str(t.dir), "--assume", "kvl1", "--quarantine", str(t.q), "--json")
    assert r.rc == 0 and r.json["result"]["quarantine"]["moved"] == 4, r.err
    recs = [json.loads(x) for x in (t.q / JOURNAL).read_text().splitlines()]
    assert [x["event"] for x in recs if x["event"] in ("begin", "end")] == ["begin", "end"] * 3


def _many(tmp_path: Path) -> SimpleNamespace:
    """Enough quarantined objects for three journal batches of the restore."""
    d, q = tmp_path / "t", tmp_path / "q"
    d.mkdir(parents=True)
    n = 2 * BATCH + 6
    for i in range(n):
        put(d, name(0, i, NS2), 16 + i % 3)
    before = tree(d)
    assert cli("l2", "scan", str(d), "--assume", "kvl1", "--quarantine", str(q)).rc == 0
    return SimpleNamespace(dir=d, q=q, before=before, n=n)


# Counted writes of restoring _many (1030 objects): 1 begin, 2 the first
# batch's names, 3..1026 its 512 links and unlinks (2 per object), 1027 the
# second batch's names, 1028..2051 its moves, 2052 the third batch's names,
# 2053..2064 its 6 links and unlinks, 2065 end.  An odd count after a batch's
# names (3, 1500) stops between a link and its unlink.
WRITES = 2065


def _one_place(t: SimpleNamespace) -> None:
    """Every object is in DIR or in DEST with its bytes; a name in both is
    one inode (a kill between the link and the unlink)."""
    a, b = tree(t.dir), tree(t.q)
    b.pop(JOURNAL, None)
    assert {**a, **b} == t.before
    for n in set(a) & set(b):
        assert os.path.samefile(t.dir / n, t.q / n), n


@pytest.mark.parametrize("at", [1, 2, 3, 4, 1027, 1500, WRITES])
def test_kill_restore_then_rerun_finishes(tmp_path, at):
    t = _many(tmp_path)
    r = cli("l2", "restore", str(t.q), "--json", env={CRASH_VAR: f"crash:{at}"}, unset=())
    assert r.rc == 86, (r.rc, r.err)
    _one_place(t)
    r = cli("l2", "restore", str(t.q), "--json")
    assert r.rc == 0, r.err
    assert r.json["result"]["resumed"] is (at < WRITES)
    assert tree(t.dir) == t.before and set(tree(t.q)) == {JOURNAL}
    recs = [json.loads(x) for x in (t.q / JOURNAL).read_text().splitlines()]
    assert recs[-1]["event"] == "end" and recs[-1]["kind"] == "restore"
    r = cli("l2", "restore", str(t.q), "--json")
    assert r.rc == 0 and r.json["result"]["restored"] == 0


def test_restore_write_failure_is_one_line(tmp_path):
    t = _many(tmp_path)
    r = cli("l2", "restore", str(t.q), env={CRASH_VAR: "eio:3"}, unset=())  # the first link
    [line] = r.err.splitlines()
    assert r.rc == 19 and line.startswith(f"patchtool: {t.dir}/") and "re-run" in line, r.err
    _one_place(t)
    assert cli("l2", "restore", str(t.q)).rc == 0 and tree(t.dir) == t.before


def test_restore_refusals_are_one_line_and_write_nothing(tmp_path):
    missing = tmp_path / "nope"
    one_line(cli("l2", "restore", str(missing)), 3, missing, "no such directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line(cli("l2", "restore", str(empty)), 3, empty / JOURNAL, "no quarantine journal")
    assert list(empty.iterdir()) == []
    # an unfinished quarantine must be finished first
    t = _many(tmp_path / "a")
    assert cli("l2", "restore", str(t.q)).rc == 0
    r = cli("l2", "scan", str(t.dir), "--assume", "kvl1", "--quarantine", str(t.q),
            env={CRASH_VAR: "crash:5"}, unset=())
    assert r.rc == 86
    j = (t.q / JOURNAL).read_bytes()
    line = one_line(cli("l2", "restore", str(t.q)), 3, t.q / JOURNAL, "unfinished quarantine")
    assert len(line) < 200 and (t.q / JOURNAL).read_bytes() == j
    # and a quarantine into a DEST with an unfinished restore is refused
    assert cli("l2", "scan", str(t.dir), "--assume", "kvl1", "--quarantine", str(t.q)).rc == 0
    r = cli("l2", "restore", str(t.q), env={CRASH_VAR: "crash:3"}, unset=())
    assert r.rc == 86
    j = (t.q / JOURNAL).read_bytes()
    r = cli("l2", "scan", str(t.dir), "--assume", "kvl1", "--quarantine", str(t.q))
    line = one_line(r, 3, t.q / JOURNAL, "unfinished restore", "l2 restore")
    assert len(line) < 200 and (t.q / JOURNAL).read_bytes() == j
    # the DIR the journal names is gone
    t2 = _quarantined(tmp_path / "b")
    gone = t2.dir.rename(t2.dir.with_name("moved-away"))
    j = (t2.q / JOURNAL).read_bytes()
    one_line(cli("l2", "restore", str(t2.q)), 3, os.path.realpath(t2.dir), "no such directory")
    assert (t2.q / JOURNAL).read_bytes() == j and gone.is_dir()


def test_readme_undo_is_the_restore_command():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    docs = Path(__file__).resolve().parents[2] / "docs" / "disk-tier.md"
    text = readme + (docs.read_text() if docs.exists() else "")
    assert "mv DEST/*.data DIR/" not in text
    assert "patchtool l2 restore DEST" in text


def test_restore_into_another_filesystem_is_refused(tmp_path):
    """A journal whose DIR is on another filesystem than DEST (a tier moved,
    a journal copied): a link cannot cross it, so the restore refuses before
    its first write."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)
            and os.stat(shm).st_dev != os.stat(tmp_path).st_dev):
        pytest.skip("no /dev/shm on another filesystem")
    t = _quarantined(tmp_path)
    other = Path(shm / f"l2-restore-{os.getpid()}-{tmp_path.name}")
    other.mkdir()
    try:
        j = t.q / JOURNAL
        j.write_text(j.read_text().replace(json.dumps(os.path.realpath(t.dir)),
                                           json.dumps(str(other))))
        data = j.read_bytes()
        line = one_line(cli("l2", "restore", str(t.q)), 3, other, "another filesystem")
        assert len(line) < 200 and j.read_bytes() == data
        assert list(other.iterdir()) == [] and len(tree(t.q)) == 5
    finally:
        shutil.rmtree(other, ignore_errors=True)
