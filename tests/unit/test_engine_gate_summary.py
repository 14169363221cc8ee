"""lab/engine_gate_evidence.py turns one engine-gate result into an
evidence cell: the per-length restore figures come from the numeric entries
of the restore arm only; the extra requests (the first restore after the
restart, the mid-step follow-up, the continuation) sit beside them under
their own names and are summarised as extras."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from lab import engine_gate_evidence as ege
def _arm(tokens: int) -> dict:
    return {"prompt_tokens": tokens + 1, "vllm_delta": {"external_hits": tokens}, "ideal_hits": tokens,
            "external_hit_fraction": 1.0, "max_logprob_delta_vs_warm": 0.0,
            "lmcache_delta": {"l2_prefetch_loaded": tokens // 640}}


def test_lengths_and_extra_requests_are_kept_apart():
    result = {"verdict": {"status": "pass", "reasons": []},
              "arms": {"restore": {"16384": _arm(16000), "3072": _arm(2560), "first": _arm(2560),
                                   "mid-step": _arm(8320), "continuation": _arm(2560)}},
              "extra_requests": {}}
    cell = ege.summarise("hybrid-full", ege.cell_spec("hybrid-full"), result, 0, 12.0)
    assert [(r["length"], r["external_hits"]) for r in cell["restore"]] == [(3072, 2560), (16384, 16000)]
    assert cell["status"] == "pass" and cell["as_expected"]
