#!/usr/bin/env python3
"""Build the folder a lent GPU machine needs for the CUDA round trip.

The device (see docs/engine-gate.md, "The lent-device CUDA round trip") has
Python 3.12, torch 2.11.0+cu130 and the packages of ``image_packages.txt``, no
network and no vLLM; a call carries at most 64 MiB, the working tree
included.  This script, run on a machine with network access, writes
``.device-carry/`` (gitignored) at the repository root:

* ``wheels/lmcache-V-*.whl`` for each LMCache version, **slimmed**: the real
  cp312 wheel minus the members the round trip never loads (the ``fs`` and
  ``redis`` storage-backend extensions, documentation images).  Every kept
  member is byte-identical and keeps its RECORD row; the dropped members'
  rows are removed.  ``manifest.json`` records the original wheel's sha256,
  what was dropped and the slim wheel's sha256;
* ``deps/*.whl``: the pure-Python and cp312 dependencies the harness imports
  that the image lacks (``DEPS``), plus ``unidiff`` for ``patchtool apply``;
* ``manifest.json``: versions, files, sizes, the total.

It measures the folder plus the tracked working tree and refuses (exit 3,
folder removed) when the total exceeds ``--limit-mib`` (64).

``--python-version 3.11`` builds a stand-in carry for the CPU test
(``tests/gpu_device``): same logic, cp311 wheels for this machine's venvs.

    python3 -m lab.prepare_carry                  # -> .device-carry/, prints the size
    run(command="bash lab/gpu_roundtrip_device.sh", carry=[".device-carry"], timeout_s=540)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSIONS = ("0.5.3", "0.5.4", "0.5.5", "0.5.6")
LIMIT_MIB = 64.0
# Imported by the harness path (import lmcache, the transfer module, the
# connector-side edits) and absent from the device image (image_packages.txt):
# found by running the harness under tests/gpu_device/image_sim (an import
# blocker that allows only the image's packages plus these).
DEPS = {
    "msgspec": "0.23.0",
    "pyzmq": "27.3.0",
    "nvtx": "0.2.17",
    "cachetools": "8.0.2",
    "opentelemetry-api": "1.40.0",
    "opentelemetry-sdk": "1.40.0",
    "opentelemetry-semantic-conventions": "0.61b0",
    "opentelemetry-exporter-prometheus": "0.61b0",
    "importlib-metadata": "8.7.1",
    "unidiff": "1.0.1",  # patchtool apply
}
# Members of the lmcache wheel the round trip never loads.
DROP_SUFFIXES = (".png",)
DROP_PREFIXES = ("lmcache/lmcache_fs.", "lmcache/lmcache_redis.")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download(spec: str, dest: Path, python_version: str) -> Path:
    """``pip download`` one exact requirement as a binary wheel for ``python_version``."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest), spec]
    for plat in PLATFORMS:
        cmd[6:6] = ["--platform", plat]
    subprocess.run(cmd, check=True)
    name, ver = spec.split("==")
    name = name.lower().replace("-", "_").replace(".", "_")
    found = [p for p in dest.glob("*.whl")
             if p.name.split("-")[0].lower().replace(".", "_") == name and p.name.split("-")[1] == ver]
    if not found:
        new = set(dest.glob("*.whl")) - before
        raise SystemExit(f"prepare_carry: pip download {spec}: no wheel found ({sorted(new)})")
    return sorted(found)[0]


def slim_wheel(src: Path, dst_dir: Path) -> dict:
    """Rewrite ``src`` without the DROP members (RECORD rows removed); same file name."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / src.name
    dropped, kept = [], 0
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))

        def drop(n: str) -> bool:
            return n.startswith(DROP_PREFIXES) or n.endswith(DROP_SUFFIXES)

        with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for info in zin.infolist():
                n = info.filename
                if drop(n):
                    dropped.append({"name": n, "bytes": info.file_size})
                    continue
                data = zin.read(n)
                if n == record:
                    rows = [r for r in data.decode().splitlines() if r and not drop(r.split(",", 1)[0])]
                    data = ("\n".join(rows) + "\n").encode()
                else:
                    kept += 1
                zout.writestr(info, data)
    return {"wheel": dst.name, "original_sha256": _sha(src), "original_bytes": src.stat().st_size,
            "sha256": _sha(dst), "bytes": dst.stat().st_size, "members_kept": kept, "dropped": dropped}


def check_slim(original: Path, slim: Path) -> None:
    """Every member of the slim wheel is the original's, byte for byte (RECORD aside), and hashes as RECORD says."""
    with zipfile.ZipFile(original) as zo, zipfile.ZipFile(slim) as zs:
        record = next(n for n in zs.namelist() if n.endswith(".dist-info/RECORD"))
        rows = {r.split(",")[0]: r.split(",")[1] for r in zs.read(record).decode().splitlines() if r}
        for n in zs.namelist():
            if n == record:
                continue
            data = zs.read(n)
            if data != zo.read(n):
                raise SystemExit(f"prepare_carry: {slim.name}: {n} differs from the original wheel")
            want = rows.get(n, "")
            if want:
                algo, _, digest = want.partition("=")
                got = urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
                if got != digest:
                    raise SystemExit(f"prepare_carry: {slim.name}: {n} does not match its RECORD row")
        if set(rows) - set(zs.namelist()) - {record}:
            raise SystemExit(f"prepare_carry: {slim.name}: RECORD lists members that are not there")


def tree_bytes(skip: Path) -> int:
    """Bytes of what travels besides the carry: tracked plus untracked-not-ignored files (not ``skip``)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout.split(b"\0")
    total = 0
    for rel in filter(None, out):
        p = REPO / rel.decode()
        if skip in p.parents:
            continue
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / ".device-carry"))
    ap.add_argument("--versions", default=",".join(VERSIONS))
    ap.add_argument("--python-version", default="3.12", help="3.12 for the device; 3.11 for the CPU stand-in")
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    ap.add_argument("--cache", default=str(Path(os.environ.get("LMCACHE_PATCHTOOL_CACHE",
                                                               Path.home() / ".cache" / "lmcache-patchtool"))
                                           / "device-wheels"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    cache = Path(args.cache) / f"py{args.python_version}"
    versions = [v for v in args.versions.split(",") if v]
    tmp = Path(tempfile.mkdtemp(prefix="device-carry-", dir=str(out.parent)))
    try:
        manifest: dict = {"format": 1, "python_version": args.python_version, "lmcache": {}, "deps": {},
                          "drop_rules": {"prefixes": list(DROP_PREFIXES), "suffixes": list(DROP_SUFFIXES)}}
        for v in versions:
            orig = download(f"lmcache=={v}", cache, args.python_version)
            info = slim_wheel(orig, tmp / "wheels")
            check_slim(orig, tmp / "wheels" / orig.name)
            manifest["lmcache"][v] = info
            print(f"lmcache {v}: {info['original_bytes'] / 2**20:.2f} MiB -> {info['bytes'] / 2**20:.2f} MiB "
                  f"(dropped {len(info['dropped'])} members)", file=sys.stderr)
        for name, ver in DEPS.items():
            whl = download(f"{name}=={ver}", cache, args.python_version)
            (tmp / "deps").mkdir(exist_ok=True)
            shutil.copy2(whl, tmp / "deps" / whl.name)
            manifest["deps"][name] = {"wheel": whl.name, "bytes": whl.stat().st_size, "sha256": _sha(whl)}
        carry = folder_bytes(tmp)
        tree = tree_bytes(tmp)
        total = carry + tree + 4096  # manifest
        manifest["sizes"] = {"carry_bytes": carry, "tree_bytes": tree, "total_bytes": total,
                             "total_mib": round(total / 2**20, 2), "limit_mib": args.limit_mib}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if total > args.limit_mib * 2**20:
            print(f"prepare_carry: {total / 2**20:.2f} MiB (carry {carry / 2**20:.2f} + tree {tree / 2**20:.2f}) "
                  f"exceeds {args.limit_mib} MiB; nothing written", file=sys.stderr)
            return 3
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        print(json.dumps(manifest["sizes"]))
        return 0
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


if __name__ == "__main__":
    raise SystemExit(main())
