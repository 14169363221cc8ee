"""``patchtool l2 scan --quarantine``: the exit status says what DIR holds
when the command ends, not what the plan expected to move.

A writer (a live server) keeps storing while the quarantine runs: objects of
a flagged namespace it adds are moved by a later pass, objects of a new
namespace are not in the plan at all.  Counting "flagged at the start minus
moved" lets late moves cancel objects left behind (``--only`` leaving a
category in DIR), and misses late ones; the command re-scans what the run
touched and counts what is still there.  The writer here is a real thread
storing real files while the real CLI process moves them."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from _cli import cli

from .l2tier import FLAGGED, JOURNAL, NS1, NS2, name, put, scan_json

NS3 = "kvl3-0123456789ab"
# Enough never-read objects that the moves take far longer than the writer
# needs to store its few late objects once the plan is journaled.
MANY = 4000


def _tier(d: Path) -> None:
    d.mkdir()
    for i in range(MANY):
        put(d, name(0, i, NS2), 16)  # never read by kvl1
    put(d, name(0, 90_000, NS1), 64)
    for i in range(3):
        put(d, name(0, 90_010 + i), 32)  # unpatched: 1/2 of kvl1's 64


def _race(d: Path, q: Path, late: list[str], *args: str) -> subprocess.CompletedProcess:
    """Run the quarantine as a process; once its ``begin`` is journaled, a
    writer thread stores ``late`` into DIR (as a live server would)."""
    done = threading.Event()

    def writer() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            j = q / JOURNAL
            if j.exists() and b'"begin"' in j.read_bytes():
                break
            time.sleep(0.001)
        for n in late:
            put(d, n, 16)
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "patchtool", "l2", "scan", str(d),
                               "--assume", "kvl1", "--quarantine", str(q), "--json", *args],
                              capture_output=True, text=True, timeout=300)
    finally:
        t.join()
    assert done.is_set()
    return proc


def test_only_leaves_a_category_and_late_moves_do_not_hide_it(tmp_path):
    """``--only never-read`` leaves the 3 unpatched objects in DIR, whatever a
    writer adds meanwhile to the never-read namespace: exit 20."""
    d, q = tmp_path / "t", tmp_path / "q"
    _tier(d)
    late = [name(0, 50_000 + i, NS2) for i in range(3)]
    proc = _race(d, q, late, "--only", "never-read")
    import json

    doc = json.loads(proc.stdout)
    assert proc.returncode == FLAGGED, (doc["result"]["quarantine"], doc["result"].get("final"))
    assert doc["result"]["remaining_flagged"] >= 3
    rc, after = scan_json(d, "--assume", "kvl1")
    assert after["result"]["flagged"]["unpatched"]["objects"] == 3


def test_late_objects_of_a_new_namespace_are_counted(tmp_path):
    """A writer of another format stores while the quarantine runs: those
    objects are in no plan, so they stay, and the exit status says so."""
    d, q = tmp_path / "t", tmp_path / "q"
    _tier(d)
    late = [name(0, 60_000 + i, NS3) for i in range(3)]
    proc = _race(d, q, late)
    import json

    doc = json.loads(proc.stdout)
    rc, after = scan_json(d, "--assume", "kvl1")
    left = after["result"]["flagged_objects"]
    assert left == 3  # the late kvl3 objects: the writer finished before the command did
    assert proc.returncode == FLAGGED, (doc["result"]["quarantine"], doc["result"].get("final"))
    assert doc["result"]["remaining_flagged"] == left
    assert doc["result"]["final"]["flagged"]["never-read"]["objects"] == 3


def test_final_state_is_reported_after_a_clean_quarantine(tmp_path):
    d, q = tmp_path / "t", tmp_path / "q"
    d.mkdir()
    put(d, name(0, 1, NS2), 16)
    put(d, name(0, 2), 16)
    r = cli("l2", "scan", str(d), "--assume", "kvl1", "--quarantine", str(q), "--json")
    assert r.rc == 0, r.err
    fin = r.json["result"]["final"]
    assert fin["rescanned"] is True and fin["objects"] == 1 and fin["flagged_objects"] == 0
    r = cli("l2", "scan", str(d), "--assume", "kvl1", "--json")
    assert r.json["result"]["final"]["rescanned"] is False  # a scan alone is its own final state


def test_left_out_objects_whose_evidence_moved_are_still_counted(tmp_path):
    """The 1/2 plain objects' only evidence is a never-read namespace.
    ``--only never-read`` moves that namespace and leaves them: a fresh scan
    no longer flags them, the run's plan still does, so they are counted."""
    d, q = tmp_path / "t", tmp_path / "q"
    d.mkdir()
    for i in range(3):
        put(d, name(0, i, NS2), 64)
    for i in range(5):
        put(d, name(0, 10 + i), 32)
    r = cli("l2", "scan", str(d), "--assume", "kvl1", "--quarantine", str(q), "--only",
            "never-read", "--json")
    assert r.rc == FLAGGED, r.err
    fin = r.json["result"]["final"]
    assert (fin["flagged_objects"], fin["flagged"]["unpatched"]["objects"]) == (5, 5)
    assert fin["examples"]["unpatched"] == name(0, 10)
    assert scan_json(d, "--assume", "kvl1")[1]["result"]["flagged_objects"] == 0
