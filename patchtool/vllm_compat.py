"""What the installed vLLM means for this install: the
notes ``status`` (and ``verify``, which shows the same status) adds.

A pure function of the vLLM version found next to lmcache (read from its
``vllm-*.dist-info/METADATA`` by :func:`patchtool.distinfo.installed_version`;
vLLM is never imported) and the patch set's ``vllm_versions``.  Stdlib only:
``status --json`` runs without this tool's dependencies, so no ``packaging``.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

# vLLM 0.33.0 pins torch 2.14.0 (0.27.1-0.32 pin 2.13.0).  No CPU wheel of
# 2.14.0 exists, so this project has not loaded LMCache's native extensions
# under it; the note stays until a GPU run checks them.
TORCH_214_VLLM = (0, 33)

TORCH_214_NOTE = (
    "vLLM {vllm} pins torch 2.14 (vLLM >= 0.33): LMCache's native extensions (c_ops on "
    "0.5.3, lmcache_native and cuda_ops on 0.5.4+) were not checked under torch 2.14 by "
    "this project; check them on the GPU machine with `patchtool verify --restore gpu` "
    "(its preflight imports them under this venv's torch) or, from a checkout of this project, "
    "lab/gpu_roundtrip_device.sh "
    "(the device probe)"
)
NOT_VERIFIED_NOTE = "not verified with vLLM {vllm}; verified: {verified}"

# vLLM 0.34 removed ``CachedRequestData.resumed_req_ids`` (a request resumed after preemption is
# re-sent in ``scheduled_new_reqs`` with its full block list).  Every LMCache release up to
# 0.5.7rc2 reads it without a guard in the connector's ``_process_cached_requests``, inside
# ``build_connector_meta``: measured with vLLM 0.34.0's real Scheduler (sched_matrix, the
# ``vllm 0.34.0`` cells of lab/evidence/sched-vllm-matrix.json), pristine 0.5.3-0.5.6 raise
# AttributeError at the second scheduler step (the first with a running request), hybrid or not;
# hybrid-fa revisions before part 15 serve a hybrid (their block-id resync takes vLLM's block
# state) and raise the same for pure attention.  Part 15 reads the field with a guard; a patch
# set whose ``vllm_versions`` lists a vLLM >= 0.34 carries it (the support table admits 0.34.0
# only from that evidence), so "verified with a vLLM >= 0.34" is what this note keys on.
SCHED_OUTPUT_VLLM = (0, 34)
SCHED_OUTPUT_NOTE = (
    "{who} dies at the first scheduler step under vLLM {vllm}{scope} (AttributeError: "
    "CachedRequestData has no resumed_req_ids, raised in build_connector_meta, which ends the "
    "engine core): {action}"
)

_RELEASE = re.compile(r"\s*v?(\d+)\.(\d+)")


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string (``0.33.0rc1+cu129`` -> (0, 33)), or
    None when it does not start with two numbers."""
    m = _RELEASE.match(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def public(version: str) -> str:
    """The version without its local part: ``0.27.1+cu129`` -> ``0.27.1``."""
    return version.strip().split("+", 1)[0]


# The hybrid-fa part that reads vLLM 0.34's scheduler output (its id ends so on every series).
SCHED_OUTPUT_PART_SUFFIX = "-vllm034-scheduler-output"


def carries_sched_output_fix(sets: Iterable[Any]) -> bool:
    """Whether one of these patch sets (``PatchSetDir``-like: ``.manifest.patches[i].id``)
    ships the scheduler-output part, so that an install patched with it serves vLLM >= 0.34."""
    return any(p.id.endswith(SCHED_OUTPUT_PART_SUFFIX) for s in sets for p in s.manifest.patches)


def vllm_notes(vllm: str | None, verified: list[str] | None, *, lmcache: str | None = None,
               state: str | None = None, carries_sched_fix: bool | None = None) -> list[str]:
    """Notes for an lmcache install next to vLLM ``vllm`` (None: no vLLM found).
    ``verified`` is the patch set's ``vllm_versions``; None when there is no
    patch set (then there is nothing to be verified against).  ``lmcache`` and
    ``state`` (the install's version and state) word the scheduler-output note;
    ``carries_sched_fix`` says whether the set ships the scheduler-output part
    (None: unknown, then a set verified with a vLLM >= 0.34 is taken to)."""
    if not vllm:
        return []
    notes = []
    rel = release(vllm)
    if rel is not None and rel >= TORCH_214_VLLM:
        notes.append(TORCH_214_NOTE.format(vllm=vllm))
    note = scheduler_output_note(vllm, verified, lmcache=lmcache, state=state,
                                 carries_sched_fix=carries_sched_fix)
    if note:
        notes.append(note)
    if verified is not None and public(vllm) not in {public(v) for v in verified}:
        notes.append(NOT_VERIFIED_NOTE.format(vllm=vllm, verified=", ".join(verified) or "none"))
    return notes


def scheduler_output_note(vllm: str, verified: list[str] | None, *, lmcache: str | None = None,
                          state: str | None = None, carries_sched_fix: bool | None = None) -> str | None:
    """The vLLM >= 0.34 scheduler-output note, or None: an older vLLM, or an install of the
    shipped revision of a patch set that ships part 15 (known from its parts, else from its
    verification with a vLLM >= 0.34; part 15 reads vLLM's scheduler output either way; whether
    *this* vLLM was verified is NOT_VERIFIED_NOTE's job)."""
    rel = release(vllm)
    if rel is None or rel < SCHED_OUTPUT_VLLM:
        return None
    fixed = [v for v in verified or () if (release(v) or (0, 0)) >= SCHED_OUTPUT_VLLM]
    ships_fix = bool(fixed) if carries_sched_fix is None else carries_sched_fix
    if state == "patched" and ships_fix:
        return None
    name = f"LMCache {lmcache}" if lmcache else "LMCache"
    if fixed:
        action = f"apply the patch set verified with vLLM {', '.join(fixed)}: patchtool apply"
    elif ships_fix:
        action = ("patchtool apply: this patch set reads vLLM 0.34's scheduler output "
                  "(not verified with a vLLM >= 0.34 for every geometry)")
    else:
        action = "no patch set of this patchtool serves it yet: keep vLLM <= 0.33 with this LMCache"
    if state == "pristine" or state is None:
        return SCHED_OUTPUT_NOTE.format(who=f"pristine {name}" if state else name, vllm=vllm,
                                        scope=", hybrid or not", action=action)
    if state in ("patched", "patched-older-revision"):
        which = "this patched" if state == "patched" else "an older patched revision of"
        if state == "patched-older-revision" and ships_fix:
            action = "patchtool apply upgrades it to the shipped revision, which serves it"
        return SCHED_OUTPUT_NOTE.format(
            who=f"{which} {name}", vllm=vllm,
            scope=" with a pure-attention model (a hybrid runs: the block-id resync reads vLLM's "
                  "block state, not the field)", action=action)
    return SCHED_OUTPUT_NOTE.format(who=f"{name} ({state})", vllm=vllm,
                                    scope=" unless its files carry hybrid-fa part 15", action=action)
