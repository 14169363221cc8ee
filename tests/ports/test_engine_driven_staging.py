"""Engine-driven staging regions (revision 3 of the set; EXPLAINER 10.6), through
the real server: ``lab.probes.ed_staging_probe`` registers a CPU
worker engine-driven, then stores and retrieves qwen35-0.8b (k = 17, two object
groups) three times, checking every restored byte, and lists the staging names
in /dev/shm after every STORE and RETRIEVE.

* both sides on revision 3, same host: the object bytes go through staging
  regions; no region name outlives the RPC that handed it over (nothing is
  left in /dev/shm after a store, a retrieve, or the end); the worker's store
  region and the server region it maps are reused from round to round, not
  made per request (no fresh memory, no page faults again);
* the worker's probe not readable by the server (a server on another host):
  object bytes over the message queue, restores byte-exact, no name left;
* a peer on revision 2 (server or worker): the same fallback, both ways, so
  the two sides of a deployment can be upgraded one at a time;
* with part 07-warm-staging (0.5.6, revision 5) both regions exist right
  after the registration and every round reuses them; a peer on revision 4
  (either side) still stages, makes its regions at the first transfer and
  leaves no name in /dev/shm.

Revision 2's series is the one the manifest's ``previous_revisions`` names
(the test checks those parts are unchanged in the shipped directory).

``LMCACHE_PATCHTOOL_ED_STAGING_OVERLAY=DIR`` runs the revision-3 side from
another tree (a workspace while authoring; a broken copy must fail here).
CI runs 0.5.6 (the revision-2 peer as the server only, about 85 s warm);
``LMCACHE_PATCHTOOL_FULL=1`` every version with the set, both peers.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from .harness_run import REPO, provision

OVERLAY_ENV = "LMCACHE_PATCHTOOL_ED_STAGING_OVERLAY"
VERSIONS = ["0.5.3", "0.5.4", "0.5.5", "0.5.6"]


def _manifest(version: str) -> dict | None:
    path = REPO / "patches" / "engine-driven" / version / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def _series(name: str, version: str, files: list[str] | None = None) -> list[Path]:
    root = REPO / "patches" / name / version
    if files is None:
        files = [p["file"] for p in json.loads((root / "manifest.json").read_text())["patches"]]
    return [root / f for f in files]


def revision3_overlay(version: str) -> Path:
    override = os.environ.get(OVERLAY_ENV)
    if override:
        return Path(override)
    m = _manifest(version)
    if m is None or m["revision"] < 3:
        pytest.skip(f"patches/engine-driven/{version} is not at revision 3 yet")
    return provision.overlay(version, _series("hybrid-fa", version) + _series("engine-driven", version))


def revision2_overlay(version: str, tmp_dir: Path) -> Path:
    """hybrid-fa + the engine-driven parts of revision 2, as shipped: from the
    shipped files while they are unchanged, else (0.5.3, whose hybrid-fa part 19
    moved the engine-driven set's base) both sets as git holds them at the last
    commit that shipped engine-driven revision 2."""
    m = _manifest(version)
    if m is None or m["revision"] < 3:
        pytest.skip(f"patches/engine-driven/{version} is not at revision 3 yet")
    (prev,) = [p for p in m["previous_revisions"] if p["revision"] == 2]
    parts = sorted(prev["patches"])
    if all(hashlib.sha256((REPO / "patches" / "engine-driven" / version / name).read_bytes()).hexdigest()
           == prev["patches"][name] for name in parts):
        return provision.overlay(version, _series("hybrid-fa", version) + _series("engine-driven", version, parts))
    return provision.overlay(version, _series_at_revision2(version, prev["patches"], tmp_dir))


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True).stdout


def _series_at_revision2(version: str, shas: dict[str, str], tmp_dir: Path) -> list[Path]:
    """The hybrid-fa series and engine-driven revision 2's parts at the newest
    commit whose engine-driven files have revision 2's sha256s, copied out."""
    ed = f"patches/engine-driven/{version}"
    for commit in _git("log", "--format=%H", "--", ed).decode().split():
        try:
            blobs = {name: _git("show", f"{commit}:{ed}/{name}") for name in shas}
        except subprocess.CalledProcessError:
            continue
        if all(hashlib.sha256(b).hexdigest() == shas[n] for n, b in blobs.items()):
            break
    else:
        raise AssertionError(f"{ed}: no commit holds engine-driven revision 2's parts (a shallow clone?)")
    hfa = f"patches/hybrid-fa/{version}"
    names = sorted(n for n in _git("ls-tree", "--name-only", f"{commit}:{hfa}").decode().split()
                   if n.endswith(".patch"))
    out = []
    for sub, listed in (("hybrid-fa", [(n, _git("show", f"{commit}:{hfa}/{n}")) for n in names]),
                        ("engine-driven", sorted(blobs.items()))):
        (tmp_dir / sub).mkdir(parents=True, exist_ok=True)
        for name, data in listed:
            path = tmp_dir / sub / name
            path.write_bytes(data)
            out.append(path)
    return out


def run_probe(version: str, worker: Path, *options: str, timeout: float = 240) -> dict:
    python = provision.runtime_env(version) / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=f"{worker}:{REPO}", NO_COLOR="1")
    proc = subprocess.run([str(python), "-m", "lab.probes.ed_staging_probe", *options],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO))
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the probe printed nothing (rc {proc.returncode})\n{proc.stderr[-3000:]}"
    doc = json.loads(lines[-1])
    assert proc.returncode == 0 and "error" not in doc, (doc.get("error"), doc.get("traceback"),
                                                          doc.get("client_log_tail"))
    assert doc["versions"]["lmcache"] == version
    assert Path(doc["versions"]["lmcache_dir"]).resolve() == worker.resolve(), "the probe did not run the overlay"
    return doc


def assert_restores_and_no_names_left(doc: dict, transport: str) -> None:
    assert doc["after_register"]["transport"] == transport, doc["after_register"]
    assert doc["after_register"]["shm_names"] == []
    assert len(doc["rounds"]) == 3
    for row in doc["rounds"]:
        assert row["miss_tokens"] == 0 and row["stored"] is True, row
        assert row["hit_tokens"] == row["stored_tokens"] and row["retrieve_ok"] is True, row
        assert row["chunks_exact"] == doc["chunks"], row
        assert row["after_store"]["transport"] == row["after_retrieve"]["transport"] == transport, row
        # No staging name outlives its RPC: the peer unlinked it once mapped.
        assert row["shm_names_after_store"] == [] and row["shm_names_after_retrieve"] == [], row
    assert doc["shm_names_at_end"] == []
    assert doc["server_log_errors"] == [], doc["server_log_errors"]


def _versions() -> list[str]:
    if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" and not os.environ.get(OVERLAY_ENV):
        return VERSIONS
    return ["0.5.6"]


@pytest.mark.slow
@pytest.mark.parametrize("version", _versions())
def test_staging_regions_carry_the_bytes_are_reused_and_leave_no_name(version):
    doc = run_probe(version, revision3_overlay(version))
    assert_restores_and_no_names_left(doc, "staging")
    rounds = doc["rounds"]
    store_regions = {r["after_retrieve"]["store_region"] for r in rounds}
    retrieve_regions = {r["after_retrieve"]["retrieve_region"] for r in rounds}
    assert len(store_regions) == 1 and None not in store_regions, store_regions
    assert len(retrieve_regions) == 1 and None not in retrieve_regions, retrieve_regions
    # The store region is the worker's, the retrieve region the server's.
    (store,), (retrieve,) = store_regions, retrieve_regions
    assert store.startswith(f"lmcache_ed_staging_{doc['worker_pid']}_"), store
    assert retrieve.startswith(f"lmcache_ed_staging_{doc['server_pid']}_"), retrieve
    if _has_warm_start(version):
        # Warm start (part 07): both regions were made and handed over at the
        # registration, and the rounds use those (no region made per request).
        reg = doc["after_register"]
        assert (reg["store_region"], reg["retrieve_region"]) == (store, retrieve), reg


def _has_warm_start(version: str) -> bool:
    return (REPO / "patches" / "engine-driven" / version / "07-warm-staging.patch").exists()


@pytest.mark.slow
@pytest.mark.parametrize("version", [v for v in _versions() if _has_warm_start(v)] or [None])
@pytest.mark.parametrize("older", ["server", "worker"])
def test_a_peer_without_warm_start_keeps_staging_and_links_no_name(version, older):
    """One side of revision 5 (part 07-warm-staging), the other of revision 4:
    staging regions still carry the bytes, made at the first transfer as
    before, and no name waits in /dev/shm for a peer that never maps it (a
    revision-4 worker offers no warm store region, so the server makes no warm
    retrieve region for it)."""
    if version is None:
        pytest.skip("no engine-driven series with 07-warm-staging")
    parts = [p["file"] for p in json.loads((REPO / "patches" / "engine-driven" / version / "manifest.json")
                                           .read_text())["patches"] if p["file"] != "07-warm-staging.patch"]
    new = revision3_overlay(version)
    old = provision.overlay(version, _series("hybrid-fa", version) + _series("engine-driven", version, parts))
    worker, server = (new, old) if older == "server" else (old, new)
    doc = run_probe(version, worker, "--server-overlay", str(server))
    assert_restores_and_no_names_left(doc, "staging")
    reg = doc["after_register"]
    assert reg["store_region"] is None and reg["retrieve_region"] is None, reg
    assert len({r["after_retrieve"]["retrieve_region"] for r in doc["rounds"]}) == 1, doc["rounds"]


@pytest.mark.slow
@pytest.mark.parametrize("version", _versions())
def test_a_server_elsewhere_gets_the_bytes_over_the_message_queue(version):
    doc = run_probe(version, revision3_overlay(version), "--probe-elsewhere")
    assert_restores_and_no_names_left(doc, "mq")
    assert any("staging probe" in line and "not readable here" in line for line in doc["server_log_staging"]), \
        doc["server_log_staging"]


def _older_sides() -> list[str]:
    """CI: a revision-2 server (the worker upgraded first); FULL=1: both."""
    return ["server", "worker"] if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" else ["server"]


@pytest.mark.slow
@pytest.mark.parametrize("version", _versions())
@pytest.mark.parametrize("older", _older_sides())
def test_a_revision2_peer_keeps_the_message_queue(version, older, tmp_path):
    """A peer of engine-driven revision 2 (no staging regions) and one of the
    shipped revision: the message queue carries the bytes.  On 0.5.3 the shipped
    worker's connector gives the GDN group a window (hybrid-fa part 19) and splits
    the hybrid's groups, which a revision-2 server merges: the worker refuses the
    registration in one line (never objects of another layout); the reverse
    pair (an old worker's connector sends no window) keeps merged objects."""
    new, old = revision3_overlay(version), revision2_overlay(version, tmp_path)
    worker, server = (new, old) if older == "server" else (old, new)
    if version == "0.5.3" and older == "server":
        with pytest.raises(AssertionError, match="engine-driven registration refused: the server's object-group"):
            run_probe(version, worker, "--server-overlay", str(server))
        return
    doc = run_probe(version, worker, "--server-overlay", str(server))
    assert_restores_and_no_names_left(doc, "mq")
