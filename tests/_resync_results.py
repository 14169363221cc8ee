"""Readers of `verify/lmcache_patchtool_verify/resync_sim.py` results, shared by
tests/resync and tests/resync_ports."""

from __future__ import annotations


def divergent_steps(result: dict) -> list[int]:
    """Steps after which the tracked block ids differ from vLLM's lists."""
    return [s["step"] for s in result["steps"] if s["divergence"]]


def bad_stores(result: dict) -> list[tuple[int, dict]]:
    """(step, store) for every store that read a block the request did not own."""
    return [(s["step"], st) for s in result["steps"] for st in s["stores"] if st["problems"]]


def events(result: dict) -> str:
    return " | ".join(e for s in result["steps"] for e in s["events"])
