"""The checksum trailer of an L2 object, and its check (``l2 scan --verify``).

hybrid-fa part ``12-l2-checksum`` makes LMCache's fs adapter write, after an
object's KV bytes, 64 bytes (``fs_l2_adapter.py`` of a patched tree; keep
the two in step)::

    digest    32  blake3(DOMAIN + binding + b"\\0" + KV bytes)
    kv_len     8  u64 LE
    version    4  u32 LE (1)
    reserved  12  zero
    magic      8  b"LMCPTSUM"

The *binding* is the name the object is stored under: the file name on an
fs tier, the Redis key ("wire key", ``lmcptsum1@`` prefix included) on a
RESP tier, whose patched adapter seals each value with the same trailer.
The name is in the digest, so an object under another key's name fails like
a corrupted one.  The binding is the only difference between the two tiers,
so both are checked here: :func:`verdict` reads a file, :func:`value_verdict`
judges a value already read (a Redis ``GET``).  This module is the one place
patchtool knows the format.

blake3 is not a patchtool dependency (patchtool runs from pipx, beside any
venv).  The check runs in patchtool's own interpreter when ``blake3`` is
importable there (the optional extra: ``pip install
'lmcache-patchtool[verify]'``), else this file runs as a script in the
target interpreter (``--python``), which has blake3 because every LMCache
release depends on it, and the same blake3 the server hashes with.  The
module imports only the standard library; the script reads a JSON list of
names on stdin and writes one JSON object.  For values that are not files
(a Redis tier) the target interpreter runs as a *digest worker* instead
(:class:`Digester`): it reads framed ``(binding, KV bytes)`` on stdin and
writes each digest, so the trailer logic stays here, in one place.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Callable

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
_DIGEST_FLAG = "--l2-digest-worker"


def _hash(blake3: Any, binding: bytes) -> Any:
    """A blake3 hasher fed the domain and the binding: the KV bytes follow."""
    h = blake3.blake3(DOMAIN)
    h.update(binding)
    h.update(b"\0")
    return h


def _trailer(tail: bytes, size: int, holder: str = "the file") -> tuple[str, str, bytes]:
    """``(verdict, detail, digest)`` from an object's last :data:`TRAILER_LEN`
    bytes and its size; verdict ``""`` means "well-formed: compare the digest
    of the ``size - TRAILER_LEN`` KV bytes with ``digest``"."""
    if size < TRAILER_LEN:
        return NO_TRAILER, f"{size} bytes: shorter than a trailer", b""
    digest, kv_len, version, _reserved, magic = TRAILER.unpack(tail)
    if magic != MAGIC:
        return NO_TRAILER, "no checksum trailer", b""
    if version != VERSION:
        return OTHER_VERSION, f"trailer version {version}, this tool checks {VERSION}", b""
    if kv_len != size - TRAILER_LEN:
        return CORRUPT, f"trailer says {kv_len} KV bytes, {holder} holds {size - TRAILER_LEN}", b""
    return "", "", digest


_MISMATCH = "checksum mismatch (corrupted, or stored under another key)"


def verdict(path: Path, blake3: Any) -> tuple[str, str]:
    """``(verdict, detail)`` of one object file; reads it whole."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size >= TRAILER_LEN:
                f.seek(size - TRAILER_LEN)
            v, detail, digest = _trailer(f.read(TRAILER_LEN) if size >= TRAILER_LEN else b"", size)
            if v:
                return v, detail
            kv_len = size - TRAILER_LEN
            f.seek(0)
            h = _hash(blake3, path.name.encode())
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
                return CORRUPT, _MISMATCH
            return OK, ""
    except OSError as exc:
        return UNREADABLE, f"{type(exc).__name__}: {exc.strerror or exc}"


# (binding, KV bytes) -> the 32-byte digest; :meth:`Digester.digest`
DigestFn = Callable[[bytes, memoryview], bytes]


def value_verdict(value: bytes, binding: bytes, digest: DigestFn) -> tuple[str, str]:
    """``(verdict, detail)`` of a whole value read from a tier that is not a
    directory (a Redis ``GET``), stored under ``binding``."""
    size = len(value)
    view = memoryview(value)
    v, detail, want = _trailer(bytes(view[size - TRAILER_LEN:]) if size >= TRAILER_LEN else b"",
                               size, "the value")
    if v:
        return v, detail
    if digest(binding, view[:size - TRAILER_LEN]) != want:
        return CORRUPT, _MISMATCH
    return OK, ""


def _check_here(directory: Path, names: list[str], blake3: Any) -> dict[str, tuple[str, str]]:
    return {n: verdict(directory / n, blake3) for n in names}


def check(directory: Path, names: list[str], python: str | None,
          here: bool = True) -> tuple[dict[str, tuple[str, str]], str]:
    """Verdicts for ``names`` in ``directory``, and where they were computed:
    in this interpreter if it imports blake3 (and ``here``), else in
    ``python``.

    Raises :class:`~patchtool.errors.Refusal` when neither interpreter can
    import blake3 (nothing is judged then)."""
    from ..errors import Refusal  # noqa: PLC0415 - the script mode runs without the package

    blake3 = None
    if here:
        try:
            import blake3  # noqa: PLC0415 - optional: the 'verify' extra
        except ImportError:
            blake3 = None
    if blake3 is not None:
        return _check_here(directory, names, blake3), f"blake3 {getattr(blake3, '__version__', '?')} in patchtool's interpreter"
    if python is None:
        raise Refusal("--verify", _NO_BLAKE3)
    # -I: the target's own site-packages only (not PYTHONPATH, not the cwd).
    proc = subprocess.run([python, "-I", str(Path(__file__).resolve()), _SCRIPT_FLAG, str(directory)],
                          input=json.dumps(names), capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Refusal("--verify", f"the check did not run in {python}: {last}")
    out = json.loads(proc.stdout)
    return {n: (v[0], v[1]) for n, v in out["verdicts"].items()}, f"blake3 {out['blake3']} in {python}"


class Digester:
    """Digests of ``(binding, KV bytes)``: blake3 in this interpreter when it
    imports it (and ``here``), else a worker process of ``python`` (the
    target's, which has blake3 because LMCache depends on it).

    The worker reads frames ``>I`` binding length, binding, ``>Q`` KV length,
    KV bytes on stdin and answers each with the 32-byte digest; it greets
    with one line (``ok <blake3 version>``) so a missing blake3 is refused
    before anything is judged.  Use as a context manager: the worker ends
    with it."""

    def __init__(self, python: str | None, here: bool = True) -> None:
        from ..errors import Refusal  # noqa: PLC0415 - the script mode runs without the package

        self._proc: subprocess.Popen | None = None
        self._blake3: Any = None
        if here:
            try:
                import blake3  # noqa: PLC0415 - optional: the 'verify' extra
                self._blake3 = blake3
            except ImportError:
                self._blake3 = None
        if self._blake3 is not None:
            self.checked_with = (f"blake3 {getattr(self._blake3, '__version__', '?')} in "
                                 "patchtool's interpreter")
            return
        if python is None:
            raise Refusal("--verify", _NO_BLAKE3)
        proc = subprocess.Popen([python, "-I", str(Path(__file__).resolve()), _DIGEST_FLAG],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        hello = proc.stdout.readline().decode(errors="replace").split()
        if hello[:1] != ["ok"]:
            proc.kill()
            _out, err = proc.communicate()
            last = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise Refusal("--verify", f"the check did not run in {python}: {last}")
        self._proc = proc
        self.checked_with = f"blake3 {hello[1] if len(hello) > 1 else '?'} in {python}"

    def digest(self, binding: bytes, kv: memoryview) -> bytes:
        if self._blake3 is not None:
            h = _hash(self._blake3, binding)
            h.update(kv)
            return h.digest()
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(struct.pack(">I", len(binding)) + binding + struct.pack(">Q", len(kv)))
        proc.stdin.write(kv)
        proc.stdin.flush()
        out = _read_exact(proc.stdout, 32)
        if out is None:
            raise OSError(f"the blake3 worker in {proc.args[0]} ended early")
        return out

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.communicate()
            self._proc = None

    def __enter__(self) -> "Digester":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


_NO_BLAKE3 = ("blake3 is not importable by patchtool's interpreter and no target was "
              "given: pass --python <the LMCache venv's python> (LMCache depends on blake3) or "
              "install the extra: pip install 'lmcache-patchtool[verify]'")


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        chunk = stream.read(n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def _digest_worker() -> int:
    """The target-interpreter side of :class:`Digester` (standard library and
    blake3 only)."""
    try:
        import blake3  # noqa: PLC0415 - optional: refused in one line where missing
    except ImportError:
        print(f"blake3 is not importable by {sys.executable}", file=sys.stderr)
        return 3
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    out.write(f"ok {getattr(blake3, '__version__', '?')}\n".encode())
    out.flush()
    while True:
        head = _read_exact(inp, 4)
        if head is None:
            return 0
        binding = _read_exact(inp, struct.unpack(">I", head)[0]) or b""
        (left,) = struct.unpack(">Q", _read_exact(inp, 8) or bytes(8))
        h = _hash(blake3, binding)
        while left:
            chunk = inp.read(min(left, _CHUNK))
            if not chunk:
                return 3
            h.update(chunk)
            left -= len(chunk)
        out.write(h.digest())
        out.flush()


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
if __name__ == "__main__" and sys.argv[1:2] == [_DIGEST_FLAG]:
    sys.exit(_digest_worker())
