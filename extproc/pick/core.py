"""Pick mode's request path: a cache view and the load view around the pure choice.

The gRPC adapter calls ``pick`` with the hash-mode decision (the normalised prompt and its key)
and ``release`` when the request's ext_proc stream ends. ``pick`` does no I/O: what gathers state
(endpoint discovery, scraping, KV events) is ``extproc.pick.picker``'s, and feeds this object
through ``set_endpoints`` and ``on_sample``. What each replica holds comes from one cache view
(``extproc.pick.views.base.CacheView``), built whole and handed in: the learned view in pick
mode, the events and the learned view combined in precise mode.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

from extproc import metrics
from extproc.core.decide import Decision
from extproc.core.settings import RouteSettings
from extproc.pick.choice import saturation
from extproc.pick.choice.adapters import AdapterSlots
from extproc.pick.choice.choose import REASONS, Candidate, Choice, choose, prefill_tokens
from extproc.pick.choice.load import LoadTracker
from extproc.pick.choice.pools import EVERY_MODEL, NO_MODEL, UNKNOWN_MODEL, Pools, Served
from extproc.pick.choice.state import ReplicaState, Sample, Snapshot
from extproc.pick.flow.room_share import Peer
from extproc.pick.views.base import NOTHING, CacheView, Match, Placed
from extproc.pick.views.learned import BYTES_PER_TOKEN, LearnedView


class Share(Protocol):
    """Told of this router's picks and their ends (extproc.pick.sources.in_flight_bus.InFlightBus)."""

    def picked(self, key: int, address: str, prefill: int, run: Sequence[int]) -> None: ...

    def released(self, key: int) -> None: ...

    def continued(self, run: Sequence[int]) -> int:
        """End the other routers' requests that a request with these blocks continues (their answer is
        out; their end message may not be): extproc.pick.sources.shared_in_flight.RemoteInFlight.continued."""
        ...

    def held_here(self, pool: str, counts: Mapping[int, int], let_out: int) -> None:
        """What flow control holds of ``pool`` now, per priority class, and how many it let out (the
        routers take turns at the room by them: extproc.pick.flow.room_share)."""
        ...

    def held_elsewhere(self, pool: str) -> list[Peer]:
        """What each other router last said it holds of ``pool`` and let out."""
        ...


LOAD_KINDS: Final = ("in_flight", "own", "running", "waiting", "kv_usage", "backlog_tokens", "prefill_tokens_per_s",
                     "request_seconds", "recent_ttft_seconds", "eviction_price")
PICK_REASONS: Final = (*REASONS, NO_MODEL, UNKNOWN_MODEL)
_PICKS: Final = {reason: metrics.PICKS.labels(reason) for reason in PICK_REASONS}  # every series from 0


class Remote:
    """Where the other router replicas' requests in flight are applied (``RemoteInFlight``'s target):
    their load and their blocks count as this router's own do. Built before the core, so the channel
    that feeds it can be handed to the core whole."""

    def __init__(self, load: LoadTracker, view: CacheView, clock: Callable[[], float] = time.monotonic) -> None:
        self.load = load
        self.view = view
        self.clock = clock

    def add_remote(self, address: str, prefill: int, run: Sequence[int], now: float) -> bool:
        """Another router replica sent a request to ``address``. Returns whether its load was counted
        (``address`` is one of this router's replicas), for ``drop_remote``."""
        self.view.add_remote(address, run)
        if not self.load.knows(address):
            return False
        self.load.assign(address, prefill, now)
        return True

    def drop_remote(self, address: str, prefill: int, run: Sequence[int], counted: bool) -> None:
        """That request ended."""
        if counted:
            self.load.release(address, prefill, self.clock())
        self.view.drop_remote(address, run)


class PickCore:
    """A cache view + the load view + the choice, without background tasks (``explain`` uses it alone)."""

    def __init__(self, view: CacheView | None = None, *, load: LoadTracker | None = None,
                 share: Share | None = None, pools: Pools | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``view``: what the replicas hold (default: a learned view with default settings); ``load``:
        their load (shared with ``Remote`` when the routers share requests in flight); ``share``: told of
        every pick and its end, for the other router replicas; ``pools``: which replicas serve which
        model (None: every replica serves every model)."""
        self.view: CacheView = view if view is not None else LearnedView()
        self.load = load if load is not None else LoadTracker()
        self.share = share
        self.pools = pools if pools is not None else Pools()
        self.clock = clock
        self._pool_snapshots: dict[str, tuple[Snapshot, Snapshot]] = {}  # pool -> (whole, its replicas)
        self.adapters = AdapterSlots()
        self._adapter_of: dict[int, str] = {}  # id(choice) -> the LoRA adapter it runs, while in flight
        self._hits: dict[str, float] = {}  # each replica's last vllm:prefix_cache_hits_total
        self._placed: dict[int, Placed] = {}  # id(choice) -> what the view kept of it

    # --- state updates -----------------------------------------------------------------
    def set_endpoints(self, addresses: Sequence[str]) -> None:
        """The router's replicas now: every pool's (``set_pool``), or without --pools the one pool's."""
        if not self.pools.named:
            self.pools.set_members(EVERY_MODEL, addresses)
        added, removed = self.load.set_addresses(addresses)
        for address in added:
            self.view.joined(address)
        for address in removed:
            self.view.left(address)
            self.adapters.left(address)
            for kind in LOAD_KINDS:
                metrics.forget_series(metrics.REPLICA_LOAD, address, kind)
            metrics.forget_series(metrics.REPLICA_UP, address)
        metrics.ENDPOINTS.set(len(self.load.addresses()))

    def set_pool(self, pool: str, addresses: Sequence[str]) -> None:
        """One pool's replicas changed (``--pools``); the router's replicas are every pool's."""
        for address in self.pools.members[pool] - set(addresses):
            metrics.forget_series(metrics.REPLICA_POOL, address, pool)
        self.pools.set_members(pool, addresses)
        for address in addresses:
            metrics.REPLICA_POOL.labels(address, pool).set(1)
        self.set_endpoints(sorted(self.pools.addresses()))

    def on_models(self, address: str, models: Sequence[Served]) -> None:
        """What a replica's /v1/models lists now (its served names and adapters)."""
        self.pools.served(address, models)

    def on_sample(self, address: str, sample: Sample | None) -> None:
        metrics.REPLICA_UP.labels(address).set(0 if sample is None else 1)
        if sample is None:
            return
        self.adapters.scraped(address, sample)
        before = self._hits.get(address)
        self._hits[address] = sample.prefix_cache_hits
        restarted = before is not None and sample.prefix_cache_hits < before
        self.view.sampled(address, sample, restarted)  # a counter that went back: a new process, cache empty
        self.load.priced(address, self.view.eviction_price(address))
        if restarted:
            metrics.LEARNED_CLEARED.inc()
        if before is not None:
            gained = sample.prefix_cache_hits - (0 if restarted else before)
            if gained > 0:
                metrics.REPLICA_CACHE_HITS.labels(address).inc(gained)

    # --- the request path --------------------------------------------------------------
    def evaluate(self, decision: Decision, settings: RouteSettings) -> tuple[Choice, Match | None]:
        """The choice for a request and the view's match (None: the view could not say), without
        recording it (``explain`` stops here)."""
        return self._evaluate(decision, settings)

    def _evaluate(self, decision: Decision, settings: RouteSettings, max_new_chars: int = 0,
                  settle: bool = False, avoid_saturated: bool = False) -> tuple[Choice, Match | None]:
        """``settle`` (``pick``): first end the other routers' requests this one continues
        (``Share.continued``), so their load no longer counts."""
        pool, unpicked = self.pools.resolve(decision.model)
        if pool is None:
            return Choice(None, unpicked or UNKNOWN_MODEL, 0, ()), None
        snapshot = self._snapshot(pool)
        match = self.view.match(decision, settings, snapshot, max_new_chars)
        adapter = self._adapter(decision, settings)
        if match is None:  # the view cannot say: no replica holds any of it as far as the choice knows
            tokens = math.ceil(len(decision.normalized) / BYTES_PER_TOKEN)
            slots = self._adapter_costs(adapter, snapshot, tokens, settings)
            return choose(decision.key, tokens, {}, snapshot, settings, pool=pool, adapter=slots,
                          avoid_saturated=avoid_saturated), None
        if settle and match.runs and self.share is not None:
            if sum(self.share.continued(run) for run in match.runs):
                snapshot = self._snapshot(pool)
        slots = self._adapter_costs(adapter, snapshot, match.prompt_tokens, settings)
        choice = choose(decision.key, match.prompt_tokens, match.cached, snapshot, settings, match.views, pool, slots,
                        avoid_saturated)
        return choice, match

    def _adapter_costs(self, adapter: str | None, snapshot: Snapshot, tokens: int,
                       settings: RouteSettings) -> dict[str, int] | None:
        """Each replica's adapter term (extproc.pick.choice.adapters); None for a base model."""
        return None if adapter is None else self.adapters.costs(adapter, snapshot.replicas, tokens, settings)

    def _adapter(self, decision: Decision, settings: RouteSettings) -> str | None:
        """The LoRA adapter the request runs, when the choice prices adapters (None: a base model)."""
        return self._lora(decision) if settings.adapter_affinity else None

    def _lora(self, decision: Decision) -> str | None:
        """The LoRA adapter the request names (None: a base model, or no model)."""
        model = decision.model
        return model if model and self.pools.base_of(model) else None

    def _snapshot(self, pool: str) -> Snapshot:
        """The load snapshot now, of ``pool``'s replicas only (every replica without --pools); a
        pool's is rebuilt only when the whole one changes."""
        snapshot = self.load.snapshot(self.clock())
        if not self.pools.named:
            return snapshot
        kept = self._pool_snapshots.get(pool)
        if kept is None or kept[0] is not snapshot:
            members = self.pools.members[pool]
            kept = self._pool_snapshots[pool] = (snapshot, Snapshot(tuple(
                r for r in snapshot.replicas if r.address in members)))
        return kept[1]

    def pool_of(self, decision: Decision) -> str | None:
        """The pool the request is picked in (None: it is not picked: no model, or one no pool serves)."""
        return self.pools.resolve(decision.model)[0]

    def room(self, pool: str, settings: RouteSettings, keep: int = 0) -> int:
        """Requests ``pool`` can start soon, ``keep`` of its free replicas left free
        (extproc.pick.choice.saturation): flow control holds the rest."""
        return saturation.room(self._snapshot(pool), settings, keep)

    def ahead_work(self, decision: Decision, settings: RouteSettings) -> object | None:
        """Before ``pick``, on the event loop: what must happen off it first (``run_ahead``), or None.
        Nothing here (``Picker`` tokenises precise mode's long new text ahead)."""
        return None

    async def run_ahead(self, work: object) -> int:
        """Do ``ahead_work``'s ``work``; returns ``pick``'s ``max_new_chars``."""
        return 0

    def pick(self, decision: Decision, settings: RouteSettings, max_new_chars: int = 0,
             avoid_saturated: bool = False) -> Choice:
        """Choose and record. ``max_new_chars`` (0: no limit): precise mode tokenises at most this many
        characters its tokenizer's cache does not hold, else uses the learned view (``Picker.prepare``
        says when: its worker could not take the request's long new text)."""
        choice, match = self._evaluate(decision, settings, max_new_chars, settle=True, avoid_saturated=avoid_saturated)
        _PICKS[choice.reason].inc()
        if self.pools.named:
            metrics.POOL_PICKS.labels(choice.pool or "", choice.reason).inc()
        address = choice.address
        if address is not None:
            placed = self.view.learn(address, match) if match is not None else NOTHING
            if placed is not NOTHING:
                self._placed[id(choice)] = placed
            chosen = _chosen(choice)
            prefill = _prefill(choice, chosen)
            self.load.assign(address, prefill, self.clock())
            lora = self._lora(decision)
            if lora is not None:  # its slot there is taken, whatever the settings
                self.adapters.assign(address, lora)
                self._adapter_of[id(choice)] = lora
            if self.share is not None:
                self.share.picked(id(choice), address, prefill, placed.run)
            if chosen.cached_tokens > placed.taken_off:
                metrics.PREDICTED_CACHED.labels(address, chosen.view).inc(chosen.cached_tokens - placed.taken_off)
        return choice

    def held_here(self, pool: str, counts: Mapping[int, int], let_out: int) -> None:
        """Flow control's held requests of ``pool`` per class and its let-outs, for the other routers."""
        if self.share is not None:
            self.share.held_here(pool, counts, let_out)

    def held_elsewhere(self, pool: str) -> list[Peer]:
        """The other router replicas' held requests of ``pool`` and let-outs ([] alone)."""
        return self.share.held_elsewhere(pool) if self.share is not None else []

    def release(self, choice: Choice) -> None:
        """The picked request ended (Envoy closed its stream)."""
        if choice.address is not None:
            self.load.release(choice.address, _prefill(choice, _chosen(choice)), self.clock())
            if self.share is not None:
                self.share.released(id(choice))
            placed = self._placed.pop(id(choice), None)
            if placed is not None:
                self.view.forget(choice.address, placed)
            adapter = self._adapter_of.pop(id(choice), None)
            if adapter is not None:
                self.adapters.release(choice.address, adapter)

    # --- observation -------------------------------------------------------------------
    def publish_metrics(self) -> None:
        """Index and per-replica load gauges, set when /metrics is read (not on every scrape)."""
        stats = self.view.stats()
        metrics.INDEX_ENTRIES.set(stats.entries)
        metrics.INDEX_BYTES.set(stats.bytes)
        for r in self.load.snapshot(self.clock()).replicas:
            values = (r.in_flight, self.load.own(r.address), r.running, r.waiting, r.kv_usage, r.backlog_tokens,
                      *self.load.speed(r.address), r.eviction_price)
            for kind, value in zip(LOAD_KINDS, values):
                metrics.REPLICA_LOAD.labels(r.address, kind).set(value)

    def state(self) -> dict[str, Any]:
        """Everything the choice reads, as JSON (``/debug/state``, ``explain --state``)."""
        stats = self.view.stats()
        return {
            **self.view.state(),
            **self.pools.state(),
            "prefill_tokens_per_s": self.load.prefill_rate,
            "index": {"entries": stats.entries, "chunks": stats.chunks, "bytes": stats.bytes},
            "replicas": [
                {"address": r.address, "healthy": r.healthy, "in_flight": r.in_flight,
                 "own_in_flight": self.load.own(r.address), "running": r.running,
                 "waiting": r.waiting, "kv_usage": r.kv_usage, "capacity_tokens": r.capacity_tokens,
                 "backlog_tokens": r.backlog_tokens, "token_cost": round(r.token_cost, 4),
                 "request_tokens": r.request_tokens, "eviction_price": round(r.eviction_price, 4),
                 **self.adapters.state(r.address),
                 **self.view.replica_state(r.address)}
                for r in self.load.snapshot(self.clock()).replicas
            ],
        }

    def explain(self, decision: Decision, settings: RouteSettings) -> dict[str, Any]:
        """The choice this request would get now, without recording it, with each candidate's view
        and, in precise mode, where that replica's event view comes from and the tokens the eviction
        forecast took off its figure (``/debug/pick``)."""
        choice, match = self._evaluate(decision, settings)
        return {"address": choice.address, "reason": choice.reason, "pool": choice.pool,
                "prompt_tokens": choice.prompt_tokens,
                "candidates": [{**c._asdict(), **self.view.describe(c.address, match)} for c in choice.candidates]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PickCore:
        """A core that sees what a saved ``state()`` saw (loads frozen as they were)."""
        view = LearnedView(int(state.get("chunk_bytes", 512)), float(state.get("bytes_per_token", 4.0)))
        # a clock that stands still: the saved queues do not drain while explain reads them
        saved_pools: Mapping[str, Sequence[str]] = state.get("pools", {})
        pools = Pools(name for name in saved_pools if name != EVERY_MODEL)
        core = cls(view, load=LoadTracker(float(state.get("prefill_tokens_per_s", 0.0))), pools=pools,
                   clock=lambda: 0.0)
        replicas = state.get("replicas", [])
        core.load.set_addresses([r["address"] for r in replicas])
        for pool in pools.order:
            pools.set_members(pool, saved_pools.get(pool, [r["address"] for r in replicas]))
        for address, cards in state.get("served", {}).items():
            pools.served(address, [Served(*card) for card in cards])
        view.restore(replicas)
        for r in replicas:
            core.load.restore(ReplicaState(
                r["address"], bool(r.get("healthy", True)), int(r.get("in_flight", 0)),
                kv_usage=float(r.get("kv_usage", 0)), capacity_tokens=int(r.get("capacity_tokens", 0)),
                backlog_tokens=int(r.get("backlog_tokens", 0)), token_cost=float(r.get("token_cost", 1.0)),
                request_tokens=int(r.get("request_tokens", 0))))
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
