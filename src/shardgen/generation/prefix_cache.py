"""A rank's prefix cache: the KV of finished sequences, kept so that a later prompt that extends
one (the next turn of a conversation: the prompt, the answer, the tool's reply) or shares a
prefix with one (a system prompt, a few-shot header) prefills only the rest.

No ``torch.distributed``; the driver thread only. Each rank keeps its own, with no agreement
across ranks: a hit only changes how many columns this rank's next prefill computes, which the
tick carries as that forward's shape, as it carries every shape.

Entries are whole sequences, least recently used first out, bounded in tokens
(``EngineConfig.prefix_cache_tokens``). A lookup walks the prompt in blocks of ``BLOCK`` tokens
through a chain of block hashes (vLLM's prefix-caching key: a block's hash folds in its
predecessor's), so it costs one pass over the prompt whatever the number of entries, then
extends the deepest match token by token. The KV of a token depends only on the tokens before
it and its position, and a row's positions count from its first real token, so an entry's
columns serve any row whose prompt starts with the same tokens, at any column of any batch.

A prefix shared with an entry is served from a whole block on (a shorter common prefix, a few
template tokens two unrelated prompts open with, is not worth a lookup), but a prompt that
extends a whole entry (the next turn of its conversation) is served whatever the entry's length:
an entry shorter than a block (a short first turn) has no block hash, and is found by its tokens.

An image row's tokens are its cache keys (``SeqState.cache_keys``): its image tokens salted by
their image's digest (``images.py``), since their KV and every later token's depend on the
pixels; the scheduler lowers a match that would end inside an image to the image's start.

The weights may change while the engine is paused (a training step), or whenever the model's
``train()``/``eval()`` mode changes: the scheduler then drops every entry (``clear``), so no KV
computed by other weights is ever served.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

#: Tokens per hashed block: prompts share a prefix in whole blocks before the token-by-token
#: extension (a shorter common prefix is not worth a lookup; a shorter whole entry is).
BLOCK = 16

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per decoder layer: keys and values ``[kv_heads, L, head_dim]`` of one sequence."""


@dataclass(eq=False)  # identity: entries are keys of the block index
class Entry:
    """One kept sequence: its tokens (their cache keys) and their KV (column j holds token j's keys
    and values)."""

    tokens: tuple[Hashable, ...]
    kv: KV
    hashes: list[int] = field(default_factory=list)  # its blocks' chain hashes, for the index

    def __len__(self) -> int:
        return len(self.tokens)


def _chain(tokens: Sequence[Hashable], blocks: int) -> list[int]:
    """The chain hashes of the first ``blocks`` whole blocks of ``tokens``."""
    out, h = [], 0
    for b in range(blocks):
        h = hash((h, tuple(tokens[b * BLOCK : (b + 1) * BLOCK])))
        out.append(h)
    return out


class PrefixCache:
    """Finished sequences' KV on one rank, at most ``capacity`` tokens in all (0: off)."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 0, capacity
        self.capacity = capacity
        self.tokens = 0  # tokens held now
        self.evictions = 0
        self._lru: OrderedDict[tuple[Hashable, ...], Entry] = OrderedDict()  # least recent first
        self._index: dict[int, Entry] = {}  # block chain hash -> the latest entry holding it
        self._short: Counter[int] = Counter()  # lengths of the entries shorter than a block

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes(self) -> int:
        """Bytes of the KV held (keys and values, every layer)."""
        return sum(k.numel() * k.element_size() * 2 for e in self._lru.values() for k, _ in e.kv)

    def match(self, prompt: Sequence[Hashable]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` and that prefix's length, at most
        ``len(prompt) - 1`` (the last prompt token is always computed: its logits give the first
        token): a whole block or more of any entry, or the whole of an entry shorter than a block.
        ``(None, 0)`` for no match. Pure: the order of use changes in ``touch``."""
        if not self._lru or len(prompt) < 2:
            return None, 0
        best, depth, h = None, 0, 0
        for b in range((len(prompt) - 1) // BLOCK):
            h = hash((h, tuple(prompt[b * BLOCK : (b + 1) * BLOCK])))
            e = self._index.get(h)
            if e is None:
                break
            best, depth = e, (b + 1) * BLOCK
        if best is None:
            return self._short_match(prompt)
        if tuple(prompt[:depth]) != best.tokens[:depth]:  # a hash collision
            return None, 0
        most = min(len(best), len(prompt) - 1)
        n = depth
        while n < most and best.tokens[n] == prompt[n]:
            n += 1
        return best, n

    def _short_match(self, prompt: Sequence[Hashable]) -> tuple[Entry | None, int]:
        """The longest entry shorter than a block that ``prompt`` extends, and its length."""
        for n in sorted((n for n in self._short if n < len(prompt)), reverse=True):
            e = self._lru.get(tuple(prompt[:n]))
            if e is not None:
                return e, n
        return None, 0

    def touch(self, entry: Entry) -> None:
        """``entry`` was used: the last to be evicted."""
        if self._lru.get(entry.tokens) is entry:
            self._lru.move_to_end(entry.tokens)

    def keeps(self, length: int) -> bool:
        """Whether ``add`` keeps a sequence of ``length`` tokens: within the bound (asked before the
        KV is copied out). Short ones too: a short first turn's next turn extends it."""
        return 0 < length <= self.capacity

    def refresh(self, tokens: Sequence[Hashable]) -> bool:
        """Whether ``tokens`` are held already, and if so now the most recently used: ``add`` would
        keep no second copy, so the caller need not copy their KV out (a greedy group's samples,
        the same answer an epoch later)."""
        key = tuple(tokens)
        if key not in self._lru:
            return False
        self._lru.move_to_end(key)
        return True

    def add(self, tokens: Sequence[Hashable], kv: KV) -> None:
        """Keep ``tokens``' KV (``kv[l]``: ``[kv_heads, len(tokens), head_dim]`` each), evicting the
        least recently used entries to stay within ``capacity``. An entry of a block or more that is
        a prefix of the new one goes (the new one serves every prompt it served); a shorter one
        stays (a sibling turn, the same turn with another reply, shares under a block with the
        new one), until the bound pushes it out."""
        key = tuple(tokens)
        if not self.keeps(len(key)) or self.refresh(key):
            return
        entry = Entry(key, kv, _chain(key, len(key) // BLOCK))
        for h in entry.hashes:  # entries this one extends (the previous turn of its conversation)
            old = self._index.get(h)
            if old is not None and len(old) < len(entry) and key[: len(old)] == old.tokens:
                self._remove(old)
        while self._lru and self.tokens + len(key) > self.capacity:
            self._remove(next(iter(self._lru.values())))
            self.evictions += 1
        self._lru[key] = entry
        self.tokens += len(key)
        if len(key) < BLOCK:
            self._short[len(key)] += 1
        for h in entry.hashes:
            self._index[h] = entry

    def clear(self) -> int:
        """Drop every entry (the weights may have changed); the entries dropped."""
        n = len(self._lru)
        self._lru.clear()
        self._index.clear()
        self._short.clear()
        self.tokens = 0
        return n

    def _remove(self, entry: Entry) -> None:
        if self._lru.pop(entry.tokens, None) is None:
            return
        self.tokens -= len(entry)
        if len(entry) < BLOCK:
            self._short[len(entry)] -= 1
            if not self._short[len(entry)]:
                del self._short[len(entry)]
        lost = set()
        for h in entry.hashes:
            if self._index.get(h) is entry:
                del self._index[h]
                lost.add(h)
        # A block another entry also holds (a shared system prompt) points at the latest holder
        # left: the most recent first, until every lost block has one or none is left.
        for other in reversed(self._lru.values()):
            if not lost:
                break
            for h in other.hashes:
                if h in lost:
                    self._index[h] = other
                    lost.discard(h)
