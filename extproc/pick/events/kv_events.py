"""Decode vLLM's KV-cache event stream: ZeroMQ frames and msgpack event batches (pure).

vLLM publishes one ``EventBatch`` per scheduler step (vllm/distributed/kv_events.py). Two
encodings are in the field: inner events as positional arrays tagged by class name with
trailing defaults omitted (before vLLM PR 42892) and maps with a ``"type"`` key (after it).
Consumers that decoded only one broke at the change, so both are read here, and fields this
module does not know are ignored: vLLM adds fields at the end (``kv_cache_spec_kind``,
``locality``, ...). An inner event that cannot be read is skipped and counted, never fatal:
one odd event must not cost a whole step; a payload that is not a batch at all raises
``EventDecodeError``.

Block hashes arrive as an unsigned int that may exceed 2**63, a signed int from other engines,
or bytes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``. They are only ever dict keys (the index
keys the cache on its own hash of the token ids), one per resident block of every replica, so
each is decoded to its low 60 bits (of a bytes hash's last 8 bytes): a two-digit CPython int,
32 bytes, where a 64-bit one takes 48 and a 32-byte bytes object 80 (a view of 5.4 M blocks:
about 80 MB less). Two of a replica's blocks collide with odds of about n**2 / 2**61 (84,000
blocks: 3e-9).

No encoder here: the lab's simulator writes the wire format; tests build payloads with
``msgpack.packb`` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import msgpack

EngineHash = int  # a block hash as decoded: its key (``engine_key``)
KEY_MASK: Final = (1 << 60) - 1

END_OF_REPLAY: Final = -1  # the replay socket's last message: seq -1 and an empty payload


class EventDecodeError(ValueError):
    """A frame or payload that is not vLLM's KV-event wire format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """One contiguous run of newly cached full blocks of one request (``token_ids`` covers all)."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None  # None: the run starts at block 0
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None  # one per block: LoRA, mm hashes, cache_salt
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None  # the group's kind: "full_attention", "sliding_window", ... (vLLM 0.32)
    kv_cache_spec_sliding_window: int | None = None  # a sliding-window group's window, in tokens


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Evicted blocks (one physical copy each: vLLM may still hold another, vllm#55092)."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The replica reset its prefix cache."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(NamedTuple):
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None


class DecodedBatch(NamedTuple):
    batch: EventBatch
    skipped: int  # inner events dropped as unknown or malformed


class Frame(NamedTuple):
    topic: str
    seq: int  # END_OF_REPLAY on the replay socket's end marker
    payload: bytes


# --- frames ------------------------------------------------------------------------------
def parse_frames(frames: Sequence[bytes]) -> Frame:
    """One ZeroMQ multipart message from the PUB socket or the replay DEALER, as a ``Frame``.

    Shapes: PUB ``[topic, seq, payload]``; replay as a DEALER receives it
    ``[b"", seq, payload]`` (vLLM: ROUTER's empty delimiter is kept by a DEALER, and reads
    here as an empty topic), ``[b"", topic, seq, payload]`` (publishers that also send the
    topic), or ``[seq, payload]`` (a DEALER-less client). The end marker has seq -1 (eight
    0xFF bytes) and an empty payload; the oldest publishers sent an empty seq frame instead,
    read as ``END_OF_REPLAY`` too.
    """
    parts = [bytes(f) for f in frames]
    if len(parts) == 4 and not parts[0]:
        parts = parts[1:]
    if len(parts) == 3:
        topic_b, seq_b, payload = parts
    elif len(parts) == 2:
        topic_b, (seq_b, payload) = b"", parts
    else:
        raise EventDecodeError(f"expected [topic,] seq, payload frames, got {len(parts)} frames")
    if not seq_b and not payload:
        seq = END_OF_REPLAY
    elif len(seq_b) != 8:
        raise EventDecodeError(f"sequence frame must be 8 bytes, got {len(seq_b)}")
    else:
        seq = int.from_bytes(seq_b, "big", signed=True)
    try:
        topic = topic_b.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EventDecodeError(f"topic frame is not utf-8: {e}") from None
    return Frame(topic, seq, payload)


FULL_ATTENTION: Final = "full_attention"
SLIDING_WINDOW: Final = "sliding_window"


def window_store(ev: Event) -> bool:
    """A sliding-window group's store that says its window (extproc.pick.events.window_groups places it)."""
    return type(ev) is BlockStored and ev.kv_cache_spec_kind == SLIDING_WINDOW and bool(ev.kv_cache_spec_sliding_window)


def unplaceable_groups(events: Sequence[Event]) -> set[int]:
    """A hybrid model's KV-cache groups the view cannot follow: a kind other than full attention or a
    sliding window that says its window (Mamba, ...), or, from a publisher that does not say its
    kind, stores naming fewer blocks than their tokens fill. vLLM 0.32 announces a sliding-window
    group's run with every token of it but only the hashes of the blocks it keeps (the window
    before a point a later request could hit), with no parent (seen on the wire: docs/precise-fidelity.md)."""
    return {ev.group_idx for ev in events if type(ev) is BlockStored and ev.group_idx is not None
            and not window_store(ev) and (ev.kv_cache_spec_kind not in (None, FULL_ATTENTION)
                                          or len(ev.token_ids) > len(ev.block_hashes) * ev.block_size)}


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to vLLM's ROUTER replay socket for every batch with seq >= start."""
    return [b"", start_seq.to_bytes(8, "big")]


# --- payloads ----------------------------------------------------------------------------
def decode_batch(payload: bytes) -> DecodedBatch:
    """The batch in ``payload``; inner events that cannot be read are skipped and counted."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise EventDecodeError(f"payload is not msgpack: {type(e).__name__}: {e}") from None
    ts: Any  # checked below
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and 2 <= len(raw):
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise EventDecodeError(f"payload is not an event batch: {type(raw).__name__}")
    if not _is_num(ts) or not isinstance(events, list) or not (rank is None or _is_int(rank)):
        raise EventDecodeError("payload is not an event batch: want [ts, events, data_parallel_rank]")
    out: list[Event] = []
    skipped = 0
    for item in events:
        event = _event(item)
        if event is None:
            skipped += 1
        else:
            out.append(event)
    return DecodedBatch(EventBatch(float(ts), tuple(out), rank), skipped)


_STORED_FIELDS: Final = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                         "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                         "kv_cache_spec_sliding_window")
_NONES: Final = [None] * len(_STORED_FIELDS)


def _event(item: Any) -> Event | None:
    """One inner event, or None when its tag is unknown or a field has the wrong type.

    Called once per event on the ingest path, and vLLM sends one BlockRemoved per evicted block,
    so each tag's fields are read directly (no per-field lookups through a shared accessor)."""
    if isinstance(item, dict):
        tag = item.get("type")
        if tag == "BlockRemoved":
            return _removed(item.get("block_hashes"), item.get("medium"), item.get("group_idx"))
        if tag == "BlockStored":
            return _stored(*[item.get(name) for name in _STORED_FIELDS])
        if tag == "AllBlocksCleared":
            return _CLEARED
        return None
    if isinstance(item, list) and item:
        tag = item[0]
        if tag == "BlockRemoved":  # positional, trailing defaults omitted
            return _removed(*(item[1:4] + _NONES)[:3])
        if tag == "BlockStored":
            return _stored(*(item[1:12] + _NONES)[:11])
        if tag == "AllBlocksCleared":
            return _CLEARED
    return None


_CLEARED: Final = AllBlocksCleared()


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, lora_id: Any, medium: Any,
            lora_name: Any, extra: Any, group: Any, kind: Any, window: Any) -> BlockStored | None:
    if (not _hash_list(hashes) or not (parent is None or _is_hash(parent))
            or not isinstance(tokens, list) or not set(map(type, tokens)) <= _INT
            or not _is_int(block_size) or block_size <= 0
            or not _opt_int(lora_id) or not _opt_str(medium) or not _opt_str(lora_name)
            or not _opt_int(group)):
        return None
    if extra is not None:
        if not isinstance(extra, list) or not all(e is None or isinstance(e, list) for e in extra):
            return None
        extra = tuple(None if e is None else tuple(e) for e in extra)
    return BlockStored(_keys(hashes), None if parent is None else engine_key(parent), tuple(tokens), block_size,
                       lora_id, medium, lora_name, extra, group, kind if isinstance(kind, str) else None,
                       window if _is_int(window) else None)


def _removed(hashes: Any, medium: Any, group: Any) -> BlockRemoved | None:
    if not _hash_list(hashes) or not _opt_str(medium) or not _opt_int(group):
        return None
    return BlockRemoved(_keys(hashes), medium, group)


def engine_key(h: int | bytes) -> int:
    """A block hash as the view keys it (see the module): its low 60 bits, of a bytes hash's last 8 bytes."""
    return (int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h) & KEY_MASK


def _keys(hashes: list[int | bytes]) -> tuple[int, ...]:
    """Each hash's ``engine_key``: int hashes in one comprehension, without a call each."""
    try:
        return tuple([h & KEY_MASK for h in hashes])  # type: ignore[operator]  # bytes: TypeError, below
    except TypeError:  # bytes hashes
        return tuple(map(engine_key, hashes))


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool


def _is_num(x: Any) -> bool:
    return type(x) is int or type(x) is float


def _is_hash(x: Any) -> bool:
    return type(x) is int or type(x) is bytes


_INT: Final = frozenset((int,))  # not bool: type() is exact
_HASH: Final = frozenset((int, bytes))


def _hash_list(x: Any) -> bool:
    return isinstance(x, list) and set(map(type, x)) <= _HASH


def _opt_int(x: Any) -> bool:
    return x is None or type(x) is int


def _opt_str(x: Any) -> bool:
    return x is None or isinstance(x, str)
