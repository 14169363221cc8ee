"""Cross-version gate: what a writer phase hands its readers (runs in the target env).

The writer fills its source cache with ``restore_client.fill_source`` (Python's
``random.Random(seed).randbytes``, per layer, per block position, in that
order).  A reader in another venv cannot share tensors, so it regenerates the
same bytes from the seed with :func:`regenerate_expected` and proves it got
them right by comparing :func:`expected_digest` with the writer's (recorded in
the state file): a mismatch means the regeneration is not deterministic across
the environments and the gate refuses to judge.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

STATE_SCHEMA = 1


def expected_digest(expected: dict[tuple[int, int], Any]) -> str:
    """sha256 over every expected block, in (layer, position) order."""
    h = hashlib.sha256()
    for key in sorted(expected):
        h.update(f"{key[0]}:{key[1]}:".encode())
        h.update(bytes(expected[key].numpy().tobytes()))
    return h.hexdigest()


def regenerate_expected(row_bytes: list[int], group_of_layer: list[int], ids: list[list[int]],
                        seed: int) -> dict[tuple[int, int], Any]:
    """The bytes ``fill_source(client, ids, seed)`` wrote, without a client.

    ``row_bytes[layer]`` is the size of one logical block of that layer (the
    width of ``Client.rows(layer)``); the draw order is fill_source's.
    """
    import torch  # noqa: PLC0415 - target environment only

    rng = random.Random(seed)
    out: dict[tuple[int, int], Any] = {}
    for layer, size in enumerate(row_bytes):
        for pos, _block in enumerate(ids[group_of_layer[layer]]):
            out[(layer, pos)] = torch.frombuffer(bytearray(rng.randbytes(size)), dtype=torch.uint8)
    return out


def model_field(filename: str) -> str:
    """The model field of an fs L2 object name (``<model>@<rank>@<group>@<hash>[@salt].data``),
    ``-SEP-`` turned back into ``/``."""
    return filename.split("@", 1)[0].replace("-SEP-", "/")


def l2_listing(paths: list[Any]) -> dict[str, Any]:
    """Per model field seen in the names: object count and distinct sizes."""
    out: dict[str, Any] = {}
    for p in paths:
        entry = out.setdefault(model_field(p.name), {"objects": 0, "sizes": []})
        entry["objects"] += 1
        size = p.stat().st_size
        if size not in entry["sizes"]:
            entry["sizes"].append(size)
    for entry in out.values():
        entry["sizes"].sort()
    return out
