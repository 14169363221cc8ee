"""What the CPU restore gate plans and carries per preset (stdlib only, no torch).

:class:`PresetRun` is one preset's request through a server pair: its
geometry and chunking, the block ids it stores from and restores into, the
live client and layout while it runs, and the result dict the verdict reads.
:func:`plan_cycles` groups presets into server pairs by chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gate import geometry
from gate.xver_outcome import preset as gate_preset


class GateError(Exception):
    """Infrastructure failure: the gate could not reach a verdict."""


@dataclass
class PresetRun:
    geo: geometry.Geometry
    chunk_size: int
    chunks: int
    seed: int
    model: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # live state during the run
    layout: Any = None
    restore_layout: Any = None  # the fresh client's after the restart (--restart-window-rule)
    tokens: list[int] = field(default_factory=list)
    src_ids: list[list[int]] = field(default_factory=list)
    dst_ids: list[list[int]] = field(default_factory=list)
    expected: dict = field(default_factory=dict)
    client1: Any = None
    num_blocks: int = 0
    # --phase restore: which writer stored it, and its entry in the writer's state file
    writer: str = ""
    state_entry: dict = field(default_factory=dict)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.geo.tokens_per_block

    @property
    def stored_tokens(self) -> int:
        return self.chunks * self.chunk_size

    def full_object_bytes(self) -> int:
        """Bytes of one chunk's object if every FA/GDN byte were kept."""
        g = self.geo
        return self.blocks_per_chunk * (g.num_fa_layers * g.fa_block_bytes + g.num_gdn_layers * g.gdn_block_bytes)


def json_infos(infos: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """EngineGroupInfo dicts as JSON (their layer indices may be a range or tuple)."""
    return None if infos is None else [dict(i, layer_indices=list(i["layer_indices"])) for i in infos]


def plan_cycles(names: list[str], chunk_blocks: int, chunk_size: int | None) -> list[tuple[int, list[str]]]:
    """Group presets by chunk size (one server pair per group), in given order."""
    cycles: dict[int, list[str]] = {}
    for name in names:
        geo = gate_preset(name)
        c = chunk_size if chunk_size else chunk_blocks * geo.tokens_per_block
        if c % geo.tokens_per_block:
            raise SystemExit(f"--chunk-size {c} is not a multiple of {name}'s block size {geo.tokens_per_block}")
        cycles.setdefault(c, []).append(name)
    return list(cycles.items())
