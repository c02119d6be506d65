"""What each replica holds, exact to the token, from vLLM's KV-cache events (pure).

Keyed on the router's OWN chain hash over each block's token ids and extra keys
(``extproc.pick.events.block_hashes``, the one function that hashes both the events and a
request), never on vLLM's block hashes.

Per replica, ``EventIndex`` keeps engine hash -> own hash (to apply BlockRemoved and to
chain a BlockStored run onto its parent) and the number of resident copies of each own
hash: vLLM can announce a BlockRemoved while another physical copy with the same hash is
still resident (vllm#55092), so a hash leaves a replica only with its last copy. Globally,
own hash -> bit mask of the replicas holding it, as in ``LearnedIndex``, so ``match`` is a
walk of dict lookups and bit operations.

Every medium counts as held: vLLM's CPU offloading announces the blocks it keeps in host
memory with ``medium="CPU"``, and loading those back still beats recomputing them. The
copy count keeps the GPU and CPU copies of one block apart, so evicting one keeps the other.

A plain data structure: no I/O, no clock, no threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, cast

from extproc.pick.choice.ghosts import BLOCK_SAMPLE_MASK, GhostList
from extproc.pick.choice.state import IndexStats
from extproc.pick.events.block_hashes import ROOT, block_hashes, request_extra_keys
from extproc.pick.events.kv_events import (
    SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    window_store,
)
from extproc.pick.events.match_memo import SPAN, MatchMemo
from extproc.pick.events.window_groups import WindowGroups

# Memory per resident block (the engine -> own entry, both hashes as ints, the holders entry),
# measured with tracemalloc on CPython 3.11 for blocks no other replica holds (shared blocks
# share the holders entry): 126-168 bytes as dicts fill between resizes, int and bytes engine
# hashes alike (both decoded to 60-bit ints). tracemalloc counts what was asked for, not the
# allocator's size classes; a process holding 5.4 M blocks grew 131 bytes a block
# (lab/tools/event_view_scale.py). tests/test_kv_index.py checks the estimate stays close.
BYTES_PER_BLOCK: Final = 180
# Per eviction forecast reading (a dict entry keyed by an own hash the engine map holds too), measured
# the same way: 80 bytes is an upper bound (the key's int is its own object where nothing else holds it).
BYTES_PER_READING: Final = 80

def _no_reading(_hash: int, default: None) -> None:
    return default


class ApplyResult(NamedTuple):
    stored: int = 0  # block copies added
    removed: int = 0  # block copies removed
    duplicates: int = 0  # of ``stored``: a copy of a hash the replica already held
    unknown_parent: int = 0  # BlockStored runs skipped: parent engine hash not known here
    cleared: int = 0  # AllBlocksCleared seen
    malformed: int = 0  # BlockStored runs skipped: token count or extra keys don't fit
    refused: int = 0  # blocks not indexed: the replica's share of max_blocks is full
    unknown_removed: int = 0  # BlockRemoved hashes this replica was not known to hold
    unplaced: int = 0  # a sliding-window group's hashes not placed (extproc.pick.events.window_groups)


class _Tally:
    """One ``apply``'s rarer counts, as the event kinds' methods add them up (``ApplyResult``'s fields;
    the copies stored and removed are the methods' return values). Class-level zeros and no
    ``__init__``: one is made per batch, on the ingest path."""

    duplicates = unknown_parent = cleared = malformed = refused = unknown = 0


@dataclass(slots=True)
class _Replica:
    bit: int
    engine: dict[EngineHash, int] = field(default_factory=dict)  # engine hash -> own hash
    extra: dict[int, int] = field(default_factory=dict)  # own hash -> copies beyond the first
    blocks: int = 0  # resident copies
    block_size: int | None = None
    allocated: int = 0  # blocks its BlockStored events announced so far: its allocation clock
    last_use: dict[int, int] = field(default_factory=dict)  # own hash -> that clock when its chain was last in use
    # own hash -> [requests watching it, times it left the replica since]: the eviction forecast's check
    watched: dict[int, list[int]] = field(default_factory=dict)
    # what its evictions cost (extproc.pick.choice.ghosts), from one block hash in BLOCK_SAMPLE_MASK + 1
    ghosts: GhostList = field(default_factory=lambda: GhostList(sample_mask=BLOCK_SAMPLE_MASK))


class EventIndex:
    """Per replica engine -> own hash map and copy counts; per own hash a bit mask of holders.

    Bounded by ``max_blocks`` over all replicas, each replica getting an equal share: past
    its share a replica's new blocks are refused and counted (``ApplyResult.refused``), not
    evicted. Events carry no recency, so there is nothing sound to evict by, and a full view
    means misconfiguration (the bound is below the fleet's KV capacity), which the count
    makes visible. A refused block's children then arrive with an unknown parent; a
    subscriber seeing ``refused`` should not read those as a gap.
    """

    def __init__(self, max_blocks: int = 2_000_000, match_span: int = SPAN, stamp_events: bool = False) -> None:
        self.max_blocks = max_blocks  # ~360 MB at BYTES_PER_BLOCK
        # keep the eviction forecast's readings: each BlockStored's last block and parent
        self.stamp_events = stamp_events
        self._replicas: dict[str, _Replica] = {}
        self._name: dict[int, str] = {}  # bit -> address
        self._owners: dict[int, int] = {}  # own hash -> bit mask of replicas holding it
        self._memo = MatchMemo(span=match_span)  # match's walk states of earlier chains; told of every holder change
        self.windows = WindowGroups()  # a hybrid model's sliding-window groups; the rest is full attention
        self.sizes_version = 0  # changes whenever a replica's block size (``block_size``) may have changed

    # --- reads -------------------------------------------------------------------------
    def match(self, own_hashes: Sequence[int]) -> dict[str, int]:
        """Replica -> how many leading blocks of ``own_hashes`` it holds (only those with >= 1):
        ``index.leading_runs``, resumed where an earlier request sharing the prefix stood."""
        return self._memo.match(own_hashes, self._owners, self._name)

    def window_hit(self, address: str, own_hashes: Sequence[int], held: int, block_size: int) -> int:
        """Of the ``held`` leading blocks ``match`` found at ``address``, those vLLM would serve once its
        sliding-window groups are asked too (a hybrid model: extproc.pick.events.window_groups)."""
        return self.windows.hit(address, own_hashes, held, block_size)

    def holds_block(self, address: str, own_hash: int) -> bool:
        replica = self._replicas.get(address)
        return replica is not None and bool(self._owners.get(own_hash, 0) & replica.bit)

    def eviction_price(self, address: str) -> float:
        """The share of the replica's recent evictions that came back (extproc.pick.choice.ghosts)."""
        replica = self._replicas.get(address)
        return replica.ghosts.price() if replica is not None else 0.0

    def set_ghost_capacity(self, address: str, blocks: int) -> None:
        """Remember as many of ``address``'s evictions as its KV holds blocks (each scrape: the same
        size again costs a division)."""
        self._replica(address).ghosts.resize(blocks)

    def block_size(self, address: str) -> int | None:
        """The block size ``address``'s events announce (None before its first BlockStored)."""
        replica = self._replicas.get(address)
        return replica.block_size if replica else None

    def addresses(self) -> list[str]:
        return list(self._replicas)

    def allocations(self, address: str) -> int:
        """``address``'s allocation clock: the blocks its BlockStored events announced so far, each one
        a block vLLM took from the head of its free queue (never goes back)."""
        replica = self._replicas.get(address)
        return replica.allocated if replica else 0

    def last_use(self, address: str) -> Callable[[int, None], int | None]:
        """``get`` of own hash -> the allocation clock when ``address`` last used the chain up to that
        block, as its events tell (with ``stamp_events``): a BlockStored stored it as its last block
        or chained onto it (``extproc.pick.events.eviction_forecast``). Sparse: most blocks have no entry.

        The clock is read at the end of the event's batch (one engine step): the request held its
        blocks through the step, so that is the later, closer bound on when it freed them, and one
        int serves every reading of the step (a decode step stores a block for each of many requests)."""
        replica = self._replicas.get(address)
        return replica.last_use.get if replica else _no_reading

    def watch(self, address: str, own_hashes: Sequence[int]) -> list[int]:
        """Start counting when each of ``own_hashes`` leaves ``address`` (its last copy removed, or
        the replica's view reset); returns the counts now, for ``unwatch``. For the eviction
        forecast's check of the blocks it said a request would find evicted."""
        watched = self._replica(address).watched
        counts = []
        for h in own_hashes:
            entry = watched.get(h)
            if entry is None:
                entry = watched[h] = [0, 0]
            entry[0] += 1
            counts.append(entry[1])
        return counts

    def unwatch(self, address: str, own_hashes: Sequence[int], counts: Sequence[int]) -> int | None:
        """Stop ``watch``; how many of ``own_hashes`` left ``address`` since (None: the replica left)."""
        replica = self._replicas.get(address)
        if replica is None:
            return None
        watched, left = replica.watched, 0
        for h, count in zip(own_hashes, counts, strict=True):
            entry = watched.get(h)
            if entry is None:  # the replica left and came back since: its view started empty
                left += 1
                continue
            left += entry[1] > count
            entry[0] -= 1
            if not entry[0]:
                del watched[h]
        return left

    def holds(self, address: str) -> list[int]:
        """``address``'s own hashes, in the order first stored (``/debug/state``)."""
        replica = self._replicas.get(address)
        if replica is None:
            return []
        bit, get = replica.bit, self._owners.get
        return [h for h in dict.fromkeys(replica.engine.values()) if get(h, 0) & bit]

    def share(self) -> int:
        """Blocks each replica may hold: an equal part of ``max_blocks``."""
        return max(1, self.max_blocks // max(len(self._replicas), 1))

    def stats(self) -> IndexStats:
        """entries: resident block copies; chunks: distinct own hashes; bytes: an estimate."""
        blocks = sum(r.blocks for r in self._replicas.values())
        mapped = sum(len(r.engine) for r in self._replicas.values()) + self.windows.entries()
        readings = sum(len(r.last_use) for r in self._replicas.values())
        return IndexStats(blocks, len(self._owners), mapped * BYTES_PER_BLOCK + readings * BYTES_PER_READING)

    # --- writes ------------------------------------------------------------------------
    def apply(self, address: str, events: Iterable[Event]) -> ApplyResult:
        """Apply one replica's events in order (BlockStored, BlockRemoved, AllBlocksCleared).

        Each kind is its own method, called once per event with what the batch shares (the per-block
        loops stay inside them: this is the ingest path). A sliding-window group's events are set
        apart and given to ``windows`` after the batch's others, whose stores place their hashes."""
        replica = self._replica(address)
        tally = _Tally()
        share = self.share()
        changed = self._memo.log.append if self._memo.active() else None  # holders changed, for the memo
        windows = self.windows.groups(address)  # its sliding-window groups: their events go there
        window_events: list[Event] = []
        stamp = 0
        if self.stamp_events:
            events = events if isinstance(events, (list, tuple)) else list(events)
            stamp = self._stamp(replica, events)
        stored = removed = 0  # block copies added and removed: the kinds' methods return theirs
        on_stored, on_removed = self._stored, self._removed  # bound once a batch, not once an event
        for event in events:
            if type(event) is BlockStored:
                # window_store's own first test inline: most stores are full attention, and a call is ~80 ns
                if event.kv_cache_spec_kind == SLIDING_WINDOW and window_store(event):
                    window = cast(int, event.kv_cache_spec_sliding_window)  # window_store: it says its window
                    windows = self.windows.declare(address, event.group_idx, window)
                    window_events.append(event)
                else:
                    stored += on_stored(replica, event, share, stamp, changed, tally)
            elif type(event) is BlockRemoved:
                if windows and event.group_idx in windows:
                    window_events.append(event)
                else:
                    removed += on_removed(replica, event, changed, tally)
            elif type(event) is AllBlocksCleared:
                self._cleared(address, window_events, tally)
                changed = None  # the reset dropped the memo's states: nothing to keep valid
        if len(self._memo.log) > self._memo.max_log:
            self._memo.clear()
        # after the batch's full-attention events, whose stores place the window groups' hashes
        unplaced = self.windows.apply(address, window_events, replica.engine) if window_events else 0
        t = tally
        return ApplyResult(stored, removed, t.duplicates, t.unknown_parent, t.cleared, t.malformed, t.refused,
                           t.unknown, unplaced)

    @staticmethod
    def _stamp(replica: _Replica, events: Sequence[Event]) -> int:
        """The allocation clock after this batch (``stamp_events``): the readings of its blocks' use."""
        stamp = replica.allocated
        for e in events:
            if type(e) is BlockStored and not (e.kv_cache_spec_kind == SLIDING_WINDOW and window_store(e)):
                stamp += len(e.block_hashes)
        return stamp

    def _stored(self, replica: _Replica, event: BlockStored, share: int, stamp: int,
                changed: Callable[[int], None] | None, tally: _Tally) -> int:
        """A run of full blocks one request cached, chained onto its parent's own hash: each block one
        more copy at the replica (a duplicate when it held the hash already), past its share refused.
        Skipped whole when its parent is unknown or its tokens or extra keys do not fit. Returns the
        copies added."""
        hashes, bs = event.block_hashes, event.block_size
        n = len(hashes)
        replica.allocated += n
        keys: Sequence[Sequence[Any] | None] | None = event.extra_keys
        if keys is None and event.lora_name:  # publishers without extra_keys
            keys = request_extra_keys(n, None, event.lora_name)
        if len(event.token_ids) != n * bs or (keys is not None and len(keys) != n):
            tally.malformed += 1
            return 0
        engine = replica.engine
        if event.parent_block_hash is None:
            parent = ROOT
        else:
            known = engine.get(event.parent_block_hash)
            if known is None:
                tally.unknown_parent += 1
                return 0
            parent = known
        try:
            own = block_hashes(event.token_ids, bs, keys, parent)
        except (OverflowError, TypeError, ValueError):  # token ids outside uint32, odd keys
            tally.malformed += 1
            return 0
        if replica.block_size != bs:
            replica.block_size = bs
            self.sizes_version += 1
        room = share - replica.blocks
        if room < n:
            tally.refused += n - max(room, 0)
            n = max(room, 0)
        if stamp and n:  # the chain up to its last block is in use in this step (eviction forecast)
            last_use = replica.last_use
            last_use[own[n - 1]] = stamp
            if parent != ROOT:
                last_use[parent] = stamp
        owners, bit, extra = self._owners, replica.bit, replica.extra
        ghosts = [r.ghosts for r in self._replicas.values() if r.ghosts.ghosts]  # evicted anywhere, back here
        duplicates = 0
        for i in range(n):
            e = hashes[i]
            h = engine.get(e)
            if h is None:
                h = engine[e] = own[i]
            held = owners.get(h, 0)
            if held & bit:
                extra[h] = extra.get(h, 0) + 1
                duplicates += 1
            else:
                owners[h] = held | bit if held else bit  # alone: share the replica's int, not a new one
                if changed:
                    changed(h)
                if ghosts and not held and not h & BLOCK_SAMPLE_MASK:
                    for g in ghosts:
                        g.stored(h)
        if duplicates:
            tally.duplicates += duplicates
        replica.blocks += n
        return n

    def _removed(self, replica: _Replica, event: BlockRemoved, changed: Callable[[int], None] | None,
                 tally: _Tally) -> int:
        """Evicted copies: a hash leaves the replica with its last copy (its holders change, a watch
        counts it). A hash the replica was not known to hold is counted, its stale engine entry dropped.
        Returns the copies removed."""
        owners, bit = self._owners, replica.bit
        engine, extra, last_use, watched = replica.engine, replica.extra, replica.last_use, replica.watched
        evicted = replica.ghosts.evicted
        removed = unknown = 0
        for e in event.block_hashes:
            h = engine.get(e)
            if h is None:
                unknown += 1
                continue
            held = owners.get(h, 0)
            if not held & bit:
                del engine[e]
                unknown += 1
                continue
            removed += 1
            copies = extra.get(h)
            if copies:
                if copies > 1:
                    extra[h] = copies - 1
                else:
                    del extra[h]
            else:
                del engine[e]
                if last_use:
                    last_use.pop(h, None)
                if watched and (entry := watched.get(h)) is not None:
                    entry[1] += 1
                if not h & BLOCK_SAMPLE_MASK:
                    evicted(h)
                left = held & ~bit
                if left:
                    owners[h] = left
                else:
                    del owners[h]
                if changed:
                    changed(h)
        replica.blocks -= removed
        if unknown:
            tally.unknown += unknown
        return removed

    def _cleared(self, address: str, window_events: list[Event], tally: _Tally) -> None:
        """The replica reset its prefix cache: it holds nothing, and its window groups' events so far go too."""
        self.reset(address)
        window_events.clear()  # the window groups were emptied too
        tally.cleared += 1

    def reset(self, address: str) -> None:
        """``address`` holds nothing (restart, sequence gap, AllBlocksCleared)."""
        self.windows.reset(address)
        replica = self._replicas.get(address)
        if replica is None:
            return
        self._memo.clear()
        owners, bit = self._owners, replica.bit
        for h in replica.engine.values():
            held = owners.get(h, 0)
            if held & bit:
                left = held & ~bit
                if left:
                    owners[h] = left
                else:
                    del owners[h]
        replica.engine.clear()  # clear() frees the table (and apply's local names stay valid)
        replica.extra.clear()
        replica.last_use.clear()
        replica.ghosts.clear()
        for entry in replica.watched.values():
            entry[1] += 1
        replica.blocks = 0

    def remove(self, address: str) -> None:
        """Forget a replica that left the fleet (its bit is reused by the next one)."""
        self.reset(address)
        self.windows.remove(address)
        replica = self._replicas.pop(address, None)
        if replica is not None:
            self._name.pop(replica.bit, None)
            self.sizes_version += 1

    def _replica(self, address: str) -> _Replica:
        replica = self._replicas.get(address)
        if replica is None:
            used = 0
            for r in self._replicas.values():
                used |= r.bit
            bit = (used + 1) & ~used  # lowest free bit
            replica = self._replicas[address] = _Replica(bit)
            self._name[bit] = address
        return replica
