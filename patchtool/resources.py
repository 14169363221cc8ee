"""Where the shipped patch sets and the gate (the proofs patchtool runs) are.

Order: the environment override, then the repository checkout next to the
package (an editable install or running from the tree), then the copies
installed as package data inside the wheel (``patchtool/_data/...``).
"""

from __future__ import annotations

import os
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(env_var: str, checkout_name: str) -> Path:
    override = os.environ.get(env_var)
    if override:
        return Path(override)
    checkout = _PKG.parent / checkout_name
    # pyproject.toml marks a real checkout; a bare "patches" dir that happens to
    # sit next to an installed package in site-packages is not ours.
    if checkout.is_dir() and (_PKG.parent / "pyproject.toml").is_file():
        return checkout
    return _PKG / "_data" / checkout_name


def patches_root() -> Path:
    return _find("LMCACHE_PATCHTOOL_PATCHES", "patches")


def gate_root() -> Path:
    """The ``gate`` folder: the restore gate, the round trip and the engine
    gate, run by path with this folder's parent on ``PYTHONPATH``."""
    return _find("LMCACHE_PATCHTOOL_GATE", "gate")


def upstream_root() -> Path:
    """The upstream proposals (``upstream/*.patch`` and ``parts.json``)."""
    return _find("LMCACHE_PATCHTOOL_UPSTREAM", "upstream")
