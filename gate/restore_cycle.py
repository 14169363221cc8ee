"""The store/restore cycle of the CPU restore gate, per step over a server's
presets: store through a first client, wait for every chunk in the L2 tier,
restore through a fresh client after the restart, the optional stay-alive
arm, and the progress lines of each.

:class:`CycleSteps` builds on :class:`gate.restore_lifecycle.ServerLifecycle`
(timings, guards, the server) and drives ``restore_steps.ClientSteps`` (the
client side, imported with torch + lmcache once a server boots);
``gate/restore_gate.py``'s ``Gate`` orders these steps into its phases.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from gate import procs
from gate.l2_tier import Tier, listing
from gate.restore_lifecycle import ServerLifecycle
from gate.restore_plan import PresetRun
from gate.restore_server import ServerSpec, object_groups


class CycleSteps(ServerLifecycle):
    """The steps of one server pair: store, flush, restore, stay-alive."""

    def _store_all(self, cycle: dict[str, Any], runs: list[PresetRun], spec: ServerSpec,
                   server: procs.ManagedProcess, model_prefix: str) -> None:
        """Store through a first client per preset."""
        d = self.d
        for r in runs:
            r.model = f"{model_prefix}-{r.geo.name}-{uuid.uuid4().hex[:8]}"
            with self.phase(cycle, "register_fill"):
                self._guard(r, "register+fill", lambda r=r: self.steps.prepare_source(r, spec))
            with self.phase(cycle, "store"):
                self._guard(r, "store", lambda r=r: self.steps.store(r))
            self._alive_or_die(server)
            if not r.error:
                st = r.result["stored"]
                d.step(f"{r.geo.name}: stored {st['chunks_ok']}/{r.chunks} chunks "
                       f"({r.stored_tokens} tokens, {r.blocks_per_chunk} blocks/chunk, k={r.geo.k})",
                       st["seconds"], st["ok"])

    def _flush(self, cycle: dict[str, Any], runs: list[PresetRun], tier: Tier,
               server: procs.ManagedProcess) -> None:
        """Wait until every chunk is a finished object in the L2 tier."""
        with self.phase(cycle, "flush_to_disk"):
            t0 = time.monotonic()
            log = procs.ansi_strip(server.log_text())
            want = {r.model: r.chunks * object_groups(log, r.model) for r in runs if not r.error}

            def flushed() -> bool:
                self._alive_or_die(server)
                return all(len(tier.objects(m)) >= c for m, c in want.items()) and not tier.unfinished()

            try:
                procs.wait_until(flushed, self.args.step_timeout, poll=0.02, what="every chunk on disk")
                flushed_ok = True
            except TimeoutError:
                flushed_ok = False
            for r in runs:
                if not r.error:
                    r.result["on_disk"] = self._on_disk(r, tier, want[r.model])
            self.d.step(f"L2 flushed: {sum(len(tier.objects(m)) for m in want)}/{sum(want.values())} "
                        f"objects in {tier.describe()}", time.monotonic() - t0, flushed_ok)

    @staticmethod
    def _on_disk(r: PresetRun, tier: Tier, expected: int) -> dict[str, Any]:
        """What one preset left in the L2 tier: object count and sizes."""
        objs = tier.objects(r.model)
        # KV bytes: a patched build's object also holds a 64-byte checksum trailer
        sizes = sorted({o.kv_len for o in objs})
        return {"objects": len(objs), "expected": expected, "object_bytes": sizes,
                "checksum_trailers": sum(o.sealed for o in objs),
                "full_fidelity_object_bytes": r.full_object_bytes(),
                "fraction_of_full": (sizes[0] / r.full_object_bytes()) if sizes else None,
                "model_fields": listing(objs)}

    def _restore_all(self, cycle: dict[str, Any], runs: list[PresetRun], spec: ServerSpec,
                     server: procs.ManagedProcess) -> None:
        """Fresh client per preset: look up, prefetch from L2, retrieve elsewhere, compare."""
        for r in runs:
            if r.error:
                continue
            with self.phase(cycle, "restore"):
                self._guard(r, "restore", lambda r=r: self.steps.restore(r, spec, server))
            self._alive_or_die(server)
            if not r.error:
                self._print_restore(r)

    def _stay_alive_arm(self, cycle: dict[str, Any], runs: list[PresetRun], server: procs.ManagedProcess,
                        restart_window: float) -> None:
        """Optional: the first client, alive all along like a running vLLM (never the verdict)."""
        for r in runs:
            if r.client1 is None:
                continue
            with self.phase(cycle, "stay_alive"):
                if self.args.stay_alive and not r.error:
                    try:
                        r.result["stay_alive"] = self.steps.stay_alive(r, server, restart_window)
                    except Exception as exc:  # noqa: BLE001 - optional arm, never the verdict
                        r.result["stay_alive"] = {"ran": False, "error": f"{type(exc).__name__}: {exc}"}
                    sa = r.result["stay_alive"]
                    self.d.step(f"{r.geo.name}: stay-alive worker: {sa.get('summary', sa.get('error'))}",
                                None, None)
                r.client1.close(graceful=server.alive())
                r.client1 = None

    @staticmethod
    def _close_first_clients(runs: list[PresetRun]) -> None:
        """Close the storing clients while their server is up: closing one whose
        server is gone hangs in the adapter's shutdown.  Every chunk is stored."""
        for r in runs:
            if r.client1 is not None:
                r.client1.close(graceful=True)
                r.client1 = None

    def _print_restore(self, r: PresetRun) -> None:
        res, d = r.result, self.d
        ar, rs = res["after_restart"], res["restored"]
        d.step(f"{r.geo.name}: found {ar['chunks_found']}/{r.chunks} chunks after restart "
               f"(server: {ar['l1_hits']} from L1, {ar['l2_hits']} from L2)", ar["lookup_seconds"],
               ar["chunks_found"] == r.chunks and ar["l2_hits"] > 0)
        fa, gdn = res["fidelity"]["fa"], res["fidelity"]["gdn"]
        parts = []
        if fa:
            parts.append(f"FA pages exact {fa['pages_exact']}/{fa['pages_total']}")
        if gdn:
            nr = gdn.get("blocks_not_restored_by_design")
            parts.append(f"GDN blocks exact {gdn['blocks_exact']}/{gdn['blocks_total']}"
                         + (f" (chunk-end slots; {nr} non-end slots not stored by design)" if nr else ""))
        fw = res["foreign_writes"]
        d.step(f"{r.geo.name}: restored into other blocks: {rs['chunks_restored_exact']}/{r.chunks} chunks exact; "
               + ", ".join(parts) + f"; foreign bytes changed {fw['bytes']}", rs["seconds"],
               rs["chunks_restored_exact"] == r.chunks and fw["bytes"] == 0)
