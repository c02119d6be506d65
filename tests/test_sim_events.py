"""The simulator's KV-cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared) and its
``--tokenizer`` mode, checked against the router's own precise-mode pieces.

(a) pure: a KVCache with a recording listener; (b) end to end over real ZeroMQ on 127.0.0.1: a
simulated replica with events on and the tiny byte-level tokenizer, the router's
KvEventSubscriber feeding an EventIndex, and the router's view of a request compared with the
cached tokens the replica then reports. Every wait polls a condition with a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.pick.events import kv_events
from extproc.pick.events.block_hashes import block_hashes as own_hashes
from extproc.pick.events.block_hashes import request_extra_keys
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.sources.kv_subscriber import KvEventSubscriber
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from routerlab.harness.procs import free_ports
from routerlab.sim.fleet import FleetThread, SimConfig
from routerlab.sim.hf_tokenizer import HfTokenizer
from routerlab.sim.kv_cache import KVCache, block_hashes, extra_keys, root_hash
from routerlab.sim.profiles import get_profile
from routerlab.sim.scheduler import Scheduler, Sequence

from support import until

pytestmark = pytest.mark.timeout(90)

ASSETS = Path(__file__).resolve().parent.parent / "lab" / "routerlab" / "assets"
BYTELEVEL = ASSETS / "tiny-bytelevel"
METASPACE = ASSETS / "tiny-metaspace"


# ---- (a) pure: the cache's listener ------------------------------------------------------

class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stored(self, block_hashes, parent_hash, token_ids, block_size, extra_keys=None, lora_id=None,
               lora_name=None) -> None:  # the adapter fields: tests/test_sim_lora.py
        self.events.append(("stored", list(block_hashes), parent_hash, list(token_ids), block_size,
                            None if extra_keys is None else list(extra_keys)))

    def removed(self, block_hashes) -> None:
        self.events.append(("removed", list(block_hashes)))

    def cleared(self) -> None:
        self.events.append(("cleared",))

    def take(self) -> list[tuple]:
        out, self.events = self.events, []
        return out


ROOT = root_hash(extra_keys("m", None))


def test_cold_request_then_a_shared_prefix_stores_only_the_new_run() -> None:
    rec = Recorder()
    kv = KVCache(64, 16, rec)
    a = list(range(100, 140))  # 40 tokens: 2 full blocks
    ha = block_hashes(a, 16, ROOT)
    assert kv.allocate("a", len(a), ha, token_ids=a)
    assert rec.take() == [("stored", ha, None, a[:32], 16, [None, None])]

    b = a[:32] + list(range(500, 530))  # shares a's 2 blocks, then 30 more tokens: 1 new full block
    hb = block_hashes(b, 16, ROOT)
    hits = kv.longest_hit(hb, len(b))
    assert len(hits) == 2
    assert kv.allocate("b", len(b), hb, hits, token_ids=b)
    assert rec.take() == [("stored", hb[2:3], ha[1], b[32:48], 16, [None])]

    # a hit of everything cached, with no new full block: nothing is announced
    c = a[:32] + [7]
    hc = block_hashes(c, 16, ROOT)
    assert kv.allocate("c", len(c), hc, kv.longest_hit(hc, len(c)), token_ids=c)
    assert rec.take() == []

    assert kv.reset() == 3
    assert rec.take() == [("cleared",)]


def test_eviction_announces_exactly_the_evicted_hashes() -> None:
    rec = Recorder()
    kv = KVCache(5, 4, rec)  # 4 usable blocks
    a = list(range(12))  # 3 full blocks
    ha = block_hashes(a, 4, ROOT)
    assert kv.allocate("a", 12, ha, token_ids=a)
    kv.free("a")  # free queue: the unused block, then a's blocks tail first
    rec.take()
    cached_before = set(kv.cached)
    b = list(range(100, 112))  # 3 new blocks: the free one, then a's last two (tail first)
    hb = block_hashes(b, 4, ROOT)
    assert kv.allocate("b", 12, hb, token_ids=b)
    evicted = cached_before - (set(kv.cached) - set(hb))
    ev = rec.take()
    removed = [e for e in ev if e[0] == "removed"]
    assert removed == [("removed", [ha[2]]), ("removed", [ha[1]])]  # one event per block, as vLLM
    assert {e[1][0] for e in removed} == evicted and kv.evictions == 2
    assert ev[-1] == ("stored", hb, None, b, 4, [None, None, None])
    assert ev.index(ev[-1]) > ev.index(removed[-1])  # removals first, then what reused them


def test_salted_request_carries_its_salt_on_block_zero_only() -> None:
    rec = Recorder()
    kv = KVCache(64, 4, rec)
    root = root_hash(extra_keys("m", "tenant-a"))
    t = list(range(10))
    h = block_hashes(t, 4, root)
    assert kv.allocate("s", 6, h, token_ids=t, cache_salt="tenant-a")  # chunk 1: block 0
    assert kv.allocate("s", 10, h, token_ids=t, cache_salt="tenant-a")  # chunk 2: block 1
    assert rec.take() == [("stored", h[:1], None, t[:4], 4, [("tenant-a",)]),
                          ("stored", h[1:2], h[0], t[4:8], 4, [None])]


def test_scheduler_stores_decode_blocks_and_the_router_index_agrees() -> None:
    """Generated tokens fill blocks that are stored too; the router's EventIndex built from these
    events matches the request-side hashes of prompt + output, block for block."""
    rec = Recorder()
    profile = get_profile("tiny").with_overrides(num_blocks=64, block_size=16)
    sched = Scheduler(profile, listener=rec)
    prompt = list(range(1000, 1020))  # 20 tokens
    seq = Sequence("r", prompt, max_tokens=30, extra_keys=extra_keys("m", "s1"), cache_salt="s1")
    sched.add(seq)
    now = 0.0
    batches = []
    while sched.has_work():
        plan = sched.schedule()
        now += plan.duration
        sched.complete(plan, now)
        batches.append(rec.take())
    stored = [e for b in batches for e in b]
    # 50 tokens, the last one never computed: blocks 0..2 (48 tokens) are stored, one per step
    assert [len(e[1]) for e in stored] == [1, 1, 1]
    assert [e[3] for e in stored] == [seq.tokens[0:16], seq.tokens[16:32], seq.tokens[32:48]]
    assert stored[1][3][4:] == seq.outputs[:12]  # block 1 is mostly generated tokens
    idx = EventIndex()
    idx.apply("r", [kv_events.BlockStored(e[1], e[2], e[3], e[4], extra_keys=e[5]) for e in stored])
    want = own_hashes(seq.tokens[:48], 16, request_extra_keys(3, "s1", None))
    assert idx.match(want) == {"r": 3}
    assert idx.match(own_hashes(seq.tokens[:48], 16, request_extra_keys(3, None, None))) == {}


@pytest.mark.parametrize("model_dir", [BYTELEVEL, METASPACE], ids=lambda p: p.name)
def test_real_tokenizer_outputs_are_vocabulary_ids(model_dir: Path) -> None:
    tok = HfTokenizer(model_dir)
    assert tok.output_ids and all(0 <= t < tok.vocab_size for t in tok.output_ids)
    n = len(tok.output_ids)
    text = tok.output_text(2 * n + 3)
    assert text.startswith("lorem ipsum") and "tempor" in text
    assert tok.output_text(2 * n + 3, 5) == text[len(tok.output_text(5)):]
    doc = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    assert tok.chat(doc) == ModelTokenizer(model_dir).tokens_for(doc, "chat")


# ---- (b) end to end -------------------------------------------------------------------------



SYSTEM = ("You are a careful assistant for the prefix router lab. Answer in short sentences, cite "
          "the design notes where you can, and never invent numbers that were not measured. ") * 3


def chat(question: str, system: str = SYSTEM, salt: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": "sim-tiny", "max_tokens": 20,
                           "messages": [{"role": "system", "content": system},
                                        {"role": "user", "content": question}]}
    if salt is not None:
        doc["cache_salt"] = salt
    return doc


class Rig:
    def __init__(self, encoding: str, hashes: str) -> None:
        self.http_port, self.events_port, self.replay_port = free_ports(3)
        self.config = SimConfig(
            replicas=1, base_port=self.http_port, time_scale=10.0, tokenizer=str(BYTELEVEL),
            kv_events_port_offset=self.events_port - self.http_port,
            kv_replay_port_offset=self.replay_port - self.http_port,
            kv_events_encoding=encoding, kv_events_hashes=hashes)
        self.ft = FleetThread(self.config)
        self.address = f"127.0.0.1:{self.http_port}"
        self.url = f"http://{self.address}"
        self.index = EventIndex()
        self.resets: list[tuple[str, str]] = []
        self.sub = KvEventSubscriber(self.index, self.events_port, self.replay_port, "kv",
                                     on_reset=lambda a, c: self.resets.append((a, c)),
                                     replay_timeout=0.5, poll_interval=0.05)
        self.mt = ModelTokenizer(BYTELEVEL)
        self.bs = self.config.resolved_profile().block_size

    def run(self, scenario: Callable[[aiohttp.ClientSession], Awaitable[None]], timeout: float = 60) -> None:
        """The fleet started, the subscriber started and subscribed, ``scenario(http)`` run, then
        everything stopped again (bounded by ``timeout``)."""
        async def body() -> None:
            await self.sub.start()
            try:
                await self.subscribe()
                async with aiohttp.ClientSession() as http:
                    await scenario(http)
            finally:
                await self.sub.stop()

        self.ft.start()
        try:
            asyncio.run(asyncio.wait_for(body(), timeout))
        finally:
            self.ft.stop()

    async def on_fleet(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the fleet's loop (the publisher's sockets belong to that thread)."""
        async def call() -> Any:
            return fn()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), self.ft.loop))

    async def subscriptions(self) -> int:
        def count() -> int:
            pub = self.ft.fleet.replicas[0].publisher if self.ft.fleet else None
            return pub.subscriptions() if pub is not None else 0
        return await self.on_fleet(count)

    async def subscribe(self) -> None:
        """The router's subscriber on this replica, its subscription seen by the publisher and the
        first replay answered (the subscriber must be started)."""
        self.sub.set_endpoints([self.address])
        await self.wait_subscribed()
        await until(lambda: all(s.synced for s in self.sub._streams[self.address]), "the first replay's answer")

    async def wait_subscribed(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while await self.subscriptions() < 1:
            if loop.time() > deadline:
                raise TimeoutError("the subscription never reached the publisher")
            await asyncio.sleep(0.01)

    async def post(self, http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> tuple[int, dict]:
        async with http.post(self.url + path, json=body) as r:
            return r.status, await r.json(content_type=None)

    async def caught_up(self, http: aiohttp.ClientSession) -> None:
        """Every batch the replica has published so far is applied to the index."""
        async with http.get(self.url + "/sim/state") as r:
            last = (await r.json())["kv_events"]["next_seq"] - 1
        view = self.sub.stats.replicas[self.address]
        await until(lambda: view.last_seq.get(0, -1) >= last, f"seq {last} applied")

    def view(self, doc: dict[str, Any]) -> tuple[int, int]:
        """The router's precise view: (prompt tokens, predicted cached tokens on this replica)."""
        ids = self.mt.tokens_for(doc, "chat")
        blocks = (len(ids) - 1) // self.bs
        hashes = own_hashes(ids[:blocks * self.bs], self.bs,
                            request_extra_keys(blocks, doc.get("cache_salt"), None))
        return len(ids), self.index.match(hashes).get(self.address, 0) * self.bs


@pytest.mark.parametrize("encoding,hashes,salt", [("array", "int", None), ("map", "bytes", "tenant-a")])
def test_router_view_equals_the_replicas_cached_tokens(encoding: str, hashes: str, salt: str | None) -> None:
    rig = Rig(encoding, hashes)

    async def scenario(http: aiohttp.ClientSession) -> None:
        doc1 = chat("What does the router do with a cold replica?", salt=salt)
        n1, predicted1 = rig.view(doc1)
        assert predicted1 == 0
        status, r1 = await rig.post(http, "/v1/chat/completions", doc1)
        assert status == 200, r1
        assert r1["usage"]["prompt_tokens"] == n1
        assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await rig.caught_up(http)

        doc2 = chat("And with a warm one, which blocks does it reuse?", salt=salt)
        n2, predicted2 = rig.view(doc2)
        assert 0 < predicted2 < n2 - rig.bs  # the shared system prompt, not the question
        status, r2 = await rig.post(http, "/v1/chat/completions", doc2)
        assert status == 200, r2
        assert r2["usage"]["prompt_tokens"] == n2
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted2
        await rig.caught_up(http)

        # another salt (or a salt vs none) shares nothing, on both sides
        other = chat("And with a warm one, which blocks does it reuse?", salt="other" if salt else "x")
        assert rig.view(other)[1] == 0
        # the second request's own blocks are now held too: a repeat matches all but its last block
        n2b, again = rig.view(doc2)
        assert again == (n2b - 1) // rig.bs * rig.bs

        # a restart: the publisher comes back with seq 0 on a new connection, and the
        # subscriber rebuilds the view from the new process's buffer (cause reconnect)
        status, state = await rig.post(http, "/sim/control", {"restart": True})
        assert status == 200 and state["restarts"] == 1 and state["blocks_cached"] == 0
        assert state["kv_events"]["next_seq"] == 0
        await rig.wait_subscribed()  # the SUB socket reconnected to the new publisher
        doc3 = chat("Unrelated.", system="A different system prompt, nothing shared with the first.")
        status, r3 = await rig.post(http, "/v1/chat/completions", doc3)
        assert status == 200, r3
        await until(lambda: rig.sub.stats.resets["reconnect"] == 1, "a reset with cause reconnect")
        await rig.caught_up(http)
        assert (rig.address, "reconnect") in rig.resets
        assert rig.view(doc2)[1] == 0  # the view emptied of everything before the restart
        status, r4 = await rig.post(http, "/v1/chat/completions", doc2)
        assert r4["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # and the replica agrees
        assert rig.sub.stats.bad_frames == 0 and rig.sub.stats.events_skipped == 0
        assert rig.sub.stats.resets["gap"] == 0

    rig.run(scenario)


def test_reset_cache_publishes_all_blocks_cleared_and_bad_requests_are_400() -> None:
    rig = Rig("array", "int")

    async def scenario(http: aiohttp.ClientSession) -> None:
        doc = chat("Hello?")
        status, _ = await rig.post(http, "/v1/chat/completions", doc)
        assert status == 200
        await rig.caught_up(http)
        assert rig.view(doc)[1] > 0
        status, _ = await rig.post(http, "/sim/control", {"reset_cache": True})
        assert status == 200
        await until(lambda: rig.sub.stats.resets["cleared"] == 1, "AllBlocksCleared applied")
        assert rig.view(doc)[1] == 0
        # what the real tokenizer cannot render is a 400, as vLLM answers
        bad = {"model": "sim-tiny", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}
        status, err = await rig.post(http, "/v1/chat/completions", bad)
        assert status == 400 and err["error"]["type"] == "BadRequestError"
        status, err = await rig.post(http, "/v1/completions", {"model": "sim-tiny", "prompt": [5, 99999]})
        assert status == 400 and "vocabulary" in err["error"]["message"]
        # completions: a string prompt gets the tokenizer's special tokens, as vLLM's default
        status, r = await rig.post(http, "/v1/completions", {"model": "sim-tiny", "prompt": "hi there",
                                                             "max_tokens": 3})
        assert status == 200
        want = rig.mt.tokens_for({"prompt": "hi there"}, "completions")
        assert r["usage"]["prompt_tokens"] == len(want)

    rig.run(scenario)
