"""What an eviction costs on a replica: how much of what it evicts comes back (pure).

A replica whose KV is short evicts cached prefixes that later requests ask for again, so a prompt
computed there costs more than its own prefill: the blocks it pushes out are computed once more
when their owners return. A ghost list keeps the hashes a replica evicted last (as many as it
holds: the ghost of a cache twice its size) and counts those computed again, on any replica, while
remembered: the learned index counts a chunk recorded on a replica that did not hold it, the event
index a block stored where no replica held it.
The price is the share of evictions that came back, both counted with an exponential decay per
eviction (the last ``capacity`` or so weigh most): near 0 where the KV keeps what is asked again
(only finished conversations leave), towards 1 where every eviction is computed again. Both
indexes keep one per replica: the learned index from its own capacity-bounded LRU, the event
index from vLLM's BlockRemoved and BlockStored events.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 4096  # hashes a replica holds until its KV size is known
# The event index's blocks are 16 tokens: it remembers and counts one hash in 8 (the hashes are
# uniform, so the share is the same), an eighth of the memory and of the work on the ingest path.
BLOCK_SAMPLE_MASK = 7


class GhostList:
    """One replica's recently evicted hashes, and how many of its evictions came back."""

    __slots__ = ("capacity", "ghosts", "evictions", "returns", "sample_mask", "_keep")

    def __init__(self, capacity: int = DEFAULT_CAPACITY, sample_mask: int = 0) -> None:
        """``sample_mask``: the caller passes only the hashes ``h & sample_mask == 0`` (0: every one)."""
        self.ghosts: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0.0  # decayed count
        self.returns = 0.0  # decayed count of evicted hashes stored again while remembered
        self.sample_mask = sample_mask
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """Remember as many evicted hashes as the replica holds (its KV in chunks or blocks; of
        them, the sampled share)."""
        self.capacity = max(1, capacity // (self.sample_mask + 1))
        self._keep = 1.0 - 1.0 / self.capacity
        while len(self.ghosts) > self.capacity:
            self.ghosts.popitem(last=False)

    def evicted(self, h: int) -> None:
        keep = self._keep
        self.evictions = self.evictions * keep + 1.0
        self.returns *= keep
        ghosts = self.ghosts
        ghosts[h] = None
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def stored(self, h: int) -> None:
        """``h`` is stored again: a return if it was evicted lately."""
        if self.ghosts and self.ghosts.pop(h, 0) is None:
            self.returns += 1.0

    def price(self) -> float:
        """The share of the recent evictions that came back (0: none, or nothing evicted yet)."""
        return min(self.returns / self.evictions, 1.0) if self.evictions else 0.0

    def clear(self) -> None:
        """The replica restarted: what it evicted before says nothing of its cache now."""
        self.ghosts.clear()
        self.evictions = self.returns = 0.0
