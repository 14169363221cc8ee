#!/usr/bin/env python3
"""Stand-in for ``nvidia-smi --query-gpu=... / --query-compute-apps=...`` (csv, noheader, nounits).

GPU memory in use is the sum of the MiB written by live fake EngineCore
processes into ``$FAKE_GPU_STATE/<pid>`` (see ``fake_vllm.py``), plus
``$FAKE_GPU_BASE_MIB`` and ``$FAKE_GPU_STATE/stuck`` (memory nobody gives back).  ``$FAKE_SMI_FAIL=1`` makes every call fail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode("ascii", "replace")
    except OSError:
        return False
    return data[data.rfind(")") + 2:].split()[0] not in ("Z", "X")


def main() -> int:
    if os.environ.get("FAKE_SMI_FAIL") == "1":
        print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", file=sys.stderr)
        return 9
    state = Path(os.environ.get("FAKE_GPU_STATE", "/nonexistent"))
    apps = []
    if state.is_dir():
        for f in state.iterdir():
            if f.name.isdigit() and alive(int(f.name)):
                try:
                    apps.append((int(f.name), int(f.read_text().strip() or 0)))
                except ValueError:
                    pass
    base = int(os.environ.get("FAKE_GPU_BASE_MIB", "500"))
    stuck = state / "stuck"
    if stuck.is_file():
        base += int(stuck.read_text().strip() or 0)
    args = " ".join(sys.argv[1:])
    if "--query-gpu" in args:
        print(f"0, NVIDIA H200 (stand-in), {base + sum(m for _, m in apps)}, 143771")
    elif "--query-compute-apps" in args:
        for pid, mib in apps:
            print(f"{pid}, {mib}")
    else:
        print("fake nvidia-smi: unsupported query", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
