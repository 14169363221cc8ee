#!/usr/bin/env python3
"""The CUDA round trip on a lent GPU machine, per LMCache version.

Run by ``lab/gpu_roundtrip_device.sh`` (``python3 -m
lab.roundtrip_device``, the repository root on ``PYTHONPATH``)
with the image's ``python3`` and the folder ``lab/prepare_carry.py`` wrote (``.device-carry``).  Never a
venv: each version is ``pip install --no-deps --target``-ed from its carried
wheel, the carried dependencies into one more folder, and everything is put on
``PYTHONPATH``.  Per version:

1. **probe**: whether each compiled extension of the wheel loads under the
   image's torch (``c_ops`` on 0.5.3, ``cuda_ops`` and ``lmcache_native`` on
   0.5.4+), and what LMCache itself then finds (native plan executor, direct
   copy);
2. **patch**: a copy of the install is patched with ``patchtool apply
   --site-packages`` (GNU ``patch -p1 -F0`` if that fails, recorded);
3. **correctness**: ``-m lab.ports_roundtrip --device cuda --edits`` on
   the small matrix, pristine and patched, on the native path in HND and NHD,
   and on 0.5.6's direct-copy path (NHD, the layout it serves);
4. **timing**: patched ``qwen35-0.8b`` (k=17) vs pristine ``control-k1`` on
   the native path, guards and hashes off, ``--reps`` repetitions: the
   per-FA-byte ratio.

Everything runs under one deadline (``--budget-s``, default 450): what did not
start in time is reported as skipped.  ``$OUT`` receives ``device-summary.json``
(verdicts, probes, ratios), ``device-runs.json`` (every harness document),
``device.log`` and, when matplotlib is there, ``device-per-byte.png``.

``--standin`` runs the same on this machine's CPU (``--device cpu-standin``;
``--python`` a provisioned runtime venv's interpreter): the CPU test of this
script's logic.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = ["-m", "lab.ports_roundtrip"]  # the repository root is on PYTHONPATH (env())
# vLLM 0.30+ registers GDN state as (nb, 1, 1, content) with a padded stride(0).
# On CPU every LMCache version refuses it (docs/ports.md); whether the CUDA
# kernels take it is the open question, so it is recorded per version and
# layout but does not decide "verified".
GDN_VIEW_PROBE = ["preset=qwen35-bs576-v030,chunk_blocks=1,num_chunks=3"]

MATRIX = {  # small: every sub-paged preset, a batched retrieve with a skip, the k=1 control
    "tiny": ["preset=qwen35-0.8b,chunk_blocks=1,num_chunks=3",
             "preset=control-k1,chunk_blocks=1,num_chunks=2"],
    "small": ["preset=qwen35-0.8b,chunk_blocks=1,num_chunks=3",
              "preset=qwen35-0.8b,chunk_blocks=2,num_chunks=5,skip_blocks=3",
              "preset=control-k1,chunk_blocks=2,num_chunks=5,skip_blocks=3",
              "preset=pure-attn-bs128,chunk_blocks=2,num_chunks=5,skip_blocks=2",
              "preset=gdn-27b,chunk_blocks=1,num_chunks=2",
              # vLLM 0.33's align-mode block on Hopper (FlashInfer GDN prefill): 576/64, k=9
              "preset=qwen35-bs576,chunk_blocks=1,num_chunks=3"],
}
TIMING = "chunk_blocks=2,num_chunks=4"
PROBE = r"""
import importlib.machinery, importlib.util, json, sys, traceback
from pathlib import Path
site = Path(sys.argv[1])
out = {"extensions": {}}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda_available"] = torch.cuda.is_available()
except Exception as exc:
    out["torch_error"] = repr(exc)
for so in sorted((site / "lmcache").glob("*.so")):
    stem = so.name.split(".")[0]
    if stem not in ("c_ops", "cuda_ops", "lmcache_native"):
        continue
    try:
        spec = importlib.util.spec_from_file_location("lmcache." + stem, so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out["extensions"][stem] = {"loaded": True, "has_executor": hasattr(mod, "execute_object_group_transfer"),
                                   "has_direct": hasattr(mod, "execute_direct_copy_transfer")}
    except BaseException as exc:
        out["extensions"][stem] = {"loaded": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
for k in [k for k in sys.modules if k == "lmcache" or k.startswith("lmcache.")]:
    del sys.modules[k]
try:
    import lmcache
    from gate import harness_cuda as hc
    out["torch_device_type"] = getattr(lmcache, "torch_device_type", None)
    out["lmcache_sees"] = hc.native_status()
except BaseException as exc:
    out["lmcache_error"] = traceback.format_exc()[-1500:]
print(json.dumps(out))
"""


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work)
        self.carry = Path(args.carry)
        self.py = args.python
        self.device = "cpu-standin" if args.standin else "cuda"
        self.deadline = time.monotonic() + args.budget_s
        self.t0 = time.monotonic()
        self.log_fh = open(self.out / "device.log", "a")
        self.summary: dict = {"device": self.device, "python": self.py, "versions": {}, "skipped": []}
        self.runs: list[dict] = []

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        self.log_fh.write(line + "\n")
        self.log_fh.flush()

    def sh(self, cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
        left = self.deadline - time.monotonic()
        try:
            return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO),
                                  timeout=max(1.0, min(timeout, left)))
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(cmd, 124, exc.stdout or "", f"timed out after {exc.timeout:.0f} s")

    def env(self, site: Path) -> dict:
        paths = [str(site), str(self.work / "deps"), str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                        else [])
        return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")

    # -- steps ----------------------------------------------------------------------------
    def install(self, version: str, wheel: Path) -> Path | None:
        site = self.work / version / "pristine"
        r = self.sh([self.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                     "--no-cache-dir", "--target", str(site), str(wheel)], 120)
        if r.returncode:
            self.summary["versions"][version]["install_error"] = r.stderr[-1500:]
            return None
        return site

    def patch(self, version: str, pristine: Path) -> Path | None:
        patched = self.work / version / "patched"
        shutil.copytree(pristine, patched, symlinks=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(self.work / "deps")]))
        r = self.sh([self.py, "-m", "patchtool", "apply", "--site-packages", str(patched)], 120, env=env)
        rec = {"tool": "patchtool", "rc": r.returncode, "tail": (r.stdout + r.stderr)[-800:]}
        if r.returncode:
            shutil.rmtree(patched)
            shutil.copytree(pristine, patched, symlinks=True)
            ok = True
            for p in sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch")):
                q = subprocess.run(["patch", "-p1", "-F0", "--forward", "--no-backup-if-mismatch", "-s", "-i",
                                    str(p)], cwd=patched, capture_output=True, text=True)
                ok &= q.returncode == 0
            rec = {"tool": "patch -p1 -F0 (patchtool failed)", "ok": ok, "patchtool": rec}
            if not ok:
                self.summary["versions"][version]["patch"] = rec
                return None
        self.summary["versions"][version]["patch"] = rec
        return patched

    def harness(self, version: str, variant: str, site: Path, path: str, layout: str, cells: list[str],
                extra: list[str] = (), tag: str = "check") -> dict | None:
        label = f"{version}/{variant}/{path}/{layout}/{tag}"
        if time.monotonic() > self.deadline - 5:
            self.summary["skipped"].append(label)
            self.log(f"skip {label}: deadline")
            return None
        cmd = [self.py, *HARNESS, "--json", "--no-hashes", "--device", self.device, "--path", path,
               "--layout", layout, "--edits", *extra]
        for c in cells:
            cmd += ["--cell", c]
        r = self.sh(cmd, self.args.run_timeout_s, env=self.env(site))
        entry = {"label": label, "version": version, "variant": variant, "path": path, "layout": layout,
                 "tag": tag, "rc": r.returncode}
        try:
            entry["doc"] = json.loads(r.stdout)
        except ValueError:
            entry["stderr_tail"] = r.stderr[-2000:]
        self.runs.append(entry)
        doc = entry.get("doc")
        cells_ = doc["cells"] if doc else []
        self.log(f"{label}: rc {r.returncode}, {sum(c['verdict']['pass'] for c in cells_)}/{len(cells_)} pass")
        return doc

    # -- verdicts ---------------------------------------------------------------------------
    @staticmethod
    def judge(doc: dict | None, variant: str, version: str) -> dict:
        """pristine: every sub-paged cell fails (0.5.6: its connector edit fixes the hybrids, so only the
        pure-attention one), every k=1 cell passes; patched: every cell passes."""
        if not doc:
            return {"ok": False, "why": "no result"}
        bad = []
        for c in doc["cells"]:
            geo = c.get("geometry") or {}
            broken = geo.get("sub_paged") and (version < "0.5.6" or not geo.get("num_gdn_layers"))
            want = not broken if variant == "pristine" else True
            if "error" in c:
                bad.append(f"{c['name']}: {c['error']}")
            elif c["verdict"]["pass"] is not want:
                bad.append(f"{c['name']}: pass={c['verdict']['pass']}, expected {want} "
                           f"({'; '.join(c['verdict']['reasons'][:2])})")
        return {"ok": not bad, "cells": len(doc["cells"]), "problems": bad[:8]}

    def timing(self, version: str, pristine: Path, patched: Path) -> dict:
        reps = ["--reps", str(self.args.reps + 1), "--no-guards"]
        a = self.harness(version, "patched", patched, "native", "HND", [f"preset=qwen35-0.8b,{TIMING}"], reps,
                         "timing")
        b = self.harness(version, "pristine", pristine, "native", "HND", [f"preset=control-k1,{TIMING}"], reps,
                         "timing")
        out: dict = {}
        for name, doc in (("patched_k17", a), ("pristine_k1", b)):
            c = doc["cells"][0] if doc and doc["cells"] else {}
            t = (c.get("timings") or {}).get("store_retrieve_s", [])[1:]
            if not t or "error" in c:
                return {"ok": False, "why": f"{name}: {c.get('error', 'no timings')}"}
            fa = c["timings"]["fa_bytes_per_rep"]
            out[name] = {"median_s": statistics.median(t), "fa_bytes": fa, "ns_per_fa_byte": statistics.median(t)
                         / fa * 1e9, "samples_s": t, "pass": c["verdict"]["pass"]}
        out["ratio"] = out["patched_k17"]["ns_per_fa_byte"] / out["pristine_k1"]["ns_per_fa_byte"]
        out["ok"] = True
        return out

    def run(self) -> int:
        manifest = json.loads((self.carry / "manifest.json").read_text())
        versions = [v for v in self.args.versions.split(",") if v in manifest["lmcache"]] if self.args.versions \
            else list(manifest["lmcache"])
        self.summary["carry"] = manifest.get("sizes")
        deps = sorted((self.carry / "deps").glob("*.whl"))
        r = self.sh([self.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                     "--no-cache-dir", "--target", str(self.work / "deps"), *map(str, deps)], 180)
        self.summary["deps_install"] = {"rc": r.returncode, "tail": r.stderr[-800:], "wheels": [d.name for d in deps]}
        smi = self.sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], 20) \
            if shutil.which("nvidia-smi") else None
        self.summary["nvidia_smi"] = smi.stdout.strip() if smi and smi.returncode == 0 else None
        # 1. probes first, for every version: what loads under this torch
        sites = {}
        for v in versions:
            self.summary["versions"][v] = {}
            site = self.install(v, self.carry / "wheels" / manifest["lmcache"][v]["wheel"])
            if site is None:
                continue
            sites[v] = site
            p = self.sh([self.py, "-c", PROBE, str(site), str(REPO)], 120, env=self.env(site))
            try:
                self.summary["versions"][v]["probe"] = json.loads(p.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                self.summary["versions"][v]["probe"] = {"error": p.stderr[-1500:]}
            sees = self.summary["versions"][v]["probe"].get("lmcache_sees") or {}
            self.log(f"probe {v}: extensions "
                     f"{ {k: e.get('loaded') for k, e in self.summary['versions'][v]['probe'].get('extensions', {}).items()} }, "
                     f"native executor {sees.get('native_plan_executor')}, direct {sees.get('direct_copy')}")
        # 2-4. per version
        native = "native" if not self.args.path else self.args.path
        cells = MATRIX[self.args.matrix]
        for v, pristine in sites.items():
            rec = self.summary["versions"][v]
            patched = self.patch(v, pristine)
            checks = {}
            for layout in self.args.layouts.split(","):
                for variant, site in (("pristine", pristine), ("patched", patched)):
                    if site is None:
                        continue
                    checks[f"{variant}/{native}/{layout}"] = self.judge(
                        self.harness(v, variant, site, native, layout, cells), variant, v)
            if (rec.get("probe", {}).get("lmcache_sees") or {}).get("direct_copy"):
                for variant, site in (("pristine", pristine), ("patched", patched)):
                    if site is not None:
                        checks[f"{variant}/direct/NHD"] = self.judge(
                            self.harness(v, variant, site, "direct", "NHD", cells), variant, v)
            rec["checks"] = checks
            if patched is not None:
                rec["vllm030_gdn_view"] = {
                    f"{variant}/{native}/{layout}": self.judge(
                        self.harness(v, variant, site, native, layout, GDN_VIEW_PROBE, tag="gdn030"),
                        variant, v)
                    for layout in self.args.layouts.split(",")
                    for variant, site in (("pristine", pristine), ("patched", patched))}
            if patched is not None and self.args.reps:
                rec["timing"] = self.timing(v, pristine, patched)
            rec["ok"] = bool(checks) and all(c["ok"] for c in checks.values())
        self.summary["seconds"] = round(time.monotonic() - self.t0, 1)
        self.summary["verified"] = sorted(v for v, r in self.summary["versions"].items() if r.get("ok"))
        self.summary["plot"] = self.plot()
        (self.out / "device-summary.json").write_text(json.dumps(self.summary, indent=1, default=str))
        (self.out / "device-runs.json").write_text(json.dumps(self.runs, default=str))
        self.log(f"done in {self.summary['seconds']} s; verified: {self.summary['verified'] or 'none'}; "
                 f"skipped {len(self.summary['skipped'])}")
        return 0

    def plot(self) -> dict:
        rows = [(v, r["timing"]) for v, r in self.summary["versions"].items() if (r.get("timing") or {}).get("ok")]
        if not rows:
            return {"written": False, "note": "no timings"}
        try:
            import matplotlib  # noqa: PLC0415

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt  # noqa: PLC0415
        except Exception as exc:  # noqa: BLE001
            return {"written": False, "note": f"matplotlib unavailable: {exc}"}
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [t["patched_k17"]["ns_per_fa_byte"] for _, t in rows], 0.4,
               label="patched k=17 (qwen35-0.8b)")
        ax.bar([x + 0.2 for x in xs], [t["pristine_k1"]["ns_per_fa_byte"] for _, t in rows], 0.4,
               label="pristine k=1 (control)")
        for x, (_, t) in zip(xs, rows):
            ax.annotate(f"{t['ratio']:.2f}x", (x, t["patched_k17"]["ns_per_fa_byte"]), ha="center", va="bottom")
        ax.set_xticks(list(xs), [v for v, _ in rows])
        ax.set_ylabel("store+retrieve ns per FA byte")
        ax.set_title(f"LMCache native path, {self.device}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(self.out / "device-per-byte.png", dpi=110)
        return {"written": True, "file": "device-per-byte.png"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carry", default=str(REPO / ".device-carry"))
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "out-device"))
    ap.add_argument("--work", default="/tmp/lmcache-device-roundtrip")
    ap.add_argument("--python", default="python3", help="the image's interpreter (never a venv's)")
    ap.add_argument("--versions", default="", help="comma list (default: every version carried)")
    ap.add_argument("--matrix", choices=sorted(MATRIX), default="small")
    ap.add_argument("--layouts", default=None, help="default HND,NHD (--standin: HND)")
    ap.add_argument("--path", default="", help="path for the correctness runs (default native)")
    ap.add_argument("--reps", type=int, default=6, help="timed repetitions (0: no timing)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="nothing new starts after this")
    ap.add_argument("--run-timeout-s", type=float, default=150.0)
    ap.add_argument("--standin", action="store_true", help="CPU stand-in: --device cpu-standin")
    args = ap.parse_args(argv)
    if args.layouts is None:  # on CPU, 0.5.3-0.5.5 force HND: NHD means something on CUDA only
        args.layouts = "HND" if args.standin else "HND,NHD"
    if Path(args.work).exists():
        shutil.rmtree(args.work)
    Path(args.work).mkdir(parents=True)
    if not (Path(args.carry) / "manifest.json").exists():
        print(f"roundtrip_device: no carry at {args.carry} (run lab/prepare_carry.py and carry it)",
              file=sys.stderr)
        return 2
    return Runner(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
