#!/usr/bin/env python3
"""Cross-version gate: one persistent L2 tier (fs, or one shared Redis) across LMCache upgrades and patch switches.

Runs in any Python 3.11 with no torch (it never imports lmcache): it provisions
the environments with ``lab/provision.py`` and runs ``gate/restore_gate.py``
in them, in two phases, through the REAL ``lmcache server`` on 127.0.0.1:

* writer (version A, pristine|patched): ``restore_gate.py --phase store`` in
  ``runtime_env(A)`` with ``PYTHONPATH = overlay(A[, series])``: a server with
  an fs L2 in the writer's directory, one client per preset stores a
  multi-chunk request, every chunk lands as a ``.data`` file, the server is
  SIGKILLed and reaped, its L1 segment removed; a state file records tokens,
  block ids, the seed and the sha256 of the source bytes;
* reader (version B, pristine|patched): the writers' directories are hard-linked
  into a fresh directory per reader (every reader sees the tier as its writer
  left it; the writer files are checked unchanged afterwards), then
  ``restore_gate.py --phase restore`` in B's environment: a fresh server over
  that directory, a FRESH client per (writer, preset) looks up (the server
  prefetches from L2), retrieves into different block ids, regenerates the
  source bytes from the seed (refusing to judge if their sha256 differs from
  the writer's) and compares byte for byte, foreign bytes included.

Writers use distinct model names, so one reader server serves every writer
of the same chunk size (keys never collide across writers; the model name is
a key field).  Outcome per (writer, reader, preset, blocks per chunk): exact,
miss or wrong (``gate/xver_outcome.py``), checked against
``expected_outcome`` (the outcome required once patched builds key by layout).

Examples::

    python3 -m lab.xver_gate --all --json-out xver.json --markdown xver.md
    python3 -m lab.xver_gate --edges-for 0.5.6           # the CI edges touching 0.5.6
    python3 -m lab.xver_gate --pairs 0.5.5-patched:0.5.6-pristine --presets qwen35-0.8b --chunk-blocks 1

Exit code: 0 every cell as expected, 1 a cell differs from expected_outcome
(a wrong hit where none is allowed, a miss where an exact hit is required, ...)
or a patched reader wrote over a writer's object on the shared Redis tier,
2 the gate could not run (a phase errored).  Progress on stderr.

``--tier redis`` / ``--redis-url``: every writer and reader on ONE Redis
server (LMCache's resp adapter), see docs/xver-gate.md "Over a shared Redis
tier"; ``lab/xver_share.py`` owns fs vs Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from lab import provision
from gate.l2_tier import RespTier
from lab.redis_proc import RedisServer, RedisStartError, start_redis_server
from gate.xver_outcome import (
    ALL_BUILDS, CHUNK_BLOCKS, PRESETS, TIERS, Build, byte_class, expected_outcome, is_upstream, matrix_markdown,
    namespace, predicted_outcome,
)
from lab.xver_share import (
    FsShare, RedisShare, Share, XverShareError, command_delta, fingerprint_diff, models_of,
)

GATE = REPO / "gate" / "restore_gate.py"
SERIES_ROOT = REPO / "patches" / "hybrid-fa"
EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


class XverError(Exception):
    """A phase could not run: no verdict."""


def B(text: str) -> Build:  # noqa: N802 - short constructor for the tables below
    return Build.parse(text)


# The upgrade/downgrade edges operators meet (the CI subset): same-version
# pristine <-> patched, patched neighbours across the 0.5.5/0.5.6 and
# 0.5.3/0.5.4 boundaries.
CI_EDGES: tuple[tuple[Build, Build], ...] = (
    (B("0.5.6-pristine"), B("0.5.6-patched")),
    (B("0.5.6-patched"), B("0.5.6-pristine")),
    (B("0.5.3-pristine"), B("0.5.3-patched")),
    (B("0.5.5-patched"), B("0.5.6-patched")),
    (B("0.5.6-patched"), B("0.5.5-patched")),
    (B("0.5.3-patched"), B("0.5.4-patched")),
)
# 0.5.6 <-> the 0.5.7rc2 pre-release: measured once over every state pair
# (lab/evidence/xver-fs-057rc2.json), kept out of the CI edges for time.
# The gate's positive control: an upstream wrong hit (pristine 0.5.6 writes
# 0.5.6's re-viewed hybrid objects, pristine 0.5.4 reads a longer file under the
# same key) that no change to a patched build can turn into a miss.
UPSTREAM_CONTROL = (B("0.5.6-pristine"), B("0.5.4-pristine"), "qwen35-0.8b", 1)


def edges_for(version: str) -> list[tuple[Build, Build]]:
    """The CI edges with ``version`` on either side."""
    return [(w, r) for w, r in CI_EDGES if version in (w.version, r.version)]


# ---------------------------------------------------------------------------
# Environments
# ---------------------------------------------------------------------------


# Patches left out of every patched build (--exclude-patch), e.g. 05-layout-keys
# to measure the tier as it was before layout-namespaced keys.
EXCLUDED: list[str] = []
# --series-rev: take the series from this git commit (exported under SERIES_DIR)
# instead of the working tree, so a run is not changed by patches being edited.
SERIES_REV: dict[str, Any] = {"commit": None, "dir": None}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout


def series(version: str) -> list[Path]:
    """The version's series, sorted, minus the patches named in EXCLUDED (by stem)."""
    commit, root = SERIES_REV["commit"], SERIES_REV["dir"]
    if commit is None:
        found = sorted((SERIES_ROOT / version).glob("*.patch"))
    else:
        rel = f"patches/hybrid-fa/{version}"
        names = [n for n in _git("ls-tree", "--name-only", f"{commit}:{rel}").split() if n.endswith(".patch")]
        dest = Path(root) / version
        dest.mkdir(parents=True, exist_ok=True)
        for n in names:
            if not (dest / n).exists():
                (dest / n).write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{rel}/{n}"],
                                                      capture_output=True, check=True).stdout)
        found = sorted(dest / n for n in names)
    if not found:
        raise XverError(f"no patch series for {version} in {SERIES_ROOT / version}"
                        + (f" at {commit}" if commit else ""))
    return [p for p in found if p.stem not in EXCLUDED and p.name not in EXCLUDED]


def build_env(build: Build) -> tuple[Path, Path]:
    """``(interpreter, overlay)`` for a build (provisioned and cached)."""
    py = provision.runtime_env(build.version) / "bin" / "python"
    ov = provision.overlay(build.version, series(build.version) if build.state == "patched" else None)
    return py, ov


def run_phase(build: Build, args: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """One restore_gate phase in the build's environment; its JSON report.
    Run once more (another process, another pid) when the phase refused to
    start because shared-memory segments of a dead process with its pid were
    left behind (restore_gate.STALE_SHM)."""
    try:
        return _run_phase(build, args, log, timeout)
    except XverError as exc:
        if STALE_SHM not in str(exc):
            raise
        log.rename(log.with_suffix(".stale-shm.log"))
        return _run_phase(build, args, log, timeout)


# restore_gate.STALE_SHM (not imported: restore_gate needs the target environment)
STALE_SHM = "stale shared-memory segments named for pid"


def _run_phase(build: Build, args: list[str], log: Path, timeout: float) -> dict[str, Any]:
    py, ov = build_env(build)
    report = log.with_suffix(".json")
    env = dict(os.environ, PYTHONPATH=f"{ov}:{REPO}", NO_COLOR="1")
    argv = [str(py), str(GATE), *args, "--json-out", str(report)]
    with open(log, "w") as fh:
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=fh, env=env, cwd=str(REPO), timeout=timeout)
    if not report.exists():
        raise XverError(f"{build.label}: restore_gate {args[:2]} wrote no report (rc {proc.returncode}); "
                        f"log {log}:\n{log.read_text()[-3000:]}")
    rep = json.loads(report.read_text())
    if rep["verdict"] == "error":
        raise XverError(f"{build.label}: restore_gate {args[:2]} errored: {rep['reason'].splitlines()[0]} "
                        f"(log {log})")
    return rep


# ---------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------


READER_SERVERS = ("auto", "shared", "per-request")


def reader_server_mode(choice: str, tier: str, reader: Build) -> str:
    """``shared`` (one reader server per chunk size serves every writer) or
    ``per-request`` (a fresh one per stored (writer, preset) request).

    auto: per-request for a pristine reader on Redis, shared otherwise.  Once
    a pristine build's native RESP client has met a value of another size
    ("GET: size header mismatch"), the server finds nothing more on that
    Redis (measured: a pristine 0.5.6 server then misses even its own
    objects, with no further log line), so on a shared server a pristine
    cell would depend on which writers' loads went before it.  A
    patched reader never meets one here (sealed, layout-namespaced keys: one
    size per key), and serving every writer from one server is the stronger
    test of that.
    """
    if choice != "auto":
        return choice
    return "per-request" if tier == "redis" and reader.state == "pristine" else "shared"


def run_matrix(pairs: list[tuple[Build, Build]], presets: list[str], chunk_blocks: list[int], work: Path,
               chunks: int, seed: int, timeout: float, say, share: Share,
               reader_servers: str = "auto") -> dict[str, Any]:
    """Every writer stores once per chunk size, every reader restores all its
    writers' stores in one phase; ``share`` puts the stores in front of the
    readers (fs: hard-linked copies; redis: the one shared server) and proves
    afterwards that no reader changed what its writers left."""
    writers = sorted({w for w, _ in pairs})
    timings: dict[str, Any] = {"writers": {}, "readers": {}}
    readers_info: dict[str, Any] = {}
    cells: list[dict[str, Any]] = []
    preset_args = [a for p in presets for a in ("--preset", p)]
    for cb in chunk_blocks:
        states: dict[Build, Path] = {}
        stored: dict[Build, dict[str, Any]] = {}
        models: dict[Build, list[str]] = {}
        for w in writers:
            wdir = work / f"w-{w.label}-cb{cb}"
            tier_args = share.writer_args(wdir)
            t0 = time.monotonic()
            rep = run_phase(w, ["--phase", "store", *tier_args, "--state-out",
                                str(wdir / "state.json"), "--model-prefix", f"xver-w{w.label}",
                                "--chunk-blocks", str(cb), "--chunks", str(chunks), "--seed", str(seed),
                                *preset_args], wdir / "store.log", timeout)
            dt = time.monotonic() - t0
            timings["writers"][f"{w.label}/cb{cb}"] = round(dt, 2)
            if rep["verdict"] != "pass":
                raise XverError(f"writer {w.label} cb{cb}: {rep['reason']}")
            states[w] = wdir
            stored[w] = {p["preset"]: p for p in rep["presets"]}
            models[w] = models_of(json.loads((wdir / "state.json").read_text()))
            summary = share.keys_summary(models[w])
            if summary is not None:
                for p in stored[w].values():
                    p["tier_keys"] = summary.get(p.get("model_name") or "")
            say(f"writer {w.label:16} cb{cb}: stored {len(presets)} presets in {dt:.1f} s")
        readers = sorted({r for _, r in pairs})
        share.protect([m for w in writers for m in models[w]])
        for r in readers:
            ws = [w for w, rr in pairs if rr == r]
            rdir = work / f"r-{r.label}-cb{cb}"
            before = {w: share.fingerprint(states[w], models[w]) for w in ws}
            tier_args = share.reader_args(rdir, [states[w] for w in ws])
            state_before = share.reader_state(rdir, before)
            mode = reader_server_mode(reader_servers, share.tier, r)
            if mode == "per-request":
                tier_args.append("--server-per-request")
            commands_before = share.command_counts()
            t0 = time.monotonic()
            rep = run_phase(r, ["--phase", "restore", *tier_args,
                                *[a for w in ws for a in ("--state-in", str(states[w] / "state.json"))]],
                            rdir / "restore.log", timeout)
            dt = time.monotonic() - t0
            commands = command_delta(commands_before, share.command_counts())
            timings["readers"][f"{r.label}/cb{cb}"] = {"seconds": round(dt, 2), "writers": len(ws),
                                                       "phases": rep.get("timings", {})}
            # What the reader's servers wrote over its writers' objects (a
            # restore asks for no store; LMCache 0.5.3-0.5.5 can store the
            # buffer of a failed load: xver_share), then put back on Redis.
            after = {w: share.fingerprint(states[w], models[w]) for w in ws}
            writes = share.reader_writes(rdir, state_before, share.reader_state(rdir, after))
            if writes:
                share.undo(writes)
                after = {w: share.fingerprint(states[w], models[w]) for w in ws}
                say(f"TIER WRITE by reader {r.label} cb{cb}: {len(writes)} object(s) of its writers "
                    + ("(put back)" if share.tier == "redis" else "(in its own copy)") + ": "
                    + "; ".join(f"{x['object'][:60]}... {x['before']} -> {x['after']}"
                                + (" all zeros" if x["zeros"] else "") for x in writes[:3]))
            for w in ws:
                if after[w] != before[w]:
                    raise XverError(f"reader {r.label} changed writer {w.label}'s objects on the {share.tier} "
                                    f"tier (cb{cb}) and they could not be put back: "
                                    f"{'; '.join(fingerprint_diff(before[w], after[w]))}; commands during the "
                                    f"reader {commands}; log {rdir / 'restore.log'}")
            # the reader servers' own account per server cycle: the L2 adapters'
            # status (a patched resp adapter counts the objects its checksum
            # refused) and the native client's failed loads by reason
            cycles = rep.get("cycles", [])
            readers_info[f"{r.label}/cb{cb}"] = {
                "servers": mode, "server_cycles": len(cycles), "redis_commands": commands, "tier_writes": writes,
                "l2_adapters_status": [c.get("l2_adapters_status") for c in cycles],
                "native_get_failures": _summed([c.get("native_get_failures") or {} for c in cycles])}
            per_request = {(q["writer"], q["preset"]): c.get("native_get_failures") or {}
                           for c in cycles if len(c.get("requests", [])) == 1 for q in c["requests"]}
            wrote_to = {x["model"] for x in writes}
            for p in rep["presets"]:
                w = Build.parse(p["writer"].removeprefix("xver-w"))
                c = cell(w, r, p, stored[w][p["preset"]], cb)
                c["reader_server"] = mode
                c["native_get_failures"] = per_request.get((p["writer"], p["preset"])) if mode == "per-request" \
                    else None
                c["reader_wrote"] = [x for x in writes if x["model"] == p.get("model_name")] \
                    if p.get("model_name") in wrote_to else []
                cells.append(c)
            say(f"reader {r.label:16} cb{cb}: {len(ws)} writer(s) x {len(presets)} presets in {dt:.1f} s: "
                + " ".join(f"{c['writer_short']}:{c['letters']}" for c in _reader_rows(cells, r, cb, presets)))
        released = share.release([m for w in writers for m in models[w]])
        if released:
            say(f"cb{cb}: deleted the writers' {released} keys from {share.describe()['url']}")
    return {"cells": cells, "timings": timings, "readers": readers_info}


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in counts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _reader_rows(cells: list[dict[str, Any]], r: Build, cb: int, presets: list[str]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for c in cells:
        if c["reader"] == r.label and c["chunk_blocks"] == cb:
            row = rows.setdefault(c["writer"], {"writer_short": Build.parse(c["writer"]).short, "o": {}})
            row["o"][c["preset"]] = c["outcome"]
    for row in rows.values():
        row["letters"] = "".join({"exact": "E", "miss": "M", "wrong": "W"}.get(row["o"].get(p), "!") for p in presets)
    return list(rows.values())


EXPECT = "layout"  # which keys the expectation assumes (--expect)
TIER = "fs"  # which tier the cells were measured on (--tier): the expectation differs (xver_outcome)


def cell(w: Build, r: Build, p: dict[str, Any], wp: dict[str, Any], cb: int) -> dict[str, Any]:
    """One (writer, reader, preset, chunk_blocks) result, with what it should have been."""
    name = p["preset"]
    x = p.get("xver") or {}
    fid = p.get("fidelity") or {}
    fa, gdn = fid.get("fa"), fid.get("gdn")
    exp = judge({"writer": w.label, "reader": r.label, "preset": name, "chunk_blocks": cb, "tier": TIER})
    return {
        "writer": w.label, "reader": r.label, "preset": name, "chunk_blocks": cb, "tier": TIER,
        "outcome": p["outcome"], "why": p["outcome_why"],
        "expected": exp, "as_expected": p["outcome"] == exp, "upstream": is_upstream(w, r, name, cb, TIER),
        "predicted_today": predicted_outcome(w, r, name, cb, "today") if TIER == "fs" else None,
        "classes": {"writer": byte_class(w, name, cb), "reader": byte_class(r, name, cb)},
        "namespaces_with_layout_keys": {"writer": namespace(w, name, cb), "reader": namespace(r, name, cb)},
        "chunks_stored": x.get("chunks_stored"), "chunks_hit": x.get("chunks_hit"),
        "chunks_exact": x.get("chunks_exact"), "retrieve_ok": x.get("retrieve_ok"),
        "foreign_bytes": x.get("foreign_bytes"),
        "fa_fidelity": fa.get("pages_fraction") if fa else None,
        "gdn_fidelity": gdn.get("blocks_fraction") if gdn else None,
        "fa_byte_fraction": fa.get("byte_fraction") if fa else None,
        "gdn_byte_fraction": gdn.get("byte_fraction") if gdn else None,
        "l2_model_fields": (wp.get("on_disk") or {}).get("model_fields"),
        "object_bytes": (wp.get("on_disk") or {}).get("object_bytes"),
        "checksum_trailers": (wp.get("on_disk") or {}).get("checksum_trailers"),
        "tier_keys": wp.get("tier_keys"),
    }


def estimate(timings: dict[str, Any], presets: int) -> dict[str, float]:
    """Full-matrix wall time (8 writers x 8 readers x 2 chunk sizes, all presets),
    from the measured phases: a writer run is fixed, a reader run is a fixed part
    (its servers) plus a part per writer it serves."""
    w = list(timings["writers"].values())
    rs = list(timings["readers"].values())
    if not w or not rs:
        return {}
    writer_s = sum(w) / len(w)
    per_writer = []
    fixed = []
    for r in rs:
        restore = r["phases"].get("restore", 0.0)
        fixed.append(r["seconds"] - restore)
        per_writer.append(restore / max(1, r["writers"]))
    fixed_s, per_writer_s = sum(fixed) / len(fixed), sum(per_writer) / len(per_writer)
    n_builds, n_cb = len(ALL_BUILDS), len(CHUNK_BLOCKS)
    full = n_cb * (n_builds * writer_s + n_builds * (fixed_s + n_builds * per_writer_s))
    per_pair_alone = writer_s + fixed_s + per_writer_s
    return {"writer_run_s": round(writer_s, 1), "reader_fixed_s": round(fixed_s, 1),
            "reader_per_writer_s": round(per_writer_s, 2), "full_matrix_s": round(full),
            "one_pair_alone_s": round(per_pair_alone, 1),
            "full_matrix_one_server_pair_per_pair_s": round(n_cb * n_builds * n_builds * per_pair_alone),
            "presets_per_run": presets}


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _builds(text: str | None) -> list[Build]:
    if not text:
        return list(ALL_BUILDS)
    out: list[Build] = []
    for part in text.split(","):
        part = part.strip()
        if part in ("0.5.3", "0.5.4", "0.5.5", "0.5.6"):
            out += [Build(part, "pristine"), Build(part, "patched")]
        elif part:
            out.append(Build.parse(part))
    return out


def select_pairs(args: argparse.Namespace) -> list[tuple[Build, Build]]:
    if args.pairs:
        pairs = []
        for part in args.pairs.split(","):
            w, sep, r = part.partition(">") if ">" in part else part.partition(":")
            if not sep or not r:
                raise SystemExit(f"--pairs {part!r}: write WRITER>READER, e.g. 0.5.5-patched>0.5.6-pristine")
            pairs.append((Build.parse(w), Build.parse(r)))
        return pairs
    if args.edges_for:
        pairs = edges_for(args.edges_for)
        if not pairs:
            raise SystemExit(f"--edges-for {args.edges_for}: no CI edge involves that version")
        return pairs
    if args.ci:
        return list(CI_EDGES)
    if args.all or args.writers or args.readers:
        return [(w, r) for w in _builds(args.writers) for r in _builds(args.readers)]
    raise SystemExit("select pairs: --all, --ci, --edges-for V, --pairs W>R,..., or --writers/--readers")


def judge(c: dict[str, Any]) -> str:
    """The outcome a cell must have: with --expect layout the required one on
    the cell's tier, else what the byte classes predict with those keys (fs)."""
    w, r, name, cb = Build.parse(c["writer"]), Build.parse(c["reader"]), c["preset"], c["chunk_blocks"]
    tier = c.get("tier", "fs")
    if EXPECT == "layout":
        return expected_outcome(w, r, name, cb, tier)
    return predicted_outcome(w, r, name, cb, EXPECT, tier)


def rejudge(path: Path, args: argparse.Namespace) -> int:
    """--rejudge: the stored cells against --expect (no server runs)."""
    result = json.loads(path.read_text())
    tier = result.get("tier", "fs")
    if tier != "fs" and EXPECT != "layout":
        raise SystemExit(f"--rejudge {path}: measured on the {tier} tier; --expect {EXPECT} predicts the fs tier only")
    bad = []
    for c in result["cells"]:
        c.setdefault("tier", tier)
        c["expected"] = judge(c)
        c["as_expected"] = c["outcome"] == c["expected"]
        if not c["as_expected"]:
            bad.append(c)
    cbs = sorted({c["chunk_blocks"] for c in result["cells"]})
    print("\n\n".join(f"### {cb} block(s) per chunk\n\n"
                      + matrix_markdown(result["cells"], result["presets"], cb, expected=EXPECT, tier=tier)
                      for cb in cbs))
    for c in bad:
        print(f"UNEXPECTED {c['writer']} -> {c['reader']} {c['preset']} cb{c['chunk_blocks']}: {c['outcome']} "
              f"(expected {c['expected']} with {EXPECT} keys on {tier}): {c['why']}", file=sys.stderr)
    print(f"xver: {len(result['cells']) - len(bad)}/{len(result['cells'])} cells as expected with {EXPECT} keys",
          file=sys.stderr)
    return EXIT_MISMATCH if bad else EXIT_OK


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every writer x every reader (10 x 10 builds: 0.5.3-0.5.7rc2, pristine and patched)")
    ap.add_argument("--ci", action="store_true", help="the CI edges (" + ", ".join(
        f"{w.short}>{r.short}" for w, r in CI_EDGES) + ")")
    ap.add_argument("--edges-for", metavar="V", help="the CI edges with version V on either side")
    ap.add_argument("--pairs", metavar="W>R,...", help="explicit pairs, e.g. 0.5.5-patched>0.5.6-pristine "
                                                       "(a build: VERSION-pristine|VERSION-patched, or 0.5.6p / 0.5.6P)")
    ap.add_argument("--writers", metavar="B,...", help="writer builds (a bare version = both states); x --readers")
    ap.add_argument("--readers", metavar="B,...", help="reader builds (default: all 8)")
    ap.add_argument("--presets", default=",".join(PRESETS), help=f"comma list (default {','.join(PRESETS)})")
    ap.add_argument("--chunk-blocks", default="1,2", help="comma list of blocks per chunk (default 1,2)")
    ap.add_argument("--chunks", type=int, default=3, help="chunks per stored request (default 3)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--phase-timeout", type=float, default=600.0, help="bound per phase process, seconds")
    ap.add_argument("--work-dir", help="keep the writer/reader directories, logs and phase reports here")
    ap.add_argument("--json-out", metavar="PATH", help="write the full result (cells, timings, estimate)")
    ap.add_argument("--markdown", metavar="PATH", help="write the matrices as markdown")
    ap.add_argument("--exclude-patch", action="append", default=[], metavar="NAME",
                    help="leave this patch (file stem, e.g. 05-layout-keys) out of every patched build")
    ap.add_argument("--series-rev", metavar="REV",
                    help="take the patch series from this git commit (e.g. HEAD) instead of the working tree")
    ap.add_argument("--expect", choices=["layout", "today", "05", "06", "12", "053-06"], default="layout",
                    help="check cells against the outcome the byte classes predict with these keys: layout "
                         "(default: the series as it stands, = 053-06), 12 (before 0.5.3's part 19: use with "
                         "--exclude-patch 19-state-chunk-ends), 06 (06's keys without object checksums: "
                         "use with --exclude-patch 12-l2-checksum), 05 (up to 05-layout-keys), today (bare keys: "
                         "use with --exclude-patch 05-layout-keys)")
    ap.add_argument("--tier", choices=list(TIERS),
                    help="the L2 tier writers and readers share: fs (default: a directory per writer, hard-linked "
                         "into one per reader) or redis (LMCache's resp adapter on ONE Redis server for every "
                         "writer and reader; without --redis-url a private redis-server on 127.0.0.1, from "
                         "lab/provision_redis.py, for the run)")
    ap.add_argument("--redis-url", metavar="redis://HOST:PORT",
                    help="use this Redis server (implies --tier redis); the gate writes keys of its own random "
                         "model names there and deletes them after each chunk size")
    ap.add_argument("--reader-servers", choices=list(READER_SERVERS), default="auto",
                    help="shared: one reader server per chunk size serves every writer; per-request: a fresh one "
                         "per stored (writer, preset) request; auto (default): per-request for pristine readers "
                         "on the redis tier (their native client breaks after a size mismatch), shared otherwise")
    ap.add_argument("--rejudge", metavar="RESULT.json",
                    help="run nothing: judge the cells of an earlier --json-out against --expect again")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.redis_url:
        try:
            RespTier.from_url(args.redis_url)
        except ValueError as exc:
            ap.error(f"--redis-url {exc}")
        if args.tier == "fs":
            ap.error("--redis-url names a Redis tier; it cannot be combined with --tier fs")
        args.tier = "redis"
    args.tier = args.tier or "fs"
    if args.tier != "fs" and args.expect != "layout" and not args.rejudge:
        ap.error(f"--tier {args.tier}: only --expect layout (the series as it stands) has a {args.tier} table")
    return args


def provenance(argv: list[str] | None) -> dict[str, Any]:
    """What a stored result needs to be judged later: the command, when, and
    the checkout it ran from (a dirty tree is said, not hidden)."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return {"command": ["lab/xver_gate.py", *(sys.argv[1:] if argv is None else argv)],
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "git_head": head.stdout.strip() or None,
            "git_dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}


def open_share(args: argparse.Namespace, work: Path, say) -> tuple[Share, RedisServer | None]:
    """The tier the run shares (--tier, --redis-url): fs, the named Redis, or
    a private redis-server on 127.0.0.1 (its log under the work directory)."""
    if args.tier == "fs":
        return FsShare(), None
    if args.redis_url:
        return RedisShare(args.redis_url, private=False), None
    from lab.provision_redis import RedisUnavailable, redis_server  # noqa: PLC0415 - only the redis tier needs it

    try:
        binary = redis_server()
    except RedisUnavailable as exc:
        raise XverError(f"--tier redis: no redis-server: {exc}") from exc
    try:
        server = start_redis_server(binary, work / "redis")
    except RedisStartError as exc:
        raise XverError(f"--tier redis: {exc}") from exc
    say(f"private redis-server {binary} on {server.url} (pid {server.proc.pid}, log {server.log_path})")
    try:
        return RedisShare(server.url, private=True), server
    except XverShareError:
        server.stop()
        raise


def main(argv: list[str] | None = None) -> int:
    global EXPECT, TIER
    args = parse_args(argv)
    EXCLUDED[:] = args.exclude_patch
    EXPECT = args.expect
    TIER = args.tier
    if args.rejudge:
        return rejudge(Path(args.rejudge), args)
    pairs = select_pairs(args)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    cbs = [int(c) for c in args.chunk_blocks.split(",") if c.strip()]

    def say(line: str) -> None:
        if not args.quiet:
            print(f"xver: {line}", file=sys.stderr, flush=True)

    say(f"{len(pairs)} pair(s) x {len(presets)} presets x chunk blocks {cbs}: "
        + ", ".join(f"{w.short}>{r.short}" for w, r in pairs))
    t0 = time.monotonic()
    tmp = None
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        if any(work.iterdir()):
            raise SystemExit(f"--work-dir {work} is not empty")
    else:
        tmp = tempfile.TemporaryDirectory(prefix="lmcache-xver-")
        work = Path(tmp.name)
    if args.series_rev:
        SERIES_REV.update(commit=_git("rev-parse", args.series_rev).strip(), dir=str(work / "series"))
    result: dict[str, Any] = {"tool": "xver_gate", "schema": 1, **provenance(argv),
                              "pairs": [[w.label, r.label] for w, r in pairs],
                              "presets": presets, "chunk_blocks": cbs, "chunks": args.chunks, "seed": args.seed,
                              "excluded_patches": list(EXCLUDED), "expect": EXPECT, "tier": TIER,
                              "reader_servers": args.reader_servers,
                              "series_rev": SERIES_REV["commit"],
                              "series": {v: [p.name for p in series(v)] for v in sorted({b.version for wr in pairs
                                                                                         for b in wr})}}
    code = EXIT_OK
    redis: RedisServer | None = None
    try:
        share, redis = open_share(args, work, say)
        result["share"] = share.describe()
        result.update(run_matrix(pairs, presets, cbs, work, args.chunks, args.seed, args.phase_timeout, say,
                                 share, args.reader_servers))
        bad = [c for c in result["cells"] if not c["as_expected"]]
        result["mismatches"] = bad
        result["tier_writes"] = [{"reader": key, **x} for key, info in result["readers"].items()
                                 for x in info["tier_writes"]]
        # A patched reader that writes over a shared tier's object launders
        # whatever it read (or did not read) into an object later readers
        # trust: a failure, like a wrong hit.  Judged on Redis, where readers
        # share the writers' keys; on fs a reader writes into its own copy
        # (recorded, not judged yet).
        result["patched_reader_tier_writes"] = [
            x for x in result["tier_writes"]
            if TIER == "redis" and Build.parse(x["reader"].split("/")[0]).state == "patched"]
        failed = bad or result["patched_reader_tier_writes"]
        result["verdict"] = "as expected" if not failed else "differs from expected"
        code = EXIT_MISMATCH if failed else EXIT_OK
    except (XverError, XverShareError, subprocess.TimeoutExpired) as exc:
        result.update(verdict="error", reason=str(exc))
        code = EXIT_ERROR
    finally:
        if redis is not None:
            redis.stop()
        if tmp is not None:
            tmp.cleanup()
    result["seconds"] = round(time.monotonic() - t0, 1)
    if "timings" in result:
        result["estimate"] = estimate(result["timings"], len(presets))
    md = "\n\n".join(f"### {cb} block(s) per chunk\n\n"
                     + matrix_markdown(result["cells"], presets, cb, expected=EXPECT, tier=TIER)
                     for cb in cbs) if "cells" in result else ""
    if args.markdown and md:
        Path(args.markdown).write_text(md + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    if md and not args.quiet:
        print(md, file=sys.stderr)
    for x in result.get("patched_reader_tier_writes", []):
        say(f"UNEXPECTED patched reader {x['reader']} wrote {x['object']}: {x['before']} -> {x['after']}")
    for c in result.get("mismatches", []):
        say(f"UNEXPECTED {c['writer']} -> {c['reader']} {c['preset']} cb{c['chunk_blocks']}: "
            f"{c['outcome']} (expected {c['expected']}): {c['why']}")
    est = result.get("estimate")
    if est:
        say(f"full-matrix estimate: {est['full_matrix_s'] / 60:.1f} min (writer run {est['writer_run_s']} s, "
            f"reader {est['reader_fixed_s']} s + {est['reader_per_writer_s']} s per writer); one server pair "
            f"per pair would take {est['full_matrix_one_server_pair_per_pair_s'] / 60:.1f} min")
    say(f"{result['verdict']} in {result['seconds']} s" + (f": {result.get('reason')}" if code == EXIT_ERROR else ""))
    return code


if __name__ == "__main__":
    sys.exit(main())
