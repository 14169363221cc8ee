#!/usr/bin/env bash
# One short device-machine check (target: <= ~5 minutes on one H200; NOT run yet).
#
# What it does, writing everything under $OUT (JSON + logs):
#   1. probes the machine: nvidia-smi, python3, and whether the image has torch
#      preinstalled (`python3 -c 'import torch'`) -- a CUDA torch wheel (~900 MB)
#      cannot be carried (64 MiB carry limit), so without it the run stops here
#      and says so in $OUT/device.json;
#   2. builds a venv offline: `--system-site-packages` (reuses the image's torch),
#      lmcache==0.5.3 and its non-torch dependencies from the carried wheel dir
#      .whl/ (`pip install --no-index --find-links .whl`);
#   3. probes LMCache's CUDA extension (`lmcache.c_ops`) on the GPU and records
#      why it fails if it does;
#   4. runs verify/roundtrip.py (the in-process round-trip harness) for PRISTINE
#      and PATCHED 0.5.3 (patches/hybrid-fa/0.5.3 applied to a copy of the
#      installed package, prepended with PYTHONPATH), on CUDA tensors when the
#      harness offers a device option, else on CPU tensors (recorded).
#
# Prepare the wheel dir on the dev machine (network), then carry `.whl` (<= 64 MiB):
#   PYV=3.12   # the device image's python3 minor version (check with `python3 -V` there)
#   pip download --no-deps --only-binary=:all: --python-version $PYV \
#       --platform manylinux_2_28_x86_64 -d .whl lmcache==0.5.3
#   pip download --only-binary=:all: --python-version $PYV --platform manylinux_2_28_x86_64 -d .whl \
#       $(python3 - <<'EOF'
#   import zipfile, glob, re
#   w = glob.glob(".whl/lmcache-0.5.3-*.whl")[0]
#   meta = [n for n in zipfile.ZipFile(w).namelist() if n.endswith("METADATA")][0]
#   reqs = [l.split(":", 1)[1].strip() for l in zipfile.ZipFile(w).read(meta).decode().splitlines()
#           if l.startswith("Requires-Dist:") and "extra ==" not in l]
#   print(" ".join(r.split(";")[0].replace(" ", "") for r in reqs
#                  if not re.match(r"(torch|nvidia-|triton|cupy)", r)))
#   EOF
#   )
#   du -sh .whl      # must stay under 64 MiB together with everything else carried
# and run:   run(command="bash verify/gpu_roundtrip_device.sh", carry=[".whl"], timeout_s=420)
#
# Exit status: 0 when the script reached the end (whatever the harness found), 2 when a
# prerequisite (torch, GPU, wheels) was missing; $OUT/device.json says which.

set -u
OUT="${OUT:-$PWD/out-device}"
mkdir -p "$OUT"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${WORK:-/tmp/gpu-roundtrip-$$}"
mkdir -p "$WORK"
JSON="$OUT/device.json"
LOG="$OUT/device.log"
exec > >(tee -a "$LOG") 2>&1
start=$(date +%s)

note() { echo "[device] $*"; }
finish() {  # finish STATUS REASON
  python3 - "$JSON" "$1" "$2" "$WORK" "$start" <<'EOF'
import json, os, sys, time, glob
path, status, reason, work, start = sys.argv[1:6]
doc = {"status": status, "reason": reason, "seconds": round(time.time() - float(start), 1)}
for name in ("nvidia_smi", "python", "torch", "venv", "cext", "patch", "roundtrip_options"):
    p = os.path.join(work, name + ".json")
    if os.path.exists(p):
        try:
            doc[name] = json.load(open(p))
        except ValueError:
            doc[name] = {"unparsable": open(p).read()[-2000:]}
doc["roundtrip_results"] = sorted(os.path.basename(p) for p in glob.glob(os.path.join(os.path.dirname(path), "roundtrip-*.json")))
json.dump(doc, open(path, "w"), indent=1)
print(json.dumps({k: doc[k] for k in ("status", "reason", "seconds")}))
EOF
}

# 1. machine ---------------------------------------------------------------
note "nvidia-smi"
if nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv,noheader > "$WORK/smi.txt" 2>&1; then
  python3 -c 'import json,sys; print(json.dumps({"ok": True, "gpus": open(sys.argv[1]).read().strip().splitlines()}))' "$WORK/smi.txt" > "$WORK/nvidia_smi.json"
else
  python3 -c 'import json,sys; print(json.dumps({"ok": False, "error": open(sys.argv[1]).read()[-500:]}))' "$WORK/smi.txt" > "$WORK/nvidia_smi.json"
fi
python3 -c 'import json,sys; print(json.dumps({"version": sys.version, "executable": sys.executable}))' > "$WORK/python.json"
note "probing torch in the image"
python3 - > "$WORK/torch.json" 2>&1 <<'EOF'
import json
try:
    import torch
    d = {"importable": True, "version": torch.__version__, "cuda": torch.version.cuda,
         "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        d["device"] = torch.cuda.get_device_name(0)
        d["capability"] = list(torch.cuda.get_device_capability(0))
except Exception as exc:
    d = {"importable": False, "error": repr(exc)}
print(json.dumps(d))
EOF
if ! python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d.get("importable") and d.get("cuda_available") else 1)' "$WORK/torch.json" 2>/dev/null; then
  finish prerequisite-missing "no CUDA torch in the image (a CUDA torch wheel does not fit the 64 MiB carry); see torch"
  exit 2
fi

# 2. venv --------------------------------------------------------------------
note "venv (system site packages, offline wheels from .whl/)"
if [ ! -d "$REPO/.whl" ]; then
  finish prerequisite-missing "no .whl/ directory carried (see the pip download commands in this script)"
  exit 2
fi
python3 -m venv --system-site-packages "$WORK/venv" > "$WORK/venv.log" 2>&1
VPY="$WORK/venv/bin/python"
if "$VPY" -m pip install --no-index --find-links "$REPO/.whl" lmcache==0.5.3 >> "$WORK/venv.log" 2>&1; then
  ok=true
else
  ok=false
fi
"$VPY" - "$ok" "$WORK/venv.log" > "$WORK/venv.json" <<'EOF'
import json, sys, importlib.metadata as md
d = {"pip_ok": sys.argv[1] == "true", "pip_log_tail": open(sys.argv[2]).read()[-1500:]}
for n in ("lmcache", "torch", "vllm"):
    try:
        d[n] = md.version(n)
    except Exception:
        d[n] = None
print(json.dumps(d))
EOF
if [ "$ok" != true ]; then
  finish prerequisite-missing "pip could not install lmcache==0.5.3 from .whl/ (missing wheels?); see venv.pip_log_tail"
  exit 2
fi

# 3. LMCache CUDA extension ----------------------------------------------------
note "probing lmcache.c_ops on CUDA"
"$VPY" - > "$WORK/cext.json" 2>&1 <<'EOF'
import json, traceback
d = {}
try:
    import torch, lmcache
    d["lmcache_file"] = lmcache.__file__
    d["torch_device_type"] = getattr(lmcache, "torch_device_type", None)
    import lmcache.c_ops as ops
    d["c_ops_loaded"] = True
    d["c_ops_file"] = ops.__file__
    x = torch.zeros(16, device="cuda")
    d["cuda_tensor_ok"] = bool(x.is_cuda)
except Exception as exc:
    d["c_ops_loaded"] = d.get("c_ops_loaded", False)
    d["error"] = repr(exc)
    d["traceback"] = traceback.format_exc()[-2000:]
print(json.dumps(d))
EOF

# 4. pristine and patched overlays, round trip ----------------------------------
note "building the patched overlay"
SITE=$("$VPY" -c 'import lmcache, os; print(os.path.dirname(os.path.dirname(lmcache.__file__)))')
mkdir -p "$WORK/patched"
cp -r "$SITE/lmcache" "$WORK/patched/lmcache"
patch_ok=true
for p in "$REPO"/patches/hybrid-fa/0.5.3/*.patch; do
  if command -v patch >/dev/null 2>&1; then
    (cd "$WORK/patched" && patch -p1 --forward --no-backup-if-mismatch -s < "$p") >> "$WORK/patch.log" 2>&1 || patch_ok=false
  else
    (cd "$WORK/patched" && git apply -p1 "$p") >> "$WORK/patch.log" 2>&1 || patch_ok=false
  fi
done
python3 -c 'import json,sys; print(json.dumps({"ok": sys.argv[1] == "true", "log": open(sys.argv[2]).read()[-1500:] if __import__("os").path.exists(sys.argv[2]) else ""}))' "$patch_ok" "$WORK/patch.log" > "$WORK/patch.json"

DEVICE_OPT=""
if "$VPY" "$REPO/verify/roundtrip.py" --help 2>/dev/null | grep -q -- "--device"; then
  DEVICE_OPT="--device cuda"
fi
python3 -c 'import json,sys; print(json.dumps({"device_option": sys.argv[1] or None, "note": None if sys.argv[1] else "verify/roundtrip.py has no --device option: the harness ran on CPU tensors; only the CUDA extension probe used the GPU"}))' "$DEVICE_OPT" > "$WORK/roundtrip_options.json"

for variant in pristine patched; do
  if [ "$variant" = patched ] && [ "$patch_ok" != true ]; then
    note "skipping patched round trip: the series did not apply"
    continue
  fi
  overlay=""
  [ "$variant" = patched ] && overlay="$WORK/patched"
  note "round trip: $variant"
  PYTHONPATH="$overlay" timeout 120 "$VPY" "$REPO/verify/roundtrip.py" --json --matrix fast $DEVICE_OPT \
      --out "$OUT/roundtrip-$variant.json" > /dev/null 2> "$OUT/roundtrip-$variant.stderr" \
    || echo "{\"variant\": \"$variant\", \"exit\": $?}" > "$OUT/roundtrip-$variant.exit.json"
done

finish done "reached the end; read roundtrip-*.json and cext"
exit 0
