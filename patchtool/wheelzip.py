"""A deterministic zip writer for wheels.

Why not ``zipfile`` for writing: its deflate output depends on the zlib the
interpreter links (zlib vs zlib-ng give different bytes), so a rebuilt wheel's
sha256 would differ between machines and could not be pinned in a
requirements file.  Here the members a patch series does not touch are copied
with their compressed bytes verbatim from the source wheel, the few new or
changed members are STORED (no compression at all), and every entry gets the
same fixed timestamp.  The output is then a pure function of the source
wheel's bytes and the new members' bytes.

Only what wheels need is supported: no zip64, no encryption, no comments.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import Refusal

# 1980-01-01 00:00:00, the earliest DOS timestamp: fixed, so rebuilds are identical.
DOS_DATE = (0 << 9) | (1 << 5) | 1
DOS_TIME = 0
_UTF8_FLAG = 0x800
_ZIP32_MAX = 0xFFFFFFFF
_REGULAR_FILE_644 = (0o100644 << 16)


@dataclass(frozen=True)
class Member:
    """One zip entry, ready to write: ``raw`` is the data as stored
    (compressed for DEFLATED members)."""

    name: str
    compress_type: int
    crc: int
    file_size: int
    raw: bytes
    external_attr: int


def stored(name: str, data: bytes, external_attr: int = _REGULAR_FILE_644) -> Member:
    return Member(name, zipfile.ZIP_STORED, zlib.crc32(data) & 0xFFFFFFFF, len(data), data,
                  external_attr)


def copied(src, info: zipfile.ZipInfo, new_name: str | None = None) -> Member:
    """The member ``info`` of the open source file ``src`` with its compressed
    bytes untouched (only its name may change)."""
    if info.flag_bits & 0x1:
        raise Refusal(info.filename, "is encrypted; not a wheel this tool rebuilds")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise Refusal(info.filename, f"uses zip compression method {info.compress_type}; "
                      "only stored and deflated members are supported")
    src.seek(info.header_offset)
    header = src.read(30)
    if header[:4] != b"PK\x03\x04":
        raise Refusal(info.filename, "bad local file header in the source wheel")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    src.seek(info.header_offset + 30 + name_len + extra_len)
    raw = src.read(info.compress_size)
    if len(raw) != info.compress_size:
        raise Refusal(info.filename, "truncated member in the source wheel")
    return Member(new_name or info.filename, info.compress_type, info.CRC, info.file_size, raw,
                  info.external_attr)


def _flags(name: bytes, text: str) -> int:
    return _UTF8_FLAG if name != text.encode("ascii", "ignore") else 0


def write_zip(path: Path, members: list[Member]) -> None:
    """Write ``members`` in the given order to ``path`` (atomically)."""
    if len(members) >= 0xFFFF:
        raise Refusal(path, "too many members for a zip without zip64")
    tmp = path.with_name(f".{path.name}.tmp")
    central = bytearray()
    with open(tmp, "wb") as fh:
        for m in members:
            name = m.name.encode("utf-8")
            offset = fh.tell()
            if max(m.file_size, len(m.raw), offset) > _ZIP32_MAX:
                raise Refusal(m.name, "too large for a zip without zip64")
            flags = _flags(name, m.name)
            fixed = struct.pack("<HHHHHIIIHH", 20, flags, m.compress_type, DOS_TIME, DOS_DATE,
                                m.crc, len(m.raw), m.file_size, len(name), 0)
            fh.write(b"PK\x03\x04" + fixed + name)
            fh.write(m.raw)
            central += b"PK\x01\x02" + struct.pack(
                "<HHHHHHIIIHHHHHII", (3 << 8) | 20, 20, flags, m.compress_type, DOS_TIME,
                DOS_DATE, m.crc, len(m.raw), m.file_size, len(name), 0, 0, 0, 0,
                m.external_attr & 0xFFFFFFFF, offset) + name
        cd_offset = fh.tell()
        if cd_offset + len(central) > _ZIP32_MAX:
            raise Refusal(path, "too large for a zip without zip64")
        fh.write(central)
        fh.write(b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, len(members), len(members),
                                             len(central), cd_offset, 0))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
