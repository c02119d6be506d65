"""LoRA adapters in pick and precise mode: the scraped slots, the adapter term of the cost, and
adapter-keyed blocks (pure: no sockets)."""

from __future__ import annotations

import json

import pytest

from extproc.core.decide import decide
from extproc.core.settings import RouteSettings
from extproc.pick.choice.adapters import AdapterSlots, home_order
from extproc.pick.choice.pools import Served
from extproc.pick.choice.state import ReplicaState, Sample
from extproc.pick.core import PickCore
from extproc.pick.events.block_hashes import request_extra_keys
from extproc.pick.events.kv_events import BlockStored
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.sources.scrape import parse_metrics
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.pick.views.event_view import EventView
from extproc.pick.views.learned import LearnedView
from extproc.pick.views.partial import CombinedView
from extproc.pick.views.precise import PreciseView
from routerlab.assets import TINY_BYTELEVEL

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
PICK = RouteSettings(mode="pick")
BS = 16


def info(max_lora: int, running: str, waiting: str, at: float, engine: str | None = None) -> str:
    labels = (f'engine="{engine}",' if engine is not None else "") + (
        f'max_lora="{max_lora}",running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"')
    return f"vllm:lora_requests_info{{{labels}}} {at}\n"


def sample(max_lora: int = 2, running: frozenset[str] = frozenset(), waiting: frozenset[str] = frozenset()) -> Sample:
    return Sample(0.0, 0.0, 0.0, 0, max_lora=max_lora, running_adapters=running, waiting_adapters=waiting)


def body(model: str, question: str = "hi", system: str = "You are a SQL expert. " * 30) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": question}]}).encode()


# --- the scrape ----------------------------------------------------------------------------------

def test_the_latest_lora_sample_per_engine_says_the_slots() -> None:
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 1\n'
            + info(4, "a,b", "", 1_700_000_000.5) + info(4, "c", "d,e", 1_700_000_001.0)  # the later wins
            + info(4, "x", "", 1_699_999_999.0))
    s = parse_metrics(text)
    assert (s.max_lora, s.running_adapters, s.waiting_adapters) == (4, {"c"}, {"d", "e"})
    two = parse_metrics(info(2, "a", "", 5.0, "0") + info(2, "b", "c", 6.0, "1") + info(2, "z", "", 1.0, "1"))
    assert (two.max_lora, two.running_adapters, two.waiting_adapters) == (2, {"a", "b"}, {"c"})
    assert parse_metrics("vllm:num_requests_running 0\n").max_lora == 0  # no LoRA: nothing known
    assert parse_metrics(info(4, "", "", 1.0)).running_adapters == frozenset()


# --- the adapter term ------------------------------------------------------------------------------

def test_running_free_slot_and_full_slots_cost_nothing_the_load_and_a_request_time() -> None:
    slots = AdapterSlots()
    slots.scraped(A, sample(2, frozenset({"sql"})))
    slots.scraped(B, sample(2, frozenset({"chat"})))
    slots.scraped(C, sample(2, frozenset({"chat", "code"})))
    replicas = [ReplicaState(A), ReplicaState(B), ReplicaState(C, request_tokens=30_000)]
    settings = RouteSettings(adapter_load_tokens=500, adapter_home_tokens=0)  # the home term: the next test
    assert slots.costs("sql", replicas, 2000, settings) == {A: 0, B: 1500, C: 30_500}  # B: the load + a slot
    slots.assign(B, "sql")  # one of ours in flight there takes a slot until it ends
    assert slots.costs("sql", replicas, 2000, settings)[B] == 0
    assert slots.costs("math", replicas, 2000, settings) == {A: 1500, B: 2500, C: 30_500}  # B full: its prompt
    slots.assign(B, "math")  # ours beyond B's slots: it waits, and so would the next of it
    slots.assign(B, "sql")
    assert slots.slots(B, 2) == (["chat", "sql"], 3)
    assert slots.costs("math", replicas, 2000, settings)[B] == 2500
    slots.release(B, "math")
    slots.release(B, "sql")
    slots.release(B, "sql")
    # ended, but still in one of B's GPU slots (the last two adapters it ran): no load to run it again
    assert slots.resident(B, 2) == ["math", "sql"]
    assert slots.costs("sql", replicas, 2000, settings)[B] == 0
    slots.scraped(B, sample(2, frozenset({"chat", "code"})))  # two others ran since: they took its slot
    assert slots.resident(B, 2) == ["chat", "code"] and slots.costs("sql", replicas, 2000, settings)[B] == 2500
    slots.left(C)
    assert slots.costs("sql", replicas, 2000, settings)[C] == 0  # nothing known of its LoRA: no term


def test_where_an_adapter_must_load_its_home_replicas_come_first_the_same_on_every_router() -> None:
    replicas = [ReplicaState(f"10.0.1.{i}:8000") for i in range(5)]
    order = home_order("sql", [r.address for r in replicas])
    assert sorted(order.values()) == list(range(5))
    assert home_order("sql", [r.address for r in reversed(replicas)]) == order  # whatever order they come in
    assert home_order("chat", [r.address for r in replicas]) != order  # each adapter its own order
    slots = AdapterSlots()
    for r in replicas:
        slots.scraped(r.address, sample(2))  # every slot free everywhere
    settings = RouteSettings(adapter_load_tokens=500, adapter_home_tokens=4000)
    costs = slots.costs("sql", replicas, 2000, settings)
    assert costs == {address: 500 + 1000 * place + 1000 for address, place in order.items()}
    full = replicas[0].address
    slots.scraped(full, sample(2, frozenset({"a", "b"})))
    assert slots.costs("sql", replicas, 2000, settings)[full] == 2000 + 500 + 4000  # beyond every free slot
    assert max(v for a, v in slots.costs("sql", replicas, 2000, settings).items() if a != full) < 2000 + 500 + 4000


def lora_core() -> PickCore:
    core = PickCore(clock=lambda: 0.0)
    core.set_endpoints([A, B, C])
    for address in (A, B, C):
        core.on_models(address, [Served("llama"), Served("sql", "llama"), Served("chat", "llama"),
                                 Served("code", "llama")])
    core.on_sample(A, sample(2, frozenset({"sql"})))
    core.on_sample(B, sample(2, frozenset({"chat", "code"})))
    core.on_sample(C, sample(2, frozenset({"chat"})))
    return core


def test_an_adapters_cold_requests_go_where_it_runs_and_never_into_full_slots() -> None:
    core = lora_core()
    picks = []
    for i in range(3):  # distinct prompts: only the adapter term tells the replicas apart
        choice = core.pick(decide(body("sql", system=f"system {i} " * 60), {}, PICK), PICK)
        picks.append(choice)
        assert choice.address == A and choice.candidates[0].adapter_tokens == 0
    costs = {c.address: c.adapter_tokens for c in picks[0].candidates}
    assert costs[B] > costs[C] > 0  # B's two slots are taken; C has a free one
    off = RouteSettings(mode="pick", adapter_affinity=False)
    without = core.evaluate(decide(body("sql", system="other " * 60), {}, off), off)[0]
    assert {c.adapter_tokens for c in without.candidates} == {0}
    for choice in picks:
        core.release(choice)
    assert core.adapters.state(A)["own_adapters"] == {}


def test_a_hot_adapter_spreads_to_a_free_slot_once_its_replica_queues_more_than_the_load() -> None:
    core = lora_core()
    settings = RouteSettings(mode="pick", adapter_load_tokens=1000, adapter_home_tokens=0)  # home: its own test
    seen = [core.pick(decide(body("sql", system=f"system {i} " * 200), {}, settings), settings).address
            for i in range(12)]
    assert seen[0] == A and C in seen and B not in seen  # spilled to C's free slot, never to B's full set


def test_a_base_model_request_has_no_adapter_term_and_explain_shows_the_term() -> None:
    core = lora_core()
    base = core.pick(decide(body("llama"), {}, PICK), PICK)
    assert {c.adapter_tokens for c in base.candidates} == {0}
    explained = core.explain(decide(body("chat"), {}, PICK), PICK)
    by = {c["address"]: c["adapter_tokens"] for c in explained["candidates"]}
    assert by[B] == by[C] == 0 and by[A] > 0
    state = core.state()
    assert {r["address"]: r["running_adapters"] for r in state["replicas"]}[B] == ["chat", "code"]


# --- adapter-keyed blocks (precise mode) ------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(TINY_BYTELEVEL)


def test_an_adapters_request_matches_only_blocks_its_adapter_stored(tokenizer: ModelTokenizer) -> None:
    index = EventIndex()

    class Live:
        origin = "events"

    core = PickCore(clock=lambda: 0.0)
    precise = PreciseView(index, {"llama": tokenizer}, {a: Live() for a in (A, B, C)}, core.pools.base_of)
    core.view = CombinedView(EventView(precise), LearnedView())
    core.set_endpoints([A, B, C])
    for address in (A, B, C):
        core.on_models(address, [Served("llama"), Served("sql", "llama")])
    ids = tokenizer.tokens_for(json.loads(body("sql")), "chat")  # an adapter's prompt: its base model's tokens
    n = len(ids) // BS
    for address, lora in ((A, "sql"), (B, None), (C, "chat")):
        index.apply(address, [BlockStored(tuple(range(100, 100 + n)), None, tuple(ids[:n * BS]), BS,
                                          lora_name=lora, extra_keys=tuple(request_extra_keys(n, None, lora)))])
    as_sql = precise.match(decide(body("sql"), {}, PICK))
    assert as_sql.cached[A] > 0 and as_sql.cached[B] == as_sql.cached[C] == 0
    as_base = precise.match(decide(body("llama"), {}, PICK))
    assert as_base.cached[B] == as_sql.cached[A] and as_base.cached[A] == as_base.cached[C] == 0
