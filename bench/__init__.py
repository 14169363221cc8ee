"""Benchmarks: each module prints ratios measured side by side in one run (``python -m bench.<name>`` from the repository root)."""
