"""The run-time tokenizer check against a replica's POST /tokenize: sampling, what it asks, and what
each answer does to the model's trust. The replica here is a small aiohttp server on 127.0.0.1 whose
answers the test sets (match, mismatch, an error status, garbage); the real simulator's /tokenize is
checked end to end in test_precise_envoy.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from extproc.core.decide import decide
from extproc.core.settings import RouteSettings
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.sources.tokenizer_check import TokenizerCheck, first_difference, tokenize_body
from extproc.pick.tokens.prompt_tokens import ModelTokenizer, NotTokenizable
from extproc.pick.views.precise import PreciseView
from routerlab.assets import TINY_BYTELEVEL

MODEL = "m"


def decision(**doc: Any) -> Any:
    return decide(json.dumps({"model": MODEL, **doc}).encode(), {}, RouteSettings(mode="pick"))


CHAT = {"messages": [{"role": "user", "content": "how do I roll back the deploy?"}], "max_tokens": 3}


class Replica:
    """Answers /tokenize with whatever ``answer`` says (ids, or an HTTP status) and records the bodies."""

    def __init__(self) -> None:
        self.answer: Any = None
        self.bodies: list[dict[str, Any]] = []

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if isinstance(self.answer, int):
            return web.Response(status=self.answer, text="no")
        if isinstance(self.answer, str):
            return web.Response(text=self.answer)
        return web.json_response({"count": len(self.answer), "tokens": self.answer})


async def with_replica(run: Any) -> None:
    replica = Replica()
    app = web.Application()
    app.router.add_post("/tokenize", replica.tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        await run(replica, f"127.0.0.1:{port}")
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def view() -> PreciseView:
    return PreciseView(EventIndex(1000), {MODEL: ModelTokenizer(TINY_BYTELEVEL)})


def test_each_answer_sets_the_models_trust(view: PreciseView) -> None:
    d = decision(**CHAT)
    ours = list(view.tokens(d))

    async def run(replica: Replica, address: str) -> None:
        check = TokenizerCheck(view, every=1)
        await check.start()
        try:
            replica.answer = ours
            assert await check.check(address, MODEL, d.document, d) == "match"
            replica.answer = ours[:5] + [ours[5] + 1] + ours[6:]
            assert await check.check(address, MODEL, d.document, d) == "mismatch"
            assert MODEL in view.distrusted
            with pytest.raises(NotTokenizable) as exc:  # the request path now falls back
                view.tokens(d)
            assert exc.value.reason == "tokenizer_mismatch"
            replica.answer = 404  # a replica without /tokenize says nothing about the tokenizer
            assert await check.check(address, MODEL, d.document, d) == "error"
            replica.answer = "not json"
            assert await check.check(address, MODEL, d.document, d) == "error"
            assert MODEL in view.distrusted
            replica.answer = ours  # agreement again: trusted again, without a restart
            assert await check.check(address, MODEL, d.document, d) == "match"
            assert MODEL not in view.distrusted and list(view.tokens(d)) == ours
            assert check.models[MODEL].results == {"match": 2, "mismatch": 1, "error": 2}
            assert replica.bodies[0] == {"model": MODEL, "messages": CHAT["messages"]}  # no max_tokens
        finally:
            await check.stop()

    asyncio.run(with_replica(run))


def test_the_first_request_then_one_in_every_is_checked_in_the_background(view: PreciseView) -> None:
    d = decision(prompt="a completions prompt about rollbacks", max_tokens=2)

    async def run(replica: Replica, address: str) -> None:
        replica.answer = list(view.tokens(d))
        check = TokenizerCheck(view, every=3)
        await check.start()
        try:
            for _ in range(7):  # requests 1, 4 and 7 are sampled
                check.offer(address, d)
            for _ in range(1000):  # up to 10 s
                if len(replica.bodies) == 3 and check.models[MODEL].results["match"] == 3:
                    break
                await asyncio.sleep(0.01)
            assert check.models[MODEL].results["match"] == 3 and check.models[MODEL].offered == 7
            assert replica.bodies[0] == {"model": MODEL, "prompt": "a completions prompt about rollbacks"}
        finally:
            await check.stop()

    asyncio.run(with_replica(run))


def test_only_bodies_tokenize_can_express_are_asked() -> None:
    assert tokenize_body({"model": MODEL, "prompt": [1, 2, 3]}) is None  # token ids: nothing to check
    assert tokenize_body({"model": MODEL, **CHAT, "reasoning_effort": "low"}) is None
    assert tokenize_body({"model": MODEL, "messages": CHAT["messages"], "tools": [{"type": "function"}],
                          "add_generation_prompt": False, "continue_final_message": True, "temperature": 0}) == {
        "model": MODEL, "messages": CHAT["messages"], "tools": [{"type": "function"}],
        "add_generation_prompt": False, "continue_final_message": True}
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1, 2], [1, 2, 3]) == 2


def test_a_samples_long_new_text_is_tokenised_on_the_worker_and_skipped_when_it_is_busy() -> None:
    import threading

    from extproc.pick.sources.tokenize_ahead import TokenizeAhead

    tokenizer = ModelTokenizer(TINY_BYTELEVEL)
    view = PreciseView(EventIndex(1000), {MODEL: tokenizer})
    ahead = TokenizeAhead(view, inline_chars=100, max_wait_s=0.1)
    long = decision(messages=[{"role": "user", "content": "why does the canary keep failing on step 3? " * 10}])
    theirs = tokenizer.encode_uncached(tokenizer.render_chat(long.document))
    encode, threads = tokenizer.encode_segments, []

    def on_worker(segments, words=True):  # type: ignore[no-untyped-def]
        assert not words  # the word cache's Python loop would hold the GIL the event loop needs
        threads.append(threading.get_ident())
        return encode(segments, words)

    tokenizer.encode_segments = on_worker  # type: ignore[method-assign]

    async def run(replica: Replica, address: str) -> None:
        check = TokenizerCheck(view, every=1, ahead=lambda d: ahead.prepare(d, checking=True))
        await check.start()
        try:
            replica.answer = theirs
            assert await check.check(address, MODEL, long.document, long) == "match"
            assert threads and threading.get_ident() not in threads  # tokenised on the worker
            ahead.queued_chars, ahead.chars_per_s = 10**6, 1000.0  # the worker has 1,000 s of work queued
            other = decision(messages=[{"role": "user", "content": "a different long question, " * 10}])
            assert await check.check(address, MODEL, other.document, other) is None
            assert check.busy == 1 and len(replica.bodies) == 1  # skipped: not asked, not counted
        finally:
            await check.stop()
            ahead.close()

    asyncio.run(with_replica(run))
