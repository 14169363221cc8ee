"""Where ``l2 scan`` reads a tier from: the :class:`TierSource` protocol the
scan, its rules and ``--verify`` are written against, and :class:`FsTier`,
the fs L2 adapter's directory.  The Redis (RESP) tier is
``patchtool.l2.redis_tier.RedisTier``.

The judgement (``patchtool.l2.rules``, ``patchtool.l2.content_check``,
``patchtool.l2.scan``) needs four things of a tier, and nothing else, so it
is the same code for every tier: one pass of names and sizes as a
:class:`~patchtool.l2.tally.Tally`; the parse of a set prefix; a second pass
listing the objects ``--verify`` reads; and the size of one named object now
(the final re-scan).  Moving objects (quarantine, restore) is per tier: a
rename within one filesystem, a ``RENAMENX`` within one Redis database.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .names import OBJECT_RE, SetKey, prefix_key
from .reader import TierReader
from .rules import Plan
from .tally import Tally, dir_entries, tally


class TierSource(Protocol):
    """A tier as ``l2 scan`` reads it."""

    # The tier as the report names it (``dir`` in ``--json``): the directory
    # as given, or a Redis URL without its password.
    where: str

    def tally(self, sizes: bool) -> Tally:
        """One pass: per set prefix, per size, ``[count, smallest name]``;
        ``sizes=False`` reads names only (``--names-only``)."""
        ...

    def set_key(self, prefix: str) -> SetKey:
        """What a set prefix of this tier's :meth:`tally` says."""
        ...

    def candidates(self, reader: TierReader, plan: Plan) -> dict[str, tuple[str, int]]:
        """name -> (set prefix, size) of every object ``reader`` reads that
        ``plan`` does not select: what ``--verify`` reads."""
        ...

    def size_of(self, name: str) -> int | None:
        """The object's size now; ``None`` once it is gone."""
        ...


class FsTier:
    """The fs (and fs_native) adapter's ``base_path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)

    def tally(self, sizes: bool) -> Tally:
        return tally(self.path, sizes)

    def set_key(self, prefix: str) -> SetKey:
        return prefix_key(prefix)

    def candidates(self, reader: TierReader, plan: Plan) -> dict[str, tuple[str, int]]:
        """A second ``scandir`` pass (the first keeps no per-file state),
        only for ``--verify``, which reads every byte anyway."""
        out: dict[str, tuple[str, int]] = {}
        readable: dict[str, bool] = {}
        match = OBJECT_RE.fullmatch
        with dir_entries(self.path) as it:
            for entry in it:
                m = match(entry.name)
                if m is None or not entry.is_file(follow_symlinks=False):
                    continue
                prefix = entry.name[:m.end(3)]
                ok = readable.get(prefix)
                if ok is None:
                    ok = readable[prefix] = reader.reads(prefix_key(prefix))
                if not ok:
                    continue
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                if plan.select(prefix, size) is None:
                    out[entry.name] = (prefix, size)
        return out

    def size_of(self, name: str) -> int | None:
        try:
            return (self.path / name).stat().st_size
        except FileNotFoundError:
            return None
