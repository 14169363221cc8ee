"""The rules of the engine-driven staging regions (``posix_shm.py`` as patched
by the set's part staging-regions, EXPLAINER 10.6), one by one, on real POSIX
shared memory in the runtime venv of each version (the part's posix_shm.py
text is the same on 0.5.3-0.5.6; CI checks 0.5.6):

* a peer maps a region only under a staging name and at the size the
  descriptor says (a larger mapping would SIGBUS), and unlinks the name once
  mapped;
* an object offset outside the region, or a descriptor with another number of
  object groups, is refused in one line naming posix_shm.py;
* the worker reuses its store region only after a commit the server answered
  having mapped it; unanswered (the server may still be reading) or answered
  unmapped, the name is unlinked and the next store gets a new region;
* the server's retrieve region is dropped when the worker never mapped it,
  kept when it did;
* regions up to the keep limit are kept (next power of two), a larger
  transfer gets one of its own;
* the registration probe holds only for the nonce the worker wrote;
* a pickled commit is not mistaken for a staging descriptor.

``LMCACHE_PATCHTOOL_ED_STAGING_OVERLAY=DIR`` checks another tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from .harness_run import REPO, provision
from .test_engine_driven_staging import OVERLAY_ENV, revision3_overlay

SCRIPT = textwrap.dedent(r"""
    import json, os, pickle, secrets, sys
    import lmcache.v1.multiprocess.posix_shm as ps

    out = {}
    def names():
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"{ps.STAGING_PREFIX}{os.getpid()}_"))
    def refusal(fn):
        try:
            fn()
        except (ValueError, OSError) as exc:
            return str(exc)
        return None

    # Size and name checks; the peer unlinks the name once mapped.
    r = ps.StagingRegion.create(1 << 20)
    out["size_mismatch"] = refusal(lambda: ps.StagingRegion.open(r.name, 2 << 20))
    out["name_left_after_refusal"] = r.name in names()
    out["foreign_name"] = refusal(lambda: ps.StagingRegion.open("lmcache_l1_pool_1", 1 << 20))
    peer = ps.StagingRegion.open(r.name, 1 << 20)
    out["name_left_after_open"] = r.name in names()
    r.tensor()[:4].fill_(7)
    out["shared_bytes"] = peer.tensor()[:4].tolist()

    # Offsets and group counts.
    out["offset_outside"] = refusal(lambda: r.views([[(1 << 20) - 100]], [4096]))
    out["negative_offset"] = refusal(lambda: r.views([[-4096]], [4096]))
    out["group_count"] = refusal(lambda: r.views([[0], [4096]], [4096]))
    out["views_ok"] = [None if v is None else v.numel() for v in r.views([[0, None, 4096]], [4096])[0]]
    offsets, need = ps.staging_offsets([5000, 100], [[True, False, True], [True]])
    out["offsets"], out["need"] = offsets, need

    # The worker's store region: reused only after an answered, mapped commit.
    w = ps.WorkerStaging()
    a, keep = w.store_target(3 << 20)
    out["store_size_keep"] = [a.nbytes, keep]
    ps.StagingRegion.open(a.name, a.nbytes)           # the server mapped it
    w.after_commit(a, answered=True)
    b, _ = w.store_target(3 << 20)
    out["reused_after_mapped_commit"] = b is a
    w.after_commit(b, answered=False)                 # timed out
    c, _ = w.store_target(1)
    out["dropped_after_timeout"] = [c is not b, b.name in names()]
    w.after_commit(c, answered=True)                  # answered, never mapped
    d, _ = w.store_target(1)
    out["dropped_when_never_mapped"] = [d is not c, c.name in names()]
    d.unlink()
    big, big_keep = w.store_target(ps.STAGING_KEEP_BYTES + 4096)
    out["big_transfer"] = [big.nbytes == ps.STAGING_KEEP_BYTES + 4096, big_keep]
    big.unlink()

    # The server's retrieve region: dropped if the worker never mapped it.
    s = ps.ServerStaging()
    desc, views = s.stage_retrieve([4096], [[True, True]])
    s.settle()                                        # the worker never opened it
    desc2, _ = s.stage_retrieve([4096], [[True]])
    out["retrieve_dropped_unmapped"] = [desc2["region"] != desc["region"], desc["region"] in names()]
    ps.StagingRegion.open(desc2["region"], desc2["size"])   # the worker maps it
    s.settle()
    desc3, _ = s.stage_retrieve([4096], [[True]])
    out["retrieve_kept_mapped"] = desc3["region"] == desc2["region"]
    s.settle(); s.close()

    # The registration probe.
    probe, wire = ps.staging_probe()
    out["probe_wrong_nonce"] = ps.staging_probe_ok([wire[0], secrets.token_hex(16)])
    probe2, wire2 = ps.staging_probe()
    out["probe_right_nonce"] = ps.staging_probe_ok(wire2)
    out["probe_name_left"] = wire2[0] in names()
    probe.unlink(); probe2.unlink()

    out["pickle_is_not_staging"] = ps.decode_staging_commit(pickle.dumps([[b"x"]])) is None
    out["staging_roundtrip"] = ps.decode_staging_commit(ps.encode_staging_commit({"region": "x"}))
    del r, peer, a, b, c, d, w, s
    out["names_at_end"] = [n for n in names() if n != wire[0]]
    print(json.dumps(out))
""")


def _versions() -> list[str]:
    if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1" and not os.environ.get(OVERLAY_ENV):
        return ["0.5.3", "0.5.4", "0.5.5", "0.5.6"]
    return ["0.5.6"]


@pytest.mark.parametrize("version", _versions())
def test_staging_region_rules(version):
    overlay = revision3_overlay(version)
    python = provision.runtime_env(version) / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=f"{overlay}:{REPO}", NO_COLOR="1", LMCACHE_DISABLE_BANNER="1")
    env.pop("LMCACHE_PATCHTOOL_STAGING_FILL", None)
    proc = subprocess.run([str(python), "-c", SCRIPT], capture_output=True, text=True, env=env,
                          timeout=120, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert "has 1048576 bytes, the descriptor says 2097152" in out["size_mismatch"]
    assert out["size_mismatch"].startswith("posix_shm.py: ") and "\n" not in out["size_mismatch"]
    assert out["name_left_after_refusal"] is True  # a refused mapping does not consume the name
    assert "is not a staging region name" in out["foreign_name"]
    assert out["name_left_after_open"] is False and out["shared_bytes"] == [7, 7, 7, 7]
    for key in ("offset_outside", "negative_offset"):
        assert "lies outside the 1048576-byte region" in out[key], out[key]
    assert "2 object groups in a staging descriptor, 1 registered" in out["group_count"]
    assert out["views_ok"] == [4096, None, 4096]
    assert out["offsets"] == [[0, None, 8192], [16384]] and out["need"] == 20480
    assert out["store_size_keep"] == [4 << 20, True]
    assert out["reused_after_mapped_commit"] is True
    assert out["dropped_after_timeout"] == [True, False]
    assert out["dropped_when_never_mapped"] == [True, False]
    assert out["big_transfer"] == [True, False]
    assert out["retrieve_dropped_unmapped"] == [True, False]
    assert out["retrieve_kept_mapped"] is True
    assert out["probe_wrong_nonce"] is False and out["probe_right_nonce"] is True
    assert out["probe_name_left"] is False
    assert out["pickle_is_not_staging"] is True and out["staging_roundtrip"] == {"region": "x"}
    assert out["names_at_end"] == []
