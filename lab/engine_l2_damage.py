#!/usr/bin/env python3
"""Damage the stored objects of an fs L2 tier between the engine gate's store and restore arms.

The negative controls of the engine restore gate: each must make a correct gate
fail.  Run by the gate through ``--between-arms-cmd`` (``$GATE_L2_DIR`` is the
tier), stdlib only::

    python -m lab.engine_l2_damage zero  [--match REGEX] DIR   # every KV byte 0
    python -m lab.engine_l2_damage flip  [--match REGEX] DIR   # one bit-rotted byte per object
    python -m lab.engine_l2_damage swap  [--match REGEX] DIR   # wrong state: objects of two chunks
                                                                  # exchange their bytes
    python -m lab.engine_l2_damage swap-keys [--match REGEX] DIR  # two attention objects exchange
                                                                  # their keys, keep their values

``--match`` selects objects by a regular expression on the file name (default:
every ``*.data`` file); ``--group N`` selects one object group of a hybrid's
chunks, the third ``@`` field of an fs L2 object's name
(``<model>+<layout>@<format>@<group>@<chunk hash>.data``; on the tiny hybrid,
group 0 is the GDN state, stored at the prompt's last whole chunk only, and
group 1 the attention KV, one object per chunk).
``swap`` exchanges the content of same-size objects pairwise (chunk i gets
chunk j's bytes): the restore then serves a real, well-formed state from
another position, which only a verdict that compares against a reference can
catch.  For attention KV a whole exchange is invisible in principle when every
chunk is restored: vLLM caches keys after the rotary embedding, so each key
keeps its own position, and full attention sums over the same (key, value)
pairs in another order (the logprobs can move by float rounding only, or not
at all: float addition commutes).  ``swap-keys`` therefore exchanges only the
keys, the first half of an attention object (LMCache's ``[2 (K, V), layers,
tokens, hidden]`` layout), and leaves each chunk its values: every query then
meets keys whose values belong to other tokens, which the answer shows.
Prints one line per object touched; exits 1 when nothing matched.

A build with the object checksum trailer (hybrid-fa part ``l2-checksum``)
serves every such object as a miss: the gate then fails on the hit count.
``--resign`` rewrites the trailer for the damaged bytes (blake3, as the part
does; run it with an interpreter that has ``blake3``, e.g. the engine venv's),
so LMCache serves the wrong bytes and the verdict has to catch them in the
answer: what a build that *stores* a wrong state looks like on disk.
"""

from __future__ import annotations

import argparse
import re
import struct
import sys
from pathlib import Path

from gate import tier_objects as to


def select(l2: Path, match: str | None) -> list[Path]:
    rx = re.compile(match) if match else None
    return sorted(p for p in l2.rglob("*.data") if rx is None or rx.search(p.name))


# the trailer of hybrid-fa's l2-checksum part (fs_l2_adapter.py); keep in step with it
_SUM_DOMAIN = b"lmcache-patchtool l2 object v1\0"
_SUM_TRAILER = struct.Struct("<32sQI12s8s")


def resign(path: Path) -> bool:
    """Rewrite the checksum trailer of ``path`` for its current KV bytes; False without a trailer."""
    if not to.has_trailer(path):
        return False
    import blake3  # noqa: PLC0415 - only for --resign

    data = path.read_bytes()
    kv, trailer = data[:-to.TRAILER_LEN], data[-to.TRAILER_LEN:]
    _digest, n, version, reserved, magic = _SUM_TRAILER.unpack(trailer)
    h = blake3.blake3(_SUM_DOMAIN)
    h.update(path.name.encode())
    h.update(b"\0")
    h.update(kv)
    path.write_bytes(kv + _SUM_TRAILER.pack(h.digest(), n, version, reserved, magic))
    return True


def zero(path: Path) -> None:
    n = to.kv_len(path)
    with open(path, "r+b") as f:
        f.write(bytes(n))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["zero", "flip", "swap", "swap-keys"])
    ap.add_argument("l2_dir", type=Path)
    ap.add_argument("--match", help="regular expression on the object file name")
    ap.add_argument("--group", type=int, help="only this object group (the name's third @ field)")
    ap.add_argument("--resign", action="store_true", help="rewrite the checksum trailer of every damaged object")
    args = ap.parse_args(argv)
    files = select(args.l2_dir, args.match)
    if args.group is not None:
        files = [f for f in files if len(f.name.split("@")) == 4 and f.name.split("@")[2] == str(args.group)]
    if not files:
        print(f"{args.l2_dir}: no object matches {args.match!r}", file=sys.stderr)
        return 1
    if args.mode in ("swap", "swap-keys"):
        by_size: dict[int, list[Path]] = {}
        for f in files:
            by_size.setdefault(f.stat().st_size, []).append(f)
        pairs = [(g[i], g[i + 1]) for g in by_size.values() for i in range(0, len(g) - 1, 2)]
        if not pairs:
            print(f"{args.l2_dir}: no two same-size objects to swap", file=sys.stderr)
            return 1
        for a, b in pairs:
            da, db = a.read_bytes(), b.read_bytes()
            if da == db:
                continue
            # the KV bytes change places (swap-keys: the key half only), each file
            # keeps its own trailer (then re-signed or not)
            ka, kb = to.kv_bytes(a), to.kv_bytes(b)
            cut = len(ka) // 2 if args.mode == "swap-keys" else len(ka)
            a.write_bytes(kb[:cut] + ka[cut:] + da[len(ka):])
            b.write_bytes(ka[:cut] + kb[cut:] + db[len(kb):])
            if args.resign:
                resign(a), resign(b)
            print(f"swapped {'the keys of ' if cut < len(ka) else ''}{a.name} <-> {b.name}")
        return 0
    for f in files:
        if args.mode == "zero":
            zero(f)
            print(f"zeroed {f.name}")
        else:
            at = to.flip_byte(f)
            print(f"flipped byte {at} of {f.name}")
        if args.resign and resign(f):
            print(f"re-signed {f.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
