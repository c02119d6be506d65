"""The eviction forecast: what a queueing replica will have evicted before it admits a request (pure).

Checked against a small model of vLLM's block pool (a free queue, least recently freed evicted
first, a request's blocks freed tail first), driven through the real EventIndex and PreciseView.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc import metrics
from extproc.core.decide import Decision, decide
from extproc.core.settings import RouteSettings
from extproc.pick.choice.load import LoadTracker
from extproc.pick.choice.state import Sample
from extproc.pick.core import PickCore
from extproc.pick.events.block_hashes import block_hashes
from extproc.pick.events.eviction_forecast import EvictionForecast, surviving
from extproc.pick.events.kv_events import BlockRemoved, BlockStored
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.pick.views.event_view import EventView
from extproc.pick.views.learned import LearnedView
from extproc.pick.views.partial import CombinedView
from extproc.pick.views.precise import Exact, PreciseView
from extproc.process.explain import render_pick
from routerlab.assets import TINY_BYTELEVEL

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
BS = 4
BUSY = Sample(running=8, waiting=4, kv_usage=0.99, capacity_tokens=100 * 16, block_size=16)  # queueing, KV full


class Live:
    origin = "events"


def test_blocks_per_finished_request_come_from_the_clock_and_the_success_counter() -> None:
    f = EvictionForecast()
    f.on_sample(A, allocated=100, done=10)
    assert f.per_request(A) == 0.0 and f.threshold(A, 100, waiting=3, free_blocks=50) is None  # one scrape: no rate
    f.on_sample(A, allocated=160, done=13)  # 60 blocks over 3 requests
    assert f.per_request(A) == 20.0
    assert f.threshold(A, 160, waiting=3, free_blocks=50) == 160 + 20 * 4 - 50
    # nothing queued: the step running now allocates too, announced after it
    assert f.threshold(A, 160, waiting=0, free_blocks=50) == 160 + 20 - 50
    f.on_sample(A, allocated=160, done=15)  # two more finished, nothing allocated: the rate falls
    assert 0 < f.per_request(A) < 20.0
    f.on_sample(A, allocated=160, done=2)  # the counter went back: a new process, start again
    assert f.per_request(A) == 0.0
    f.forget(A)
    assert f.per_request(A) == 0.0


@given(st.lists(st.one_of(st.none(), st.integers(0, 60)), min_size=1, max_size=40), st.integers(-5, 60), st.data())
@settings(max_examples=300, deadline=None)
def test_surviving_is_the_prefix_of_blocks_with_enough_ahead_of_them(readings: list[int | None], threshold: int,
                                                                     data: st.DataObject) -> None:
    run = list(range(1000, 1000 + len(readings)))
    held = data.draw(st.integers(0, len(run)))
    floor = data.draw(st.integers(0, held))
    last_use = {h: t for h, t in zip(run, readings) if t is not None}
    seen = [last_use[h] for h in run[floor:held] if h in last_use]
    if not seen:
        expected = held  # no evidence: all kept
    else:
        last = max(i for i in range(floor, held) if run[i] in last_use)

        def reading(i: int) -> int:  # the latest reading at or after i; after the last one, that one
            return max(last_use[h] for h in run[i:held] if h in last_use) if i <= last else last_use[run[last]]
        expected = floor
        while expected < held and reading(expected) - expected > threshold:
            expected += 1
    assert surviving(run, held, floor, last_use.get, threshold) == expected


def test_a_chain_with_no_reading_survives() -> None:
    assert surviving([1, 2, 3], 3, 0, {}.get, threshold=10**9) == 3


class Pool:
    """vLLM's block pool in miniature: a free queue (oldest first), evicting for each allocation."""

    def __init__(self, blocks: int) -> None:
        self.free: OrderedDict[int, None] = OrderedDict((-i - 1, None) for i in range(blocks))  # empty blocks first
        self.pinned: dict[int, int] = {}

    def run(self, chain: list[int]) -> tuple[list[int], list[int]]:
        """Admit a request over ``chain`` (own hashes): its hits, then allocations; returns (stored, evicted)."""
        stored, evicted = [], []
        for h in chain:
            if h in self.pinned:
                self.pinned[h] += 1
            elif h in self.free:
                del self.free[h]
                self.pinned[h] = 1
            else:
                victim, _ = self.free.popitem(last=False)
                if victim >= 0:
                    evicted.append(victim)
                self.pinned[h] = 1
                stored.append(h)
        return stored, evicted

    def finish(self, chain: list[int]) -> None:
        for h in reversed(chain):  # vLLM frees a request's blocks tail first
            self.pinned[h] -= 1
            if not self.pinned[h]:
                del self.pinned[h]
                self.free[h] = None

    def holds(self, chain: list[int]) -> int:
        n = 0
        while n < len(chain) and (chain[n] in self.free or chain[n] in self.pinned):
            n += 1
        return n


def _conversation(c: int, blocks: int) -> tuple[list[int], list[int]]:
    """A prompt of ``blocks`` full blocks of its own tokens, and its own chain hashes."""
    ids = [c * 1000 + i for i in range(blocks * BS)]
    return ids, block_hashes(ids, BS)


def _run(pool: Pool, index: EventIndex, ids: list[int], chain: list[int]) -> None:
    """One request through the pool, announced as vLLM would (the engine hash being the own hash), and ended."""
    stored, evicted = pool.run(chain)
    events: list = [BlockRemoved(tuple(evicted))] if evicted else []
    if stored:
        k = chain.index(stored[0])
        events.append(BlockStored(tuple(chain[k:]), chain[k - 1] if k else None, tuple(ids[k * BS:]), BS))
    index.apply(A, events)
    pool.finish(chain)


@given(st.integers(4, 12), st.integers(0, 8), st.integers(2, 6))
@settings(max_examples=100, deadline=None)
def test_the_forecast_finds_what_a_full_pool_keeps_of_a_conversation_after_the_queue_ahead(
        warm: int, ahead: int, blocks: int) -> None:
    """Conversations of ``blocks`` blocks through a 40-block pool: after ``warm`` of them, what the
    forecast says the pool will still hold of the first one once ``ahead`` more have run is what the
    pool then holds, read from the events alone."""
    pool, index = Pool(40), EventIndex(stamp_events=True)
    convs = [_conversation(c, blocks) for c in range(warm + ahead)]
    for ids, chain in convs[:warm]:
        _run(pool, index, ids, chain)
    target = convs[warm - 1 if warm * blocks > 40 else 0][1]  # a conversation the pool still holds whole
    present = index.match(target).get(A, 0)
    assert present == pool.holds(target) == blocks
    free = 40  # nothing running: the whole pool is the free queue
    threshold = index.allocations(A) + blocks * ahead - free  # ahead requests of ``blocks`` new blocks each
    forecast = surviving(target, present, 0, index.last_use(A), threshold)
    for ids, chain in convs[warm:]:
        _run(pool, index, ids, chain)
    truth = pool.holds(target)
    assert forecast == truth
    assert index.match(target).get(A, 0) == truth  # the events caught up with the pool


def _queueing_fleet() -> tuple[Callable[[EvictionForecast | None], PickCore], EventIndex, Decision, int,
                                   BlockStored]:
    """Replicas A and B each hold a prompt's blocks (engine hashes 1..n, stored in one run), both
    with 8 running, 4 waiting and their KV all in use; A allocated 50 blocks between two scrapes.
    Returns a core over that fleet with a given forecast (or none), the index, the request's decision,
    its whole blocks' tokens and the event that stored them."""
    tokenizer = ModelTokenizer(TINY_BYTELEVEL)
    route = RouteSettings(mode="pick")
    body = b'{"model":"m","messages":[{"role":"user","content":"' + b"tell me about blocks " * 20 + b'"}]}'
    decision = decide(body, {}, route)
    ids = tokenizer.tokens_for(decision.document, "chat")
    own = block_hashes(ids, 16)
    whole = (len(ids) - 1) // 16 * 16
    index = EventIndex(stamp_events=True)
    precise, learned, load = PreciseView(index, {"*": tokenizer}, {A: Live(), B: Live()}), LearnedView(), LoadTracker()

    def core_with(forecast: EvictionForecast | None) -> PickCore:
        """The fleet's core with ``forecast``: the same event view, learned view and load."""
        return PickCore(CombinedView(EventView(precise, forecast), learned), load=load)

    core = core_with(None)
    core.set_endpoints([A, B])
    prompt = BlockStored(tuple(range(1, len(own) + 1)), None, tuple(ids[:len(own) * 16]), 16)
    for address in (A, B):  # the prompt's blocks, stored in one run: read at the clock then
        index.apply(address, [prompt])
    core.load.scraped(A, BUSY, 0)
    core.load.scraped(B, BUSY, 0)
    for done in (0.0, 1.0):  # two scrapes of A, 50 blocks allocated between them
        core.on_sample(A, dataclasses.replace(BUSY, requests_done=done))
        index.apply(A, [BlockStored((900 + i,), None, tuple(range(16)), 16) for i in range(50)])
    return core_with, index, decision, whole, prompt


def _forecast_of_50_blocks_a_request() -> EvictionForecast:
    forecast = EvictionForecast()
    forecast.on_sample(A, 0, 0.0)
    forecast.on_sample(A, 50, 1.0)
    return forecast


def test_a_queueing_replicas_prediction_loses_what_it_will_evict_and_the_choice_does_not_change() -> None:
    """Through PickCore: replicas A and B hold the whole prompt; A is queueing (4 waiting, 50 blocks
    allocated per finished request, its KV all in use), B is not allocating. The forecast expects A
    to have evicted the prompt before admitting it (explain shows it; a pick of A predicts no hit and
    counts the loss), B to keep it; the choice itself ranks by what each replica holds now, so it is
    the same with and without the forecast (router replicas with different readings still agree)."""
    core_with, index, decision, whole, _ = _queueing_fleet()
    route = RouteSettings(mode="pick")
    for loads in ((BUSY, BUSY), (BUSY, Sample(running=30, waiting=30, kv_usage=0.99, capacity_tokens=1600))):
        core = core_with(None)
        core.load.scraped(A, loads[0], 0)
        core.load.scraped(B, loads[1], 0)
        without = core.evaluate(decision, route)[0].address
        core = core_with(_forecast_of_50_blocks_a_request())
        info = core.explain(decision, route)
        by = {c["address"]: c for c in info["candidates"]}
        assert (by[A]["cached_tokens"], by[A]["forecast_evicted_tokens"]) == (whole, whole)
        assert render_pick(info).count("(forecast: 0 by admission)") == 1
        assert (by[B]["cached_tokens"], by[B]["forecast_evicted_tokens"]) == (whole, 0)
        predicted = {a: metrics.PREDICTED_CACHED.labels(a, "events")._value.get() for a in (A, B)}
        evicted = metrics.PREDICTED_EVICTED.labels(A)._value.get()
        choice = core.pick(decision, route)
        core.release(choice)  # ended: in flight, its blocks would be kept
        chosen = choice.address
        assert chosen == without
        gained = {a: metrics.PREDICTED_CACHED.labels(a, "events")._value.get() - predicted[a] for a in (A, B)}
        if chosen == A:
            assert gained == {A: 0, B: 0} and metrics.PREDICTED_EVICTED.labels(A)._value.get() - evicted == whole
        else:
            assert gained == {A: 0, B: whole} and metrics.PREDICTED_EVICTED.labels(A)._value.get() == evicted
    assert chosen == A  # the far busier B loses, and A's pick predicted nothing cached
    in_flight = core.pick(decision, route)  # not ended: the replica is using the prompt's blocks
    assert in_flight.address == A
    assert {c["address"]: c["forecast_evicted_tokens"] for c in core.explain(decision, route)["candidates"]}[A] == 0



def test_the_forecast_is_scaled_by_how_its_recent_forecasts_came_out() -> None:
    f = EvictionForecast()
    assert f.scale(A) == 1.0  # nothing checked: taken at its word
    f.on_outcome(A, forecast=10, evicted=0)
    assert f.scale(A) == 1.0  # fewer blocks checked than MIN_CHECKED
    for _ in range(10):
        f.on_outcome(A, forecast=10, evicted=3)
    assert 0.2 < f.scale(A) < 0.3  # most of what it said would go stayed
    for _ in range(200):  # the recent outcomes outweigh the old ones
        f.on_outcome(A, forecast=10, evicted=9)
    assert 0.89 < f.scale(A) < 0.91
    for _ in range(200):
        f.on_outcome(A, forecast=10, evicted=10, missed=5)  # and blocks it said would stay went too
    assert 1.48 < f.scale(A) <= 1.5
    f.on_outcome(A, forecast=10, evicted=99, missed=99)  # counts past the blocks watched are capped
    assert f.scale(A) <= 2.0
    assert f.scale(B) == 1.0  # per replica
    f.forget(A)
    assert f.scale(A) == 1.0


@pytest.mark.parametrize("came_true", [False, True])
def test_a_forecast_checks_itself_against_the_removals_while_the_request_is_in_flight(came_true: bool) -> None:
    """Through PickCore: each pick of the queueing replica A forecasts the whole prompt evicted. If
    the replica then removes those blocks before the request ends (and stores them again as it
    recomputes them), the forecast stands; if it keeps them (what another router's requests queued
    there would cause), what the forecast takes off falls to nothing, and the outcomes are counted."""
    core_with, index, decision, whole, prompt = _queueing_fleet()
    route = RouteSettings(mode="pick")
    core = core_with(_forecast_of_50_blocks_a_request())
    core.load.scraped(B, Sample(running=30, waiting=30, kv_usage=0.99, capacity_tokens=1600), 0)  # far busier

    def counted(outcome: str) -> float:
        return metrics.EVICTION_FORECAST_CHECKED.labels(A, outcome)._value.get()

    before = {o: counted(o) for o in ("evicted", "kept", "missed")}
    taken_off, forecast = [], whole // 16
    for _ in range(20):
        taken_off.append(_evicted_at(core, decision, route))
        choice = core.pick(decision, route)
        assert choice.address == A
        if came_true:  # the replica evicts the prompt's blocks before admitting it, then recomputes them
            index.apply(A, [BlockRemoved(prompt.block_hashes), prompt])
        core.release(choice)
    evicted, kept, missed = (counted(o) - before[o] for o in ("evicted", "kept", "missed"))
    assert missed == 0  # the forecast took the whole prompt: nothing below it to miss
    if came_true:
        assert set(taken_off) == {whole}
        assert (evicted, kept) == (20 * forecast, 0)
    else:
        assert taken_off[0] == whole and taken_off[-1] == 0 and taken_off == sorted(taken_off, reverse=True)
        assert (evicted, kept) == (0, 20 * forecast)
    assert not index._replicas[A].watched  # every watch ended


def _evicted_at(core: PickCore, decision: Decision, route: RouteSettings) -> int:
    """What the forecast takes off A's figure for ``decision`` now (explain)."""
    return {c["address"]: c["forecast_evicted_tokens"] for c in core.explain(decision, route)["candidates"]}[A]


def test_a_pending_request_watches_its_forecast_and_as_many_blocks_below_it() -> None:
    """PreciseView.pend/unpend: of 8 held blocks the forecast takes the last 2; blocks 4-5 are watched
    as the ones it said would stay. Blocks 5 and 6 leave while the request is in flight: one came
    true, one below it was missed; block 1 leaving is not the forecast's business."""
    index = EventIndex()
    tokens = list(range(8 * BS))
    index.apply(A, [BlockStored(tuple(range(1, 9)), None, tuple(tokens), BS)])
    run = block_hashes(tokens, BS)
    view = PreciseView(index, {}, {A: Live()})
    exact = Exact(8 * BS + 1, {A: 8 * BS}, {BS: run}, {A: BS}, evicting={A: 2 * BS})
    pended = view.pend(A, exact)
    assert (list(pended.forecast), list(pended.below)) == (run[6:8], run[4:6])
    index.apply(A, [BlockRemoved((6, 7, 2))])
    assert view.unpend(A, pended) == (2, 1, 1)
    assert not index._replicas[A].watched and not view.pending
    quiet = view.pend(A, exact._replace(evicting={}))
    assert not quiet.forecast and view.unpend(A, quiet) is None  # no forecast, nothing to check


def test_the_checks_series_exist_from_0_for_every_replica_and_leave_with_it() -> None:
    """The dashboard's forecast panel reads them before any replica queues."""
    def series(address: str) -> dict[str, float]:
        return {s.labels["outcome"]: s.value for m in metrics.REGISTRY.collect() for s in m.samples
                if s.name == "prefix_router_eviction_forecast_blocks_total" and s.labels.get("replica") == address}

    core = PickCore(CombinedView(EventView(PreciseView(EventIndex(), {}), EvictionForecast()), LearnedView()))
    address = "10.9.9.9:8000"
    assert series(address) == {}
    core.set_endpoints([address])
    assert series(address) == {"evicted": 0.0, "kept": 0.0, "missed": 0.0}
    core.set_endpoints([])
    assert series(address) == {}
    learned = PickCore()  # no forecast (pick mode, or --eviction-forecast off): no series
    learned.set_endpoints([address])
    assert series(address) == {}
