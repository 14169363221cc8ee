"""A failed L2 load vanishes (part 18-failed-load-discard on 0.5.3-0.5.5).

``lab.probes.failed_load_probe`` runs LMCache's real
StorageManager (L1, store controller, prefetch controller, the ``fs`` L2
adapter) in a version's runtime venv: a writer stores three chunks, chunk 1's
object is damaged on disk (a flipped byte the checksum rejects, or a cut file
upstream refuses), and a fresh StorageManager prefetches them.

0.5.3-0.5.5 end a failed load with ``finish_write`` then ``delete``; the
first tells the store controller the never-filled buffer is complete.  In
``--race`` mode the probe lets the store loop win (it read-locks what it was
told before the ``delete`` runs), and without the part the buffer stays in
L1, is stored back sealed as valid, and the next restart serves chunk 1 as a
hit with other bytes than the writer's (measured here: 3 hits, chunk 1
wrong, on 0.5.3 with the series minus part 18).  With the part the
listeners are never told, the damaged chunk stays a miss, and the next
restart still hits one chunk.  0.5.6 needs no part (upstream's own
``finish_write_and_delete``, with another StorageManager API the probe does
not speak).

``LMCACHE_PATCHTOOL_EXCLUDE_PATCH=18-failed-load-discard`` runs the series
without the part: every 0.5.3-0.5.5 case fails.  CI runs the flipped byte on
every version and the cut file on 0.5.4; ``LMCACHE_PATCHTOOL_FULL=1`` runs
both on every version.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .harness_run import REPO, provision, series

VERSIONS = ("0.5.3", "0.5.4", "0.5.5")
FULL = os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
CASES = [(v, d) for v in VERSIONS for d in ("flip", "cut") if FULL or d == "flip" or v == "0.5.4"]
PROBE = "lab.probes.failed_load_probe"
# 0.5.5's default prefetch policy keeps no loaded object in L1 (each is
# reserved temporary, and a temporary one's finish_write tells no listener);
# 'retain' keeps them, as 0.5.3 and 0.5.4 always do, and so reaches the race.
POLICY = {"0.5.5": "retain"}


def _patched(version: str) -> list[Path]:
    skip = {s for s in os.environ.get("LMCACHE_PATCHTOOL_EXCLUDE_PATCH", "").split(",") if s}
    return [p for p in series(version) if p.stem not in skip]


@pytest.mark.parametrize(("version", "damage"), CASES)
def test_a_failed_load_is_discarded_and_never_stored_back(version: str, damage: str, tmp_path: Path) -> None:
    python = provision.runtime_env(version) / "bin" / "python"
    overlay = provision.overlay(version, _patched(version))
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1")
    proc = subprocess.run([str(python), "-m", PROBE, str(tmp_path), "--damage", damage, "--race",
                           "--prefetch-policy", POLICY.get(version, "default")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    # The prefix before the damaged chunk hits; whatever L1 holds (under
    # 'retain' also chunk 2, loaded after the damaged one) is the writer's.
    assert doc["hits"] == 1, doc
    assert doc["resident_right"].get("0") is True and all(doc["resident_right"].values()), doc
    # Nobody is told the never-filled buffer finished writing, so the store
    # loop has nothing to lock: it is gone from L1.
    assert doc["write_finished"] == [], doc
    assert 1 not in doc["resident"], doc
    # And nothing wrong was stored back: the next restart still misses chunk 1.
    again = doc["next_restart"]
    assert again["hits"] == 1 and "1" not in again["resident_right"], doc
    assert all(again["resident_right"].values()), doc
