"""vLLM v1 prefix (KV) cache model: pure data structures, no I/O, no clock.

Semantics copied from vLLM v1 (see docs/simulator.md, "Cache semantics"):

* KV memory is ``num_blocks`` blocks of ``block_size`` tokens. Block 0 is the reserved
  "null block" as in vLLM, so ``num_blocks - 1`` blocks are usable and
  ``usage = 1 - free / (num_blocks - 1)``.
* Only full blocks are hashed. Hash of block i = H(hash of block i-1, token ids of block
  i); the first block's parent is a root hash over the *extra keys* (the model or LoRA adapter
  the request names and ``cache_salt``), so a salt, a model or an adapter isolates a whole chain.
* Lookup = longest run of consecutive cached blocks from the start, over at most
  ``(num_tokens - 1) // block_size`` blocks: at least one prompt token is always computed
  (vLLM recomputes the last token to get logits, rounded down to whole blocks).
* Free blocks sit in an LRU queue. A finished request frees its blocks tail first (so
  the tail of a prompt is evicted before its head). New blocks are taken from the queue
  head; taking a block that still has a hash evicts it from the cache map. A cache hit
  pulls a free block out of the queue (ref count 0 -> 1). Blocks with ref count > 0 are
  never evicted; when there are not enough free blocks, allocation fails and the caller
  (the scheduler) keeps the request waiting.
* Full blocks are registered in the cache map when they are *scheduled* (vLLM caches
  blocks in ``allocate_slots``), including blocks filled by generated tokens.

KV-cache events (vLLM's ``BlockPool`` with ``enable_kv_cache_events``): an optional
``listener`` (:class:`KvEventListener`, e.g. :class:`routerlab.sim.kv_events.KvEventPublisher`)
hears ``stored(...)`` once per newly cached contiguous run of one request's blocks (its token
ids, the parent block's hash or None at block 0, the per-block extra keys, the adapter's id and name),
``removed([hash])`` for every cached block evicted because it is reused, and ``cleared()`` on
:meth:`KVCache.reset`. A prefix-cache hit announces nothing. The cache only calls the
listener; batching per engine step and all I/O belong to the caller.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import xxhash

_hash = xxhash.xxh3_64_intdigest


def root_hash(extra_keys: bytes) -> int:
    """Parent hash of a chain's first block: carries model name, cache_salt, ..."""
    return _hash(b"prefix-router-sim-root\x00" + extra_keys)


def extra_keys(model: str, cache_salt: str | None, lora_path: str | None = None) -> bytes:
    """Extra keys of a request's first block: the model the request names (a LoRA adapter's name
    for an adapter, so adapters never share blocks), the optional salt and, for an adapter, its
    path (vLLM 0.32 hashes ``("lora", name, path)``: an adapter re-loaded from elsewhere starts cold)."""
    keys = model.encode("utf-8") + b"\x00" + (cache_salt or "").encode("utf-8") + (
        b"\x01" if cache_salt is not None else b"\x00"
    )
    return keys if lora_path is None else keys + b"\x02" + lora_path.encode("utf-8")


def extend_block_hashes(
    hashes: list[int], tokens: Sequence[int], block_size: int, root: int
) -> list[int]:
    """Append hashes for every newly completed full block of ``tokens`` to ``hashes``."""
    full = len(tokens) // block_size
    start = len(hashes)
    if full <= start:
        return hashes
    raw = np.asarray(tokens[start * block_size : full * block_size], dtype=np.int64).tobytes()
    parent = hashes[-1] if hashes else root
    step = block_size * 8
    for i in range(full - start):
        parent = _hash(parent.to_bytes(8, "little") + raw[i * step : (i + 1) * step])
        hashes.append(parent)
    return hashes


def block_hashes(tokens: Sequence[int], block_size: int, root: int) -> list[int]:
    """Chained hashes of all full blocks of ``tokens``."""
    return extend_block_hashes([], tokens, block_size, root)


class KvEventListener(Protocol):
    """What a :class:`KVCache` reports (the hook API of ``KvEventPublisher``)."""

    def stored(self, block_hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int],
               block_size: int, extra_keys: Sequence[Any] | None = None, lora_id: int | None = None,
               lora_name: str | None = None) -> None: ...

    def removed(self, block_hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


def block_extra_keys(first_block: int, n: int, cache_salt: str | None,
                     lora_name: str | None = None) -> list[tuple[str, ...] | None]:
    """vLLM's per-block extra keys of a text-only request as its events carry them: the adapter's
    name on every block, then ``cache_salt`` on block 0; None for a block with neither."""
    lora: tuple[str, ...] = (lora_name,) if lora_name else ()
    first = lora + ((cache_salt,) if cache_salt else ())
    return [(first if first_block + i == 0 else lora) or None for i in range(n)]


class Block:
    """One KV block: id, reference count, hash when full and cached, LRU links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "owner", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.owner = ""  # the tenant whose request computed the cached block (a simulator diagnostic)
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked LRU queue of free blocks: O(1) popleft, append and remove."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self._len += 1

    def prepend(self, blocks: Sequence[Block]) -> None:
        """Put ``blocks`` at the head, in order (``blocks[0]`` becomes the first evicted)."""
        for block in reversed(blocks):
            first = self._head.next
            assert first is not None
            self._head.next = block
            block.prev = self._head
            block.next = first
            first.prev = block
            self._len += 1

    def popleft(self) -> Block:
        first = self._head.next
        if first is None or first is self._tail:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, "block not in free queue"
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class KVCache:
    """Block pool + prefix cache map + per-request block tables."""

    def __init__(self, num_blocks: int, block_size: int, listener: KvEventListener | None = None) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[0].ref_cnt = 1  # null block, never allocated
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[int, dict[int, Block]] = {}
        self.req_blocks: dict[str, list[Block]] = {}
        self._req_num_cached: dict[str, int] = {}
        self.evictions = 0
        self.listener = listener

    # ---- observation -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Free blocks (including cached blocks nobody holds)."""
        return len(self.free_queue)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_usable - self.num_free

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(d) for d in self.cached.values())

    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: fraction of usable blocks held by requests."""
        return 1.0 - self.num_free / self.num_usable

    def free_order(self) -> list[int]:
        """Block ids in eviction order (head first); for tests and debugging."""
        return [b.block_id for b in self.free_queue]

    # ---- lookup ------------------------------------------------------------------
    def longest_hit(self, hashes: Sequence[int], num_tokens: int) -> list[Block]:
        """Longest cached chain prefix, capped at ``(num_tokens - 1) // block_size`` blocks."""
        max_blocks = max(0, (num_tokens - 1) // self.block_size)
        hits: list[Block] = []
        cached = self.cached
        for h in hashes[:max_blocks]:
            found = cached.get(h)
            if not found:
                break
            hits.append(next(iter(found.values())))
        return hits

    # ---- allocation --------------------------------------------------------------
    def allocate(
        self,
        req_id: str,
        num_tokens: int,
        hashes: Sequence[int] = (),
        hit_blocks: Sequence[Block] = (),
        num_tokens_to_cache: int | None = None,
        owner: str = "",
        token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> bool:
        """Make the request hold blocks for ``num_tokens`` tokens (computed + scheduled).

        ``hit_blocks`` (only on admission) are the prefix hits from :meth:`longest_hit`;
        they are touched before new blocks are taken so they cannot be evicted by this
        very allocation. Returns False, changing nothing, if there are not enough free
        blocks. Full blocks up to ``num_tokens_to_cache`` are then registered in the cache.
        ``token_ids`` (the request's prompt + generated ids), ``cache_salt`` and the adapter
        (``lora_id``, ``lora_name``) are only read to tell the listener what was stored; with a
        listener, ``token_ids`` is required.
        """
        held = self.req_blocks.get(req_id)
        if held is None:
            held = []
        required = -(-num_tokens // self.block_size)
        num_new = max(0, required - len(held) - len(hit_blocks))
        touch_from_free = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new + touch_from_free > len(self.free_queue):
            return False
        if req_id not in self.req_blocks:
            self.req_blocks[req_id] = held
            self._req_num_cached[req_id] = len(hit_blocks)
        for b in hit_blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
        held.extend(hit_blocks)
        for _ in range(num_new):
            held.append(self._take_free_block())
        self._cache_full_blocks(
            req_id, held, hashes, num_tokens if num_tokens_to_cache is None else num_tokens_to_cache, owner,
            token_ids, cache_salt, lora_id, lora_name,
        )
        return True

    def _take_free_block(self) -> Block:
        b = self.free_queue.popleft()
        if b.block_hash is not None:
            h = b.block_hash
            self._drop_from_map(b)
            self.evictions += 1
            if self.listener is not None:
                self.listener.removed([h])  # vLLM: one BlockRemoved per evicted block
        b.ref_cnt = 1
        return b

    def _drop_from_map(self, b: Block) -> None:
        h = b.block_hash
        found = self.cached.get(h) if h is not None else None
        if found is not None:
            found.pop(b.block_id, None)
            if not found:
                del self.cached[h]  # type: ignore[arg-type]
        b.block_hash = None

    def _cache_full_blocks(
        self, req_id: str, held: list[Block], hashes: Sequence[int], num_tokens: int, owner: str,
        token_ids: Sequence[int] | None, cache_salt: str | None, lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        done = self._req_num_cached[req_id]
        full = min(num_tokens // self.block_size, len(hashes), len(held))
        if full <= done:
            return
        for i in range(done, full):
            b = held[i]
            if b.block_hash is None:
                h = hashes[i]
                b.block_hash = h
                b.owner = owner
                self.cached.setdefault(h, {})[b.block_id] = b
        self._req_num_cached[req_id] = full
        if self.listener is not None:
            # vLLM's cache_full_blocks: one BlockStored for the run [done, full) of this request
            if token_ids is None:
                raise ValueError("a KVCache with a listener needs the request's token_ids")
            bs = self.block_size
            self.listener.stored(
                list(hashes[done:full]), hashes[done - 1] if done > 0 else None,
                list(token_ids[done * bs : full * bs]), bs, block_extra_keys(done, full - done, cache_salt, lora_name),
                lora_id, lora_name,
            )

    def free(self, req_id: str) -> None:
        """Release a request's blocks, tail first, into the LRU free queue.

        As vLLM 0.32 does (seen against real vLLM, docs/fidelity.md): hashed blocks go to
        the tail, so they stay findable longest; blocks without a hash (a partial last
        block) go to the head and are reused first, since they can never be a hit.
        """
        held = self.req_blocks.pop(req_id, None)
        self._req_num_cached.pop(req_id, None)
        if not held:
            return
        unhashed: list[Block] = []
        for b in reversed(held):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    unhashed.append(b)
                else:
                    self.free_queue.append(b)
        if unhashed:
            self.free_queue.prepend(unhashed)

    def reset(self) -> int:
        """Forget every cached hash (like vLLM's /reset_prefix_cache); returns how many.

        Unlike vLLM this also works while requests run: their blocks stay allocated but
        are no longer findable.
        """
        n = 0
        for found in self.cached.values():
            for b in found.values():
                b.block_hash = None
                n += 1
        self.cached.clear()
        if self.listener is not None:
            self.listener.cleared()
        return n
