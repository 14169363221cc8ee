"""What the installed vLLM means for this install: the
notes ``status`` (and ``verify``, which shows the same status) adds.

A pure function of the vLLM version found next to lmcache (read from its
``vllm-*.dist-info/METADATA`` by :func:`patchtool.distinfo.installed_version`;
vLLM is never imported) and the patch set's ``vllm_versions``.  Stdlib only:
``status --json`` runs without this tool's dependencies, so no ``packaging``.
"""

from __future__ import annotations

import re

# vLLM 0.33.0 pins torch 2.14.0 (0.27.1-0.32 pin 2.13.0).  No CPU wheel of
# 2.14.0 exists, so this project has not loaded LMCache's native extensions
# under it; the note stays until a GPU run checks them.
TORCH_214_VLLM = (0, 33)

TORCH_214_NOTE = (
    "vLLM {vllm} pins torch 2.14 (vLLM >= 0.33): LMCache's native extensions (c_ops on "
    "0.5.3, lmcache_native and cuda_ops on 0.5.4+) were not checked under torch 2.14 by "
    "this project; check them on the GPU machine with `patchtool verify --restore gpu` "
    "(its preflight imports them under this venv's torch) or, from a checkout of this project, "
    "verify/gpu_roundtrip_device.sh "
    "(the device probe)"
)
NOT_VERIFIED_NOTE = "not verified with vLLM {vllm}; verified: {verified}"

_RELEASE = re.compile(r"\s*v?(\d+)\.(\d+)")


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string (``0.33.0rc1+cu129`` -> (0, 33)), or
    None when it does not start with two numbers."""
    m = _RELEASE.match(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def public(version: str) -> str:
    """The version without its local part: ``0.27.1+cu129`` -> ``0.27.1``."""
    return version.strip().split("+", 1)[0]


def vllm_notes(vllm: str | None, verified: list[str] | None) -> list[str]:
    """Notes for an lmcache install next to vLLM ``vllm`` (None: no vLLM found).
    ``verified`` is the patch set's ``vllm_versions``; None when there is no
    patch set (then there is nothing to be verified against)."""
    if not vllm:
        return []
    notes = []
    rel = release(vllm)
    if rel is not None and rel >= TORCH_214_VLLM:
        notes.append(TORCH_214_NOTE.format(vllm=vllm))
    if verified is not None and public(vllm) not in {public(v) for v in verified}:
        notes.append(NOT_VERIFIED_NOTE.format(vllm=vllm, verified=", ".join(verified) or "none"))
    return notes
