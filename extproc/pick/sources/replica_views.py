"""What applying one KV-event batch means: the index fed, and what it says of the replica's view.

Split from kv_subscriber.py, which follows each stream's sequence over ZeroMQ (which batch is
applied when: live, replayed, after a gap or a restart). This module is the other half, whatever
the transport: a batch decoded and fed to the index (a hybrid model's groups the view cannot
follow set aside), each replica's view kept (complete or partial, ``covers_from``; its origin),
resets with their causes, and the counters the integrator exports. ``ViewKeeper`` holds that
half's methods; ``KvEventSubscriber`` is one, and its streams' sessions call them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from extproc.pick.events.kv_events import Event, EventDecodeError, Frame, decode_batch, unplaceable_groups
from extproc.pick.views.precise import PARTIAL

# The subscriber's logger: its warnings are about the subscriber, whichever module holds the code.
log = logging.getLogger("extproc.pick.sources.kv_subscriber")

CAUSES: Final = ("restart", "reconnect", "gap", "cleared", "left", "hybrid")
_NO_GROUPS: Final[frozenset[int]] = frozenset()


class Index(Protocol):
    def apply(self, address: str, events: Sequence[Any]) -> Any: ...
    def reset(self, address: str) -> None: ...
    def remove(self, address: str) -> None: ...


def covers_from(seq: int) -> bool:
    """Whether a rank's view is complete (its events cover everything its cache holds) when the
    first batch it learns, at the start or right after a hole, is ``seq``.

    Only at seq 0: vLLM counts from 0 per process, and a new process starts with an empty cache.
    (An ``AllBlocksCleared``, vLLM's ``reset_prefix_cache``, completes a view too: the cache is
    empty after it.) Later than 0 (a router that starts while the replica is warm and its replay
    buffer no longer starts at 0; no replay socket at all; batches lost beyond the buffer), the
    blocks stored before and still resident are unknown, and so is every block a request later
    chains onto them: vLLM announces a prefix-cache hit with nothing, and the router cannot hash
    a run whose parent it never saw. The view is then *partial*.

    A partial view becomes complete only by one of those two events, never by time or by eviction
    turnover: vLLM evicts least-recently-used free blocks, so the blocks that keep being hit (hot
    system prompts, the very ones worth routing on) stay resident and are never announced again,
    and any count of stores or removals could declare the view complete while the most valuable
    blocks are still missing. Until then the learned view (this router's own placements) fills
    in; its errors are bounded by its LRU capacity.
    """
    return seq == 0


@dataclass
class ReplicaView:
    """What is known of one replica's event stream (all its DP ranks)."""

    # "none" (nothing heard: the learned view) | "replayed" (built from a replay buffer that holds
    # the process's whole history) | "events" (live events flow, history complete) | "partial"
    # (events flow or were replayed, but they miss what the replica stored before them; ``covers_from``)
    origin: str = "none"
    complete: dict[int, bool] = field(default_factory=dict)  # rank -> its events cover all it holds
    last_seq: dict[int, int] = field(default_factory=dict)  # rank -> last applied seq
    last_event_time: float = 0.0  # wall clock when its last batch was applied
    lag: float = 0.0  # seconds from the last batch's ts to its application


@dataclass
class KvSubscriberStats:
    batches: int = 0  # batches applied (live and replayed)
    blocks: int = 0  # block hashes in applied BlockStored/BlockRemoved events
    events_skipped: int = 0  # inner events the decoder could not read
    gaps: int = 0  # missing seq ranges seen
    replays_asked: int = 0
    replays_served: int = 0  # replay requests answered up to the end marker
    replayed_batches: int = 0  # batches applied from replay answers
    bad_frames: int = 0
    # events of a hybrid model's KV-cache groups the view cannot follow (``kv_events.unplaceable_groups``:
    # Mamba, or a sliding window that does not say its window), set aside (docs/precise-mode.md, "Hybrid models")
    set_aside_events: int = 0
    apply_s: float = 0.0  # CPU time decoding and applying batches (thread time): the ingest path's share of the core
    resets: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    replicas: dict[str, ReplicaView] = field(default_factory=dict)


class RankStream:
    """One (endpoint, rank) event stream."""

    __slots__ = ("address", "rank", "events_url", "replay_url", "applied", "live", "synced", "resync", "task",
                 "dropped", "complete")

    def __init__(self, address: str, rank: int, events_url: str, replay_url: str | None) -> None:
        self.address = address
        self.rank = rank
        self.events_url = events_url
        self.replay_url = replay_url
        self.applied = -1  # last applied seq
        self.live = -1  # last seq received on the live socket
        self.synced = replay_url is None  # the initial replay answered (or there is none)
        self.resync = False  # the address was reset: replay from 0 again
        self.task: asyncio.Task[None] | None = None
        self.dropped = False  # the connection to the publisher went down since the last connect
        self.complete = False  # the batches applied since the last hole cover the cache (``covers_from``)

    def skip_to(self, seq: int) -> None:
        """The next batch applied is ``seq``, after a hole (or as the first): what came before is unknown."""
        self.applied = seq - 1
        self.complete = covers_from(seq)


def view_origin(view: ReplicaView, live: bool) -> str:
    """A replica's origin after a batch: partial while any rank's events miss what it holds."""
    if not all(view.complete.values()):
        return PARTIAL
    return "events" if live or view.origin == "events" else "replayed"


def _cleared(result: Any) -> int:
    """How many AllBlocksCleared resets an ``ApplyResult`` reports (0 when it says nothing)."""
    n = getattr(result, "cleared", 0)
    return int(n) if n else 0


class ViewKeeper:
    """Applying batches to ``index`` and keeping ``stats``: the replicas' views, resets, counters.

    The attributes below are the subscriber's (``KvEventSubscriber`` sets them); ``_streams`` is its
    streams by endpoint, which a reset asks to replay again."""

    index: Index
    stats: KvSubscriberStats
    dp_ranks: int
    on_reset: Callable[[str, str], None] | None
    _streams: dict[str, list[RankStream]]
    _dirty: dict[str, bool]  # applied anything since the last reset
    _set_aside_groups: dict[str, set[int]]  # address -> its groups the view cannot follow

    def _apply(self, st: RankStream, frame: Frame, live: bool) -> None:
        if st.resync:
            return  # this replica's view is rebuilt by the replay the session runs next
        st.applied = frame.seq
        if frame.seq == 0:
            st.complete = True  # a process's first batch: its cache was empty before it
        view = self.stats.replicas.get(st.address)
        if view is None:
            return  # the endpoint left while a replay was under way
        view.last_seq[st.rank] = frame.seq
        started = time.thread_time()
        try:
            decoded = decode_batch(frame.payload)
        except EventDecodeError:
            self.stats.bad_frames += 1
            return
        batch = decoded.batch
        events: Sequence[Event] = batch.events
        aside: Set[int] = self._set_aside_groups.get(st.address, _NO_GROUPS)
        found = unplaceable_groups(events)
        if not found <= aside:
            self._set_aside(st, found)
            if st.resync:
                return  # the replay rebuilds the view, this batch included
            aside = self._set_aside_groups[st.address]
        stats = self.stats
        if aside:
            kept = [ev for ev in events if getattr(ev, "group_idx", None) not in aside]
            stats.set_aside_events += len(events) - len(kept)
            events = kept
        result = self.index.apply(st.address, events)
        self._dirty[st.address] = True
        stats.batches += 1
        stats.events_skipped += decoded.skipped
        stats.blocks += sum(len(getattr(ev, "block_hashes", ())) for ev in events)
        now = time.time()
        view.last_event_time = now
        view.lag = now - batch.ts
        if not live:
            stats.replayed_batches += 1
        cleared = _cleared(result)
        if cleared:
            st.complete = True  # the cache was emptied: everything after it is announced
        for _ in range(cleared):
            self._count_reset(st.address, "cleared")
        view.complete[st.rank] = st.complete
        view.origin = view_origin(view, live)
        stats.apply_s += time.thread_time() - started

    def _set_aside(self, st: RankStream, groups: set[int]) -> None:
        """A hybrid model: the view cannot follow ``groups`` (``unplaceable_groups``). Their events are
        set aside from now on, and this replica's view, which may hold some of their blocks, is
        rebuilt from its replay buffer without them."""
        aside = self._set_aside_groups.setdefault(st.address, set())
        aside |= groups
        log.warning("replica %s has KV-cache groups %s that precise mode cannot follow (a hybrid model's: "
                    "Mamba, or a sliding window that does not say its window): their events are set aside, so "
                    "it can predict more cached tokens than vLLM finds where those groups no longer hold what a "
                    "hit needs (docs/precise-mode.md, Hybrid models)", st.address, sorted(aside))
        self._reset(st, "hybrid")
        st.resync = st.replay_url is not None  # without a buffer to rebuild from the view stays partial

    def _reset(self, st: RankStream, cause: str) -> None:
        self.index.reset(st.address)
        self._dirty[st.address] = False
        view = self.stats.replicas.get(st.address)
        if view is not None and view.origin != "none":
            # nothing is known until the streams learn again; the learned view fills in meanwhile
            view.complete = dict.fromkeys(range(self.dp_ranks), False)
            view.origin = PARTIAL
        self._count_reset(st.address, cause)
        for other in self._streams.get(st.address, ()):
            if other is not st and other.replay_url is not None:
                other.resync = True  # its part of the union is gone too: replay its buffer again

    def _count_reset(self, address: str, cause: str) -> None:
        self.stats.resets[cause] += 1
        if self.on_reset is not None:
            try:
                self.on_reset(address, cause)
            except Exception:
                log.exception("on_reset callback failed")
