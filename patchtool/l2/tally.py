"""One pass over an fs L2 tier: names and sizes, nothing opened.

One ``os.scandir`` over a directory fd and one ``lstat`` per object (none
with ``sizes=False``, ``--names-only``), so a million-file tier costs about
what ``find -printf %s`` costs (bench/bench_l2_scan.py).  Memory is a size
histogram per *set* (the name up to the group field: model, namespace,
kv_rank, object group) and one example name per (set, size): nothing per
file.  What the sets mean is judged elsewhere (``patchtool.l2.rules``).
"""

from __future__ import annotations

import bisect
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .. import fsio
from ..errors import Refusal
from .names import OBJECT_RE, TMP_EXT

FOREIGN_LISTED = 100  # names listed in the report; all are counted
# The one histogram bucket of a names-only pass (no object was stat'ed).
UNKNOWN_SIZE = -1


@dataclass
class Tally:
    """The raw pass: per set prefix (the name up to the group field), per
    size, ``[count, smallest name]``."""

    sets: dict[str, dict[int, list]] = field(default_factory=dict)
    tmp_files: int = 0
    subdirs: int = 0
    foreign: int = 0
    foreign_names: list[str] = field(default_factory=list)  # the smallest, sorted
    vanished: int = 0  # listed, then gone before its lstat (a live tier)
    sizes_read: bool = True  # False: every histogram is {UNKNOWN_SIZE: ...}


@contextmanager
def dir_entries(path: Path) -> Iterator[Iterator[os.DirEntry]]:
    """``scandir`` over an fd of ``path``: each ``entry.stat()`` is then an
    ``fstatat`` of the bare name instead of a walk of the whole path (about
    12% less CPU on a million files)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise Refusal(path, "no such directory") from None
    except NotADirectoryError:
        raise Refusal(path, "is not a directory") from None
    except OSError as exc:
        raise fsio.refusal_for(path, exc, "list it") from None
    try:
        with os.scandir(fd) as it:
            yield it
    finally:
        os.close(fd)


def count(hist: dict[int, list], size: int, name: str) -> None:
    """One object into a set's size histogram: ``size -> [objects, the
    smallest name]`` (the example the report shows, stable across runs)."""
    b = hist.get(size)
    if b is None:
        hist[size] = [1, name]
    else:
        b[0] += 1
        if name < b[1]:
            b[1] = name


def add_foreign(t: Tally, name: str) -> None:
    """Count a foreign name; keep the smallest :data:`FOREIGN_LISTED`, sorted."""
    t.foreign += 1
    names = t.foreign_names
    if len(names) < FOREIGN_LISTED or name < names[-1]:
        bisect.insort(names, name)
        del names[FOREIGN_LISTED:]


def _not_an_object(t: Tally, entry: os.DirEntry, named_like_one: bool) -> None:
    """Anything but a regular file named like an object.  Named like one (a
    link, a directory, a FIFO) it is foreign: listed for the operator, never
    touched.  Otherwise a directory is skipped (the adapter's tmp dir), as is
    a ``*.tmp`` file (a write in progress); the rest is foreign."""
    if named_like_one:
        add_foreign(t, entry.name)
    elif entry.is_dir(follow_symlinks=False):
        t.subdirs += 1
    elif entry.name.endswith(TMP_EXT):
        t.tmp_files += 1
    else:
        add_foreign(t, entry.name)


def tally(path: Path, sizes: bool = True) -> Tally:
    """One ``scandir`` pass.  The loop is written for speed (it runs once per
    file): one regex match, one lstat, one dict lookup; no per-file object.
    Without ``sizes`` there is no lstat: every object lands in the
    ``UNKNOWN_SIZE`` bucket of its set."""
    t = Tally(sizes_read=sizes)
    sets = t.sets
    match = OBJECT_RE.fullmatch
    with dir_entries(path) as it:
        for entry in it:
            name = entry.name
            m = match(name)
            # d_type answers is_file without a syscall.
            if m is None or not entry.is_file(follow_symlinks=False):
                _not_an_object(t, entry, m is not None)
                continue
            if sizes:
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    t.vanished += 1
                    continue
                except OSError as exc:
                    raise fsio.refusal_for(path / name, exc, "stat it") from None
            else:
                size = UNKNOWN_SIZE
            prefix = name[:m.end(3)]
            hist = sets.get(prefix)
            if hist is None:
                hist = sets[prefix] = {}
            count(hist, size, name)
    return t
