"""Every filesystem access the tool makes to an install goes through here.

Two jobs, kept together because they must see the same operations:

* **Reads that refuse.**  :func:`read_file` returns ``None`` for a file that
  does not exist and turns every other ``OSError`` (a directory where a file
  should be, a parent that is a file, EACCES, EIO) into a one-line
  :class:`~patchtool.errors.Refusal` naming the path and the errno's meaning.
* **Counted writes.**  Every write (a durable file write, a rename, an
  unlink, a mkdir, a directory removal) ticks one counter, so the single
  test-only hook ``LMCACHE_PATCHTOOL_FAULT`` can stop the tool at any write:

  - ``crash:N``  exit abruptly (code 86, as a ``kill -9`` would) right after
    the N-th write;
  - ``enospc:N`` / ``eio:N`` / ``erofs:N`` / ``efbig:N``  fail the N-th write
    with that errno (a durable write first writes half its bytes, as a full
    disk would leave them).

  Never set it outside tests.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Callable

from .errors import Refusal

FAULT_ENV = "LMCACHE_PATCHTOOL_FAULT"
CRASH_EXIT = 86

_ERRNOS = {"enospc": errno.ENOSPC, "eio": errno.EIO, "erofs": errno.EROFS,
           "efbig": errno.EFBIG}


def describe(exc: OSError) -> str:
    """``No space left on device (ENOSPC)``: the errno's meaning and name."""
    if exc.errno is None:
        return str(exc)
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    return f"{os.strerror(exc.errno)} ({name})"


def refusal_for(path: object, exc: OSError, doing: str) -> Refusal:
    return Refusal(path, f"cannot {doing}: {describe(exc)}")


# ---------------------------------------------------------------- reads


def read_file(path: Path) -> bytes | None:
    """The file's bytes; ``None`` if it does not exist.  Any other failure is a
    refusal: a directory or a special file where a file belongs is never
    "missing", and guessing would let apply overwrite it."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise Refusal(path, "is a directory, not a file") from None
    except NotADirectoryError:
        raise Refusal(path, "a parent of it is not a directory") from None
    except OSError as exc:
        raise refusal_for(path, exc, "read it") from None


def symlink_on_path(base: Path, rel: str) -> Path | None:
    """The first symbolic link among ``base/rel``'s components below ``base``
    (``base`` itself may be a link: venvs link ``lib64`` to ``lib``)."""
    cur = base
    for part in Path(rel).parts:
        cur = cur / part
        if cur.is_symlink():
            return cur
    return None


# ---------------------------------------------------------------- counted writes


class _Fault:
    """The parsed ``LMCACHE_PATCHTOOL_FAULT`` and the process-wide write count."""

    def __init__(self) -> None:
        self.count = 0
        self.mode, self.at = "", 0
        spec = os.environ.get(FAULT_ENV, "")
        if spec:
            mode, _, n = spec.partition(":")
            if mode in ("crash", *_ERRNOS) and n.isdigit() and int(n) > 0:
                self.mode, self.at = mode, int(n)

    def failing(self) -> int | None:
        """The errno the next write must fail with, if it is the chosen one."""
        if self.mode in _ERRNOS and self.count + 1 == self.at:
            self.count += 1
            return _ERRNOS[self.mode]
        return None

    def done(self) -> None:
        self.count += 1
        if self.mode == "crash" and self.count == self.at:
            os._exit(CRASH_EXIT)


_fault = _Fault()


def _fail(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def write_durable(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``path`` fully and fsync it (not atomic by itself)."""
    injected = _fault.failing()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # umask must not change a replaced file's mode
        view = memoryview(data)
        if injected is not None:
            os.write(fd, view[: len(view) // 2])
            raise _fail(injected, path)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    _fault.done()


def _counted(path: Path, op: Callable[[], object]) -> None:
    """Run one write ``op`` on ``path`` as a counted write (fault hook)."""
    injected = _fault.failing()
    if injected is not None:
        raise _fail(injected, path)
    op()
    _fault.done()


def replace(src: Path, dst: Path) -> None:
    _counted(dst, lambda: os.replace(src, dst))


def chmod(path: Path, mode: int) -> None:
    _counted(path, lambda: os.chmod(path, mode))


def unlink(path: Path) -> None:
    """Remove ``path`` if it exists (removing nothing is no write)."""
    if os.path.lexists(path):
        _counted(path, lambda: os.unlink(path))


def makedirs(path: Path) -> None:
    if not path.is_dir():
        _counted(path, lambda: path.mkdir(parents=True, exist_ok=True))


def rmtree(path: Path) -> None:
    if path.exists():
        _counted(path, lambda: shutil.rmtree(path))


def prune_empty_dirs(root: Path) -> None:
    """Remove empty directories under ``root``, bottom-up, ``root`` included:
    an empty state dir carries no information, and docs/reference.md promises that
    ``tx/`` exists only while a transaction is open."""
    if not root.is_dir() or root.is_symlink():
        return
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -len(t[0])):
        p = Path(dirpath)
        if not any(p.iterdir()):
            _counted(p, p.rmdir)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Reader:
    """How planning and classification see an install: file bytes (``None``
    when absent, a refusal for anything else), symbolic links on a path, and
    a module's bytecode files.  Tests may pass their own."""

    def read(self, path: Path) -> bytes | None:
        return read_file(path)

    def link_on(self, base: Path, rel: str) -> Path | None:
        return symlink_on_path(base, rel)

    def pycs(self, module: Path) -> list[Path]:
        cache = module.parent / "__pycache__"
        try:
            return sorted(cache.glob(f"{module.stem}.*.pyc"))
        except OSError as exc:
            raise refusal_for(cache, exc, "list it") from None

    def entries(self, root: Path) -> list[Path]:
        """Everything under ``root`` that is not a directory (files, and
        symbolic links, to directories too, never followed), sorted; empty
        when ``root`` does not exist."""
        return list_entries(root)


def list_entries(root: Path) -> list[Path]:
    out: list[Path] = []

    def fail(exc: OSError) -> None:
        raise refusal_for(exc.filename or root, exc, "list it")

    if not os.path.isdir(root) or os.path.islink(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        here = Path(dirpath)
        links = [d for d in dirnames if os.path.islink(here / d)]
        dirnames[:] = [d for d in dirnames if d not in links]
        out += [here / name for name in filenames + links]
    return sorted(out)
