"""What each replica most likely holds: an approximate, capacity-bounded prefix index.

``PrefixIndex`` is the interface the picker reads and writes. ``LearnedIndex`` learns from
the router's own decisions: a request sent to replica r is assumed to leave its prompt's
chunks in r's prefix cache. Each replica's entries form an LRU bounded by that replica's KV
capacity in chunks, so the index forgets what vLLM has most likely evicted: vLLM frees a
finished request's blocks tail first into an LRU free queue and evicts from its head, so
a prompt's chunks are touched last-to-first and its shared head is the last to go. A second
source, vLLM's KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared), can drive
the same interface later through ``record``/``forget``/``clear``.

A plain data structure: no I/O, no clock, no threads (the picker calls it from one loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Protocol

from extproc.pick.choice.ghosts import GhostList
from extproc.pick.choice.state import IndexStats

# Memory per entry (an int in the owner map, a node in one replica's LRU), measured with
# tracemalloc on CPython 3.11 (tests/test_pick_core.py checks the estimate stays close).
BYTES_PER_ENTRY: Final = 200


class PrefixIndex(Protocol):
    def match(self, chunks: Sequence[int]) -> dict[str, int]:
        """Replica -> how many leading chunks of ``chunks`` it holds (only replicas with >= 1)."""
        ...

    def record(self, address: str, chunks: Sequence[int]) -> None:
        """``address`` now holds ``chunks`` (most recently used)."""
        ...

    def forget(self, address: str, chunks: Iterable[int]) -> None:
        """``address`` no longer holds these chunks (KV events: BlockRemoved)."""
        ...

    def clear(self, address: str) -> None:
        """``address`` holds nothing (it left, restarted, or reset its prefix cache)."""
        ...

    def remove(self, address: str) -> None:
        """``address`` left the endpoints: forget it and free its slot."""
        ...

    def set_capacity(self, address: str, chunks: int) -> None: ...

    def capacity(self, address: str) -> int: ...

    def holds(self, address: str) -> list[int]:
        """``address``'s chunks, least recently used first (``/debug/state``)."""
        ...

    def load(self, holdings: Mapping[str, Sequence[int]]) -> None:
        """Replace the contents with a saved ``holds`` per replica (``explain --state``)."""
        ...

    def stats(self) -> IndexStats: ...

    def eviction_price(self, address: str) -> float:
        """The share of the replica's recent evictions that came back (extproc.pick.choice.ghosts)."""
        ...


class LearnedIndex:
    """Per-replica LRU of chained chunk hashes plus, per hash, a bit mask of its holders."""

    def __init__(self, max_chunks: int = 2_000_000, default_capacity: int = 0) -> None:
        self.max_chunks = max_chunks  # over all replicas
        self.default_capacity = default_capacity  # per replica, when its KV size is unknown
        self._bit: dict[str, int] = {}
        self._name: dict[int, str] = {}
        self._owners: dict[int, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}
        self._ghosts: dict[str, GhostList] = {}  # what each replica's evictions cost

    # --- reads -------------------------------------------------------------------------
    def match(self, chunks: Sequence[int]) -> dict[str, int]:
        return leading_runs(chunks, self._owners, self._name)

    def holds(self, address: str) -> list[int]:
        """``address``'s chunks, least recently used first (for the debug state)."""
        return list(self._lru.get(address, ()))

    def addresses(self) -> list[str]:
        return list(self._bit)

    def capacity(self, address: str) -> int:
        cap = self._capacity.get(address) or self.default_capacity or self.max_chunks
        share = self.max_chunks // max(len(self._bit), 1)
        return max(1, min(cap, share))

    def eviction_price(self, address: str) -> float:
        ghosts = self._ghosts.get(address)
        return ghosts.price() if ghosts is not None else 0.0

    def stats(self) -> IndexStats:
        entries = sum(len(lru) for lru in self._lru.values())
        return IndexStats(entries, len(self._owners), entries * BYTES_PER_ENTRY)

    # --- writes ------------------------------------------------------------------------
    def _slot(self, address: str) -> int:
        bit = self._bit.get(address)
        if bit is None:
            used = 0
            for b in self._bit.values():
                used |= b
            bit = (used + 1) & ~used  # lowest free bit
            self._bit[address] = bit
            self._name[bit] = address
            self._lru[address] = OrderedDict()
            self._ghosts[address] = GhostList()
            for other in self._bit:  # each replica's share of max_chunks just shrank
                self._trim(other)
        return bit

    def record(self, address: str, chunks: Sequence[int]) -> None:
        bit = self._slot(address)
        lru = self._lru[address]
        owners = self._owners
        touch = lru.move_to_end
        ghosts = [g for g in self._ghosts.values() if g.ghosts]  # evictions anywhere come back here too
        for h in reversed(chunks):  # the head ends most recent: vLLM evicts a prompt tail first
            if h in lru:
                touch(h)
            else:
                lru[h] = None
                for g in ghosts:
                    g.stored(h)
                held = owners.get(h, 0)
                owners[h] = held | bit if held else bit  # alone: share the replica's int, not a new one
        self._trim(address)

    def _drop(self, h: int, bit: int) -> None:
        left = self._owners.get(h, 0) & ~bit
        if left:
            self._owners[h] = left
        else:
            self._owners.pop(h, None)

    def _trim(self, address: str) -> None:
        lru, bit, cap = self._lru[address], self._bit[address], self.capacity(address)
        evicted = self._ghosts[address].evicted
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            self._drop(h, bit)
            evicted(h)

    def forget(self, address: str, chunks: Iterable[int]) -> None:
        if address not in self._bit:
            return
        lru, bit = self._lru[address], self._bit[address]
        for h in chunks:
            if lru.pop(h, 0) is None:
                self._drop(h, bit)

    def clear(self, address: str) -> None:
        if address in self._bit:
            self.forget(address, list(self._lru[address]))
            self._ghosts[address].clear()

    def remove(self, address: str) -> None:
        """Forget a replica that left the endpoints (its bit is reused by the next one)."""
        self.clear(address)
        self._name.pop(self._bit.pop(address, 0), None)
        self._lru.pop(address, None)
        self._capacity.pop(address, None)
        self._ghosts.pop(address, None)

    def set_capacity(self, address: str, chunks: int) -> None:
        self._slot(address)
        if self._capacity.get(address) != chunks:
            self._capacity[address] = chunks
            self._ghosts[address].resize(self.capacity(address))
            self._trim(address)

    def load(self, holdings: Mapping[str, Sequence[int]]) -> None:
        """Replace the contents (``explain --state``): replica -> chunks, least recent first."""
        for address in list(self._bit):
            self.remove(address)
        for address, chunks in holdings.items():
            self.record(address, list(reversed(chunks)))


def leading_runs(hashes: Sequence[int], owners: Mapping[int, int], name: Mapping[int, str]) -> dict[str, int]:
    """Replica -> how many leading ``hashes`` it holds (only replicas with >= 1), where
    ``owners`` maps a hash to a bit mask of its holders and ``name`` a bit to a replica."""
    out: dict[str, int] = {}
    alive = 0  # replicas holding every hash so far, as bits
    get = owners.get
    for depth, h in enumerate(hashes):
        now = get(h, 0) & alive if depth else get(h, 0)
        if now != alive:
            for bit in _bits(alive & ~now):
                out[name[bit]] = depth
            if not now:
                break
            alive = now
    else:
        for bit in _bits(alive):
            out[name[bit]] = len(hashes)
    return out


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low
