"""Precise mode's figures (the tiny byte-level tokenizer): decide() + the choice for a new
question on a system prompt tokenised before (with and without the word cache, with requests of
ours in flight, against pick mode's), its parts, a cold tokenisation, and a conversation's next turn
with the prompt memo and without it."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

from extproc.core.decide import decide
from extproc.core.settings import RouteSettings
from extproc.pick.core import PickCore
from extproc.pick.events.kv_events import BlockStored
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.pick.views.event_view import EventView
from extproc.pick.views.learned import LearnedView
from extproc.pick.views.partial import CombinedView
from extproc.pick.views.precise import PreciseView
from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench.micro.bodies import chat_body, conversation_bodies, questions
from routerlab.bench.micro.timing import REPEAT, interleaved_us, median_us

IN_FLIGHT: Final = 48  # precise mode's requests of ours in flight for the loaded column (kv-pressure's)


class _Live:
    origin = "events"


def precise_core(tokenizer: ModelTokenizer, replicas: int, held: Sequence[int], block_size: int = 16) -> PickCore:
    """Pick mode in precise mode over ``replicas`` addresses, all covered by events, the first half
    holding the full blocks of the token ids ``held``."""
    index = EventIndex()
    addresses = [f"10.0.0.{i}:8000" for i in range(replicas)]
    core = PickCore(CombinedView(EventView(PreciseView(index, {"*": tokenizer}, {a: _Live() for a in addresses})),
                                 LearnedView()))
    core.set_endpoints(addresses)
    full = len(held) // block_size * block_size
    for i, address in enumerate(addresses[: replicas // 2]):
        hashes = [(i << 32) + n for n in range(full // block_size)]
        index.apply(address, [BlockStored(tuple(hashes), None, tuple(held[:full]), block_size)])
    return core


def precise_of(core: PickCore) -> PreciseView:
    """The event matcher inside ``precise_core``'s view."""
    view = core.view
    assert isinstance(view, CombinedView)
    return view.events.precise


MAX_WARM: Final = 20_000  # requests at most to bring the prompt memo to its bound
WARM_NUMBERS: Final = 10_000_000  # the warm-up's questions are numbered (and seeded) from here, the timed ones' below


def fill_memo(core: PickCore, tokenizer: ModelTokenizer, system: str, settings: RouteSettings) -> int:
    """Route new questions on ``system`` until the tokenizer's prompt memo holds its bound, as a
    router that has run a while does (pick mode's row warms its index likewise); returns how many.

    Timed from an empty memo, every request's text is new memory the memo keeps: until the memo is
    full (about 500 requests at 32 KB) each pays the heap's growth (5.5 minor page faults a request
    at 32 KB, measured here), which a running router, evicting as much as it files, does not. The
    warm-up's questions carry numbers the timed ones do not, so every timed question still has a
    word the word cache has not seen."""
    memo, n = tokenizer.memo, 0
    while memo is not None and memo.bytes < 0.95 * memo.max_bytes and n < MAX_WARM:
        for body in questions(system, 200, seed=WARM_NUMBERS + n, first=WARM_NUMBERS + n):
            core.release(core.pick(decide(body, {}, settings), settings))
        n += 200
    return n


def precise_measure(size_kb: int, replicas: int, block_size: int = 16,
                    pick_once: Callable[[], None] | None = None) -> dict[str, Any]:
    """Precise mode (the tiny byte-level tokenizer): decide + the choice for requests that share a
    system prompt already tokenised once (only their new question is tokenised), with half the
    replicas holding the prompt's blocks in the event view; and the cold tokenisation of one.
    ``pick_once`` (``pick_request``'s): pick mode's decide() + choice, timed interleaved with
    precise mode's for their ratio (``precise_over_pick``)."""
    settings = RouteSettings(mode="pick")
    tokenizer = ModelTokenizer(TINY_BYTELEVEL)
    system = json.loads(chat_body(size_kb * 1024, 0))["messages"][0]["content"]  # one system prompt for all
    number = 200 if size_kb <= 4 else 50
    bodies = questions(system, 3 * REPEAT * number + IN_FLIGHT + 1)  # a new question for every request timed
    ids = tokenizer.token_array(json.loads(bodies[0]), "chat")  # as precise mode gets them
    full = len(ids) // block_size * block_size
    core = precise_core(tokenizer, replicas, ids.tolist(), block_size)
    warmed = fill_memo(core, tokenizer, system, settings)
    requests = iter(bodies[1:])
    docs = [json.loads(b) for b in bodies[:400]]
    words = tokenizer.words

    def pick_new(word_cache: bool) -> Callable[[], None]:
        def once() -> None:
            tokenizer.words = words if word_cache else None
            core.release(core.pick(decide(next(requests), {}, settings), settings))
        return once

    def cold() -> None:
        tokenizer.clear_cache()
        tokenizer.tokens_for(docs[0], "chat")

    in_flight: deque[Any] = deque()

    def pick_loaded() -> None:  # each pick ends the oldest of IN_FLIGHT requests in flight
        in_flight.append(core.pick(decide(next(requests), {}, settings), settings))
        if len(in_flight) > IN_FLIGHT:
            core.release(in_flight.popleft())

    warm_docs = iter(docs * 50)
    variants = (pick_new(True), pick_new(False)) + ((pick_once,) if pick_once is not None else ())
    total, without_words, *pick = interleaved_us(*variants, number=number)
    tokenizer.words = words
    for _ in range(IN_FLIGHT):
        pick_loaded()
    loaded = median_us(pick_loaded, number)
    while in_flight:
        core.release(in_flight.popleft())
    out = {
        "precise_total_us": total,
        "precise_total_no_words_us": without_words,
        "precise_in_flight_us": loaded,
        "precise_tokenize_us": median_us(lambda: tokenizer.token_array(next(warm_docs), "chat"), number),
        "precise_hash_us": median_us(lambda: precise_of(core).chains.hashes(ids[:full], block_size), number),
        "precise_tokenize_cold_us": median_us(cold, max(5, number // 10)),
        "prompt_tokens": len(ids),
        "warm_requests": warmed,
    }
    rounded = {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}
    if pick:
        rounded["precise_over_pick"] = round(total / pick[0], 2)
    return rounded


TURNS: Final = (10, 40)
TURN_REQUESTS: Final = 10  # requests a repeat of the turns table times (7 repeats, two variants)


def precise_turns(turns: int, replicas: int) -> dict[str, Any]:
    """Precise mode's decide + choice for a conversation's next turn, every earlier turn seen, with
    the prompt memo and without it (each with its own tokenizer, their repeats interleaved)."""
    settings = RouteSettings(mode="pick")
    warm, timed = conversation_bodies(turns, 2 * REPEAT * TURN_REQUESTS)
    variants = []
    for memo in (True, False):
        tokenizer = ModelTokenizer(TINY_BYTELEVEL)
        if not memo:
            tokenizer.memo = None
        core = precise_core(tokenizer, replicas, tokenizer.token_array(json.loads(warm[0]), "chat").tolist())
        for body in warm:
            core.release(core.pick(decide(body, {}, settings), settings))
        bodies = iter(timed)

        def once(core: PickCore = core, bodies: Any = bodies) -> None:
            core.release(core.pick(decide(next(bodies), {}, settings), settings))
        variants.append(once)
    with_memo, without = interleaved_us(*variants, number=TURN_REQUESTS)
    return {"turns": turns, "body_bytes": len(timed[0]), "memo_us": round(with_memo, 1),
            "no_memo_us": round(without, 1)}
