"""The checksum trailer of an fs L2 object, and its check (``l2 scan --verify``).

hybrid-fa part ``12-l2-checksum`` makes LMCache's fs adapter write, after an
object's KV bytes, 64 bytes (``fs_l2_adapter.py`` of a patched tree; keep
the two in step)::

    digest    32  blake3(DOMAIN + file name + b"\\0" + KV bytes)
    kv_len     8  u64 LE
    version    4  u32 LE (1)
    reserved  12  zero
    magic      8  b"LMCPTSUM"

The name is in the digest, so an object under another key's name fails like
a corrupted one.  This module is the one place patchtool knows the format.

blake3 is not a patchtool dependency (patchtool runs from pipx, beside any
venv).  The check runs in patchtool's own interpreter when ``blake3`` is
importable there (the optional extra: ``pip install
'lmcache-patchtool[verify]'``), else this file runs as a script in the
target interpreter (``--python``), which has blake3 because every LMCache
release depends on it, and the same blake3 the server hashes with.  The
module imports only the standard library; the script reads a JSON list of
names on stdin and writes one JSON object.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

MAGIC = b"LMCPTSUM"
VERSION = 1
DOMAIN = b"lmcache-patchtool l2 object v1\0"
TRAILER = struct.Struct("<32sQI12s8s")
TRAILER_LEN = TRAILER.size  # 64
_CHUNK = 8 << 20

# Verdicts, per object.
OK = "ok"  # the trailer matches the name and the bytes
CORRUPT = "corrupt"  # a trailer of this format that does not match
NO_TRAILER = "no-trailer"  # written by a build without the check (or damaged at its end)
OTHER_VERSION = "other-version"  # a trailer of a format this tool does not know: not judged
UNREADABLE = "unreadable"  # vanished or not readable while checked: not judged

_SCRIPT_FLAG = "--l2-checksum-worker"


def verdict(path: Path, blake3: Any) -> tuple[str, str]:
    """``(verdict, detail)`` of one object file; reads it whole."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size < TRAILER_LEN:
                return NO_TRAILER, f"{size} bytes: shorter than a trailer"
            f.seek(size - TRAILER_LEN)
            digest, kv_len, version, _reserved, magic = TRAILER.unpack(f.read(TRAILER_LEN))
            if magic != MAGIC:
                return NO_TRAILER, "no checksum trailer"
            if version != VERSION:
                return OTHER_VERSION, f"trailer version {version}, this tool checks {VERSION}"
            if kv_len != size - TRAILER_LEN:
                return CORRUPT, f"trailer says {kv_len} KV bytes, the file holds {size - TRAILER_LEN}"
            f.seek(0)
            h = blake3.blake3(DOMAIN)
            h.update(path.name.encode())
            h.update(b"\0")
            buf = bytearray(min(_CHUNK, max(kv_len, 1)))
            view = memoryview(buf)
            left = kv_len
            while left:
                n = f.readinto(view[:min(left, len(buf))])
                if not n:
                    return CORRUPT, f"ended {left} bytes before its trailer said"
                h.update(view[:n])
                left -= n
            if h.digest() != digest:
                return CORRUPT, "checksum mismatch (corrupted, or stored under another key)"
            return OK, ""
    except OSError as exc:
        return UNREADABLE, f"{type(exc).__name__}: {exc.strerror or exc}"


def _check_here(directory: Path, names: list[str], blake3: Any) -> dict[str, tuple[str, str]]:
    return {n: verdict(directory / n, blake3) for n in names}


def check(directory: Path, names: list[str], python: str | None,
          here: bool = True) -> tuple[dict[str, tuple[str, str]], str]:
    """Verdicts for ``names`` in ``directory``, and where they were computed:
    in this interpreter if it imports blake3 (and ``here``), else in
    ``python``.

    Raises :class:`~patchtool.errors.Refusal` when neither interpreter can
    import blake3 (nothing is judged then)."""
    from .errors import Refusal  # noqa: PLC0415 - the script mode runs without the package

    blake3 = None
    if here:
        try:
            import blake3  # noqa: PLC0415 - optional: the 'verify' extra
        except ImportError:
            blake3 = None
    if blake3 is not None:
        return _check_here(directory, names, blake3), f"blake3 {getattr(blake3, '__version__', '?')} in patchtool's interpreter"
    if python is None:
        raise Refusal("--verify", "blake3 is not importable by patchtool's interpreter and no target was "
                      "given: pass --python <the LMCache venv's python> (LMCache depends on blake3) or "
                      "install the extra: pip install 'lmcache-patchtool[verify]'")
    # -I: the target's own site-packages only (not PYTHONPATH, not the cwd).
    proc = subprocess.run([python, "-I", str(Path(__file__).resolve()), _SCRIPT_FLAG, str(directory)],
                          input=json.dumps(names), capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Refusal("--verify", f"the check did not run in {python}: {last}")
    out = json.loads(proc.stdout)
    return {n: (v[0], v[1]) for n, v in out["verdicts"].items()}, f"blake3 {out['blake3']} in {python}"


def _worker(argv: list[str]) -> int:
    try:
        import blake3  # noqa: PLC0415 - optional: refused in one line where missing
    except ImportError:
        print(f"blake3 is not importable by {sys.executable}", file=sys.stderr)
        return 3
    names = json.loads(sys.stdin.read())
    verdicts = _check_here(Path(argv[0]), names, blake3)
    json.dump({"blake3": getattr(blake3, "__version__", "?"), "verdicts": verdicts}, sys.stdout)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == [_SCRIPT_FLAG]:
    sys.exit(_worker(sys.argv[2:]))
