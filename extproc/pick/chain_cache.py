"""Own block hashes of a request's tokens, remembering the spans of prefixes hashed before.

Precise mode hashes every block of every request (``kv_index.block_hashes``, ~0.2 us a block:
about 200 us for a 32 KB prompt), yet most of a request is a prefix seen before (a system
prompt, the history of a conversation). The tokens are fingerprinted at every ``span`` blocks
with one streaming xxh3 (a fingerprint covers everything before it, so equal fingerprints mean
an equal prefix), and the hashes of each span are kept under its fingerprint in a bounded LRU:
a request hashes only the spans it does not share with an earlier one. Exact by construction
(tests/test_kv_index.py checks cached == uncached); pure, no clock, no I/O.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

import xxhash

from extproc.pick.kv_index import ROOT, block_hashes, request_extra_keys

SPAN_BLOCKS: Final = 32


class ChainCache:
    """``hashes(tokens, block_size, salt)`` == ``block_hashes`` of them with the request's extra keys."""

    def __init__(self, max_spans: int = 20_000, span: int = SPAN_BLOCKS) -> None:
        self.max_spans = max_spans  # about 1.3 KB a span of 32 blocks
        self.span = span
        self._spans: OrderedDict[tuple[int, int], tuple[int, ...]] = OrderedDict()
        self.hits = 0  # spans served from the cache
        self.misses = 0  # spans hashed

    def hashes(self, tokens: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
        blocks = len(tokens) // block_size
        if blocks < self.span:
            return block_hashes(tokens[: blocks * block_size], block_size,
                                request_extra_keys(blocks, cache_salt, None) if cache_salt else None)
        whole = tokens if isinstance(tokens, array) else array("I", tokens)
        raw = whole[: blocks * block_size].tobytes()
        step = self.span * block_size * 4
        prints = xxhash.xxh3_64(seed=block_size)
        if cache_salt:
            prints.update(cache_salt.encode("utf-8", "surrogatepass") + b"\x00")
        out: list[int] = []
        parent = ROOT
        for start in range(0, (blocks // self.span) * step, step):
            prints.update(raw[start:start + step])
            key = (prints.intdigest(), len(out))
            cached = self._spans.get(key)
            if cached is None:
                first = len(out)
                extra = request_extra_keys(self.span, cache_salt, None) if cache_salt and not first else None
                cached = tuple(block_hashes(tokens[first * block_size:(first + self.span) * block_size], block_size,
                                            extra, parent))
                self._store(key, cached)
                self.misses += 1
            else:
                self._spans.move_to_end(key)
                self.hits += 1
            out.extend(cached)
            parent = cached[-1]
        tail = blocks - len(out)
        if tail:
            out.extend(block_hashes(tokens[len(out) * block_size: blocks * block_size], block_size, None, parent))
        return out

    def _store(self, key: tuple[int, int], value: tuple[int, ...]) -> None:
        self._spans[key] = value
        while len(self._spans) > self.max_spans:
            self._spans.popitem(last=False)
