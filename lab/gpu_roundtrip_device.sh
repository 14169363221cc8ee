#!/usr/bin/env bash
# The CUDA round trip on a lent GPU machine (docs/engine-gate.md, "The lent-device CUDA round trip").
#
# Here (network):   python3 -m lab.prepare_carry            # -> .device-carry/ (gitignored), <= 64 MiB
# Device tool:      run(command="bash lab/gpu_roundtrip_device.sh", carry=[".device-carry"], timeout_s=540)
#
# Uses the image's python3 (never a venv): each LMCache version is `pip install --no-deps --target`-ed from its
# carried wheel and put on PYTHONPATH.  It first reports, per version, whether the compiled extensions load under
# the image's torch, then runs lab.ports_roundtrip --device cuda (pristine and patched;
# native path, HND and NHD; 0.5.6's direct-copy path) and times patched k=17 vs pristine k=1.  Nothing new starts after --budget-s
# (default 450 s): the whole call stays under 8 minutes.  Results in $OUT: device-summary.json, device-runs.json,
# device.log, device-per-byte.png (when matplotlib is there).  Commit them under lab/results/ by hand.
# Extra arguments go to lab/roundtrip_device.py (e.g. --versions 0.5.3,0.5.6 --reps 4).
set -u
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out-device}"
mkdir -p "$OUT"
PY="${DEVICE_PYTHON:-python3}"
"$PY" -V
export PYTHONPATH="$PWD/verify${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m lab.roundtrip_device --python "$PY" --out "$OUT" "$@"
