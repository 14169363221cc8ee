"""The modelled LMCache server for :mod:`sched_sim`: which bytes a STORE op
commits per version, and what a later lookup hits.

Modelled (not run), from the server code of each wheel:

* A chunk is one object holding every group (LMCache's default merged object
  groups, ``separate_object_groups = False``): it is committed entirely or not
  at all.  0.5.4+ skip a chunk only when every block id of every group in it
  is the null block (``all_null_chunk_masks``), which never happens while the
  FA ids are real.
* Of a chunk's Mamba blocks the server reads the last ``keep`` ones
  (``downsample_and_stage_block_ids``); ``keep`` comes from the installed
  connector's ``sw_size_tokens`` via :func:`geometry.kept_blocks_per_chunk`
  (0.5.3: every block; 0.5.4+: the chunk-end block).  FA: every block.
* Keys are prefix hashes and the first write of a key wins (``reserve_write``
  skips existing keys).
* A lookup hits the longest run of stored chunks from chunk 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from lab.sched_truth import NULL_BLOCK, Truth


@dataclass
class ServerRules:
    """What the installed LMCache's server does with a chunk's block ids."""

    mamba_keep_blocks: Callable[[int], int]  # chunk blocks -> Mamba blocks read
    skips_all_null: bool  # 0.5.4+: all_null_chunk_masks
    # "merged": one object per chunk (LMCache's default); "separate": the FA
    # and the Mamba groups in separate objects (``--separate-object-groups``,
    # or a series that forces it for hybrids).
    objects: str = "merged"


@dataclass
class ChunkWrite:
    """One chunk of a STORE op, judged against the truth model."""

    end: int  # chunk end, in tokens of the storing request
    rid: str
    key: int  # prefix digest at the chunk end
    fa_stored: bool
    mamba_stored: bool
    fa_ok: bool
    mamba_end_ok: bool  # every Mamba group's chunk-end slot holds the true state
    mamba_mid_ok: bool  # the other Mamba slots the server reads (0.5.3) do too
    problems: list[str] = field(default_factory=list)
    # What the server read from each kept Mamba slot: (group, block index in
    # the chunk) -> content; a retrieve writes exactly this back.
    mamba_read: dict[tuple[int, int], Any] = field(default_factory=dict)

    @property
    def stored(self) -> bool:
        return self.fa_stored or self.mamba_stored

    @property
    def wrong_block(self) -> bool:
        return ((self.fa_stored and not self.fa_ok)
                or (self.mamba_stored and not (self.mamba_end_ok and self.mamba_mid_ok)))

    @property
    def wrong_state(self) -> bool:
        return self.mamba_stored and not self.mamba_end_ok


@dataclass
class FakeServer:
    block_size: int
    chunk: int
    mamba_groups: list[int]
    fa_groups: list[int]
    rules: ServerRules
    fa_objects: dict[int, ChunkWrite] = field(default_factory=dict)
    mamba_objects: dict[int, ChunkWrite] = field(default_factory=dict)
    writes: list[ChunkWrite] = field(default_factory=list)  # every stored chunk write
    skipped_null: int = 0
    duplicate: int = 0

    def store(self, rid: str, start: int, end: int, block_ids: list[list[int]],
              truth: Truth, digest: Callable[[str, int], int]) -> None:
        """One STORE op of the connector's metadata, read after the step."""
        n, c = self.block_size, self.chunk
        bpc = c // n
        keep = self.rules.mamba_keep_blocks(bpc)
        for i in range((end - start) // c):
            a = start + i * c
            ids = [list(g[i * bpc:(i + 1) * bpc]) for g in block_ids]

            def all_null(groups: list[int]) -> bool:
                return self.rules.skips_all_null and all(
                    b == NULL_BLOCK for g in groups for b in ids[g])

            if self.rules.objects == "separate":
                fa_stored = not all_null(self.fa_groups)
                mamba_stored = not all_null(self.mamba_groups)
            else:
                fa_stored = mamba_stored = not all_null(self.fa_groups + self.mamba_groups)
            if not (fa_stored or mamba_stored):
                self.skipped_null += 1
                continue
            w = self._judge(rid, a, ids, keep, truth, digest, fa_stored, mamba_stored)
            self.writes.append(w)
            dup = False
            for stored, objects in ((fa_stored, self.fa_objects),
                                    (mamba_stored, self.mamba_objects)):
                if stored:
                    dup |= w.key in objects
                    objects.setdefault(w.key, w)  # reserve_write skips existing keys
            self.duplicate += dup

    def _judge(self, rid: str, a: int, ids: list[list[int]], keep: int, truth: Truth,
               digest: Callable[[str, int], int], fa_stored: bool,
               mamba_stored: bool) -> ChunkWrite:
        n, b_end = self.block_size, a + self.chunk
        problems: list[str] = []
        fa_ok = True
        for g in self.fa_groups:
            for k, b in enumerate(ids[g]):
                slot = a // n + k
                if truth.fa_digest(b, digest) != digest(rid, (slot + 1) * n):
                    fa_ok = False
                    problems.append(f"FA g{g} slot{slot}: block {b} holds {truth.fa.get(b)}")
        end_ok = mid_ok = True
        read: dict[tuple[int, int], Any] = {}
        for g in self.mamba_groups:
            blocks = ids[g]
            for k in range(len(blocks) - keep, len(blocks)):
                slot = a // n + k
                want = digest(rid, (slot + 1) * n)
                got = read[(g, k)] = truth.mamba_content(blocks[k])
                if got != want:
                    if k == len(blocks) - 1:
                        end_ok = False
                    else:
                        mid_ok = False
                    what = "null block" if blocks[k] == NULL_BLOCK else repr(got)
                    problems.append(f"Mamba g{g} slot{slot}: block {blocks[k]} holds {what}")
        return ChunkWrite(b_end, rid, digest(rid, b_end), fa_stored, mamba_stored,
                          fa_ok, end_ok, mid_ok, problems, read)

    def restore(self, rid: str, start: int, end: int, block_ids: list[list[int]],
                truth: Truth, digest: Callable[[str, int], int]) -> None:
        """One RETRIEVE op: write each chunk's stored bytes into the request's
        blocks (FA: every block; Mamba: the kept slots, as stored)."""
        n, c = self.block_size, self.chunk
        bpc = c // n
        keep = self.rules.mamba_keep_blocks(bpc)
        for i in range((end - start) // c):
            a = start + i * c
            key = digest(rid, a + c)
            ids = [list(g[i * bpc:(i + 1) * bpc]) for g in block_ids]
            fa = self.fa_objects.get(key)
            for g in self.fa_groups:
                for k, b in enumerate(ids[g]):
                    slot = a // n + k
                    good = fa is not None and fa.fa_ok
                    truth.load_fa(b, rid, slot, (slot + 1) * n if good else slot * n)
            obj = self.mamba_objects.get(key)
            if obj is None:
                continue
            for g in self.mamba_groups:
                for k in range(len(ids[g]) - keep, len(ids[g])):
                    truth.load_state(ids[g][k], obj.mamba_read.get((g, k)))

    # ---- lookups --------------------------------------------------------
    def hit(self, prefix_digests: list[int]) -> tuple[int, ChunkWrite | None]:
        """What a lookup returns for a prompt (its prefix digests): tokens and
        the boundary chunk's Mamba object.  Merged objects: the longest run of
        stored chunks from chunk 0.  Separate objects (0.5.6's window-aware
        lookup): the longest prefix of stored FA objects, cut back to its last
        chunk that has a Mamba object (the Mamba window is one chunk)."""
        c = self.chunk
        fa = 0
        while fa + c < len(prefix_digests) and prefix_digests[fa + c] in self.fa_objects:
            fa += c
        if not self.mamba_groups:  # pure attention: the FA objects are the whole chunk
            return fa, self.fa_objects.get(prefix_digests[fa]) if fa else None
        if self.rules.objects != "separate":
            return fa, self.mamba_objects.get(prefix_digests[fa]) if fa else None
        for b in range(fa, 0, -c):
            if prefix_digests[b] in self.mamba_objects:
                return b, self.mamba_objects[prefix_digests[b]]
        return 0, None

    def stored_ok(self, key: int) -> bool:
        """The FA object of ``key`` holds the right KV."""
        return self.fa_objects[key].fa_ok

    def summary(self) -> dict[str, Any]:
        w = self.writes
        return {"objects": self.rules.objects,
                "chunks_stored": len(self.fa_objects),
                "mamba_objects": len(self.mamba_objects),
                "chunk_writes": len(w),
                "wrong_block_stores": sum(x.wrong_block for x in w),
                "wrong_state_stores": sum(x.wrong_state for x in w),
                "wrong_fa_stores": sum(x.fa_stored and not x.fa_ok for x in w),
                "mid_slot_only_stores": sum(x.mamba_stored and x.mamba_end_ok
                                            and not x.mamba_mid_ok for x in w),
                "skipped_all_null": self.skipped_null,
                "duplicate_keys": self.duplicate}
