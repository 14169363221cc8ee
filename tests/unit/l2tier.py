"""Building and reading fs L2 tiers for the ``patchtool l2`` tests: real
files named by the adapter's grammar (``patchtool.l2.names``), with bytes that
differ per name so a test can see which file is which and that nothing was
lost."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from _cli import cli

from patchtool.l2 import names as l2names
from patchtool.exitcodes import ExitCode

M = "Qwen/Qwen3.5-0.8B"
NS1 = "kvl1-3f2a9c0b1d4e"
NS2 = "kvl2-00112233aabb"
R = 0x01000100
FLAGGED = int(ExitCode.L2_FLAGGED)
JOURNAL = "quarantine.jsonl"


def name(group: int = 0, h: int = 0, ns: str = "", salt: str = "", model: str = M,
         rank: int = R, hash_bytes: int = 8) -> str:
    return l2names.object_name(model, rank, group, f"{h:0{2 * hash_bytes}x}", salt, ns)


def prefix(group: int = 0, ns: str = "", model: str = M, rank: int = R) -> str:
    """A set as ``--expect-size`` names it: the file name up to the group field."""
    return name(group, 0, ns, model=model, rank=rank).rsplit("@", 1)[0]


def put(d: Path, fname: str, size: int) -> Path:
    """A real object: ``size`` bytes that differ per name."""
    seed = hashlib.sha256(fname.encode()).digest()
    p = d / fname
    p.write_bytes((seed * (size // len(seed) + 1))[:size])
    return p


def put_sparse(d: Path, fname: str, size: int) -> Path:
    """A large object cheaply: its name's digest, then a hole up to ``size``
    (the scan reads sizes only; the digest still tells the files apart)."""
    p = d / fname
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, hashlib.sha256(fname.encode()).digest()[:min(size, 32)])
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return p


def tree(d: Path) -> dict[str, str]:
    """name -> sha256 of every plain file directly in ``d``."""
    if not d.exists():
        return {}
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir()
            if p.is_file() and not p.is_symlink()}


def check_split(src: Path, dest: Path, before: dict[str, str]) -> None:
    """Every object is in exactly one of src/dest, with its bytes."""
    a, b = tree(src), tree(dest)
    b.pop(JOURNAL, None)
    assert not set(a) & set(b), sorted(set(a) & set(b))[:3]
    assert {**a, **b} == before


def scan_json(d: Path, *extra: str, **kw) -> tuple[int, dict]:
    r = cli("l2", "scan", str(d), "--json", *extra, **kw)
    assert r.err == "" or r.rc not in (0, FLAGGED), r.err
    return r.rc, r.json
