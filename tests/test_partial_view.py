"""A replica whose events miss part of its cache (origin ``partial``): the router credits the larger
of the event view's and the learned view's match, and says which (pure: no sockets)."""

from __future__ import annotations

import json

import pytest

from extproc.core.decide import decide
from extproc.core.settings import RouteSettings
from extproc.pick.core import PickCore
from extproc.pick.events.block_hashes import request_extra_keys
from extproc.pick.events.kv_events import BlockStored
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.pick.views.event_view import EventView
from extproc.pick.views.learned import LearnedView
from extproc.pick.views.partial import CombinedView, learned_tokens
from extproc.pick.views.precise import PreciseView
from extproc.process.explain import render_pick
from routerlab.assets import TINY_BYTELEVEL

BS = 16
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
PICK = RouteSettings(mode="pick")
SYSTEM = "You answer questions about the ACME deploy pipeline with numbered runbook steps. " * 30


class View:
    def __init__(self, origin: str) -> None:
        self.origin = origin


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(TINY_BYTELEVEL)


def body(question: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": question}]}).encode()


def core_with(tokenizer: ModelTokenizer, origins: dict[str, str]) -> tuple[PickCore, EventIndex]:
    index = EventIndex()
    precise = PreciseView(index, {"*": tokenizer}, {a: View(o) for a, o in origins.items()})
    precise.block_size_hint = BS
    core = PickCore(CombinedView(EventView(precise), LearnedView()))
    core.set_endpoints([A, B])
    return core, index


def precise_of(core: PickCore) -> PreciseView:
    view = core.view
    assert isinstance(view, CombinedView)
    return view.events.precise


def store(index: EventIndex, address: str, ids: list[int]) -> None:
    n = len(ids) // BS
    index.apply(address, [BlockStored(tuple(range(1000, 1000 + n)), None, tuple(ids[:n * BS]), BS,
                                      extra_keys=tuple(request_extra_keys(n, None, None)))])


def candidates(core: PickCore, question: str) -> dict[str, tuple[int, str]]:
    choice, _ = core.evaluate(decide(body(question), {}, PICK), PICK)
    return {c.address: (c.cached_tokens, c.view) for c in choice.candidates}


def test_learned_chunks_become_whole_blocks_of_the_request_s_own_tokens() -> None:
    assert learned_tokens(4, 512, 4096, 2000, 16) == 992  # half the bytes: half the tokens, whole blocks
    assert learned_tokens(8, 512, 4096, 2000, 16) == 1984  # all of it: below the last token
    assert learned_tokens(0, 512, 4096, 2000, 16) == 0
    assert learned_tokens(3, 512, 1000, 1, 16) == 0


def test_a_partial_replica_gets_the_learned_match_where_its_events_know_nothing(tokenizer: ModelTokenizer) -> None:
    """The router restarted while A was warm and A's buffer no longer started at seq 0: A's system
    prompt is resident but its events never said so. Once this router placed it on A, A is credited."""
    core, _ = core_with(tokenizer, {A: "partial", B: "events"})
    first = core.pick(decide(body("first question"), {}, PICK), PICK)
    core.release(first)
    assert first.address is not None
    other = B if first.address == A else A
    precise_of(core).origins = {first.address: View("partial"), other: View("events")}
    got = candidates(core, "second question")
    cached, view = got[first.address]
    assert view == "learned" and cached > 0 and cached % BS == 0
    assert got[other] == (0, "events")
    prompt = precise_of(core).match(decide(body("second question"), {}, PICK)).prompt_tokens
    assert cached <= prompt - 1
    # a replica whose events are complete ignores the learned view: it would credit lost blocks
    precise_of(core).origins = {first.address: View("events"), other: View("events")}
    assert candidates(core, "second question")[first.address] == (0, "events")


def test_a_partial_replica_keeps_the_event_match_where_it_is_larger(tokenizer: ModelTokenizer) -> None:
    core, index = core_with(tokenizer, {A: "partial", B: "partial"})
    d = decide(body("q"), {}, PICK)
    ids = tokenizer.tokens_for(d.document, "chat")
    store(index, A, ids)  # stored within the buffer: the events know it, the learned view does not
    got = candidates(core, "q")
    assert got[A] == ((len(ids) - 1) // BS * BS, "events") and got[B] == (0, "events")
    info = core.explain(d, PICK)
    assert {c["address"]: c["events_origin"] for c in info["candidates"]} == {A: "partial", B: "partial"}
    assert "events (partial)" in render_pick(info)
