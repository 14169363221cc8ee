"""Prometheus text parsing and the counters the engine gate reads (stdlib only).

vLLM 0.27.1 (``vllm/v1/metrics/loggers.py``, prometheus_client counters, so the
exposition name gets ``_total``; labels ``model_name``, ``engine``):

* ``vllm:external_prefix_cache_hits_total``    tokens served by the KV connector (:621)
* ``vllm:external_prefix_cache_queries_total`` tokens queried from the connector (:609)
* ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``  local APC (:596/:585)
* ``vllm:prompt_tokens_total`` (:671), ``vllm:prompt_tokens_by_source_total{source=...}`` (:681,
  sources ``local_compute``, ``local_cache_hit``, ``external_kv_transfer``, ``v1/metrics/stats.py:316``)

LMCache 0.5.3 MP server (OTel counters exported through
``opentelemetry.exporter.prometheus``; ``.`` becomes ``_``, the unit is appended,
counters get ``_total``; served by the HTTP frontend at ``--http-port`` under
``/metrics``, ``v1/internal_api_server/common/metrics_api.py``):

* ``lmcache_mp_l2_prefetch_hit_chunks_total``            prefix chunks found in L2 (``subscribers/metrics/l2.py``)
* ``lmcache_mp_l2_prefetch_load_completed_chunks_total`` chunks loaded from L2 into L1
* ``lmcache_mp_l2_prefetch_lookup_requests_total``
* ``lmcache_mp_l2_store_submitted_objects_chunks_total`` / ``..._completed_objects_chunks_total``
* ``lmcache_mp_num_chunks_loaded_total``                 chunks retrieved into the engine (``engine.py``)
* ``lmcache_mp_l1_write_chunks_total`` / ``lmcache_mp_l1_read_chunks_total``
* ``lmcache_mp_lookup_hit_tokens_total`` / ``lmcache_mp_lookup_requested_tokens_total``

Names are matched with and without the unit suffix, so an exporter that does not
append units still resolves.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

# ---------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------

VLLM = {
    "external_hits": ("vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_hits"),
    "external_queries": ("vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_queries"),
    "local_hits": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
    "local_queries": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"),
    "prompt_tokens": ("vllm:prompt_tokens_total", "vllm:prompt_tokens"),
    "prompt_tokens_external": ("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}",),
    "prompt_tokens_computed": ("vllm:prompt_tokens_by_source_total{source=local_compute}",),
}

LMCACHE = {
    "l2_prefetch_hit": ("lmcache_mp_l2_prefetch_hit_chunks_total", "lmcache_mp_l2_prefetch_hit_total"),
    "l2_prefetch_loaded": ("lmcache_mp_l2_prefetch_load_completed_chunks_total",
                           "lmcache_mp_l2_prefetch_load_completed_total"),
    "l2_prefetch_lookups": ("lmcache_mp_l2_prefetch_lookup_requests_total", "lmcache_mp_l2_prefetch_lookup_total"),
    "l2_load_completed": ("lmcache_mp_l2_load_completed_requests_total", "lmcache_mp_l2_load_completed_total"),
    "l2_store_submitted": ("lmcache_mp_l2_store_submitted_objects_chunks_total",
                           "lmcache_mp_l2_store_submitted_objects_total"),
    "l2_store_completed": ("lmcache_mp_l2_store_completed_objects_chunks_total",
                           "lmcache_mp_l2_store_completed_objects_total"),
    "chunks_loaded": ("lmcache_mp_num_chunks_loaded_total",),
    "l1_write": ("lmcache_mp_l1_write_chunks_total", "lmcache_mp_l1_write_total"),
    "l1_read": ("lmcache_mp_l1_read_chunks_total", "lmcache_mp_l1_read_total"),
    "lookup_hit_tokens": ("lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_hit_total"),
    "lookup_requested_tokens": ("lmcache_mp_lookup_requested_tokens_total", "lmcache_mp_lookup_requested_total"),
}


# ---------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


class MetricsParseError(ValueError):
    pass


def _unescape(v: str) -> str:
    return v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def _parse_labels(text: str, line: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            raise MetricsParseError(f"bad labels in line {line!r}")
        labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return labels


def _value(text: str, line: str) -> float:
    t = text.strip()
    if t in ("+Inf", "Inf"):
        return math.inf
    if t == "-Inf":
        return -math.inf
    try:
        return float(t)
    except ValueError:
        raise MetricsParseError(f"bad value in line {line!r}") from None


@dataclass
class Samples:
    """Parsed Prometheus text exposition: name -> [(labels, value)]."""

    series: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    def names(self) -> list[str]:
        return sorted(self.series)

    def total(self, name: str, where: Mapping[str, str] | None = None) -> float | None:
        """Sum of every series of ``name`` (whose labels include ``where``); None if absent."""
        rows = self.series.get(name)
        if rows is None:
            return None
        got = [v for labels, v in rows if not where or all(labels.get(k) == w for k, w in where.items())]
        return sum(got) if got else (None if where else 0.0)

    def resolve(self, candidates: Iterable[str]) -> tuple[str | None, float | None]:
        """First candidate present: ``name`` or ``name{label=value,...}``."""
        for cand in candidates:
            name, where = _split_selector(cand)
            value = self.total(name, where)
            if value is not None:
                return cand, value
        return None, None


def _split_selector(cand: str) -> tuple[str, dict[str, str]]:
    if "{" not in cand:
        return cand, {}
    name, _, rest = cand.partition("{")
    where = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if part)
    return name, where


def parse_prometheus(text: str) -> Samples:
    """Parse the Prometheus text format (0.0.4), strict on sample lines."""
    out = Samples()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                out.types[parts[2]] = parts[3].strip()
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise MetricsParseError(f"bad sample line {raw!r}")
        labels = _parse_labels(m.group("labels") or "", raw)
        out.series.setdefault(m.group("name"), []).append((labels, _value(m.group("value"), raw)))
    return out


# ---------------------------------------------------------------------------
# Snapshots and deltas
# ---------------------------------------------------------------------------


@dataclass
class Snapshot:
    values: dict[str, float | None]
    names: dict[str, str | None]

    def to_json(self) -> dict[str, Any]:
        return {"values": self.values, "names": self.names}


def snapshot(samples: Samples, table: Mapping[str, tuple[str, ...]]) -> Snapshot:
    values: dict[str, float | None] = {}
    names: dict[str, str | None] = {}
    for key, cands in table.items():
        names[key], values[key] = samples.resolve(cands)
    return Snapshot(values, names)


def delta(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    """after - before per key; None when ``after`` lacks the counter.

    A counter absent *before* counts as 0: LMCache's OpenTelemetry Prometheus
    exporter omits a counter until its first increment, so a freshly restarted
    server has no ``lmcache_mp_l2_prefetch_*`` series before the first request.
    A counter that went backwards (a restarted process) is reported as the
    ``after`` value, the Prometheus ``increase()`` convention.
    """
    out: dict[str, float | None] = {}
    for key, a in after.values.items():
        b = before.values.get(key)
        if a is None:
            out[key] = None
        elif b is None:
            out[key] = a
        else:
            out[key] = a - b if a >= b else a
    return out
