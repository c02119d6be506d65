"""Pick mode's request path: the learned index and the load view around the pure choice.

The gRPC adapter calls ``pick`` with the hash-mode decision (the normalised prompt and
its key) and ``release`` when the request's ext_proc stream ends. ``pick`` does no I/O:
what gathers state (endpoint discovery, scraping) is ``extproc.pick.picker``'s, and feeds
this object through ``set_endpoints`` and ``on_sample``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

from extproc import metrics
from extproc.core.decide import Decision
from extproc.core.settings import RouteSettings
from extproc.pick.choice.choose import REASONS, Candidate, Choice, choose, prefill_tokens
from extproc.pick.views.chunks import chunk_hashes
from extproc.pick.events.eviction_forecast import EvictionForecast
from extproc.pick.views.learned_index import LearnedIndex, PrefixIndex
from extproc.pick.choice.load import LoadTracker, Sample
from extproc.pick.views.partial import merge
from extproc.pick.views.precise import EVENTS, Exact, Pended, PreciseView
from extproc.pick.tokens.prompt_tokens import NotTokenizable
from extproc.pick.choice.state import ReplicaState, Snapshot


class Share(Protocol):
    """Told of this router's picks and their ends (extproc.pick.sources.in_flight_bus.InFlightBus)."""

    def picked(self, key: int, address: str, prefill: int, run: Sequence[int]) -> None: ...

    def released(self, key: int) -> None: ...

    def continued(self, run: Sequence[int]) -> int:
        """End the other routers' requests that a request with these blocks continues (their answer is
        out; their end message may not be): extproc.pick.sources.shared_in_flight.RemoteInFlight.continued."""
        ...


# A request's prompt is indexed up to this many chunks (2 MiB at 512-byte chunks): past it
# hashing would cost more than any cache it could find is worth.
MAX_REQUEST_CHUNKS: Final = 4096
LOAD_KINDS: Final = ("in_flight", "own", "running", "waiting", "kv_usage")
FORECAST_OUTCOMES: Final = ("evicted", "kept", "missed")  # prefix_router_eviction_forecast_blocks_total{outcome}
_PICKS: Final = {reason: metrics.PICKS.labels(reason) for reason in REASONS}  # every series from 0


class PickCore:
    """The index + load view + choice, without background tasks (``explain`` uses it alone)."""

    def __init__(self, chunk_bytes: int = 512, bytes_per_token: float = 4.0, kv_capacity_tokens: int = 0,
                 index_max_chunks: int = 2_000_000, prefill_tokens_per_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.chunk_bytes = chunk_bytes
        self.bytes_per_token = bytes_per_token
        self.chunk_tokens = chunk_bytes / bytes_per_token
        self.kv_capacity_tokens = kv_capacity_tokens
        self.index: PrefixIndex = LearnedIndex(index_max_chunks, self.chunks_for(kv_capacity_tokens))
        self.load = LoadTracker(prefill_tokens_per_s)
        self.clock = clock
        self.precise: PreciseView | None = None  # precise mode: the events' exact view (Picker sets it)
        self.forecast: EvictionForecast | None = None  # precise mode: evictions before admission (Picker sets it)
        # precise mode: told of every request it routed (the run-time tokenizer check samples them)
        self.on_precise_pick: Callable[[str, Decision], None] | None = None
        self._hits: dict[str, float] = {}  # each replica's last vllm:prefix_cache_hits_total
        self._pended: dict[int, tuple[str, Pended]] = {}  # id(choice) -> its blocks pending on a replica
        # told of every pick and its end, to share with the other router replicas (Picker sets it:
        # extproc.pick.sources.in_flight_bus); theirs come back through add_remote and drop_remote
        self.share: Share | None = None

    def chunks_for(self, tokens: int) -> int:
        return int(tokens // self.chunk_tokens) if tokens else 0

    def tokens(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.bytes_per_token)

    # --- state updates -----------------------------------------------------------------
    def set_endpoints(self, addresses: Sequence[str]) -> None:
        added, removed = self.load.set_addresses(addresses)
        if self.forecast is not None:  # the forecast's check counts from 0, so its shares read 0/0 until then
            for address in added:
                for outcome in FORECAST_OUTCOMES:
                    metrics.EVICTION_FORECAST_CHECKED.labels(address, outcome)
        for address in removed:
            self.index.remove(address)
            if self.forecast is not None:
                self.forecast.forget(address)
            for outcome in FORECAST_OUTCOMES:
                _forget_series(metrics.EVICTION_FORECAST_CHECKED, address, outcome)
            for kind in LOAD_KINDS:
                _forget_series(metrics.REPLICA_LOAD, address, kind)
            _forget_series(metrics.REPLICA_UP, address)
        metrics.ENDPOINTS.set(len(self.load.addresses()))

    def on_sample(self, address: str, sample: Sample | None) -> None:
        metrics.REPLICA_UP.labels(address).set(0 if sample is None else 1)
        if sample is None:
            return
        if sample.capacity_tokens and not self.kv_capacity_tokens:
            self.index.set_capacity(address, self.chunks_for(sample.capacity_tokens))
        if sample.block_size and self.precise is not None:
            self.precise.block_size_hint = sample.block_size
        if self.forecast is not None and self.precise is not None:
            self.forecast.on_sample(address, self.precise.index.allocations(address), sample.requests_done)
        before = self._hits.get(address)
        self._hits[address] = sample.prefix_cache_hits
        if before is not None:
            restarted = sample.prefix_cache_hits < before
            if restarted:  # a counter that went back is a new process: its cache started empty
                self.index.clear(address)
                metrics.LEARNED_CLEARED.inc()
            gained = sample.prefix_cache_hits - (0 if restarted else before)
            if gained > 0:
                metrics.REPLICA_CACHE_HITS.labels(address).inc(gained)

    # --- the request path --------------------------------------------------------------
    def evaluate(self, decision: Decision, settings: RouteSettings) -> tuple[Choice, list[int]]:
        """The choice for a request, without recording it (``explain`` stops here)."""
        choice, chunks, _ = self._evaluate(decision, settings)
        return choice, chunks

    def _evaluate(self, decision: Decision, settings: RouteSettings, max_new_chars: int = 0,
                  settle: bool = False) -> tuple[Choice, list[int], Exact | None]:
        """The choice, with the learned chunks to record (none when complete events cover the chosen
        replica) and the events' exact match (None without one).

        With precise mode on the route, the events' exact figures replace the learned view's
        estimates for every replica they cover, and the prompt length is exact. The learned view
        answers only where the events do not: replicas not yet covered, a request that cannot be
        tokenised, and a replica whose events miss part of its cache (origin ``partial``), which
        gets the larger of the two views' figures (``extproc.pick.views.partial``). It is matched
        and kept learning only for those, so a fleet fully covered by events pays nothing for it.
        ``settle`` (``pick``): first end the other routers' requests this one continues (``Share.continued``).
        """
        snapshot = self.load.snapshot(self.clock())
        exact = (self._exact(decision, max_new_chars, self._thresholds(snapshot))
                 if self.precise is not None and settings.cache_view != "learned" else None)
        if settle and exact is not None and self.share is not None:
            if sum(self.share.continued(run) for run in exact.hashes.values()):
                snapshot = self.load.snapshot(self.clock())
        partial: Sequence[str] = ()
        if exact is None:
            learning = True
        else:
            partial = exact.partial
            learning = bool(partial) or any(r.address not in exact.cached for r in snapshot.replicas)
        chunks = chunk_hashes(decision.normalized, self.chunk_bytes, MAX_REQUEST_CHUNKS) if learning else []
        held = self.index.match(chunks) if chunks else {}
        cached = {a: int(n * self.chunk_tokens) for a, n in held.items()}
        prompt_tokens = self.tokens(len(decision.normalized))
        views: dict[str, str] = {}
        if exact is not None:
            prompt_tokens = exact.prompt_tokens
            cached.update(exact.cached)
            views = dict.fromkeys(exact.cached, EVENTS)
            if partial:  # events that miss what the replica held before them: the learned view fills in
                merged = merge(partial, exact.cached, held, exact.sizes, chunk_bytes=self.chunk_bytes,
                               prompt_bytes=len(decision.normalized), prompt_tokens=exact.prompt_tokens)
                cached.update(merged.cached)
                views.update(merged.views)
        choice = choose(decision.key, prompt_tokens, cached, snapshot, settings, views)
        if exact is not None and choice.address in views and choice.address not in partial:
            chunks = []  # the events will tell where this request's blocks are; nothing to learn
        return choice, chunks, exact

    def _thresholds(self, snapshot: Snapshot) -> dict[str, float] | None:
        """Per replica, the eviction forecast's threshold (``EvictionForecast.threshold``):
        the requests waiting there (scraped, plus ours sent since) and its free blocks (the part of its
        KV not in use by running requests, from its last scrape)."""
        forecast, precise = self.forecast, self.precise
        if forecast is None or precise is None:
            return None
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

    def _exact(self, decision: Decision, max_new_chars: int,
               thresholds: Mapping[str, float] | None = None) -> Exact | None:
        """The events' exact match, or None (counted by reason) when the request cannot have one."""
        assert self.precise is not None
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
        return exact

    async def prepare(self, decision: Decision, settings: RouteSettings) -> int:
        """Before ``pick``, on the event loop: what must happen off it first; returns ``pick``'s
        ``max_new_chars``. Nothing here (``Picker`` tokenises precise mode's long new text ahead)."""
        return 0

    def pick(self, decision: Decision, settings: RouteSettings, max_new_chars: int = 0) -> Choice:
        """Choose and record. ``max_new_chars`` (0: no limit): precise mode tokenises at most this many
        characters its tokenizer's cache does not hold, else uses the learned view (``Picker.prepare``
        says when: its worker could not take the request's long new text)."""
        choice, chunks, exact = self._evaluate(decision, settings, max_new_chars, settle=True)
        _PICKS[choice.reason].inc()
        if choice.address is not None:
            if chunks:
                self.index.record(choice.address, chunks)
            run: Sequence[int] = ()  # its blocks, when the events matched it
            if exact is not None and self.precise is not None:
                pended = self.precise.pend(choice.address, exact)
                self._pended[id(choice)] = (choice.address, pended)
                run = pended.run
            chosen = _chosen(choice)
            prefill = _prefill(choice, chosen)
            self.load.assign(choice.address, prefill, self.clock())
            if self.share is not None:
                self.share.picked(id(choice), choice.address, prefill, run)
            if self.on_precise_pick is not None and settings.cache_view != "learned":
                self.on_precise_pick(choice.address, decision)
            events = exact if exact is not None and chosen.view == EVENTS else None
            evicting = self._taken_off(choice.address, events) if events is not None else 0
            if chosen.cached_tokens > evicting:
                metrics.PREDICTED_CACHED.labels(choice.address, chosen.view).inc(chosen.cached_tokens - evicting)
            if events is not None:
                if forecast := events.in_flight.get(choice.address, 0):
                    metrics.PREDICTED_IN_FLIGHT.labels(choice.address).inc(forecast)
                if evicting:
                    metrics.PREDICTED_EVICTED.labels(choice.address).inc(evicting)
        return choice

    def release(self, choice: Choice) -> None:
        """The picked request ended (Envoy closed its stream)."""
        if choice.address is not None:
            self.load.release(choice.address, _prefill(choice, _chosen(choice)))
            if self.share is not None:
                self.share.released(id(choice))
            pended = self._pended.pop(id(choice), None)
            if pended is not None and self.precise is not None:
                outcome = self.precise.unpend(*pended)
                if outcome is not None and self.forecast is not None:
                    forecast, evicted, missed = outcome
                    self.forecast.on_outcome(choice.address, forecast, evicted, missed)
                    for kind, blocks in zip(FORECAST_OUTCOMES, (evicted, forecast - evicted, missed), strict=True):
                        metrics.EVICTION_FORECAST_CHECKED.labels(choice.address, kind).inc(blocks)

    def add_remote(self, address: str, prefill: int, run: Sequence[int], now: float) -> bool:
        """Another router replica sent a request to ``address``: its load and its blocks in flight
        count as this router's own do (extproc.pick.sources.shared_in_flight). Returns whether its load
        was counted (``address`` is one of this router's replicas), for ``drop_remote``."""
        if self.precise is not None:
            self.precise.add_pending(address, run)
        if not self.load.knows(address):
            return False
        self.load.assign(address, prefill, now)
        return True

    def drop_remote(self, address: str, prefill: int, run: Sequence[int], counted: bool) -> None:
        """That request ended."""
        if counted:
            self.load.release(address, prefill)
        if self.precise is not None:
            self.precise.drop_pending(address, run)

    def _taken_off(self, address: str, exact: Exact) -> int:
        """Tokens the eviction forecast takes off ``address``'s events figure: what it forecast,
        scaled by how its recent forecasts there came out (``EvictionForecast.scale``), at most all."""
        tokens = exact.evicting.get(address, 0)
        if not tokens or self.forecast is None:
            return tokens
        size = exact.sizes[address]
        return min(round(tokens / size * self.forecast.scale(address)) * size, exact.cached[address])

    # --- observation -------------------------------------------------------------------
    def publish_metrics(self) -> None:
        """Index and per-replica load gauges, set when /metrics is read (not on every scrape)."""
        stats = self.index.stats()
        metrics.INDEX_ENTRIES.set(stats.entries)
        metrics.INDEX_BYTES.set(stats.bytes)
        for r in self.load.snapshot().replicas:
            values = (r.in_flight, self.load.own(r.address), r.running, r.waiting, r.kv_usage)
            for kind, value in zip(LOAD_KINDS, values):
                metrics.REPLICA_LOAD.labels(r.address, kind).set(value)

    def state(self) -> dict[str, Any]:
        """Everything the choice reads, as JSON (``/debug/state``, ``explain --state``)."""
        stats = self.index.stats()
        return {
            "chunk_bytes": self.chunk_bytes,
            "bytes_per_token": self.bytes_per_token,
            "index": {"entries": stats.entries, "chunks": stats.chunks, "bytes": stats.bytes},
            "replicas": [
                {"address": r.address, "healthy": r.healthy, "in_flight": r.in_flight,
                 "own_in_flight": self.load.own(r.address), "running": r.running,
                 "waiting": r.waiting, "kv_usage": r.kv_usage, "capacity_tokens": r.capacity_tokens,
                 "backlog_tokens": r.backlog_tokens,
                 "index_capacity_chunks": self.index.capacity(r.address),
                 "chunks": [f"{h:016x}" for h in self.index.holds(r.address)]}
                for r in self.load.snapshot(self.clock()).replicas
            ],
        }

    def explain(self, decision: Decision, settings: RouteSettings) -> dict[str, Any]:
        """The choice this request would get now, without recording it, with each candidate's view
        and, in precise mode, where that replica's event view comes from and the tokens the eviction
        forecast took off its figure (``/debug/pick``)."""
        choice, _, exact = self._evaluate(decision, settings)
        origin = self.precise.origin if self.precise is not None else (lambda _a: "none")
        return {"address": choice.address, "reason": choice.reason, "prompt_tokens": choice.prompt_tokens,
                "candidates": [{**c._asdict(), "events_origin": origin(c.address),
                                "forecast_evicted_tokens": self._taken_off(c.address, exact) if exact else 0}
                               for c in choice.candidates]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "PickCore":
        """A core that sees what a saved ``state()`` saw (loads frozen as they were)."""
        core = cls(int(state.get("chunk_bytes", 512)), float(state.get("bytes_per_token", 4.0)))
        replicas = state.get("replicas", [])
        core.load.set_addresses([r["address"] for r in replicas])
        for r in replicas:
            core.index.set_capacity(r["address"], int(r.get("index_capacity_chunks", 0)))  # 0: unknown
            core.load.restore(ReplicaState(
                r["address"], bool(r.get("healthy", True)), int(r.get("in_flight", 0)),
                kv_usage=float(r.get("kv_usage", 0)), capacity_tokens=int(r.get("capacity_tokens", 0)),
                backlog_tokens=int(r.get("backlog_tokens", 0))))
        core.index.load({r["address"]: [int(h, 16) for h in r.get("chunks", [])] for r in replicas})
        return core


def _chosen(choice: Choice) -> Candidate:
    """The chosen replica's candidate (``choice.address`` is one of them): mostly the first, which is
    checked before a generator is set up (pick and release ask it on every request)."""
    first = choice.candidates[0]
    return first if first.address == choice.address else next(
        c for c in choice.candidates if c.address == choice.address)


def _prefill(choice: Choice, chosen: Candidate) -> int:
    """Prefill tokens the chosen replica (``chosen``, found by the caller once) computes for this
    request (its cost's first term)."""
    return prefill_tokens(choice.prompt_tokens, chosen.cached_tokens)


def _forget_series(gauge: Any, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:
        pass
