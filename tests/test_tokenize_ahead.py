"""extproc.pick.sources.tokenize_ahead: long new text tokenised on a worker thread while the loop serves,
the pick then exact; a full queue sends the request to the learned view instead of making it wait."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from extproc import metrics
from extproc.core.decide import decide
from extproc.core.settings import RouteSettings
from extproc.pick.core import PickCore
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.sources.tokenize_ahead import TokenizeAhead
from extproc.pick.tokens.prompt_tokens import ModelTokenizer, NotTokenizable
from extproc.pick.views.event_view import EventView
from extproc.pick.views.learned import LearnedView
from extproc.pick.views.partial import CombinedView
from extproc.pick.views.precise import PreciseView
from routerlab.assets import TINY_BYTELEVEL

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
PICK = RouteSettings(mode="pick")
SYSTEM = "You answer questions about the ACME deploy pipeline with numbered runbook steps. " * 8  # 656 chars


class Live:
    origin = "events"


def setup(inline_chars: int = 200, max_wait_s: float = 1.0) -> tuple[PickCore, ModelTokenizer, TokenizeAhead]:
    tokenizer = ModelTokenizer(TINY_BYTELEVEL)
    precise = PreciseView(EventIndex(), {"*": tokenizer}, {A: Live(), B: Live()})
    core = PickCore(CombinedView(EventView(precise), LearnedView()))
    core.set_endpoints([A, B])
    return core, tokenizer, TokenizeAhead(precise, inline_chars, max_wait_s)


def chat(question: str, system: str = SYSTEM) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": system},
                                                  {"role": "user", "content": question}]}).encode()


def counted(view: str, reason: str) -> float:
    return metrics.cache_view_counter(view, reason)._value.get()


def test_long_new_text_is_tokenised_on_the_worker_while_the_loop_serves_then_the_pick_is_exact() -> None:
    core, tokenizer, ahead = setup()
    decision = decide(chat("How do I roll back a deploy?"), {}, PICK)
    encode = tokenizer.encode_segments
    threads: list[int] = []
    loop_ran = threading.Event()

    def on_worker(segments, words=True):  # type: ignore[no-untyped-def]
        assert not words  # the word cache's Python loop would hold the GIL the event loop needs
        threads.append(threading.get_ident())
        assert loop_ran.wait(10), "the event loop did not run while the worker tokenised"
        return encode(segments, words)

    tokenizer.encode_segments = on_worker  # type: ignore[method-assign]
    done = metrics.TOKENIZE_AHEAD.labels("done")._value.get()

    async def main() -> int:
        async def meanwhile() -> None:
            await asyncio.sleep(0)
            loop_ran.set()  # another request's work, on the loop, while the worker is busy
        prepared, _ = await asyncio.gather(ahead.prepare(decision), meanwhile())
        return prepared

    try:
        assert asyncio.run(main()) == 0
    finally:
        ahead.close()
    assert threads and threading.get_ident() not in threads
    assert metrics.TOKENIZE_AHEAD.labels("done")._value.get() == done + 1
    assert ahead.chars_per_s > 0 and ahead.queued_chars == 0
    misses = tokenizer.cache_misses
    events = counted("events", "covered")
    choice = core.pick(decision, PICK)
    assert tokenizer.cache_misses == misses  # the pick found every segment cached
    assert counted("events", "covered") == events + 1
    assert choice.prompt_tokens == len(tokenizer.encode_uncached(tokenizer.render_chat(decision.document)))


def test_long_new_text_of_words_seen_before_is_tokenised_on_the_loop_by_the_word_cache() -> None:
    core, tokenizer, ahead = setup(inline_chars=200)
    tokenizer.encode(tokenizer.render_chat(json.loads(chat("warm"))))  # the system prompt is known now
    old = " ".join(SYSTEM.split()[:8])
    tokenizer.encode("\n" + old)  # its words are known to the word cache too
    long = " ".join([old] * 6) + " rolled back"  # 323 characters, two new words
    assert len(long) > 200
    on_worker: list[int] = []
    encode = tokenizer.encode_segments
    tokenizer.encode_segments = lambda s, words=True: on_worker.append(1) or encode(s, words)  # type: ignore[method-assign]
    done, by_words = (metrics.TOKENIZE_AHEAD.labels(k)._value.get() for k in ("done", "words"))
    decision = decide(chat(long), {}, PICK)
    try:
        assert asyncio.run(ahead.prepare(decision)) == 0
        misses = tokenizer.cache_misses
        choice = core.pick(decision, PICK)
        assert tokenizer.cache_misses == misses  # the pick found it cached
        # 60 new words in 349 characters: more than the word cache may take (10 a part at 200 characters), so the worker
        fresh = decide(chat(" ".join(f"zq{i}x" for i in range(60))), {}, PICK)
        assert asyncio.run(ahead.prepare(fresh)) == 0
    finally:
        ahead.close()
    assert on_worker == [1]  # only the second request's text went to the worker
    assert metrics.TOKENIZE_AHEAD.labels("words")._value.get() == by_words + 1
    assert metrics.TOKENIZE_AHEAD.labels("done")._value.get() == done + 1
    assert choice.prompt_tokens == len(tokenizer.encode_uncached(tokenizer.render_chat(decision.document)))
    assert core.pick(fresh, PICK).prompt_tokens == len(tokenizer.encode_uncached(tokenizer.render_chat(fresh.document)))


def test_short_new_text_is_left_to_the_pick() -> None:
    core, tokenizer, ahead = setup(inline_chars=200)
    tokenizer.encode(tokenizer.render_chat(json.loads(chat("warm"))))  # the system prompt is known now
    calls: list[int] = []
    tokenizer.encode_segments = lambda s, words=True: calls.append(1)  # type: ignore[method-assign, assignment, return-value]
    try:
        assert asyncio.run(ahead.prepare(decide(chat("A short new question?"), {}, PICK))) == 0
        assert asyncio.run(ahead.prepare(decide(b'{"model": "m", "prompt": [1, 2, 3]}', {}, PICK))) == 0
    finally:
        ahead.close()
    assert calls == []


@pytest.mark.parametrize("queued,expected", [(0, 0), (50_000, 200)])
def test_a_request_that_would_wait_too_long_is_not_queued_and_takes_the_learned_view(queued: int,
                                                                                     expected: int) -> None:
    core, tokenizer, ahead = setup(inline_chars=200, max_wait_s=0.1)
    ahead.chars_per_s = 100_000.0  # measured earlier: 50,000 queued characters are 0.5 s of work
    ahead.queued_chars = queued
    decision = decide(chat("Why did the canary fail?"), {}, PICK)
    busy = metrics.TOKENIZE_AHEAD.labels("busy")._value.get()
    refused = counted("learned", "tokenizer_busy")
    try:
        limit = asyncio.run(ahead.prepare(decision))
    finally:
        ahead.close()
    assert limit == expected  # an idle worker always takes the job; a full one does not
    choice = core.pick(decision, PICK, limit)
    assert choice.address in (A, B)
    assert metrics.TOKENIZE_AHEAD.labels("busy")._value.get() == busy + (1 if queued else 0)
    assert counted("learned", "tokenizer_busy") == refused + (1 if queued else 0)


def test_the_stall_bench_runs_both_ways_and_counts_every_request() -> None:
    from argparse import Namespace

    from routerlab.bench.stall import measure
    rows = measure(Namespace(seconds=0.2, short_every=0.02, long_every=0.1, size_kb=4, replicas=4,
                             inline_chars=2048, queue_seconds=0.1))
    assert [r["tokenize_inline_chars"] for r in rows] == [0, 2048]
    for r in rows:
        assert r["short_ms"]["n"] == 10 and r["long_ms"]["n"] == 2
        assert sum(r["long_views"].values()) == 2
        assert 0 < r["short_ms"]["p50"] <= r["short_ms"]["max"]


def test_a_chat_trace_through_the_worker_and_the_word_cache_keeps_every_prompt_exact() -> None:
    """The real-vLLM end-to-end trace (variants included), its new text before each pick taken by the
    worker or the word cache: every prompt's ids as an uncached tokenizer gives them."""
    from routerlab.realvllm.chat_trace import build_chat_trace

    core, tokenizer, ahead = setup(inline_chars=128)
    reference = ModelTokenizer(TINY_BYTELEVEL, cache_bytes=0)
    before = {k: metrics.TOKENIZE_AHEAD.labels(k)._value.get() for k in ("done", "words")}
    checked = 0

    async def main() -> None:
        nonlocal checked
        for request in build_chat_trace(240, 0, variants=0.3):
            body = request.body if isinstance(request.body, bytes) else json.dumps(request.body).encode()
            decision = decide(body, {}, PICK)
            choice = core.pick(decision, PICK, await ahead.prepare(decision))
            core.release(choice)
            assert decision.document is not None
            kind = "chat" if "messages" in decision.document else "completions"
            try:
                want = reference.token_array(decision.document, kind)
            except NotTokenizable:  # a body no tokenizer takes (routed on the learned view)
                continue
            assert choice.prompt_tokens == len(want) and tokenizer.token_array(decision.document, kind) == want
            checked += 1

    try:
        asyncio.run(main())
    finally:
        ahead.close()
    assert checked >= 200
    for outcome in ("done", "words"):  # both ways were taken
        assert metrics.TOKENIZE_AHEAD.labels(outcome)._value.get() > before[outcome], outcome


def test_one_long_text_at_a_time_goes_in_parts_on_the_loop_the_next_to_the_worker() -> None:
    """Two long texts of words seen before arrive together: the first is tokenised on the loop in parts
    (the second request's prepare runs between them), the second goes to the worker, beside the loop."""
    core, tokenizer, ahead = setup(inline_chars=100)  # parts of 400 characters, 5 new words a part
    tokenizer.encode(tokenizer.render_chat(json.loads(chat("warm"))))
    sentence = SYSTEM.split(".")[0] + "."
    tokenizer.encode("\n" + sentence)  # its words are seen
    first, second = (decide(chat(" ".join([sentence] * 16) + f" ({n})"), {}, PICK) for n in (1, 2))
    counts = {k: metrics.TOKENIZE_AHEAD.labels(k)._value.get() for k in ("done", "words")}

    async def main() -> list[int]:
        return list(await asyncio.gather(ahead.prepare(first), ahead.prepare(second)))

    try:
        assert asyncio.run(main()) == [0, 0]
    finally:
        ahead.close()
    assert ahead.on_loop == 0
    assert metrics.TOKENIZE_AHEAD.labels("words")._value.get() == counts["words"] + 1
    assert metrics.TOKENIZE_AHEAD.labels("done")._value.get() == counts["done"] + 1
    for decision in (first, second):  # both exact, found cached by the pick
        misses = tokenizer.cache_misses
        choice = core.pick(decision, PICK)
        assert tokenizer.cache_misses == misses
        assert choice.prompt_tokens == len(tokenizer.encode_uncached(tokenizer.render_chat(decision.document)))


def test_while_the_worker_is_busy_a_long_text_goes_to_it_not_in_parts_on_the_loop() -> None:
    core, tokenizer, ahead = setup(inline_chars=100)
    tokenizer.encode(tokenizer.render_chat(json.loads(chat("warm"))))
    sentence = SYSTEM.split(".")[0] + "."
    tokenizer.encode("\n" + sentence)
    decision = decide(chat(" ".join([sentence] * 16) + " (3)"), {}, PICK)
    ahead.queued_chars, ahead.chars_per_s = 1_000, 1e9  # another request's text on the worker, done soon
    counts = {k: metrics.TOKENIZE_AHEAD.labels(k)._value.get() for k in ("done", "words")}
    try:
        assert asyncio.run(ahead.prepare(decision)) == 0
    finally:
        ahead.close()
    assert metrics.TOKENIZE_AHEAD.labels("words")._value.get() == counts["words"]
    assert metrics.TOKENIZE_AHEAD.labels("done")._value.get() == counts["done"] + 1
    assert core.pick(decision, PICK).prompt_tokens == len(tokenizer.encode_uncached(
        tokenizer.render_chat(decision.document)))
