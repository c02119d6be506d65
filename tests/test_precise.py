"""Precise mode's matching and pick mode's use of it, pure (no sockets): PreciseView and PickCore."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc import metrics
from extproc.core.decide import decide
from extproc.core.settings import RouteSettings
from extproc.pick.core import PickCore
from extproc.pick.events.block_hashes import block_hashes, request_extra_keys
from extproc.pick.events.kv_events import BlockRemoved, BlockStored
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.tokens.prompt_tokens import ModelTokenizer, NotTokenizable
from extproc.pick.views.event_view import EventView
from extproc.pick.views.learned import LearnedView
from extproc.pick.views.learned_index import LearnedIndex
from extproc.pick.views.partial import CombinedView
from extproc.pick.views.precise import PreciseView, _longest_shared, _shared
from routerlab.assets import TINY_BYTELEVEL

BS = 16
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
PICK = RouteSettings(mode="pick")
SYSTEM = "You answer questions about the ACME deploy pipeline with numbered runbook steps. " * 8


class Live:
    origin = "events"


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(TINY_BYTELEVEL)


def body(question: str, system: str = SYSTEM, **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": question}], **extra}).encode()


def store(index: EventIndex, address: str, ids: list[int], salt: str | None = None) -> None:
    """What vLLM would announce after computing ``ids``: every full block, with its extra keys."""
    n = len(ids) // BS
    extra = request_extra_keys(n, salt, None)
    index.apply(address, [BlockStored(tuple(range(1000, 1000 + n)), None, tuple(ids[:n * BS]), BS,
                                      extra_keys=tuple(extra))])


def core_with(tokenizer: ModelTokenizer, covered: tuple[str, ...] = (A, B)) -> tuple[PickCore, EventIndex]:
    """A precise-mode core as ``Picker`` builds it, over replicas A and B, the events covering ``covered``."""
    index = EventIndex()
    core = PickCore(CombinedView(EventView(PreciseView(index, {"*": tokenizer}, {a: Live() for a in covered})),
                                 LearnedView()))
    core.set_endpoints([A, B])
    return core, index


def precise_of(core: PickCore) -> PreciseView:
    view = core.view
    assert isinstance(view, CombinedView)
    return view.events.precise


def learned_of(core: PickCore) -> LearnedIndex:
    view = core.view
    assert isinstance(view, CombinedView) and isinstance(view.learned.index, LearnedIndex)
    return view.learned.index


def test_cached_tokens_are_whole_blocks_capped_below_the_prompt(tokenizer: ModelTokenizer) -> None:
    core, index = core_with(tokenizer)
    first = decide(body("How do I roll back?"), {}, PICK)
    ids = tokenizer.tokens_for(first.document, "chat")
    store(index, A, ids)
    exact = precise_of(core).match(first)
    assert exact.prompt_tokens == len(ids)
    assert exact.cached == {A: (len(ids) - 1) // BS * BS, B: 0}  # vLLM computes at least the last token
    second = precise_of(core).match(decide(body("And how do I roll forward?"), {}, PICK))
    shared = next(i for i, (x, y) in enumerate(zip(ids, tokenizer.tokens_for(
        json.loads(body("And how do I roll forward?")), "chat"))) if x != y)
    assert second.cached[A] == shared // BS * BS and second.cached[B] == 0


def test_a_salted_request_matches_only_blocks_stored_with_its_salt(tokenizer: ModelTokenizer) -> None:
    core, index = core_with(tokenizer)
    salted = decide(body("q", cache_salt="tenant-a"), {}, PICK)
    ids = tokenizer.tokens_for(salted.document, "chat")
    store(index, A, ids, salt="tenant-a")
    store(index, B, ids)  # the same tokens without the salt
    exact = precise_of(core).match(salted)
    assert exact.cached[A] > 0 and exact.cached[B] == 0
    assert precise_of(core).match(decide(body("q"), {}, PICK)).cached == {A: 0, B: exact.cached[A]}


def test_a_request_in_flight_counts_its_blocks_on_its_replica_until_it_ends(tokenizer: ModelTokenizer) -> None:
    """Two requests on a new system prompt arriving together must meet on one replica: the first's
    blocks are being computed there before vLLM announces them."""
    core, _ = core_with(tokenizer)
    precise_of(core).block_size_hint = BS  # as the first scrape of vllm:cache_config_info sets it
    long_system = SYSTEM * 8  # long enough that waiting behind the first beats computing it again
    first = core.pick(decide(body("first question", system=long_system), {}, PICK), PICK)
    second_decision = decide(body("second question", system=long_system), {}, PICK)
    exact = precise_of(core).match(second_decision)
    during = exact.cached
    assert during[first.address] > 0 and sum(during.values()) == during[first.address]
    assert exact.in_flight == {first.address: during[first.address]}  # all of it a forecast: no event yet
    forecast = metrics.PREDICTED_IN_FLIGHT.labels(first.address)
    before = forecast._value.get()
    second = core.pick(second_decision, PICK)
    assert second.address == first.address and second.reason == "cheapest"
    assert forecast._value.get() - before == during[first.address]
    core.release(first)
    core.release(second)
    assert precise_of(core).pending == {} and precise_of(core).match(second_decision).cached == {A: 0, B: 0}


def test_uncovered_replicas_and_untokenisable_requests_keep_the_learned_view(tokenizer: ModelTokenizer) -> None:
    core, index = core_with(tokenizer, covered=(A,))
    d = decide(body("q"), {}, PICK)
    store(index, A, tokenizer.tokens_for(d.document, "chat"))
    choice, _ = core.evaluate(d, PICK)
    assert {c.address: c.view for c in choice.candidates} == {A: "events", B: "learned"}
    image = decide(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}).encode(), {}, PICK)
    with pytest.raises(NotTokenizable) as exc:
        precise_of(core).match(image)
    assert exc.value.reason == "multimodal"
    assert {c.view for c in core.evaluate(image, PICK)[0].candidates} == {"learned"}
    learned_only = RouteSettings(mode="pick", cache_view="learned")  # a route that turns it off
    assert {c.view for c in core.evaluate(d, learned_only)[0].candidates} == {"learned"}


def test_the_learned_view_learns_only_what_the_events_do_not_cover(tokenizer: ModelTokenizer) -> None:
    """Events covering every replica leave the learned index untouched (it would only cost time);
    a replica they do not cover, or a request they cannot match, is recorded as pick mode does."""
    core, _ = core_with(tokenizer)
    core.release(core.pick(decide(body("covered"), {}, PICK), PICK))
    assert learned_of(core).stats().entries == 0
    image = json.dumps({"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}).encode()
    core.release(core.pick(decide(image, {}, PICK), PICK))
    assert learned_of(core).stats().entries == 1
    core, _ = core_with(tokenizer, covered=(A,))
    picks = [core.pick(decide(body(f"q{i}"), {}, PICK), PICK) for i in range(6)]
    on_b = sum(c.address == B for c in picks)
    assert 0 < on_b < len(picks)  # the load spreads them, so both kinds of replica were chosen
    assert list(learned_of(core).holds(A)) == [] and list(learned_of(core).holds(B))  # learned only where placed on B


def test_request_hashes_match_what_vllm_stores_for_completions_token_prompts(tokenizer: ModelTokenizer) -> None:
    core, index = core_with(tokenizer)
    ids = list(range(5, 5 + 10 * BS + 3))
    index.apply(B, [BlockStored(tuple(range(10)), None, tuple(ids[:10 * BS]), BS)])
    exact = precise_of(core).match(decide(json.dumps({"model": "m", "prompt": ids}).encode(), {}, PICK))
    assert exact.cached == {A: 0, B: 10 * BS} and list(exact.hashes[BS]) == block_hashes(ids[:10 * BS], BS)


def test_shared_leading_blocks_of_two_chains() -> None:
    chain = block_hashes(list(range(160)), BS)  # 10 blocks
    other = block_hashes(list(range(100)) + [7] * 60, BS)  # the same first 6 blocks, then apart
    assert [_shared(chain, o) for o in (chain, other, chain[:3], [], chain + [1])] == [10, 6, 3, 0, 10]
    assert _shared(chain, other, 4) == 6 and _shared(chain, chain, 10) == 10


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=6))
def test_the_longest_shared_run_is_the_best_of_every_pair(run: list[int], others: list[list[int]]) -> None:
    chains = [list(itertools.accumulate(r, lambda h, t: h * 5 + t + 1)) for r in [run, *others]]  # chain hashes
    assert _longest_shared(chains[0], chains[1:]) == max((_shared(chains[0], o) for o in chains[1:]), default=0)


def test_a_hybrid_models_window_groups_bound_the_match_and_the_credit_for_requests_in_flight(
        tokenizer: ModelTokenizer) -> None:
    """A replica whose events show a sliding-window group (vLLM 0.32: each store says its kind and
    window) is matched as vLLM matches it: the full-attention prefix, then the window before the hit
    point; and a request of ours in flight there adds credit only as far as the window groups' events
    allow (where it leaves its window is not known before it is stored)."""
    core, index = core_with(tokenizer)
    decision = decide(body("How do I roll back?"), {}, PICK)
    ids = tokenizer.tokens_for(decision.document, "chat")
    n = (len(ids) - 1) // BS
    engine = tuple(range(1000, 1000 + n))
    full = BlockStored(engine, None, tuple(ids[:n * BS]), BS, group_idx=1, kv_cache_spec_kind="full_attention")

    def window(kept: range) -> BlockStored:
        return BlockStored(tuple(engine[i] for i in kept), None, tuple(ids[:kept.stop * BS]), BS, group_idx=0,
                           kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=2 * BS)

    index.apply(A, [window(range(n - 2, n)), full])
    assert precise_of(core).match(decision).cached[A] == n * BS  # the window before block n is held
    index.apply(A, [BlockRemoved((engine[n - 1],), group_idx=0), window(range(1, 3))])
    assert precise_of(core).match(decision).cached[A] == 3 * BS  # now only the window before block 3
    precise_of(core).add_pending(A, precise_of(core).match(decision).hashes[BS])  # the same prompt in flight there
    exact = precise_of(core).match(decision)
    assert exact.cached[A] == 3 * BS and A not in exact.in_flight


def test_the_coverage_kept_between_requests_follows_every_change_that_makes_it(tokenizer: ModelTokenizer) -> None:
    """Which replicas the events cover, which of them partly, and their block sizes are kept from one
    request to the next: each thing they are made of, changed, changes them at the next request."""
    class View:
        def __init__(self, origin: str) -> None:
            self.origin = origin

    index = EventIndex()
    views = {A: View("events"), B: View("none")}
    view = PreciseView(index, {"*": tokenizer}, views)
    assert view._coverage() == ([A], (), {})
    first = view._coverage()
    assert view._coverage() is first  # nothing changed: the same answer, not walked again
    view.block_size_hint = 16
    assert view._coverage() == ([A], (), {A: 16})
    views[B].origin = "partial"
    assert view._coverage() == ([A, B], (B,), {A: 16, B: 16})
    index.apply(A, [BlockStored((1,), None, tuple(range(32)), 32)])  # its events name its block size
    assert view._coverage() == ([A, B], (B,), {A: 32, B: 16})
    index.remove(A)
    assert view._coverage() == ([A, B], (B,), {A: 16, B: 16})
    del views[A]
    views["10.0.0.3:8000"] = View("replayed")
    assert view._coverage() == ([B, "10.0.0.3:8000"], (B,), {B: 16, "10.0.0.3:8000": 16})
