"""The keys of LMCache's native RESP (Redis) L2 adapter, the seal a patched
build puts on them, and the quarantine prefix ``l2 scan --quarantine`` moves
them under.  Only the grammar lives here: no connection, no I/O.

LMCache's native connector keys an object (``_object_key_to_string`` in
``native_connector_l2_adapter.py``, the same in 0.5.3 to 0.5.7rc2)::

    <model_name>@<kv_rank:08x>@<object_group_id:x>@<chunk_hash hex>[@<cache_salt>]

The model name is written as it is (``/`` included, unlike the fs names'
``-SEP-``), and ``@`` is the one character a model name or salt cannot
hold, so splitting on ``@`` is unambiguous.  A patched build's model field
may end in a layout namespace (``+kvl<F>-<hex12>``), read by
:func:`patchtool.l2.names.split_namespace` as on the fs tier.

The patch that seals RESP values stores each one under the *wire key*
``lmcptsum1@<native key>``, its value the KV bytes followed by the fs
adapter's 64-byte trailer bound to the wire key (``patchtool.l2.checksum``).
A native key without the prefix is an *unsealed* object: written by
pristine LMCache or a build without the seal, so it cannot be verified.
Any other key is *foreign*: counted, a few listed, never touched.

A quarantined object is renamed to ``lmcptq@<wire key>``: the name records
where it came from, so a restore needs no journal (``patchtool.l2.redis_move``).
"""

from __future__ import annotations

import re

from .names import SetKey, split_namespace

SCHEME = "redis://"
SEAL_PREFIX = "lmcptsum1@"
QUARANTINE_PREFIX = "lmcptq@"

# One C-level match per key.  Groups: 1 the seal prefix (absent: unsealed),
# 2 the model field (with any namespace), 3 kv_rank (8 lowercase hex, as
# ``{:08x}`` writes it), 4 the object group, 5 the chunk hash (whole bytes),
# 6 the salt.  The seal is tried first: a key the patch wrote is read as
# sealed even if its model field could also parse as a native key.
KEY_RE = re.compile(
    r"(lmcptsum1@)?([^@]+)@([0-9a-f]{8})@([0-9a-f]+)@((?:[0-9a-f]{2})+)(?:@([^@]+))?")

# A set as the operator names it (``--expect-size``): the native key up to
# its group field, as the report prints it.
PREFIX_RE = re.compile(r"([^@]+)@([0-9a-f]{8})@([0-9a-f]+)")
PREFIX_FORM = "<model>@<kv_rank 8 hex>@<group hex>"


def is_redis_url(text: str) -> bool:
    """Whether ``l2 scan``'s DIR argument names a Redis tier.  A directory
    whose path starts with ``redis://`` can still be given as ``./redis:/...``."""
    return text.startswith(SCHEME)


def set_prefix(m: re.Match) -> str:
    """The set a matched key belongs to: its native key up to the group
    field.  Sealed and unsealed keys of one model, namespace, kv_rank and
    group are one set (the value sizes ``S + 64`` and ``S`` are one layout,
    ``patchtool.l2.rules``)."""
    return m.string[m.start(2):m.end(4)]


def prefix_key(prefix: str) -> SetKey:
    """The :class:`~patchtool.l2.names.SetKey` of a set prefix."""
    model_field, kv_rank, group = prefix.split("@")
    model, namespace, fmt = split_namespace(model_field)
    return SetKey(model, namespace, fmt, int(kv_rank, 16), int(group, 16))


def is_sealed(m: re.Match) -> bool:
    return m.group(1) is not None


def native_key(model: str, kv_rank: int, group: int, chunk_hash: str, salt: str = "",
               namespace: str = "") -> str:
    """The native key LMCache writes for these fields (tests build tiers with
    it; the tool never writes a key)."""
    field = model + (f"+{namespace}" if namespace else "")
    base = f"{field}@{kv_rank:08x}@{group:x}@{chunk_hash}"
    return f"{base}@{salt}" if salt else base


def quarantined(wire_key: str) -> str:
    """The name a quarantine renames ``wire_key`` to."""
    return QUARANTINE_PREFIX + wire_key


def live_name(key: str) -> str:
    """The live key of a quarantined one (a key without the prefix is
    returned as it is: ``l2 restore`` takes either spelling)."""
    return key[len(QUARANTINE_PREFIX):] if key.startswith(QUARANTINE_PREFIX) else key
