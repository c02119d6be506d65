"""vLLM KV-event wire format: both event encodings, both hash kinds, frames and replay."""

from __future__ import annotations

import sys

import msgpack
import pytest

from extproc.pick.events.kv_events import (
    END_OF_REPLAY,
    KEY_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    parse_frames,
    replay_request,
    unplaceable_groups,
    window_store,
)

BIG = 2**64 - 5  # unsigned block hash above int64, as vLLM publishes by default
SEQ_END = b"\xff" * 8


def packed(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_positional_events_with_int_hashes() -> None:
    events = [
        ["BlockStored", [BIG, 7], None, list(range(32)), 16, None, "GPU", None, [["salt"], None]],
        ["BlockStored", [9], 7, list(range(32, 48)), 16],  # trailing defaults omitted
        ["BlockRemoved", [BIG], "GPU"],
        ["AllBlocksCleared"],
    ]
    batch, skipped = decode_batch(packed([1.5, events, 0]))
    assert skipped == 0 and batch.ts == 1.5 and batch.data_parallel_rank == 0
    stored, second, removed, cleared = batch.events
    key = BIG & KEY_MASK  # a hash is kept as its low 60 bits: a 32-byte int, not 48
    assert key != BIG and key.bit_length() <= 60 and sys.getsizeof(key) <= 32 < sys.getsizeof(BIG)
    assert stored == BlockStored((key, 7), None, tuple(range(32)), 16, None, "GPU", None,
                                 (("salt",), None))
    assert second == BlockStored((9,), 7, tuple(range(32, 48)), 16)
    assert removed == BlockRemoved((key,), "GPU")
    assert cleared == AllBlocksCleared()
    assert isinstance(stored.token_ids, tuple) and isinstance(stored.block_hashes, tuple)


def test_map_events_with_bytes_hashes_and_unknown_fields() -> None:
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    events = [
        {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None,
         "token_ids": list(range(8)), "block_size": 4, "lora_id": 3, "medium": None,
         "lora_name": "adapter", "extra_keys": [["adapter"], ["adapter"]], "group_idx": 1,
         "kv_cache_spec_kind": "full_attention", "locality": "node", "future": {"x": 1}},
        {"type": "BlockRemoved", "block_hashes": [h2], "medium": "CPU", "group_idx": 1, "new": 2},
        {"type": "AllBlocksCleared"},
    ]
    batch, skipped = decode_batch(packed({"ts": 2, "events": events, "data_parallel_rank": None,
                                          "extra": True}))
    assert skipped == 0 and batch.ts == 2.0 and batch.data_parallel_rank is None
    k1, k2 = (int.from_bytes(h[-8:], "big") & KEY_MASK for h in (h1, h2))  # a bytes hash as an int key too
    assert batch.events[0] == BlockStored((k1, k2), None, tuple(range(8)), 4, 3, None, "adapter",
                                          (("adapter",), ("adapter",)), 1, "full_attention")
    assert batch.events[1] == BlockRemoved((k2,), "CPU", 1)
    assert batch.events[2] == AllBlocksCleared()


def test_extra_trailing_positional_fields_are_tolerated() -> None:
    ev = ["BlockStored", [1], None, [1, 2], 2, None, None, None, None, 0, "sliding_window", 128, "x"]
    removed = ["BlockRemoved", [1], None, 0, "locality"]
    batch, skipped = decode_batch(packed([0.0, [ev, removed]]))  # no data_parallel_rank
    assert skipped == 0 and batch.data_parallel_rank is None
    assert batch.events == (BlockStored((1,), None, (1, 2), 2, group_idx=0, kv_cache_spec_kind="sliding_window",
                                        kv_cache_spec_sliding_window=128),
                            BlockRemoved((1,), None, 0))


def test_a_hybrid_models_groups_are_told_apart() -> None:
    """By the kind (and window) vLLM 0.32 sends on each store: a sliding window that says its window
    is placed by the index; another kind, a window not said, or, where a publisher does not say its
    kind, a store naming fewer blocks than its tokens fill, cannot be followed."""
    full = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [0] * 8,
            "block_size": 4, "group_idx": 1, "kv_cache_spec_kind": "full_attention"}
    window = {**full, "group_idx": 0, "block_hashes": [2], "kv_cache_spec_kind": "sliding_window",
              "kv_cache_spec_sliding_window": 64}
    mamba = {**full, "group_idx": 2, "kv_cache_spec_kind": "mamba"}
    unsaid = {**full, "group_idx": 3, "block_hashes": [2], "kv_cache_spec_kind": None}
    no_window = {**full, "group_idx": 4, "kv_cache_spec_kind": "sliding_window"}
    plain = {**full, "group_idx": None, "block_hashes": [2], "kv_cache_spec_kind": None}  # no groups at all
    positional = ["BlockStored", [2], None, [0] * 8, 4, None, "GPU", None, None, 5, "sliding_window", 128]
    batch, skipped = decode_batch(packed([0.0, [full, window, mamba, unsaid, no_window, plain, positional,
                                               ["BlockRemoved", [1], None, 0]]]))
    assert skipped == 0
    assert (batch.events[1].kv_cache_spec_kind, batch.events[1].kv_cache_spec_sliding_window) == ("sliding_window", 64)
    assert batch.events[6].kv_cache_spec_sliding_window == 128 and batch.events[6].group_idx == 5
    assert [window_store(e) for e in batch.events] == [False, True, False, False, False, False, True, False]
    assert unplaceable_groups(batch.events) == {2, 3, 4}
    assert unplaceable_groups(decode_batch(packed([0.0, [full]])).batch.events) == set()


def test_unknown_and_malformed_events_are_skipped_and_counted() -> None:
    events = [
        ["SomethingNew", 1, 2],
        {"type": "AlsoNew"},
        {"no_type": 1},
        42,
        [],
        ["BlockStored", ["not-a-hash"], None, [1], 1],
        ["BlockStored", [1], None, [1, "x"], 1],
        ["BlockStored", [1], None, [1], 0],  # block size 0
        ["BlockStored", [True], None, [1], 1],  # a bool is not a hash
        ["BlockRemoved", "nope"],
        ["AllBlocksCleared"],
    ]
    batch, skipped = decode_batch(packed([0.0, events, 1]))
    assert skipped == 10 and batch.events == (AllBlocksCleared(),)


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"garbage that is not msgpack \x00\xff", packed(5), packed("text"), packed([1.0]),
    packed(["ts", []]), packed([1.0, "events"]), packed({"ts": 1.0}), packed([1.0, [], "rank"]),
])
def test_garbage_payloads_raise(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_event_decode_error_is_a_value_error() -> None:
    assert issubclass(EventDecodeError, ValueError)


def test_pub_frames() -> None:
    payload = packed([0.0, [], 0])
    frame = parse_frames([b"kv", (5).to_bytes(8, "big"), payload])
    assert frame == ("kv", 5, payload) and frame.topic == "kv"
    assert parse_frames([b"", (2**40).to_bytes(8, "big"), payload]).seq == 2**40


def test_replay_frames_both_shapes_and_the_end_marker() -> None:
    payload = packed([0.0, [], 0])
    seq = (7).to_bytes(8, "big")
    assert parse_frames([seq, payload]) == ("", 7, payload)  # older: [seq, payload]
    assert parse_frames([b"kv", seq, payload]) == ("kv", 7, payload)  # >= 0.26: [topic, seq, payload]
    assert parse_frames([b"", seq, payload]) == ("", 7, payload)  # a DEALER keeps ROUTER's delimiter
    assert parse_frames([b"", b"kv", seq, payload]) == ("kv", 7, payload)
    assert parse_frames([SEQ_END, b""]).seq == END_OF_REPLAY
    end = parse_frames([b"", SEQ_END, b""])
    assert end.seq == END_OF_REPLAY == -1 and end.payload == b""
    assert parse_frames([b"", b""]).seq == END_OF_REPLAY  # the oldest publishers' marker
    assert parse_frames([memoryview(b"kv"), bytearray(seq), payload]).seq == 7


@pytest.mark.parametrize("frames", [
    [], [b"x"], [b"a", b"b", b"c", b"d"], [b"a", b"b", b"c", b"d", b"e"],
    [b"kv", b"\x00" * 4, b"p"], [b"\xff\xfe", (1).to_bytes(8, "big"), b"p"],
])
def test_bad_frame_shapes_raise(frames: list[bytes]) -> None:
    with pytest.raises(EventDecodeError):
        parse_frames(frames)


def test_replay_request() -> None:
    assert replay_request(0) == [b"", b"\x00" * 8]
    assert replay_request(258) == [b"", (258).to_bytes(8, "big")]
