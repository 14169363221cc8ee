"""Buried-key prompts for the GPU restore gate, placed in TOKENS (stdlib only).

A prompt is built directly as a list of token ids and sent to vLLM as such
(``/v1/completions`` with ``prompt=[ids]``), so the positions computed here are
exactly the positions the engine sees: no re-tokenisation can move a key.

Layout of one prompt (T tokens)::

    [chat-template head + header] [filler ... key ... filler ... key ...] [question + template tail]
    |<------------------- full LMCache chunks (restorable) ------------------->|<- T mod C ->|

* ``T = floor(target / C) * C + tail`` (``tail`` defaults to 1), so all but
  ``tail`` tokens lie in whole chunks that a restore can cover; vLLM always
  recomputes at least the last token.
* Every key sentence lies inside one chunk, in a restorable chunk, mid-block,
  and does not touch the first kernel page of its chunk (a broken restore
  keeps that page, so a key there could pass falsely) nor, by default, the
  first kernel page of any logical block.
* Keys sit at different depths (distinct chunks spread over the context) and
  are unique ``K-<24 lowercase hex>`` strings derived from the seed.

Two tokenizer implementations share one small interface: :class:`HFTokenizer`
(the model's own tokenizer via transformers, used by real runs in the target
venv) and :class:`ByteTokenizer` (pure python, one token per UTF-8 byte, used by
the CPU tests and the stand-in servers).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, Sequence

KEY_RE = re.compile(r"K-[0-9a-f]{24}")
KEY_ANY_RE = re.compile(r"K-[0-9A-Za-z]{6,40}")  # anything key-shaped, for "spurious key" detection
SENTINEL = "\u2063GATE-BODY\u2063"

SYSTEM_PROMPT = ("You are a deterministic cache-correctness probe. Follow the final "
                 "instruction exactly and output nothing else.")


# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_frame(self, system: str, user_head: str, user_tail: str) -> tuple[str, str]:
        """(text before the body, text after it) of the rendered chat prompt."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255).  Pure python; for tests and stand-ins."""

    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")

    def chat_frame(self, system: str, user_head: str, user_tail: str) -> tuple[str, str]:
        return (f"<|system|>{system}\n<|user|>{user_head}",
                f"{user_tail}\n<|assistant|>")


class HFTokenizer:
    """The model's tokenizer through transformers (imported lazily)."""

    def __init__(self, path: str, *, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415 - target venv only

        self._tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.name = f"hf:{path}"
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def chat_frame(self, system: str, user_head: str, user_tail: str) -> tuple[str, str]:
        if not self.has_chat_template:
            return (f"{system}\n\n{user_head}", f"{user_tail}\nKeys:\n")
        msgs = [{"role": "system", "content": system},
                {"role": "user", "content": user_head + SENTINEL + user_tail}]
        try:  # thinking off (Qwen3.x templates read enable_thinking)
            text = self._tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=False)
        except TypeError:  # pragma: no cover - very old transformers
            text = self._tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        head, sep, tail = text.partition(SENTINEL)
        if not sep:
            raise ValueError("chat template dropped the body sentinel")
        return head, tail


def make_tokenizer(spec: str, model_dir: str | None) -> Any:
    """``byte`` | ``hf`` (the model dir's tokenizer) | ``hf:PATH``."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "hf":
        if not model_dir:
            raise ValueError("--tokenizer hf needs --model")
        return HFTokenizer(model_dir)
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    raise ValueError(f"unknown tokenizer {spec!r} (byte | hf | hf:PATH)")


# ---------------------------------------------------------------------------
# Geometry used for placement
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementGeometry:
    """N tokens per logical block, P tokens per kernel page, C tokens per LMCache chunk."""

    block: int = 544
    page: int = 32
    chunk: int = 544

    def __post_init__(self) -> None:
        if self.block <= 0 or self.page <= 0 or self.chunk <= 0:
            raise ValueError("geometry sizes must be positive")
        if self.block % self.page:
            raise ValueError(f"block {self.block} is not a multiple of page {self.page}")
        if self.chunk % self.block:
            raise ValueError(f"chunk {self.chunk} is not a multiple of block {self.block}")

    @property
    def k(self) -> int:
        return self.block // self.page

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk // self.block

    def forbidden(self, pos: int, *, block_pages: bool = True) -> bool:
        """Is token ``pos`` in the first kernel page of its chunk (or, with ``block_pages``
        and k > 1, of its logical block)?"""
        if pos % self.chunk < self.page:
            return True
        return block_pages and self.k > 1 and pos % self.block < self.page


# ---------------------------------------------------------------------------
# Prompt
# ---------------------------------------------------------------------------


@dataclass
class KeySlot:
    index: int
    key: str
    label: str
    start: int  # first token of the key sentence
    end: int  # one past its last token
    key_start: int  # first token whose decoded text overlaps the "K-..." string (approx.)
    chunk: int
    block: int
    offset_in_chunk: int
    offset_in_block: int
    depth: float  # start / T


@dataclass
class Prompt:
    target_tokens: int
    ids: list[int]
    keys: list[KeySlot]
    geometry: PlacementGeometry
    head_len: int
    tail_len: int
    restorable_tokens: int
    tokenizer: str
    seed: int
    tag: str
    sha256: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def key_strings(self) -> list[str]:
        return [k.key for k in self.keys]

    def to_json(self) -> dict[str, Any]:
        return {"target_tokens": self.target_tokens, "prompt_tokens": self.num_tokens,
                "restorable_tokens": self.restorable_tokens, "head_tokens": self.head_len,
                "tail_tokens": self.tail_len, "geometry": asdict(self.geometry) | {"k": self.geometry.k},
                "tokenizer": self.tokenizer, "seed": self.seed, "tag": self.tag, "ids_sha256": self.sha256,
                "keys": [asdict(k) for k in self.keys], "notes": list(self.notes)}


def make_key(seed: int, tag: str, target: int, index: int) -> str:
    h = hashlib.sha256(f"lmcache-patchtool-gpu-gate|{seed}|{tag}|{target}|{index}".encode()).hexdigest()
    return "K-" + h[:24]


_WORDS_A = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo",
            "juniper", "kestrel", "lagoon", "meadow", "nimbus", "orchard", "prairie", "quarry",
            "ridge", "summit", "tundra", "upland", "valley", "willow", "yarrow", "zephyr")
_WORDS_B = ("survey", "inventory", "ledger", "report", "bulletin", "census", "record", "digest",
            "schedule", "summary", "register", "notice")
_WORDS_C = ("lists routine figures", "notes ordinary weather", "records standard maintenance",
            "mentions usual deliveries", "describes regular inspections", "tracks normal water levels",
            "logs common supply counts", "repeats the seasonal averages")


def filler_ids(tokenizer: Any, count: int, seed: int) -> list[int]:
    """At least ``count`` token ids of neutral, deterministic, line-numbered filler."""
    rng = random.Random(f"filler|{seed}")
    out: list[int] = []
    line = 0
    while len(out) < count:
        para = []
        for _ in range(16):
            line += 1
            para.append(f"Line {line:05d}: the {rng.choice(_WORDS_A)} {rng.choice(_WORDS_B)} "
                        f"{rng.choice(_WORDS_C)} for sector {rng.randrange(1, 99)}.\n")
        out += tokenizer.encode("".join(para))
    return out


def key_sentence(label: str, key: str) -> tuple[str, str, str]:
    """(text before the key, the key, text after) of one key sentence."""
    return (f"\nNOTICE: the access key of vault {label} is ", key, " (keep it).\n")


def _key_slots(geo: PlacementGeometry, T: int, restorable: int, head: int, body_end: int,
               lengths: list[int], block_pages: bool) -> list[int]:
    """Start positions for sentences of the given token lengths (raises if impossible)."""
    n = len(lengths)
    first_chunk = 0
    last_chunk = restorable // geo.chunk - 1
    if last_chunk < first_chunk:
        raise ValueError(f"prompt of {T} tokens has no full chunk of {geo.chunk}")
    chunks = list(range(first_chunk, last_chunk + 1))
    starts: list[int] = []
    used: set[int] = set()
    for i, L in enumerate(lengths):
        depth = (i + 0.5) / n
        want = chunks[min(len(chunks) - 1, int(depth * len(chunks)))]
        # nearest unused chunk to the wanted depth that can hold the sentence
        order = sorted(chunks, key=lambda c: (abs(c - want), c))
        placed = None
        for c in order:
            if c in used:
                continue
            placed = _place_in_chunk(geo, c, L, head, min(body_end, restorable), block_pages)
            if placed is not None:
                used.add(c)
                break
        if placed is None:
            raise ValueError(f"cannot place key {i} ({L} tokens) in a {T}-token prompt with {geo} "
                             f"(head {head}, {len(chunks)} full chunks, {n} keys)")
        starts.append(placed)
    return starts


def _place_in_chunk(geo: PlacementGeometry, c: int, L: int, lo: int, hi: int, block_pages: bool) -> int | None:
    """A start in chunk ``c`` for a span of ``L`` tokens: mid-block of the middle block if possible."""
    base = c * geo.chunk
    bpc = geo.blocks_per_chunk
    order = sorted(range(bpc), key=lambda b: (abs(b - bpc // 2), b))
    for b in order:
        bstart = base + b * geo.block
        # mid-block first, then any legal offset in the block
        mid = bstart + max(0, (geo.block - L) // 2)
        cands = [mid] + list(range(bstart, bstart + geo.block))
        for s in cands:
            if s < lo or s + L > hi or s + L > base + geo.chunk:
                continue
            if any(geo.forbidden(p, block_pages=block_pages) for p in (s, s + L - 1)) or \
                    _span_forbidden(geo, s, L, block_pages):
                continue
            return s
    return None


def _span_forbidden(geo: PlacementGeometry, s: int, L: int, block_pages: bool) -> bool:
    return any(geo.forbidden(p, block_pages=block_pages) for p in range(s, s + L))


def build_prompt(tokenizer: Any, target_tokens: int, *, geometry: PlacementGeometry, num_keys: int = 3,
                 seed: int = 0, tag: str = "gate", tail: int = 1, block_pages: bool = True) -> Prompt:
    """A deterministic buried-key prompt of ``floor(target/C)*C + tail`` tokens."""
    if num_keys < 1:
        raise ValueError("need at least one key")
    C = geometry.chunk
    full = target_tokens // C
    if full < 1:
        raise ValueError(f"target {target_tokens} is shorter than one chunk ({C})")
    if not 1 <= tail < C:
        raise ValueError("tail must be in [1, chunk)")
    T = full * C + tail
    restorable = full * C

    labels = [f"{chr(ord('A') + i % 26)}{i // 26 or ''}" for i in range(num_keys)]
    keys = [make_key(seed, tag, target_tokens, i) for i in range(num_keys)]
    if len(set(keys)) != num_keys:  # pragma: no cover - sha256 collision
        raise ValueError("duplicate keys")

    # The unique tag comes first, so prompts of different lengths share no leading block
    # (a shared block would be a local prefix-cache hit and lower the external hits).
    system = f"[probe {tag}/{target_tokens}/{seed}] {SYSTEM_PROMPT}"
    header = (f"The log below hides {num_keys} vault access keys; each "
              f"is the letters K- followed by 24 hexadecimal digits.\n<log>\n")
    question = (f"\n</log>\nList every vault access key that appears in the log, in order of appearance, one "
                f"per line, exactly as written. Output only the {num_keys} keys.")
    head_text, tail_text = tokenizer.chat_frame(system, header, question)
    head_ids = tokenizer.encode(head_text)
    tail_ids = tokenizer.encode(tail_text)
    body_len = T - len(head_ids) - len(tail_ids)
    if body_len <= 0:
        raise ValueError(f"target {target_tokens} leaves no room for the body")

    sentences = []
    for label, key in zip(labels, keys):
        pre, k, post = key_sentence(label, key)
        pre_ids, k_ids, post_ids = tokenizer.encode(pre), tokenizer.encode(k), tokenizer.encode(post)
        sentences.append((pre_ids + k_ids + post_ids, len(pre_ids)))
    head = len(head_ids)
    body_end = T - len(tail_ids)
    starts = _key_slots(geometry, T, restorable, head, body_end, [len(s) for s, _ in sentences], block_pages)

    # Fill left to right; keys are reported in order of appearance.
    order = sorted(range(num_keys), key=lambda i: starts[i])
    filler = filler_ids(tokenizer, body_len, seed)
    ids = list(head_ids)
    fpos = 0
    slots: list[KeySlot] = []
    for i in order:
        s = starts[i]
        gap = s - len(ids)
        ids += filler[fpos:fpos + gap]
        fpos += gap
        sent, pre_len = sentences[i]
        ids += sent
        slots.append(KeySlot(index=i, key=keys[i], label=labels[i], start=s, end=s + len(sent),
                             key_start=s + pre_len, chunk=s // C,
                             block=s // geometry.block, offset_in_chunk=s % C, offset_in_block=s % geometry.block,
                             depth=round(s / T, 4)))
    gap = body_end - len(ids)
    if gap < 0:  # pragma: no cover - guarded by placement bounds
        raise ValueError("body overflow")
    ids += filler[fpos:fpos + gap]
    ids += tail_ids
    if len(ids) != T:  # pragma: no cover
        raise AssertionError(f"built {len(ids)} tokens, wanted {T}")
    p = Prompt(target_tokens=target_tokens, ids=ids, keys=slots, geometry=geometry, head_len=head,
               tail_len=len(tail_ids), restorable_tokens=restorable, tokenizer=getattr(tokenizer, "name", "?"),
               seed=seed, tag=tag)
    p.sha256 = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()
    return p


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def placement_violations(prompt: Prompt, geo: PlacementGeometry | None = None, *,
                         tokenizer: Any = None, block_pages: bool = True) -> list[str]:
    """Why the prompt's key placement is unsafe for ``geo`` (default: its own geometry)."""
    geo = geo or prompt.geometry
    T = prompt.num_tokens
    restorable = (T - 1) // geo.chunk * geo.chunk
    out: list[str] = []
    seen: set[str] = set()
    for s in prompt.keys:
        if s.key in seen:
            out.append(f"key {s.key} is not unique")
        seen.add(s.key)
        if not KEY_RE.fullmatch(s.key):
            out.append(f"key {s.key!r} is not K-<24 hex>")
        if s.start // geo.chunk != (s.end - 1) // geo.chunk:
            out.append(f"key {s.index} spans chunks {s.start // geo.chunk}..{(s.end - 1) // geo.chunk}")
        if s.end > restorable:
            out.append(f"key {s.index} ends at {s.end}, past the restorable prefix {restorable}")
        if s.start < prompt.head_len or s.end > T - prompt.tail_len:
            out.append(f"key {s.index} overlaps the header or the question")
        if geo.page < geo.block or geo.blocks_per_chunk > 1:
            bad = [p for p in range(s.start, s.end) if geo.forbidden(p, block_pages=block_pages)]
            if bad:
                out.append(f"key {s.index} touches a first kernel page (token {bad[0]}, page {geo.page}, "
                           f"block {geo.block}, chunk {geo.chunk})")
        if tokenizer is not None:
            text = tokenizer.decode(prompt.ids[s.start:s.end])
            if s.key not in text:
                out.append(f"key {s.index} not recoverable from its span: {text!r}")
    if tokenizer is not None:
        full = tokenizer.decode(prompt.ids)
        for s in prompt.keys:
            if full.count(s.key) != 1:
                out.append(f"key {s.key} occurs {full.count(s.key)} times in the decoded prompt")
    return out


def extract_keys(text: str) -> list[str]:
    return KEY_RE.findall(text or "")


def score_answer(expected: Sequence[str], text: str) -> dict[str, Any]:
    """Exact-key score: every expected key present verbatim, nothing key-shaped that is wrong."""
    found = extract_keys(text)
    shaped = KEY_ANY_RE.findall(text or "")
    missing = [k for k in expected if k not in found]
    spurious = sorted({k for k in shaped if k not in expected})
    return {"expected": list(expected), "found": found, "missing": missing, "spurious": spurious,
            "all_exact": not missing and not spurious, "num_correct": len(expected) - len(missing)}
