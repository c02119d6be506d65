"""Precise mode's view: the events where they reach, the learned view elsewhere, the larger where events are partial.

A replica's event view is *partial* (``extproc.pick.sources.replica_views.covers_from``) when the router
learned its events from a replay buffer that no longer started at seq 0, or lost batches beyond
the buffer. Blocks stored before are unknown to the events, and a hot system prompt that keeps
being hit is never announced again, nor is anything chained onto it. The learned view (this
router's own placements since it started) knows exactly those prefixes it routed there. Neither
view over-states what the other knows, so per replica the larger match is the better estimate:
the events' where they reach (exact, evictions seen), the learned view's where they do not.

The learned view counts 512-byte chunks of the normalised prompt; to compare it with the events'
exact tokens it is scaled by the request's own tokens per byte and cut, as vLLM does, to whole
blocks below the prompt's last token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from extproc.core.decide import Decision
from extproc.core.settings import RouteSettings
from extproc.pick.choice.state import IndexStats, Sample, Snapshot
from extproc.pick.views.base import NOTHING, Match, Placed, new_tuple
from extproc.pick.views.event_view import EventView
from extproc.pick.views.learned import LEARNED, LearnedView
from extproc.pick.views.precise import COVERED, EVENTS


class Merged(NamedTuple):
    cached: dict[str, int]  # partial replica -> cached prompt tokens credited
    views: dict[str, str]  # partial replica -> the view that gave it (events or learned)


def learned_tokens(chunks: int, chunk_bytes: int, prompt_bytes: int, prompt_tokens: int, block_size: int) -> int:
    """The learned view's ``chunks`` matched, in the request's exact tokens, whole blocks only."""
    if chunks <= 0 or prompt_bytes <= 0 or prompt_tokens <= 1:
        return 0
    tokens = min(chunks * chunk_bytes, prompt_bytes) * prompt_tokens // prompt_bytes
    limit = prompt_tokens - 1  # vLLM always computes the last prompt token
    if block_size > 0:
        return min(tokens, limit) // block_size * block_size
    return min(tokens, limit)


def merge(partial: Iterable[str], exact: Mapping[str, int], learned_chunks: Mapping[str, int],
          block_sizes: Mapping[str, int], *, chunk_bytes: int, prompt_bytes: int, prompt_tokens: int) -> Merged:
    """Per partial replica, the larger of the events' exact match and the learned view's."""
    cached: dict[str, int] = {}
    views: dict[str, str] = {}
    for address in partial:
        events = exact.get(address, 0)
        learned = learned_tokens(learned_chunks.get(address, 0), chunk_bytes, prompt_bytes, prompt_tokens,
                                 block_sizes.get(address, 0))
        cached[address], views[address] = (learned, LEARNED) if learned > events else (events, EVENTS)
    return Merged(cached, views)


class _Both(NamedTuple):
    decision: Decision
    checking: bool  # the route reads the events (cache_view is not "learned"): the tokenizer check samples it
    events: Match | None  # the events' match (None: the request has none)
    learned: Match | None  # the learned view's (None: the events covered every replica, wholly)


class CombinedView:
    """Precise mode's view: the events' exact figures for every replica they cover, the learned view's
    for the rest (replicas not yet covered, a request that cannot be tokenised, a route with
    ``cache_view: learned``), and the larger of the two for a partial replica. The learned view is
    matched and kept learning only where it answers, so a fleet the events cover wholly pays nothing
    for it."""

    def __init__(self, events: EventView, learned: LearnedView) -> None:
        self.events = events
        self.learned = learned

    def match(self, decision: Decision, settings: RouteSettings, snapshot: Snapshot,
              max_new_chars: int = 0) -> Match:
        checking = settings.cache_view != LEARNED
        exact = self.events.match(decision, settings, snapshot, max_new_chars) if checking else None
        if exact is None:
            alone = self.learned.match(decision)
            return new_tuple(Match, (alone.prompt_tokens, alone.cached, alone.views, alone.runs,
                                     new_tuple(_Both, (decision, checking, None, alone))))
        covered: Mapping[str, int] = exact.cached
        partial = exact.detail.partial
        learning = bool(partial) or any(r.address not in covered for r in snapshot.replicas)
        if not learning:
            return new_tuple(Match, (exact.prompt_tokens, covered, exact.views, exact.runs,
                                     new_tuple(_Both, (decision, checking, exact, None))))
        learned = self.learned.match(decision)
        cached = {**learned.cached, **covered}
        views = dict(exact.views)
        if partial:  # events that miss what the replica held before them: the learned view fills in
            merged = merge(partial, covered, learned.detail.held, exact.detail.sizes,
                           chunk_bytes=self.learned.chunk_bytes, prompt_bytes=len(decision.normalized),
                           prompt_tokens=exact.prompt_tokens)
            cached.update(merged.cached)
            views.update(merged.views)
        return new_tuple(Match, (exact.prompt_tokens, cached, views, exact.runs,
                                 new_tuple(_Both, (decision, checking, exact, learned))))

    def learn(self, address: str, match: Match) -> Placed:
        both: _Both = match.detail
        placed = NOTHING
        if both.events is not None:
            placed = self.events.learn(address, both.events, credited=match.views.get(address) == EVENTS)
        if both.checking:
            self.events.check(address, both.decision)
        if both.learned is not None and (both.events is None or address not in both.events.cached
                                         or address in both.events.detail.partial):
            self.learned.learn(address, both.learned)
        return placed

    def forget(self, address: str, placed: Placed) -> None:
        if placed.detail is not None:
            self.events.forget(address, placed)

    def add_remote(self, address: str, run: Sequence[int]) -> None:
        self.events.add_remote(address, run)

    def drop_remote(self, address: str, run: Sequence[int]) -> None:
        self.events.drop_remote(address, run)

    def joined(self, address: str) -> None:
        self.events.joined(address)

    def left(self, address: str) -> None:
        self.learned.left(address)
        self.events.left(address)

    def sampled(self, address: str, sample: Sample, restarted: bool) -> None:
        self.learned.sampled(address, sample, restarted)
        self.events.sampled(address, sample, restarted)

    def eviction_price(self, address: str) -> float:
        """The events' where they cover the replica, else the learned view's."""
        if self.events.precise.origin(address) in COVERED:
            return self.events.eviction_price(address)
        return self.learned.eviction_price(address)

    def describe(self, address: str, match: Match | None) -> dict[str, Any]:
        return self.events.describe(address, match.detail.events if match is not None else None)

    def stats(self) -> IndexStats:
        return self.learned.stats()

    def state(self) -> dict[str, Any]:
        return self.learned.state()

    def replica_state(self, address: str) -> dict[str, Any]:
        return self.learned.replica_state(address)
