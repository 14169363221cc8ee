"""Building Redis (RESP) L2 tiers for the ``patchtool l2 scan redis://`` tests.

Values are sealed by this file's own code, from the format the RESP seal
patch writes (``patchtool/l2/redis_keys.py``'s docstring), not by the module
under test: wire key ``lmcptsum1@`` + the
native key, value = KV bytes + ``struct.pack("<32sQI12s8s", digest, kv_len,
1, 12 zero bytes, b"LMCPTSUM")``, digest = blake3(domain + wire key + NUL +
KV bytes).
"""

from __future__ import annotations

import hashlib
import struct

import blake3

DOMAIN = b"lmcache-patchtool l2 object v1\0"
SEAL = "lmcptsum1@"
QPREFIX = "lmcptq@"
M = "Qwen/Qwen3-0.6B"
NS1 = "kvl1-802ccd5fdf07"
NS2 = "kvl2-00112233aabb"
R = 0x01000100


def native(group: int = 0, h: int = 0, ns: str = "", salt: str = "", model: str = M,
           rank: int = R) -> str:
    """LMCache's native key (``native_connector_l2_adapter._object_key_to_string``)."""
    field = model + (f"+{ns}" if ns else "")
    base = f"{field}@{rank:08x}@{group:x}@{h:016x}"
    return f"{base}@{salt}" if salt else base


def wire(*a, **kw) -> str:
    """The sealed (wire) key of :func:`native`'s key."""
    return SEAL + native(*a, **kw)


def prefix(group: int = 0, ns: str = "", model: str = M, rank: int = R) -> str:
    """A set as the report and ``--expect-size`` name it."""
    return native(group, 0, ns, model=model, rank=rank).rsplit("@", 1)[0]


def seal(wire_key: str, kv: bytes) -> bytes:
    digest = blake3.blake3(DOMAIN + wire_key.encode() + b"\0" + kv).digest()
    return kv + struct.pack("<32sQI12s8s", digest, len(kv), 1, bytes(12), b"LMCPTSUM")


def sealed_ok(wire_key: str, value: bytes) -> bool:
    """This file's own check of a sealed value."""
    if len(value) < 64:
        return False
    digest, kv_len, version, _r, magic = struct.unpack("<32sQI12s8s", value[-64:])
    kv = value[:-64]
    return (magic == b"LMCPTSUM" and version == 1 and kv_len == len(kv)
            and blake3.blake3(DOMAIN + wire_key.encode() + b"\0" + kv).digest() == digest)


def kv_of(tag: str, size: int) -> bytes:
    """``size`` KV bytes that differ per tag."""
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def snapshot(client) -> dict[bytes, bytes]:
    """Every string key and its value (a test tier is small)."""
    out = {}
    for k in client.scan_iter(count=1000):
        if client.type(k) == b"string":
            out[k] = client.get(k)
    return out
