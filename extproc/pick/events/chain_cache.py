"""Own block hashes of a request's tokens, remembering the chains of prefixes hashed before.

Precise mode hashes every block of every request (``block_hashes``, ~0.2 us a block:
about 200 us for a 32 KB prompt), yet most of a request is a prefix seen before (a system
prompt, the history of a conversation). Chains are remembered at every ``span`` blocks (a
boundary), each under a fingerprint of all the tokens before it (xxh3-128 of their bytes, so
equal fingerprints mean an equal prefix). A request probes its boundaries from the deepest
down: the first one found gives every hash up to it in one list slice, and only the blocks
after it are hashed. The probes are C-level hashes of a prefix of the request's own bytes
(~1.4 us for 17,000 tokens) and a request usually differs from a known one in its last span
only, so a warm request costs a probe or two and the hashing of its new blocks, with no
per-span Python loop. A request whose ids the prompt memo resumed from an earlier prompt's
(prompt_memo.py) says so (``known``): that prompt's chain, kept by the identity of its ids while
they live, gives every hash up to where the two agree, with no probe at all (a conversation's
next turn, a new question on a system prompt: only its own new blocks are hashed). Exact by
construction (tests/test_kv_index.py checks cached == uncached); pure, no clock, no I/O.
"""

from __future__ import annotations

import weakref
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final, TypeAlias

import xxhash

from extproc.pick.events.block_hashes import block_hashes, request_extra_keys
from extproc.pick.tokens.id_run import IdRun

Ids: TypeAlias = "array[int] | IdRun"  # a request's ids, known by their identity

SPAN_BLOCKS: Final = 32
MAX_OWNED: Final = 4096  # chains kept by the identity of their request's ids
_Keys: TypeAlias = tuple[int, str | None, str | None]  # (block size, cache_salt, LoRA name): what a chain is keyed by


class ChainCache:
    """``hashes(tokens, block_size, salt)`` == ``block_hashes`` of them with the request's extra keys,
    as an ``array('Q')``: a prefix is served by one memory copy, where a list would touch each of
    its int objects (cold in memory, ~10 us for 1,000 of them). The array returned is shared with
    the cache: callers read it, never change it.
    ``hits`` counts spans served from the cache, ``misses`` spans hashed.
    """

    def __init__(self, max_spans: int = 20_000, span: int = SPAN_BLOCKS) -> None:
        self.max_hashes = max_spans * span  # hashes the remembered chains may hold (~40 bytes each)
        self.span = span
        # (fingerprint, boundary, bytes hashed) -> a chain at least that long; many boundaries
        # share one chain list, counted once in ``held`` (per list: its length and boundaries).
        self._chains: OrderedDict[tuple[int, int, int], array[int]] = OrderedDict()
        self._lists: dict[int, list[int]] = {}  # id(chain) -> [boundaries referring to it, its length]
        self.held = 0
        self.hits = 0
        self.misses = 0
        # id(a request's ids) -> (a weak reference to them, (block size, salt, LoRA) -> their chain)
        self._owned: OrderedDict[int, tuple[weakref.ref[Ids], dict[_Keys, array[int]]]] = OrderedDict()

    def hashes(self, tokens: Sequence[int] | IdRun, block_size: int, cache_salt: str | None = None,
               known: tuple[Ids, int] | None = None, own: Ids | None = None, blocks: int | None = None,
               lora_name: str | None = None) -> array[int]:
        """``known``: (an earlier request's ids, n): ``tokens`` begin with the first n of them;
        ``own``: this request's ids (``tokens``, or ids they are the first of), for later ``known``;
        ``blocks``: hash only the first ``blocks`` full blocks (default: all), so a caller leaving out
        the last one need not copy a prefix of ``tokens``; ``lora_name``: the LoRA adapter the request
        runs (its name is in every block's extra keys, as vLLM's)."""
        key = (block_size, cache_salt, lora_name)
        full = len(tokens) // block_size
        blocks = full if blocks is None else min(blocks, full)
        out = self._known(tokens, block_size, key, known, blocks) if known is not None else None
        if out is None:
            out = self._probed(tokens, block_size, cache_salt, blocks, lora_name)
        if own is not None:
            self._own(own, key, out)
        return out

    def _known(self, tokens: Sequence[int] | IdRun, block_size: int, key: _Keys,
               known: tuple[Ids, int], blocks: int) -> array[int] | None:
        """The chain from the earlier request's, or None if this cache no longer holds it."""
        base, n = known
        entry = self._owned.get(id(base))
        chain = entry[1].get(key) if entry is not None and entry[0]() is base else None
        if chain is None:
            return None
        have = min(len(chain), n // block_size, blocks)
        # the caller's word, checked on one block
        if not have or _range(tokens, (have - 1) * block_size, have * block_size) != _range(
                base, (have - 1) * block_size, have * block_size):
            return None
        self._owned.move_to_end(id(base))
        out = chain[:have]
        if blocks > have:
            out.extend(block_hashes(_range(tokens, have * block_size, blocks * block_size), block_size,
                                    _later(blocks - have, key[2]), out[-1]))
        return out

    def _own(self, ids: Ids, key: _Keys, chain: array[int]) -> None:
        at = id(ids)
        entry = self._owned.get(at)
        if entry is None or entry[0]() is not ids:
            owned = self._owned
            entry = (weakref.ref(ids, lambda _: owned.pop(at, None)), {})  # gone with the ids
            owned[at] = entry
            if len(owned) > MAX_OWNED:
                owned.popitem(last=False)
        else:
            self._owned.move_to_end(at)
        entry[1][key] = chain

    def _probed(self, tokens: Sequence[int] | IdRun, block_size: int, cache_salt: str | None,
                blocks: int, lora_name: str | None = None) -> array[int]:
        if isinstance(tokens, IdRun):
            tokens = tokens.array()
        spans = blocks // self.span
        extra = request_extra_keys(blocks, cache_salt, lora_name) if cache_salt or lora_name else None
        if not spans:
            return array("Q", block_hashes(tokens[: blocks * block_size], block_size, extra))
        whole = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
        view = memoryview(whole).cast("B")
        step = self.span * block_size * 4
        salt = cache_salt.encode("utf-8", "surrogatepass") + b"\x00" if cache_salt else b""
        if lora_name:  # a fingerprint no salt alone can give: the LoRA after a byte a salt never ends in
            salt += b"\x01" + lora_name.encode("utf-8", "surrogatepass") + b"\x00"
        keys: list[tuple[int, int, int]] = []  # the boundaries probed and not found, deepest first
        found, chain = 0, None
        for m in range(spans, 0, -1):
            key = self._key(view, m * step, block_size, salt)
            chain = self._chains.get(key)
            if chain is not None:
                self._chains.move_to_end(key)
                found = m
                break
            keys.append(key)
        self.hits += found
        self.misses += spans - found
        first = found * self.span
        if chain is None:
            out = array("Q", block_hashes(whole[: blocks * block_size], block_size, extra))
        else:
            out = chain[:first]
            if blocks > first:
                out.extend(block_hashes(whole[first * block_size: blocks * block_size], block_size,
                                        _later(blocks - first, lora_name), out[-1]))
        if found < spans:  # boundaries past the one found are new: remember them on this chain
            self._remember(out, keys)
        return out

    @staticmethod
    def _key(view: memoryview, size: int, block_size: int, salt: bytes) -> tuple[int, int, int]:
        if salt:
            h = xxhash.xxh3_128(salt, seed=block_size)
            h.update(view[:size])
            return h.intdigest(), size, len(salt)
        return xxhash.xxh3_128_intdigest(view[:size], seed=block_size), size, 0

    def _remember(self, chain: array[int], keys: list[tuple[int, int, int]]) -> None:
        chains, lists = self._chains, self._lists
        entry = lists.setdefault(id(chain), [0, len(chain)])
        if not entry[0]:
            self.held += len(chain)
        for key in keys:
            old = chains.pop(key, None)
            if old is not None:
                self._drop(old)
            chains[key] = chain
            entry[0] += 1
        while self.held > self.max_hashes and chains:
            self._drop(chains.popitem(last=False)[1])

    def _drop(self, chain: array[int]) -> None:
        entry = self._lists[id(chain)]
        entry[0] -= 1
        if not entry[0]:
            del self._lists[id(chain)]
            self.held -= entry[1]


def _later(n_blocks: int, lora_name: str | None) -> list[tuple[str, ...]] | None:
    """The extra keys of blocks after the first: the LoRA's name on each (the salt is block 0's alone)."""
    return [(lora_name,)] * n_blocks if lora_name else None


def _range(tokens: Sequence[int] | IdRun, start: int, stop: int) -> Sequence[int]:
    return tokens.range(start, stop) if isinstance(tokens, IdRun) else tokens[start:stop]
