"""fs L2 objects of one stored request, by chunk, and the mutations a disk
tier suffers between a store and a restore (bit rot, a torn copy, a wrong
``mv``, a file from elsewhere under a valid name).

The mutations are stdlib only (the tests call them from the project venv);
:func:`chunk_hashes` runs in the target environment (it imports lmcache).
"""

from __future__ import annotations

import os
from pathlib import Path

# The checksum trailer patched builds append (fs_l2_adapter.py, part
# 12-l2-checksum): 64 bytes ending in this magic.  Mutations of the KV bytes
# stay inside the first len - TRAILER_LEN bytes so that they damage the data,
# not just the trailer.
TRAILER_LEN = 64
TRAILER_MAGIC = b"LMCPTSUM"


def chunk_hashes(tokens: list[int], chunk_size: int, chunks: int) -> list[str]:
    """The chunk-hash field (hex) of each stored chunk's object names, as the
    server computes it with its default hasher (blake3, rolling prefix)."""
    from lmcache.v1.multiprocess.token_hasher import TokenHasher  # noqa: PLC0415 - target env

    hasher = TokenHasher(chunk_size=chunk_size)
    return [TokenHasher.hash_to_bytes(h).hex()
            for h in hasher.compute_chunk_hashes(list(tokens[:chunks * chunk_size]))]


def objects_by_chunk(l2_dir: Path, model: str, hashes: list[str]) -> list[list[Path]]:
    """Per chunk (in order), that chunk's object files of ``model`` (one per
    object group), sorted by name.  Raises when a chunk has none."""
    safe = model.replace("/", "-SEP-")
    out: list[list[Path]] = []
    for i, h in enumerate(hashes):
        files = sorted(p for p in l2_dir.glob("*.data")
                       if p.name.split("@")[0].split("+")[0] == safe and p.name.split("@")[3].removesuffix(".data") == h)
        if not files:
            raise FileNotFoundError(f"{l2_dir}: no object of {model} chunk {i} (hash {h[:12]}...)")
        out.append(files)
    return out


def has_trailer(path: Path) -> bool:
    """Whether the file ends in a checksum trailer (its format, not its validity)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < TRAILER_LEN:
            return False
        f.seek(size - len(TRAILER_MAGIC))
        return f.read() == TRAILER_MAGIC


def kv_bytes(path: Path) -> bytes:
    """The KV bytes of an object: the file without its trailer, if it has one."""
    data = path.read_bytes()
    return data[:-TRAILER_LEN] if has_trailer(path) else data


def kv_len(path: Path) -> int:
    """The number of KV bytes of an object (its size less a trailer, if any)."""
    size = path.stat().st_size
    return size - TRAILER_LEN if has_trailer(path) else size


_kv_len = kv_len  # the name lab/engine_l2_damage.py imports


def flip_byte(path: Path, offset: int | None = None) -> int:
    """Bit rot: flip every bit of one KV byte in place (default: the middle one)."""
    at = kv_len(path) // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    return at


def tear(path: Path) -> int:
    """A torn copy into a pre-sized file: the second half of the KV bytes and
    everything after them become zeros, the size is unchanged."""
    size = path.stat().st_size
    cut = kv_len(path) // 2
    with open(path, "r+b") as f:
        f.truncate(cut)
        f.truncate(size)
    return cut


def cut_short(path: Path) -> int:
    """An interrupted copy: the file ends in the middle of its KV bytes."""
    cut = kv_len(path) // 2
    os.truncate(path, cut)
    return cut


def swap(a: Path, b: Path) -> None:
    """A wrong ``mv``: two objects exchange names (sizes must match)."""
    if a.stat().st_size != b.stat().st_size:
        raise ValueError(f"swap {a.name} <-> {b.name}: sizes differ, that is not a same-size swap")
    tmp = a.with_name(a.name + ".swap")
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)


def plant(src: Path, dst: Path) -> None:
    """A foreign object under a valid name: ``src``'s file (another key's, intact)
    replaces ``dst``."""
    if src.stat().st_size != dst.stat().st_size:
        raise ValueError(f"plant {src.name} -> {dst.name}: sizes differ")
    dst.write_bytes(src.read_bytes())
