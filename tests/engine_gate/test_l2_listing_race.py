"""The gate lists the fs tier while LMCache is still writing to it.

LMCache's fs adapter (and the stand-in) writes ``<name>.tmp`` and renames it
to ``<name>.data``.  A ``.tmp`` that ``rglob`` listed can be gone when it is
stat'ed or read; the CI run of d20042e aborted the engine gate in STORE_FLUSH
on exactly that ``FileNotFoundError``.  These tests race a real writer thread
against the gate's listings on real files.  Before the fix the ``files_under``
case failed in each of 5 runs here (the old listing was is_file, then stat);
the ``l2_listing`` window (is_file, stat, read) is narrower and was not hit
in one run, so that case guards the fix rather than reproducing the abort.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from gate.engine_scenarios import l2_listing
from gate.l2_tier import files_under

RACE_S = 2.0


def _race(base: Path, poll) -> int:
    """Poll ``poll(base)`` for RACE_S seconds while a thread writes .tmp and
    renames it to .data, as the fs adapter does; return the number of polls."""
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            tmp = base / f"obj{i % 40}.tmp"
            tmp.write_bytes(b"x" * 256)
            tmp.rename(base / f"obj{i % 40}.data")
            i += 1

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    polls = 0
    try:
        deadline = time.monotonic() + RACE_S
        while time.monotonic() < deadline:
            poll(base)
            polls += 1
    finally:
        stop.set()
        th.join()
    return polls


def test_files_under_skips_a_tmp_renamed_during_the_listing(tmp_path: Path) -> None:
    polls = _race(tmp_path, files_under)
    assert polls > 0
    found = files_under(tmp_path)  # quiet now: every object is finished
    assert sorted(p.name for p in found) == sorted(f"obj{i}.data" for i in range(40))
    assert set(found.values()) == {256}


def test_l2_listing_skips_a_tmp_renamed_during_the_listing(tmp_path: Path) -> None:
    _race(tmp_path, l2_listing)
    listing = l2_listing(tmp_path)
    assert len(listing) == 40 and all(size == 256 for size, _ in listing.values())


def test_files_under_lists_nested_files_and_not_directories(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.data").write_bytes(b"abc")
    (tmp_path / "b.tmp").write_bytes(b"")
    assert {p.relative_to(tmp_path).as_posix(): n for p, n in files_under(tmp_path).items()} == {
        "sub/a.data": 3, "b.tmp": 0}
