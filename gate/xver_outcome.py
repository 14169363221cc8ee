"""Cross-version gate: builds, outcomes and the expected-outcome table (no torch).

A *build* is ``(lmcache version, "pristine" | "patched")``.  A writer build
stores a request into an fs L2 directory through the real server; a reader
build, with a fresh server and client over the same directory, looks it up and
retrieves it.  Per (writer, reader, preset, blocks per chunk) the gate reports
exactly one outcome:

* ``exact``  -- at least one chunk hit, every hit chunk restored byte-exact,
  no byte outside the destination changed (``hit < stored`` is a byte-exact
  prefix; the hit count is reported next to the outcome);
* ``miss``   -- 0 chunks hit, or a loud failure (refusal, failed retrieve)
  that wrote nothing into the reader's cache;
* ``wrong``  -- a hit whose restored bytes differ, any foreign byte changed,
  or a retrieve that reported success with wrong bytes.

``expected_outcome`` is the REQUIRED outcome once patched builds key their
objects by layout (design doc ``docs/design/disk-tier-keys.md`` section 3.3 for
the byte classes, 4.1 for the namespaces); ``predicted_outcome(...,
keys="today")`` is what the same classes predict with today's keys (every
build writes under the bare model name).  Both are derived from one table of
byte classes below, so the measured matrix can be checked against either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from gate import geometry

VERSIONS = ("0.5.3", "0.5.4", "0.5.5", "0.5.6", "0.5.7rc2")
STATES = ("pristine", "patched")
OUTCOMES = ("exact", "miss", "wrong")
# The L2 tier a writer and a reader share: LMCache's fs adapter over one
# directory, or its resp adapter (the native RESP client) on one Redis server.
TIERS = ("fs", "redis")
LETTER = {"exact": "E", "miss": "M", "wrong": "W", "error": "!", None: "."}

# The gate's presets: hybrid k=17, pure attention k=2, hybrid k=1, and a pure
# attention k=1 (FlashAttention, no GDN: geometry.ON_REQUEST, so the "all" of
# other gates does not iterate it) with the block size of pure-attn-bs128, so
# both share one server chunk size.
PRESETS = ("qwen35-0.8b", "pure-attn-bs128", "control-k1", "pure-attn-k1")
CHUNK_BLOCKS = (1, 2)

# The name the gates import (restore_plan, restore_gate, the probes): geometry's own lookup,
# which resolves the on-request presets too.
preset = geometry.preset


@dataclass(frozen=True, order=True)
class Build:
    version: str
    state: str  # "pristine" | "patched"

    def __post_init__(self) -> None:
        if self.version not in VERSIONS:
            raise ValueError(f"build {self.version}: not one of {', '.join(VERSIONS)}")
        if self.state not in STATES:
            raise ValueError(f"build state {self.state!r}: pristine or patched")

    @property
    def label(self) -> str:
        return f"{self.version}-{self.state}"

    @property
    def short(self) -> str:
        return f"{self.version}{'P' if self.state == 'patched' else 'p'}"

    @property
    def generation(self) -> str:
        """GDN/FA generation of the release: old (0.5.3, no GDN window), mid
        (0.5.4/0.5.5: chunk-end GDN), new (0.5.6: chunk-end GDN, sub-paged FA
        re-viewed by the connector).  What a build writes also depends on the
        series revision: :func:`generation`."""
        return {"0.5.3": "old", "0.5.4": "mid", "0.5.5": "mid", "0.5.6": "new", "0.5.7rc2": "new"}[self.version]

    @classmethod
    def parse(cls, text: str) -> "Build":
        """``0.5.6-patched``, ``0.5.6:patched``, ``0.5.6P`` (patched) / ``0.5.6p`` (pristine)."""
        t = text.strip()
        for sep in ("-", ":", "/"):
            if sep in t:
                v, _, s = t.partition(sep)
                return cls(v, s)
        if t[-1:] in ("P", "p") and t[:-1] in VERSIONS:
            return cls(t[:-1], "patched" if t[-1] == "P" else "pristine")
        raise ValueError(f"build {text!r}: write VERSION-pristine or VERSION-patched (e.g. 0.5.6-patched)")


ALL_BUILDS = tuple(Build(v, s) for v in VERSIONS for s in STATES)


def family(name: str) -> str:
    """hybrid (k>1, GDN), pure (k>1, no GDN), hybrid-k1, pure-k1."""
    geo = preset(name)
    return ("hybrid" if geo.num_gdn_layers else "pure") + ("" if geo.k > 1 else "-k1")


# ---------------------------------------------------------------------------
# Byte classes (design doc section 3.2/3.3, CPU sizes) and namespaces (4.1)
# ---------------------------------------------------------------------------


def byte_class(build: Build, name: str, chunk_blocks: int, keys: str = "layout") -> tuple[str, str]:
    """``(class, size)`` of the object a build writes: equal class = equal bytes;
    size "short" (1/k of the FA bytes) or "full" (every byte), on the CPU context.
    A "one-page" class is lossy: it is the 1/k bug itself, so even its own
    build restores it wrongly (:data:`LOSSY`).

    GDN generations differ only when a chunk has several blocks (C > N): with
    C = N the chunk-end block is the whole chunk.
    """
    fam, gen = family(name), generation(build, keys)
    gdn = "gdn-any" if chunk_blocks == 1 else ("gdn-all" if gen == "old" else "gdn-end")
    if fam == "pure-k1":
        return "engine", "full"
    if fam == "hybrid-k1":
        return f"engine,{gdn}", "full"
    if fam == "pure":
        return ("one-page", "short") if build.state == "pristine" else ("pass-major", "full")
    if gen == "new":  # 0.5.6's connector re-views the FA group; the series leaves it alone
        return "0.5.6-review,gdn-end", "full"
    if build.state == "pristine":
        return f"one-page,{gdn}", "short"
    return f"pass-major,{gdn}", "full"


LOSSY = "one-page"  # class prefix of pristine sub-paged objects (1 of k pages per block)


# Which keys a series revision writes (--expect / keys=):
#   today  every build under the bare model name (the series before 05-layout-keys);
#   05     hybrid-fa revision 2 up to 05-layout-keys (commit c1efd70);
#   06     plus 06-state-chunk-ends (0.5.4-0.5.6 write a hybrid's groups as
#          separate, namespaced objects; the GDN state group has a one-chunk window);
#   12     06's keys plus 12-l2-checksum: a patched build writes a checksum trailer
#          after the KV bytes and refuses an object without one, so an object a
#          pristine build wrote under a key both share is a miss for a patched
#          reader (the other way round the pristine reader reads the KV bytes
#          and ignores the trailer).
# "layout" is the series as it stands (12).
#   053-06 12's keys plus 0.5.3's own 06-state-chunk-ends (hybrid-fa revision 9
#          on 0.5.3): patched 0.5.3 writes a hybrid as patched 0.5.4/0.5.5 do
#          (one-block GDN window, separate namespaced object groups).
KEYS = ("today", "05", "06", "12", "053-06")
CURRENT_KEYS = "053-06"
# the revisions whose patched builds seal fs objects with a checksum trailer
CHECKSUMMED_KEYS = ("12", "053-06")


def generation(build: Build, keys: str = "layout") -> str:
    """The GDN/FA generation a build writes with the series at ``keys``:
    the release's (:attr:`Build.generation`), except patched 0.5.3 from
    053-06 on, which writes the mid generation (its part 06)."""
    keys = CURRENT_KEYS if keys == "layout" else keys
    if build.version == "0.5.3" and build.state == "patched" and keys == "053-06":
        return "mid"
    return build.generation


def namespace(build: Build, name: str, chunk_blocks: int, keys: str = "layout") -> tuple[str, ...]:
    """The model-name suffix of each object group a build's keys carry ("" = the
    bare key), as equality tokens: two builds share an object iff the tokens are
    equal.  Follows the namespaces the patched servers log, pinned per version,
    preset and chunk size in tests/ports/test_layout_keys.py (REGISTERED), which
    are design doc 4.1's rule with two deviations the series chose:

    * before 053-06, patched 0.5.3 hybrids at C > N are namespaced even at
      k = 1 (their all-blocks GDN differs from 0.5.4+'s chunk-end GDN), so
      patched 0.5.3 escapes the P-old <-> P-mid collision; from 053-06 patched
      0.5.3 writes as patched 0.5.4/0.5.5 do;
    * from 06, patched 0.5.4-0.5.6 hybrids (any k, 0.5.6 included) write the
      GDN state and the attention as separate object groups, both namespaced;
      the GDN objects are the same on 0.5.4-0.5.6.
    """
    keys = CURRENT_KEYS if keys == "layout" else keys
    if keys not in KEYS:
        raise ValueError(f"keys {keys!r}: one of {', '.join(KEYS)} or layout")
    fam = family(name)
    if keys == "today" or build.state == "pristine" or fam == "pure-k1":
        return ("",)
    if fam == "pure":
        return (f"kvl1[pure-pass-major,C={chunk_blocks}N]",)
    gen = generation(build, keys)
    if keys in ("06", "12", "053-06") and gen != "old":
        fa = {"hybrid-k1": "engine", "hybrid": "0.5.6-review" if gen == "new" else "pass-major"}[fam]
        return (f"kvl1[gdn-state,C={chunk_blocks}N]", f"kvl1[fa-{fa},C={chunk_blocks}N]")
    if fam == "hybrid-k1":
        return (f"kvl1[0.5.3-k1,C={chunk_blocks}N]",) if gen == "old" and chunk_blocks > 1 else ("",)
    if gen == "new":  # 05: 0.5.6's re-viewed group is left alone, pristine key
        return ("",)
    cls, _ = byte_class(build, name, chunk_blocks, keys)
    return (f"kvl1[{cls},C={chunk_blocks}N]",)


def predicted_outcome(writer: Build, reader: Build, name: str, chunk_blocks: int, keys: str = "layout",
                      tier: str = "fs") -> str:
    """What the byte classes predict the CPU gate sees.

    fs tier: different keys (any object group): a miss.  From 12, a pristine
    writer and a patched reader: a miss (no checksum trailer).  Same
    namespaced keys: the same layout by construction, exact.  Same bare keys:
    the reader's L1 buffer has the reader's size; a shorter file is an
    incomplete read (a miss), a longer or equal one fills the buffer (a hit),
    exact iff the bytes are the same lossless class.

    redis tier: :func:`_predicted_on_redis`.
    """
    keys = CURRENT_KEYS if keys == "layout" else keys
    if tier == "redis":
        return _predicted_on_redis(writer, reader, name, chunk_blocks, keys)
    if tier != "fs":
        raise ValueError(f"tier {tier!r}: one of {', '.join(TIERS)}")
    ns_w, ns_r = namespace(writer, name, chunk_blocks, keys), namespace(reader, name, chunk_blocks, keys)
    if ns_w != ns_r:
        return "miss"
    if keys in CHECKSUMMED_KEYS and writer.state == "pristine" and reader.state == "patched":
        return "miss"  # no checksum trailer: refused, and rewritten by the reader's next store
    if ns_w != ("",):
        return "exact"
    (wc, ws), (rc, rs) = byte_class(writer, name, chunk_blocks, keys), byte_class(reader, name, chunk_blocks, keys)
    if wc == rc and not wc.startswith(LOSSY):
        return "exact"
    if ws == "short" and rs == "full":
        return "miss"
    return "wrong"


def _predicted_on_redis(writer: Build, reader: Build, name: str, chunk_blocks: int, keys: str) -> str:
    """The redis tier (LMCache's resp adapter), with the series as it stands.

    Two rules differ from the fs tier:

    * **Sealed keys.** Part 17-resp-checksum stores a patched build's objects
      under ``lmcptsum1@<key>`` (KV bytes + the key-bound trailer) and loads
      only from there; a pristine build stores and loads the bare key.  So a
      pristine and a patched build never address the same object on Redis: a
      miss in BOTH directions, where the fs tier lets a pristine reader read a
      patched object's KV bytes under a bare key (pure attention k = 1:
      exact there).
    * **Exact sizes.** LMCache's native RESP client reads a value only into a
      buffer of exactly its size (it logs "GET: size header mismatch"; design
      doc resp-tier.md), so a value of another size under the same key is a miss,
      where the fs adapter fills its buffer from a longer file (a hit, and
      wrong).  On the CPU sizes here, size "short" vs "full" is the only size
      difference between classes that share a key.

    Otherwise as on fs: different namespaces miss, the same namespaced key is
    the same layout (exact), and a same-size hit under a bare key is exact iff
    both sides are the same lossless class.  Patched -> patched across
    versions therefore follows the layout-keyed namespaces exactly as on fs:
    the trailer binds the key, which both builds spell the same.
    """
    if keys != CURRENT_KEYS:
        raise ValueError(f"tier redis: predicted for the series as it stands (keys {CURRENT_KEYS}, parts 16-17), "
                         f"not keys {keys!r}")
    if writer.state != reader.state:
        return "miss"  # lmcptsum1@<key> vs <key>: never the same object
    ns_w, ns_r = namespace(writer, name, chunk_blocks, keys), namespace(reader, name, chunk_blocks, keys)
    if ns_w != ns_r:
        return "miss"
    if ns_w != ("",):
        return "exact"
    (wc, ws), (rc, rs) = byte_class(writer, name, chunk_blocks, keys), byte_class(reader, name, chunk_blocks, keys)
    if wc == rc and not wc.startswith(LOSSY):
        return "exact"
    if ws != rs:
        return "miss"  # the native client refuses a value of another size
    return "wrong"


def expected_outcome(writer: Build, reader: Build, name: str, chunk_blocks: int, tier: str = "fs") -> str:
    """The REQUIRED outcome with layout keys on ``tier``.  ``wrong`` here is
    only ever an upstream case (pristine keys on both sides: different bytes,
    or a pristine sub-paged reader, which restores 1 of k pages whatever it
    reads), which no change to a patched build can fix (:func:`is_upstream`)."""
    return predicted_outcome(writer, reader, name, chunk_blocks, CURRENT_KEYS, tier)


def is_upstream(writer: Build, reader: Build, name: str, chunk_blocks: int, tier: str = "fs") -> bool:
    """A wrong hit both sides of which write under today's (pristine) key."""
    return expected_outcome(writer, reader, name, chunk_blocks, tier) == "wrong"


# ---------------------------------------------------------------------------
# Classifying one measured (writer, reader, preset) result
# ---------------------------------------------------------------------------


def classify(res: dict[str, Any]) -> tuple[str, str]:
    """``(outcome, why)`` from a reader phase's per-preset result.

    ``res`` keys (restore_gate --phase restore): ``error`` (an infrastructure
    failure: outcome ``error``), ``chunks_stored``, ``chunks_hit``,
    ``retrieve_ok`` (None: no retrieve), ``chunks_exact`` (hit chunks restored
    exact), ``foreign_bytes`` (bytes changed outside the hit chunks'
    destinations; after a failed retrieve: anywhere in the cache).
    """
    if res.get("error"):
        return "error", str(res["error"]).splitlines()[0]
    stored, hit = int(res["chunks_stored"]), int(res["chunks_hit"])
    foreign = int(res["foreign_bytes"])
    if hit == 0:
        if foreign:
            return "wrong", f"0 chunks hit, yet {foreign} bytes changed in the cache"
        return "miss", f"0/{stored} chunks hit"
    if res.get("retrieve_ok") is False:
        if foreign:
            return "wrong", f"retrieve failed after {hit}/{stored} hits and changed {foreign} bytes"
        return "miss", f"{hit}/{stored} chunks hit, the retrieve failed loudly and wrote nothing"
    exact = int(res["chunks_exact"])
    if exact < hit or foreign:
        return "wrong", (f"{hit}/{stored} chunks hit, {exact} restored exact, "
                         f"{foreign} foreign bytes changed")
    return "exact", f"{hit}/{stored} chunks hit, all byte-exact, nothing foreign changed"


# ---------------------------------------------------------------------------
# Markdown matrix
# ---------------------------------------------------------------------------


def matrix_markdown(cells: Iterable[dict[str, Any]], presets: list[str], chunk_blocks: int,
                    expected: str | None = None, tier: str = "fs") -> str:
    """Rows writer, columns reader, cell = one letter per preset (E exact,
    M miss, W wrong hit, ! error, . not run), in ``presets`` order.  With
    ``expected`` ("layout" or "today": which keys) a letter that differs from
    :func:`predicted_outcome` for those keys on ``tier`` is starred."""
    cells = [c for c in cells if c["chunk_blocks"] == chunk_blocks]
    writers = sorted({Build.parse(c["writer"]) for c in cells})
    readers = sorted({Build.parse(c["reader"]) for c in cells})
    got = {(c["writer"], c["reader"], c["preset"]): c["outcome"] for c in cells}
    head = "| writer \\ reader | " + " | ".join(r.short for r in readers) + " |"
    lines = [head, "|" + "---|" * (len(readers) + 1)]
    for w in writers:
        row = []
        for r in readers:
            text = ""
            for p in presets:
                o = got.get((w.label, r.label, p))
                ch = LETTER.get(o, "?")
                if expected and o is not None and o != "error" and \
                        o != predicted_outcome(w, r, p, chunk_blocks, expected, tier):
                    ch += "*"
                text += ch
            row.append(text)
        lines.append(f"| {w.short} | " + " | ".join(row) + " |")
    legend = (f"Cells: one letter per preset ({', '.join(presets)}); E exact, M miss, W wrong hit, "
              f"! error, . not run; {chunk_blocks} block(s) per chunk; p pristine, P patched"
              + (f"; * differs from the outcome predicted with {expected} keys on the {tier} tier"
                 if expected else "") + ".")
    return "\n".join(lines + ["", legend])
