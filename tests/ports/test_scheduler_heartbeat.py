"""The scheduler adapter's heartbeat (hybrid-fa part ``13-scheduler-heartbeat``,
0.5.3-0.5.5), through a real ``lmcache server`` restarted alone.

vLLM's scheduler-side connector owns one ``LMCacheMPSchedulerAdapter``.  Its
health event gates every lookup: ``maybe_submit_lookup_request`` skips the
LOOKUP while it is cleared, and ``check_lookup_result`` then answers 0 hit
tokens.  Two things touch it: a LOOKUP that times out clears it, and the
``HeartbeatThread`` that ``_ensure_heartbeat_started`` starts on the first
lookup pings the server every interval, clearing it while the server is gone
and setting it again when it answers.  Upstream 0.5.3-0.5.5 initialise
``_heartbeats = {}`` and return from ``_ensure_heartbeat_started`` when it
``is not None``: no thread ever starts.  Through a real vLLM engine, a
restart of the LMCache server alone then costs every later cache hit: one
LOOKUP during the outage times out, the event stays cleared because nothing
pings, and every lookup is skipped until vLLM restarts.  The part tests the
dict's contents instead (0.5.6 upstream initialises it to None: no part).

``lab.probes.heartbeat_probe`` (runtime venv, the overlay, no
vLLM: the adapter module does not import it) builds the adapter as vLLM does
(``restore_client.Client``, heartbeat interval 1 s, mq_timeout 3 s), looks up,
SIGKILLs the server, looks up during the outage, restarts the server on the
same ports and looks up again; a sampler thread records every change of
``is_healthy``.

* patched (and 0.5.6's shipped build, whose upstream starts the thread): one
  heartbeat thread after the first lookup; health False within the wait after
  the kill, so the outage lookup is skipped without waiting; True again after
  the restart; the next lookup is answered by the server.  Health changes
  exactly twice.
* pristine 0.5.5: no heartbeat thread; with the server dead health stays True
  (nothing notices), so the outage lookup is sent and times out after
  mq_timeout, which clears health; with the server back it stays False and
  the next lookup is skipped (0 hit tokens, never asked of the server).

CI: patched 0.5.5.  ``LMCACHE_PATCHTOOL_FULL=1``: patched 0.5.3-0.5.6 and
pristine 0.5.5.

The lookup in flight when the server dies (hybrid-fa part
``14-lookup-wait-while-healthy``, 0.5.3/0.5.4).  On 0.5.3 and 0.5.4 the
scheduler adapter waits for the LOOKUP (and QUERY_PREFETCH_STATUS) reply on
vLLM's scheduler thread for the whole MQ timeout: through the real engine the
request sent as the server died held the engine 300 s.  The part waits in
0.1 s slices and gives up once the heartbeat has cleared the server's health.
The probe sends the outage lookup right after the SIGKILL (``--outage-lookup
in-flight``) with a 20 s MQ timeout and a 1 s heartbeat:

* patched: the lookup was sent healthy and gives up within two heartbeat
  intervals (the next ping, then its timeout) plus a slice; a miss, never
  answered; health comes back with the restarted server and the next lookup
  is answered;
* the series without part 14 (FULL): it waits the MQ timeout.

CI: patched 0.5.4.  FULL: patched 0.5.3 and the 0.5.4 break.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .harness_run import REPO, provision, series

FULL = os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
PATCHED = ("0.5.3", "0.5.4", "0.5.5", "0.5.6") if FULL else ("0.5.5",)
INTERVAL, MQ_TIMEOUT, WAIT_INTERVALS = 1.0, 3.0, 5.0
WAIT = INTERVAL * WAIT_INTERVALS  # the probe's bound on each health change
IN_FLIGHT_MQ_TIMEOUT = 20.0  # long enough to tell "gave up with the heartbeat" from "waited it out"
WAIT_PART = "14-lookup-wait-while-healthy.patch"


def heartbeat_probe(version: str, patched: bool, tmp: Path, *, patches: list[Path] | None = None,
                    mq_timeout: float = MQ_TIMEOUT, outage: str = "after-notice") -> dict:
    """The probe's document for ``version``'s pristine or patched overlay (``patches``: another
    series, e.g. the shipped one minus a part)."""
    venv = provision.runtime_env(version)
    if patches is None:
        patches = series(version) if patched else None
    overlay = provision.overlay(version, patches)
    out = tmp / f"heartbeat-{version}-{'patched' if patched else 'pristine'}-{outage}.json"
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", LMCACHE_DISABLE_BANNER="1")
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "lab.probes.heartbeat_probe",
                           "--out", str(out), "--interval", str(INTERVAL), "--mq-timeout", str(mq_timeout),
                           "--wait-intervals", str(WAIT_INTERVALS), "--outage-lookup", outage],
                          capture_output=True, text=True, env=env, timeout=300)
    assert out.exists(), f"the probe wrote nothing (rc {proc.returncode})\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert proc.returncode == 0 and "error" not in doc, (doc.get("traceback"), proc.stdout[-3000:])
    assert Path(doc["lmcache"]["root"]).resolve() == overlay.resolve(), doc["lmcache"]
    assert doc["adapter_heartbeat_interval"] == INTERVAL  # lmcache.mp.heartbeat_interval reached the adapter
    return doc


def assert_heartbeat_recovers(doc: dict) -> None:
    """The scheduler pings: it notices the outage and the server's return."""
    looks, url = doc["lookups"], doc["server_url"]
    assert doc["heartbeat_threads"] == {"before_first_lookup": 0, "after_first_lookup": 1}, doc["heartbeat_threads"]
    assert list(doc["adapter_heartbeats"]) == [url], doc["adapter_heartbeats"]
    hb = doc["adapter_heartbeats"][url]
    assert hb["running"] and hb["runs"] >= 1 and hb["last"] == "healthy", hb
    assert looks["before"]["answered_by_server"] and doc["healthy_before_kill"], (looks["before"], doc)
    # Noticed by a ping (<= 2 intervals: the next ping, then its timeout), not by a lookup.
    assert doc["unhealthy_after_kill_s"] is not None, "health still True 5 intervals after the SIGKILL"
    outage = looks["outage"]
    assert outage["healthy_at_submit"] is False and outage["answered_by_server"] is False, outage
    assert outage["hit_tokens"] == 0 and outage["seconds"] < MQ_TIMEOUT / 2, outage  # skipped, no wait
    assert doc["healthy_after_restart_s"] is not None, "health still False 5 intervals after the restart"
    after = looks["after"]
    assert after["healthy_at_submit"] and after["answered_by_server"] and after["healthy_after"], after
    # Exactly two changes: down after the kill, up after the restart.
    changes = doc["health_changes"]
    assert [c["healthy"] for c in changes] == [True, False, True], changes
    assert doc["kill"]["at"] <= changes[1]["t"] <= outage["at"] + 0.05, (doc["kill"], changes)  # 10 ms sampling
    # Up again only once the restarted server exists.  Not "once it answers GET /healthcheck": the
    # heartbeat pings over ZMQ, which the server binds before its HTTP frontend serves, and the
    # probe polls that healthcheck; CI saw health back 0.12 s before the probe saw the server ready.
    assert doc["restart"]["at"] <= changes[2]["t"], (doc["restart"], changes)
    assert changes[2]["t"] <= doc["restart"]["at"] + doc["restart"]["ready_s"] + WAIT, (doc["restart"], changes)
    assert doc["adapter_heartbeats_at_end"][url]["runs"] > hb["runs"], doc["adapter_heartbeats_at_end"]


def assert_upstream_fault(doc: dict) -> None:
    """No thread pings: one timed-out lookup disables lookups for good."""
    looks = doc["lookups"]
    assert doc["heartbeats_at_construction"] == "{}"  # a dict, so 'is not None' is True from the start
    assert doc["heartbeat_threads"] == {"before_first_lookup": 0, "after_first_lookup": 0}, doc["heartbeat_threads"]
    assert doc["adapter_heartbeats"] == {} and doc["adapter_heartbeats_at_end"] == {}
    assert looks["before"]["answered_by_server"] and doc["healthy_before_kill"], looks["before"]
    # The dead server goes unnoticed ...
    assert doc["unhealthy_after_kill_s"] is None, doc["unhealthy_after_kill_s"]
    # ... until a lookup is sent to it and times out after mq_timeout, clearing health.
    outage = looks["outage"]
    assert outage["healthy_at_submit"] is True and outage["answered_by_server"] is False, outage
    assert outage["hit_tokens"] == 0 and outage["healthy_after"] is False, outage
    assert MQ_TIMEOUT <= outage["seconds"] < MQ_TIMEOUT + 2, outage
    # The server is back and answering its healthcheck; health stays cleared.
    assert doc["healthy_after_restart_s"] is None, doc["healthy_after_restart_s"]
    after = looks["after"]
    assert after["healthy_at_submit"] is False and after["answered_by_server"] is False, after
    assert after["hit_tokens"] == 0 and after["seconds"] < MQ_TIMEOUT / 2 and after["healthy_after"] is False, after
    # One change only, made by the timed-out lookup.
    changes = doc["health_changes"]
    assert [c["healthy"] for c in changes] == [True, False], changes
    assert outage["at"] + MQ_TIMEOUT - 0.05 <= changes[1]["t"] <= outage["at"] + outage["seconds"] + 0.05, changes


@pytest.mark.parametrize("version", PATCHED)
def test_patched_scheduler_heartbeat_recovers_after_server_restart(version, tmp_path):
    assert_heartbeat_recovers(heartbeat_probe(version, True, tmp_path))


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: the upstream fault without the part")
def test_pristine_scheduler_never_pings_and_stays_unhealthy(tmp_path):
    assert_upstream_fault(heartbeat_probe("0.5.5", False, tmp_path))


def in_flight_probe(version: str, tmp: Path, *, without_part: bool = False) -> dict:
    patches = [p for p in series(version) if not (without_part and p.name == WAIT_PART)]
    assert without_part or any(p.name == WAIT_PART for p in patches), f"{version}: no {WAIT_PART}"
    return heartbeat_probe(version, True, tmp, patches=patches, mq_timeout=IN_FLIGHT_MQ_TIMEOUT,
                           outage="in-flight")


@pytest.mark.parametrize("version", ("0.5.3", "0.5.4") if FULL else ("0.5.4",))
def test_lookup_in_flight_gives_up_when_the_heartbeat_clears_health(version, tmp_path):
    doc = in_flight_probe(version, tmp_path)
    outage, after = doc["lookups"]["outage"], doc["lookups"]["after"]
    assert outage["healthy_at_submit"] is True, outage  # sent before anything noticed the kill
    assert outage["answered_by_server"] is False and outage["hit_tokens"] == 0, outage
    # the heartbeat's next ping, then its timeout, then one 0.1 s slice (and the probe's polling)
    assert outage["seconds"] <= 2 * INTERVAL + 0.5, outage
    assert doc["unhealthy_after_kill_s"] is not None and doc["healthy_after_restart_s"] is not None, doc
    assert after["healthy_at_submit"] and after["answered_by_server"] and after["healthy_after"], after


@pytest.mark.skipif(not FULL, reason="LMCACHE_PATCHTOOL_FULL=1: the 0.5.4 series without the part")
def test_lookup_in_flight_waits_the_mq_timeout_without_the_part(tmp_path):
    outage = in_flight_probe("0.5.4", tmp_path, without_part=True)["lookups"]["outage"]
    assert outage["healthy_at_submit"] is True and outage["hit_tokens"] == 0, outage
    assert IN_FLIGHT_MQ_TIMEOUT <= outage["seconds"] < IN_FLIGHT_MQ_TIMEOUT + 2, outage
