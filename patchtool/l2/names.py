"""The object names of LMCache's fs L2 adapter, and the layout namespace a
patched build puts in them (docs/design/disk-tier-keys.md §2, §4.2).

Name grammar, written by ``fs_l2_adapter._object_key_to_filename`` (and the
same by the native ``fs_native`` adapter)::

    <safe_model>@0x<kv_rank:08x>@<object_group_id:x>@<chunk_hash hex>.data
    <safe_model>@0x<kv_rank:08x>@<object_group_id:x>@<chunk_hash hex>@<cache_salt>.data

``safe_model`` is the model name with ``/`` written ``-SEP-``; ``@`` is
forbidden in model names and salts, so splitting on ``@`` is unambiguous.
A patched series revision 2+ appends ``+kvl<F>-<12 lowercase hex>`` to the
model name for object groups whose bytes differ from what pristine LMCache
writes; everything else keeps the plain model name.

Only the grammar lives here: no filesystem access.  The scanner matches one
compiled regular expression per file name, because a per-name ``split`` and
per-field checks cost about twice as much in Python (bench/bench_l2_scan.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DATA_EXT = ".data"
TMP_EXT = ".tmp"
SLASH = "-SEP-"

# One C-level match per name.  Groups: 1 the model field (with any
# namespace), 2 kv_rank (0x + 8 hex, as ``{:#010x}`` writes it), 3 the
# object group id, 4 the chunk hash, 5 the salt (absent when unsalted).
# Hex is lowercase because ``format(..., "x")`` and ``bytes.hex()`` write
# nothing else; an uppercase name was not written by the adapter, so it is
# foreign.  The hash is whole bytes (an even number of digits).
OBJECT_RE = re.compile(
    r"([^@]+)@(0x[0-9a-f]{8})@([0-9a-f]+)@((?:[0-9a-f]{2})+)(?:@([^@]+))?\.data")

# A set as the operator names it (``--expect-size``): the name up to the
# group field, i.e. groups 1-3 of OBJECT_RE.
PREFIX_RE = re.compile(r"([^@]+)@(0x[0-9a-f]{8})@([0-9a-f]+)")

# The layout namespace at the end of the model field.  Strict on purpose:
# only what the series writes (a format number, 12 lowercase hex digits) is a
# namespace; any other ``+...`` suffix is part of a (served) model alias.
# DOTALL: a model name may hold any character but ``@`` (a newline too), and
# ``.`` without it stops at a newline, so the namespace would be missed.
NAMESPACE_RE = re.compile(r"(.+)\+kvl([1-9][0-9]*)-([0-9a-f]{12})", re.DOTALL)


@dataclass(frozen=True)
class SetKey:
    """What one object's name says apart from its chunk hash and salt: the
    set whose objects one writer layout gives one size."""

    model: str  # with "/" (``-SEP-`` decoded)
    namespace: str  # "" (plain) or "kvl<F>-<hex12>"
    layout_format: int | None  # F, or None for a plain name
    kv_rank: int
    object_group: int

    @property
    def kv_rank_hex(self) -> str:
        return f"{self.kv_rank:#010x}"


@dataclass(frozen=True)
class ObjectName:
    """One parsed object name (tests and tools; the scanner works on the
    match directly)."""

    key: SetKey
    chunk_hash: str
    salt: str


def split_namespace(model_field: str) -> tuple[str, str, int | None]:
    """``(model, namespace, format)`` of a key's model field: the layout
    namespace a patched build appends (``+kvl<F>-<hex12>``), or ``""`` and
    ``None`` for a plain one.  Shared by every tier's key grammar (the fs
    names here, the Redis keys in ``patchtool.l2.redis_keys``)."""
    ns = NAMESPACE_RE.fullmatch(model_field)
    if ns is None:
        return model_field, "", None
    return ns.group(1), f"kvl{ns.group(2)}-{ns.group(3)}", int(ns.group(2))


def set_key(model_field: str, kv_rank: str, group: str) -> SetKey:
    """The :class:`SetKey` of a matched name's first three fields."""
    model, namespace, fmt = split_namespace(model_field)
    return SetKey(model.replace(SLASH, "/"), namespace, fmt, int(kv_rank, 16), int(group, 16))


def prefix_key(prefix: str) -> SetKey:
    """The :class:`SetKey` of a matched name's prefix, the name up to the
    group field (``name[:match.end(3)]``): the scanner's dict key."""
    model_field, kv_rank, group = prefix.split("@")
    return set_key(model_field, kv_rank, group)


def parse(name: str) -> ObjectName | None:
    """The object a file name stands for; ``None`` for any other shape
    (a foreign file: never touched)."""
    m = OBJECT_RE.fullmatch(name)
    if m is None:
        return None
    return ObjectName(set_key(m.group(1), m.group(2), m.group(3)), m.group(4), m.group(5) or "")


def object_name(model: str, kv_rank: int, group: int, chunk_hash: str, salt: str = "",
                namespace: str = "") -> str:
    """The file name the adapter writes for these fields (the inverse of
    :func:`parse`; used by tests and the bench to build tiers)."""
    field = model.replace("/", SLASH) + (f"+{namespace}" if namespace else "")
    base = f"{field}@{kv_rank:#010x}@{group:x}@{chunk_hash}"
    return f"{base}@{salt}{DATA_EXT}" if salt else f"{base}{DATA_EXT}"
