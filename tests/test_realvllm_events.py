"""The real-vLLM event tooling without vLLM: the launcher's event flags, the recorder against the
simulator's publisher (real ZMQ on loopback), the content naming of the event-fidelity check, and
the chat trace of the end-to-end check."""

from __future__ import annotations

import json
import time

from extproc.pick.events.block_hashes import ROOT, block_hashes
from routerlab.harness.procs import free_ports
from routerlab.realvllm.chat_trace import CHAT, COMPLETIONS, build_chat_trace
from routerlab.realvllm.event_fidelity import per_request
from routerlab.realvllm.event_recorder import EventRecorder, RawFrame, replay
from routerlab.realvllm.fleet import VllmFleet
from routerlab.sim.kv_events import BlockRemoved, BlockStored, KvEventPublisher, encode_batch


def test_the_fleet_asks_vllm_for_events_it_can_be_subscribed_to() -> None:
    fleet = VllmFleet("/tmp/none", replicas=2, base_port=8300, prompt_tokens_details=True,
                      kv_events_offset=100, kv_replay_offset=200)
    cmd = fleet.command(1)
    assert "--enable-prompt-tokens-details" in cmd
    cfg = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    # vLLM 0.32 binds its PUB socket only for a wildcard endpoint; a host makes it connect()
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:8401",
                   "replay_endpoint": "tcp://127.0.0.1:8501", "topic": "kv"}
    assert fleet.kv_event_urls == ["tcp://127.0.0.1:8400", "tcp://127.0.0.1:8401"]
    assert "--kv-events-config" not in VllmFleet("/tmp/none").command(0)


def test_the_recorder_keeps_every_raw_frame_and_matches_the_replay_buffer() -> None:
    events, replay_port = free_ports(2)
    pub = KvEventPublisher(events_port=events, replay_port=replay_port, encoding="map")
    try:
        with EventRecorder([f"tcp://127.0.0.1:{events}"]) as rec:
            deadline = time.monotonic() + 5
            while pub.subscriptions() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            pub.stored([11, 12], None, list(range(8)), 4)
            pub.flush()
            pub.removed([12])
            pub.flush()
            assert rec.wait(lambda: rec.count() == 2, 5)
            frames = rec.since(0)
        assert rec.stored == [2] and rec.last_seq == [1] and rec.batches() == 2
        assert [(f.seq_int, f.payload) for f in frames] == [
            (int.from_bytes(p[-2], "big"), p[-1]) for p in replay(f"tcp://127.0.0.1:{replay_port}")]
        assert RawFrame.from_json(frames[0].to_json()).payload == frames[0].payload
    finally:
        pub.close()


def frame(events: list, ts: float, seq: int) -> RawFrame:
    return RawFrame(0, b"kv", seq.to_bytes(8, "big"), encode_batch(events, ts, encoding="map"), 0.0)


def test_blocks_are_named_by_content_and_position_and_split_by_batch_time() -> None:
    tokens = list(range(12))
    frames = [frame([BlockStored([7, 8], None, tokens[:8], 4)], 10.5, 0),
              frame([BlockStored([9], 8, tokens[8:], 4)], 11.5, 1),
              frame([BlockRemoved([9]), BlockRemoved([8])], 12.5, 2)]
    names = block_hashes(tokens, 4, None, ROOT)
    out = per_request(frames, sent=[10.0, 11.0, 12.0])
    assert out == [(names[:2], []), ([names[2]], []), ([], [names[2], names[1]])]
    # other engine hashes for the same tokens: the same names
    again = per_request([frame([BlockStored([b"x" * 32, b"y" * 32, b"z" * 32], None, tokens, 4)], 1.0, 0)], [0.0])
    assert again == [(names, [])]


def test_the_chat_trace_is_seeded_and_mixes_shared_systems_turns_salts_and_completions() -> None:
    trace = build_chat_trace(120, seed=3)
    assert [r.body for r in trace] == [r.body for r in build_chat_trace(120, seed=3)]
    assert len(trace) == 120
    chats = [r for r in trace if r.path == CHAT]
    assert 0 < len(trace) - len(chats) < 40 and all(r.path in (CHAT, COMPLETIONS) for r in trace)
    assert any(len(r.body["messages"]) >= 5 for r in chats)  # later turns carry the earlier ones
    systems = {r.body["messages"][0]["content"] for r in chats}
    assert 1 < len(systems) <= 4  # shared across conversations
    assert any("cache_salt" in r.body for r in chats)
    assert any(isinstance(r.body.get("prompt"), list) for r in trace)


def test_the_e2e_summary_counts_exact_requests_and_lists_each_miss() -> None:
    from routerlab.realvllm.precise_e2e import Row, format_row, markdown, summarize

    def row(i: int, router_cached: int, vllm_cached: int) -> Row:
        return Row(i, CHAT, f"c{i}", "127.0.0.1:1", 300, 300, router_cached, vllm_cached, vllm_cached, True,
                   "events", "127.0.0.1:1", 2, 10.0, {"127.0.0.1:1": router_cached, "127.0.0.1:2": 0})

    rows = [row(0, 0, 0), row(1, 256, 256), row(2, 224, 256)]
    s = summarize(rows, {"removed_blocks": 5})
    assert (s["requests"], s["prompt_tokens_equal"], s["cached_tokens_equal"], s["requests_with_hits"]) == (3, 3, 2, 2)
    assert [m["index"] for m in s["misses"]] == [2]
    assert "NO" in format_row(rows[2]) and "yes" in format_row(rows[1])
    table = markdown(s, rows, {"removed_blocks": 5})
    assert "**2 / 3**" in table and "| 2 | c2 |" in table


def test_the_e2e_runs_the_benchmark_s_precise_arm_as_it_is() -> None:
    from routerlab.bench.arms import ARMS
    from routerlab.realvllm.precise_e2e import PRECISE_ARM

    assert PRECISE_ARM == ARMS["prefix-precise"]


def test_variants_change_only_the_form_of_some_requests() -> None:
    plain, varied = build_chat_trace(200, seed=2), build_chat_trace(200, seed=2, variants=0.4)
    changed = [(p, v) for p, v in zip(plain, varied) if p.body != v.body]
    assert 40 < len(changed) < 120
    assert all(p.label in v.label and p.path == v.path for p, v in zip(plain, varied))
    kinds = {v.label.rsplit("[", 1)[1].rstrip("]") for _, v in changed}
    assert {"parts", "unicode", "continue", "no-generation-prompt"} <= kinds
    for p, v in changed:
        if "continue" in v.label:
            assert v.body["messages"][:-1] == p.body["messages"] and v.body["continue_final_message"]


def test_under_concurrency_a_conversations_turns_wait_for_each_other() -> None:
    from routerlab.realvllm.precise_e2e import previous_turns

    trace = build_chat_trace(60, seed=1, variants=0.3)
    previous = previous_turns(trace)
    by_index = {r.index: r for r in trace}
    assert previous and all(by_index[p].conversation == by_index[i].conversation and p < i
                            for i, p in previous.items())
    assert all(by_index[i].path == CHAT for i in previous)
    firsts = {r.conversation for r in trace if r.conversation}
    assert len(firsts) == len([r for r in trace if r.conversation and r.index not in previous])
