"""The event view: what each replica holds, exact to the token, from vLLM's KV-cache events.

``PreciseView`` (``extproc.pick.views.precise``) matches a request's own block hashes against the
event index; this view wraps it for the pick core: the eviction forecast's per-replica thresholds
from the load snapshot, the blocks of requests in flight (this router's and, shared, the other
routers'), the forecast's check when a request ends, and the run-time tokenizer check's sample of
the requests it routed. A request it cannot tokenise gets no answer (None), counted by reason, and
the learned view answers for it (``extproc.pick.views.partial.CombinedView``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from extproc import metrics
from extproc.core.decide import Decision
from extproc.core.settings import RouteSettings
from extproc.pick.choice.state import IndexStats, Sample, Snapshot
from extproc.pick.events.eviction_forecast import EvictionForecast
from extproc.pick.tokens.not_tokenizable import NotTokenizable
from extproc.pick.views.base import Match, Placed, new_tuple
from extproc.pick.views.precise import EVENTS, Exact, Pended, PreciseView

FORECAST_OUTCOMES: Final = ("evicted", "kept", "missed")  # prefix_router_eviction_forecast_blocks_total{outcome}


class EventView:
    """The events' exact view of the replicas they cover, with the eviction forecast (optional) and
    the tokenizer check's sampler (optional), built whole."""

    def __init__(self, precise: PreciseView, forecast: EvictionForecast | None = None,
                 check: Callable[[str, Decision], None] | None = None) -> None:
        self.precise = precise
        self.forecast = forecast
        self._check = check

    def match(self, decision: Decision, settings: RouteSettings | None, snapshot: Snapshot,
              max_new_chars: int = 0) -> Match | None:
        """The events' exact match, or None (counted by reason) when the request cannot have one."""
        thresholds = self._thresholds(snapshot) if self.forecast is not None else None
        started = time.perf_counter()
        try:
            exact = self.precise.match(decision, max_new_chars, thresholds)
        except NotTokenizable as exc:
            metrics.cache_view_counter("learned", exc.reason).inc()
            return None
        except Exception:  # a tokenizer bug must cost the request its exact view, never the request
            metrics.ERRORS.labels("tokenize").inc()
            metrics.cache_view_counter("learned", "error").inc()
            return None
        metrics.PRECISE_SECONDS.observe(time.perf_counter() - started)
        metrics.cache_view_counter(EVENTS, "covered" if exact.cached else "none_covered").inc()
        return new_tuple(Match, (exact.prompt_tokens, exact.cached, dict.fromkeys(exact.cached, EVENTS),
                                 tuple(exact.hashes.values()), exact))

    def _thresholds(self, snapshot: Snapshot) -> dict[str, float]:
        """Per replica, the eviction forecast's threshold (``EvictionForecast.threshold``): the
        requests waiting there (scraped, plus ours sent since) and its free blocks (the part of its KV
        not in use by running requests, from its last scrape)."""
        forecast, precise = self.forecast, self.precise
        assert forecast is not None
        thresholds: dict[str, float] = {}
        for r in snapshot.replicas:
            if not r.capacity_tokens:
                continue
            size = precise.index.block_size(r.address) or precise.block_size_hint
            if not size:
                continue
            waiting = max(r.waiting, r.in_flight - r.running)
            free = (1.0 - r.kv_usage) * r.capacity_tokens / size
            threshold = forecast.threshold(r.address, precise.index.allocations(r.address), waiting, free)
            if threshold is not None:
                thresholds[r.address] = threshold
        return thresholds

    def check(self, address: str, decision: Decision) -> None:
        """A request routed with the events on: the tokenizer check may sample it."""
        if self._check is not None:
            self._check(address, decision)

    def learn(self, address: str, match: Match, credited: bool = True) -> Placed:
        """Its blocks count as at ``address`` until it ends. ``credited``: the choice read this view's
        figure for ``address`` (not a partial replica's learned one), so the forecast's take applies."""
        exact: Exact = match.detail
        pended = self.precise.pend(address, exact)
        if not credited:
            return Placed(pended.run, 0, pended)
        evicting = self.taken_off(address, exact)
        if in_flight := exact.in_flight.get(address, 0):
            metrics.PREDICTED_IN_FLIGHT.labels(address).inc(in_flight)
        if evicting:
            metrics.PREDICTED_EVICTED.labels(address).inc(evicting)
        return Placed(pended.run, evicting, pended)

    def forget(self, address: str, placed: Placed) -> None:
        pended: Pended = placed.detail
        outcome = self.precise.unpend(address, pended)
        if outcome is not None and self.forecast is not None:
            forecast, evicted, missed = outcome
            self.forecast.on_outcome(address, forecast, evicted, missed)
            for kind, blocks in zip(FORECAST_OUTCOMES, (evicted, forecast - evicted, missed), strict=True):
                metrics.EVICTION_FORECAST_CHECKED.labels(address, kind).inc(blocks)

    def taken_off(self, address: str, exact: Exact) -> int:
        """Tokens the eviction forecast takes off ``address``'s events figure: what it forecast, scaled
        by how its recent forecasts there came out (``EvictionForecast.scale``), at most all."""
        tokens = exact.evicting.get(address, 0)
        if not tokens or self.forecast is None:
            return tokens
        size = exact.sizes[address]
        return min(round(tokens / size * self.forecast.scale(address)) * size, exact.cached[address])

    def add_remote(self, address: str, run: Sequence[int]) -> None:
        self.precise.add_pending(address, run)

    def drop_remote(self, address: str, run: Sequence[int]) -> None:
        self.precise.drop_pending(address, run)

    def joined(self, address: str) -> None:
        if self.forecast is not None:  # the forecast's check counts from 0, so its shares read 0/0 until then
            for outcome in FORECAST_OUTCOMES:
                metrics.EVICTION_FORECAST_CHECKED.labels(address, outcome)

    def left(self, address: str) -> None:
        if self.forecast is not None:
            self.forecast.forget(address)
        for outcome in FORECAST_OUTCOMES:
            metrics.forget_series(metrics.EVICTION_FORECAST_CHECKED, address, outcome)

    def sampled(self, address: str, sample: Sample, restarted: bool) -> None:
        if sample.block_size:
            self.precise.block_size_hint = sample.block_size
            if sample.capacity_tokens:
                self.precise.index.set_ghost_capacity(address, sample.capacity_tokens // sample.block_size)
        if self.forecast is not None:
            self.forecast.on_sample(address, self.precise.index.allocations(address), sample.requests_done)

    def eviction_price(self, address: str) -> float:
        return self.precise.index.eviction_price(address)

    def describe(self, address: str, match: Match | None) -> dict[str, Any]:
        exact: Exact | None = match.detail if match is not None else None
        return {"events_origin": self.precise.origin(address),
                "forecast_evicted_tokens": self.taken_off(address, exact) if exact is not None else 0}

    def stats(self) -> IndexStats:
        return self.precise.index.stats()

    def state(self) -> dict[str, Any]:
        return {}

    def replica_state(self, address: str) -> dict[str, Any]:
        return {"events_origin": self.precise.origin(address)}
