"""Token ids in the form the installed LMCache's IPC types carry them.

Up to 0.5.6 ``IPCCacheServerKey`` and ``LoadStoreOp`` carry ``token_ids``;
0.5.7 replaced the field in place by packed ``token_bytes``
(``lmcache.v1.multiprocess.token_codec``), and the scheduler adapter's lookup
takes ``packed_token_ids``. The harnesses build and read these through here.
"""

from __future__ import annotations

from typing import Any


def packs_tokens(cls: type) -> bool:
    """Whether ``cls`` (a dataclass or msgspec struct) carries ``token_bytes``."""
    fields = getattr(cls, "__dataclass_fields__", None) or getattr(cls, "__struct_fields__", ()) or ()
    return "token_bytes" in fields


def pack(token_ids: Any) -> bytes:
    from lmcache.v1.multiprocess.token_codec import pack_token_ids  # noqa: PLC0415

    return pack_token_ids(list(token_ids))


def unpack(packed: bytes) -> list[int]:
    from lmcache.v1.multiprocess.token_codec import unpack_token_ids  # noqa: PLC0415

    return list(unpack_token_ids(packed))


def token_fields(cls: type, token_ids: Any) -> dict[str, Any]:
    """The token keyword argument of ``cls(...)`` for ``token_ids``."""
    return {"token_bytes": pack(token_ids)} if packs_tokens(cls) else {"token_ids": token_ids}


def token_ids_of(obj: Any) -> tuple[int, ...]:
    """An instance's tokens, whichever field it has."""
    if hasattr(obj, "token_bytes"):
        return tuple(unpack(obj.token_bytes))
    return tuple(obj.token_ids)
