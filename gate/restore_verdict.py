"""The CPU restore gate's verdict for one preset (pure logic, no torch).

:func:`preset_report` turns a :class:`~.restore_plan.PresetRun`'s result into the
report entry: ``pass`` / ``fail`` / ``error`` with the reasons, per phase
(``both``: the restore gate; ``store`` and ``restore``: the cross-version
writer and reader).  PASS only if every stored chunk is found after the
restart, at least one came from L2, every restored byte is right and no
foreign byte changed: a vacuous pass (nothing restored) is a fail.
"""

from __future__ import annotations

from typing import Any

from gate.restore_plan import PresetRun, json_infos
from gate.xver_outcome import classify

# What LMCache's engine-driven path raises for a multi-group (hybrid) model, in
# transfer_context/worker_transfer.py: ``_single_group_block_ids`` at the first
# store (0.5.3-0.5.5), or ``EngineDrivenTransferContext.register`` at
# registration (0.5.6, before the store is reached).
ENGINE_DRIVEN_REFUSALS = ("engine-driven transfer does not support hybrid KV cache groups",
                          "engine-driven transfer does not support multiple KV transfer groups")


def preset_report(r: PresetRun, phase: str, transfer_mode: str) -> dict[str, Any]:
    """The report entry of one preset: what ran, then the phase's verdict."""
    rep = _what_ran(r)
    if r.error:
        return _errored(r, rep, phase, transfer_mode)
    if phase == "store":
        return _store_phase(r, rep)
    if phase == "restore":
        return _restore_phase(r, rep)
    return _restore_gate(r, rep)


def _what_ran(r: PresetRun) -> dict[str, Any]:
    rep: dict[str, Any] = {"preset": r.geo.name, "geometry": r.geo.to_json(), "model_name": r.model,
                           "chunk_size": r.chunk_size, "chunks": r.chunks,
                           "blocks_per_chunk": r.blocks_per_chunk, "num_logical_blocks": r.num_blocks,
                           "block_ids": {"store": r.src_ids, "retrieve": r.dst_ids},
                           "engine_groups": json_infos(r.layout.infos if r.layout else None),
                           "engine_groups_after_restart": json_infos(
                               r.restore_layout.infos if r.restore_layout else None)}
    rep.update({k: v for k, v in r.result.items() if k != "traceback"})
    return rep


def _errored(r: PresetRun, rep: dict[str, Any], phase: str, transfer_mode: str) -> dict[str, Any]:
    assert r.error is not None
    if transfer_mode != "lmcache_driven" and any(m in r.error for m in ENGINE_DRIVEN_REFUSALS):
        # The engine-driven path refusing a multi-group model: a loud
        # failure (the pristine outcome), not an infrastructure error.
        rep["verdict"], rep["loud_refusal"] = "fail", True
        rep["reasons"] = [f"loud refusal ({r.error.splitlines()[0]})"]
        return rep
    rep["verdict"], rep["reasons"] = "error", [r.error]
    if "traceback" in r.result:
        rep["traceback"] = r.result["traceback"]
    if phase == "restore":
        rep.update(writer=r.writer, outcome="error", outcome_why=r.error.splitlines()[0])
    return rep


def _store_reasons(r: PresetRun) -> list[str]:
    """Why the store half failed: the server's confirmation, every object on disk."""
    st, od = r.result.get("stored", {}), r.result.get("on_disk", {})
    reasons = []
    if not st.get("ok"):
        reasons.append("the server did not confirm the store")
    if od.get("objects", 0) < od.get("expected", r.chunks):
        reasons.append(f"only {od.get('objects', 0)}/{od.get('expected', r.chunks)} objects reached the fs L2")
    return reasons


def _store_phase(r: PresetRun, rep: dict[str, Any]) -> dict[str, Any]:
    """--phase store: pass = the server confirmed the store and every chunk is on disk."""
    reasons = _store_reasons(r)
    rep["verdict"] = "fail" if reasons else "pass"
    rep["reasons"] = reasons or [f"{r.chunks} chunks stored and on disk "
                                 f"({r.result.get('on_disk', {}).get('object_bytes')} B each)"]
    return rep


def _restore_phase(r: PresetRun, rep: dict[str, Any]) -> dict[str, Any]:
    """--phase restore: one outcome (exact / miss / wrong); fail only on a wrong hit."""
    outcome, why = classify(r.result.get("xver") or {"error": "not completed: no restore result"})
    rep.update(writer=r.writer, outcome=outcome, outcome_why=why)
    rep["verdict"] = {"wrong": "fail", "error": "error"}.get(outcome, "pass")
    rep["reasons"] = [f"{outcome}: {why}"]
    return rep


def _found_reasons(r: PresetRun, ar: dict[str, Any]) -> list[str]:
    """After the restart: every chunk found, some from L2, the retrieve succeeded."""
    reasons = []
    if ar["hit_tokens"] == 0:
        reasons.append("0 hits after the restart (nothing restored: a vacuous pass is a fail)")
    elif ar["chunks_found"] < r.chunks:
        reasons.append(f"lost chunks: {ar['chunks_found']}/{r.chunks} found after the restart")
    if ar["hit_tokens"] and ar["l2_hits"] == 0:
        reasons.append("0 L2 hits after the restart (the server did not serve from disk)")
    rs = r.result["restored"]
    if ar["hit_tokens"] and not rs["retrieve"]["ok"]:
        reasons.append(f"retrieve failed: {rs['retrieve']['detail']}")
    return reasons


def _byte_reasons(r: PresetRun, ar: dict[str, Any]) -> list[str]:
    """Every restored byte right, no byte outside the destination changed."""
    reasons = []
    fa, gdn = r.result["fidelity"]["fa"], r.result["fidelity"]["gdn"]
    if fa and fa["pages_total"] and fa["pages_exact"] < fa["pages_total"]:
        reasons.append(f"wrong FA bytes: {fa['pages_exact']}/{fa['pages_total']} kernel pages exact "
                       f"({fa['pages_fraction']:.1%}), {fa['bytes_total'] - fa['bytes_equal']} bytes differ")
    if gdn and gdn["blocks_total"] and gdn["blocks_exact"] < gdn["blocks_total"]:
        reasons.append(f"wrong GDN bytes: {gdn['blocks_exact']}/{gdn['blocks_total']} blocks exact")
    fw = r.result["foreign_writes"]
    if fw["bytes"]:
        reasons.append(f"foreign writes: {fw['bytes']} bytes in {fw['blocks']} blocks outside the destination")
    if gdn is not None and ar["hit_tokens"] and not gdn["blocks_total"]:
        reasons.append("no GDN slot expected to be restored (the expectation is broken)")
    return reasons


def _restore_gate(r: PresetRun, rep: dict[str, Any]) -> dict[str, Any]:
    """--phase both: stored, found after the hard kill, byte-exact elsewhere."""
    reasons = _store_reasons(r)
    ar = r.result.get("after_restart")
    if ar is None:
        rep["verdict"], rep["reasons"] = "error", ["not completed: the run stopped before the restore"]
        return rep
    reasons += _found_reasons(r, ar) + _byte_reasons(r, ar)
    rep["verdict"] = "fail" if reasons else "pass"
    nr = (r.result["fidelity"]["gdn"] or {}).get("blocks_not_restored_by_design")
    rep["reasons"] = reasons or ["every stored chunk came back from L2 after a hard kill, byte-exact, "
                                 "into other block ids, with no foreign write"
                                 + (f" (GDN: the chunk-end slot of each chunk, which is all the server "
                                    f"stores; {nr} non-end slots stay unrestored)" if nr else "")]
    return rep
