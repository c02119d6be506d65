"""A hybrid model's sliding-window KV-cache groups, as vLLM's events show them (pure).

vLLM's hybrid KV-cache manager keeps each KV-cache group's blocks apart, and a prefix hit needs
every group (vllm/v1/core/kv_cache_coordinator.py): all of the prefix's blocks in the
full-attention groups, and in a sliding-window group only the window before the hit point.
vLLM 0.32 stores a sliding-window group's run with all of its tokens but only the hashes of the
blocks the group keeps, with no parent (seen on the wire: docs/precise-fidelity.md), so those hashes are
placed through the full-attention group's: vLLM hashes a request's blocks once for every group,
and the full-attention store of the same run comes in the same batch. ``EventIndex`` holds the
full-attention view and hands a replica's sliding-window events here.

The hit, as vLLM's ``SlidingWindowManager.find_longest_cache_hit`` finds it: from the longest
candidate (the full-attention match) down, the first point before which the group holds
``cdiv(window - 1, block_size)`` consecutive blocks; else the run the group holds from block 0.
Groups of one window must all hold a block (vLLM looks them up together), groups of different
windows take turns until the hit stops shrinking (vLLM's fixed point).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from extproc.pick.events.kv_events import BlockRemoved, BlockStored, EngineHash, Event


@dataclass(slots=True)
class _Group:
    window: int  # tokens
    engine: dict[EngineHash, int] = field(default_factory=dict)  # engine hash -> own hash
    held: dict[int, int] = field(default_factory=dict)  # own hash -> copies


class WindowGroups:
    """Per replica, its sliding-window groups' blocks, by own hash."""

    def __init__(self) -> None:
        self._groups: dict[str, dict[int | None, _Group]] = {}
        # per replica, window -> the held blocks of its groups of that window (vLLM looks them up together)
        self._by_window: dict[str, dict[int, list[dict[int, int]]]] = {}

    def declare(self, address: str, group: int | None, window: int) -> dict[int | None, _Group]:
        """``group`` of ``address`` is a sliding window of ``window`` tokens (its stores say so);
        returns the replica's groups, whose keys name its sliding-window groups."""
        groups = self._groups.setdefault(address, {})
        if group not in groups:
            groups[group] = added = _Group(window)
            self._by_window.setdefault(address, {}).setdefault(window, []).append(added.held)
        return groups

    def groups(self, address: str) -> Mapping[int | None, _Group]:
        return self._groups.get(address, {})

    def __bool__(self) -> bool:
        """Whether any replica has sliding-window groups (else a match needs no asking)."""
        return bool(self._groups)

    def apply(self, address: str, events: Sequence[Event], engine: Mapping[EngineHash, int]) -> int:
        """A replica's sliding-window stores and removals, in order, after its full-attention events
        of the same batch (``engine``: their engine -> own hash map). Returns the hashes that could
        not be placed (a store's block the full-attention view does not know, a removal of a block
        the group was not known to hold)."""
        groups = self._groups.get(address, {})
        unplaced = 0
        for ev in events:
            group = groups.get(ev.group_idx)  # type: ignore[union-attr]  # both event kinds have it
            if group is None:
                unplaced += len(ev.block_hashes)  # type: ignore[union-attr]
                continue
            if type(ev) is BlockStored:
                for e in ev.block_hashes:
                    own = group.engine.get(e)
                    if own is None:
                        own = engine.get(e)
                        if own is None:
                            unplaced += 1
                            continue
                        group.engine[e] = own
                    group.held[own] = group.held.get(own, 0) + 1
            elif type(ev) is BlockRemoved:
                for e in ev.block_hashes:
                    own = group.engine.get(e)
                    if own is None:
                        unplaced += 1
                        continue
                    copies = group.held[own] - 1
                    if copies:
                        group.held[own] = copies
                    else:
                        del group.held[own]
                        del group.engine[e]
        return unplaced

    def hit(self, address: str, run: Sequence[int], n: int, block_size: int) -> int:
        """How many leading blocks of ``run`` (a request's own hashes) vLLM would serve from
        ``address``'s cache, given that its full-attention groups hold the first ``n``."""
        by_window = self._by_window.get(address)
        if not by_window or not n:
            return n
        while True:
            before = n
            for window, helds in by_window.items():
                n = _window_hit(run, n, -(-(window - 1) // block_size), helds)
            if n == before:
                return n

    def reset(self, address: str) -> None:
        """The replica holds nothing (its groups stay known: the same model)."""
        for group in self._groups.get(address, {}).values():
            group.engine.clear()
            group.held.clear()

    def remove(self, address: str) -> None:
        self._groups.pop(address, None)
        self._by_window.pop(address, None)

    def entries(self) -> int:
        """Engine hashes mapped over every replica's groups (for the index's memory figure)."""
        return sum(len(g.engine) for groups in self._groups.values() for g in groups.values())


def _window_hit(run: Sequence[int], n: int, blocks: int, helds: list[dict[int, int]]) -> int:
    count = 0
    for i in range(n - 1, -1, -1):
        h = run[i]
        if all(h in held for held in helds):
            count += 1
            if count >= blocks:
                return i + count
        else:
            count = 0
    return count
