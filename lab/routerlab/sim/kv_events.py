"""The simulator's KV-cache event publisher: the same wire format as vLLM's ZmqEventPublisher.

Mirrors ``vllm/distributed/kv_events.py`` (``ZmqEventPublisher._publisher_thread`` and
``_service_replay``; read in vllm-project/vllm at commits b4e69e0a and 0181ea31, and in a newer
copy of the same file that adds the topic frame to replay answers):

* live: one PUB message per engine step, ``[topic, seq (8 bytes big-endian), msgpack payload]``,
  seq counting from 0 per process;
* replay: a ROUTER socket; a request is ``[identity, b"", start_seq (8 bytes)]`` (a DEALER sends
  ``[b"", start_seq]``); the answer is one message per buffered batch with seq >= start, then an
  end marker with seq -1 (eight 0xFF bytes) and an empty payload. Two framings exist:

  - ``replay_topic=True`` (newer vLLM): ``[identity, b"", topic, seq, payload]`` and the end marker
    ``[identity, b"", b"", END_SEQ, b""]``;
  - ``replay_topic=False`` (vLLM at b4e69e0a / 0181ea31): ``[identity, b"", seq, payload]`` and
    ``[identity, b"", END_SEQ, b""]``.

  A malformed request (not 3 frames) is ignored, as vLLM does.
* payload: the batch ``[ts, events, data_parallel_rank]`` (``batch_encoding="array"``) or the map
  ``{"ts", "events", "data_parallel_rank"}`` (``"map"``); events as positional arrays tagged by
  class name with trailing defaults omitted (``encoding="array"``, vLLM before June 2026) or maps
  with a ``"type"`` key, default-valued optional fields omitted (``"map"``; as vLLM 0.32 sends it,
  with ``group_idx`` 0 and ``kv_cache_spec_kind`` "full_attention", tests/fixtures/vllm_kv_events). Block hashes are
  unsigned 64-bit ints by default, or bytes (``hash_type="bytes"``, 32 bytes big-endian, like a
  sha256 digest) when asked.

One deliberate difference: the live socket is an XPUB (wire-identical to PUB for a SUB peer), so
:meth:`subscriptions` can tell a test when a subscriber's subscription has arrived instead of
sleeping through ZMQ's slow-joiner window.

Hook API for the engine (collected per step, sent as one batch by :meth:`flush`):
``stored(block_hashes, parent_hash, token_ids, block_size, extra_keys, lora_id, lora_name)``,
``removed(block_hashes)``,
``cleared()``. The replay socket is served by a daemon thread (it only touches the ROUTER socket
and the buffer, under a lock); ``publish``/``flush``/``subscriptions`` must be called from one
thread (the simulator's event loop), since the XPUB socket is not thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"

Encoding = Literal["array", "map"]
HashType = Literal["int", "bytes"]


@dataclass
class BlockStored:
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[int | bytes]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def _hash(h: int | bytes, hash_type: HashType) -> int | bytes:
    if hash_type == "bytes" and isinstance(h, int):
        return h.to_bytes(32, "big")
    return h


def encode_event(ev: Event, encoding: Encoding = "array", hash_type: HashType = "int") -> Any:
    """One event as msgspec would give it to msgpack (tag first; defaults omitted)."""
    if isinstance(ev, BlockStored):
        name = "BlockStored"
        required: list[tuple[str, Any]] = [
            ("block_hashes", [_hash(h, hash_type) for h in ev.block_hashes]),
            ("parent_block_hash", None if ev.parent_block_hash is None else _hash(ev.parent_block_hash, hash_type)),
            ("token_ids", list(ev.token_ids)),
            ("block_size", ev.block_size),
            ("lora_id", ev.lora_id),
            ("medium", ev.medium),
            ("lora_name", ev.lora_name),
        ]
        optional: list[tuple[str, Any]] = [("extra_keys", ev.extra_keys), ("group_idx", ev.group_idx),
                                           ("kv_cache_spec_kind", ev.kv_cache_spec_kind)]
    elif isinstance(ev, BlockRemoved):
        name = "BlockRemoved"
        required = [("block_hashes", [_hash(h, hash_type) for h in ev.block_hashes]), ("medium", ev.medium)]
        optional = [("group_idx", ev.group_idx)]
    elif isinstance(ev, AllBlocksCleared):
        name, required, optional = "AllBlocksCleared", [], []
    else:
        raise TypeError(f"not a KV event: {ev!r}")
    if encoding == "map":
        out: dict[str, Any] = {"type": name}
        out.update(required)
        out.update((k, v) for k, v in optional if v is not None)
        return out
    values = [v for _, v in optional]
    while values and values[-1] is None:  # omit_defaults on an array_like struct: trailing defaults only
        values.pop()
    return [name, *(v for _, v in required), *values]


def encode_batch(events: Sequence[Event], ts: float, dp_rank: int | None = 0, encoding: Encoding = "array",
                 batch_encoding: Encoding = "array", hash_type: HashType = "int") -> bytes:
    evs = [encode_event(e, encoding, hash_type) for e in events]
    if batch_encoding == "map":
        batch: Any = {"ts": ts, "events": evs}
        if dp_rank is not None:
            batch["data_parallel_rank"] = dp_rank
    else:
        batch = [ts, evs] if dp_rank is None else [ts, evs, dp_rank]
    return msgpack.packb(batch, use_bin_type=True)


class KvEventPublisher:
    """Publishes KV-cache event batches like one vLLM engine (DP rank ``data_parallel_rank``).

    Ports are offset by the rank, as vLLM's ``offset_endpoint_port`` does.
    """

    def __init__(self, host: str = "127.0.0.1", events_port: int = 5557, replay_port: int | None = 5558,
                 topic: str = "kv", buffer_steps: int = 10_000, encoding: Encoding = "array",
                 batch_encoding: Encoding = "array", hash_type: HashType = "int", data_parallel_rank: int = 0,
                 replay_topic: bool = True, hwm: int = 100_000) -> None:
        self.topic = topic.encode("utf-8")
        self.encoding: Encoding = encoding
        self.batch_encoding: Encoding = batch_encoding
        self.hash_type: HashType = hash_type
        self.rank = data_parallel_rank
        self.replay_topic = replay_topic
        self.next_seq = 0
        self.sent = 0
        self.replays_served = 0
        self._subscriptions = 0
        self._pending: list[Event] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription message, not just the first per topic
        self._router: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._running = True
        try:
            self._pub.bind(f"tcp://{host}:{events_port + data_parallel_rank}")
            if replay_port is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(f"tcp://{host}:{replay_port + data_parallel_rank}")
        except zmq.ZMQError:  # a port in use: leave no socket behind
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            raise
        if replay_port is not None:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True, name="sim-kv-replay")
            self._thread.start()

    # ---- hook API (one engine step) -----------------------------------------------------
    def stored(self, block_hashes: Sequence[int | bytes], parent_hash: int | bytes | None,
               token_ids: Sequence[int], block_size: int, extra_keys: Sequence[Any] | None = None,
               lora_id: int | None = None, lora_name: str | None = None) -> None:
        self._pending.append(BlockStored(list(block_hashes), parent_hash, list(token_ids), block_size,
                                         lora_id=lora_id, lora_name=lora_name,
                                         extra_keys=None if extra_keys is None else list(extra_keys),
                                         **self._group(stored=True)))

    def removed(self, block_hashes: Sequence[int | bytes]) -> None:
        self._pending.append(BlockRemoved(list(block_hashes), **self._group(stored=False)))

    def _group(self, stored: bool) -> dict[str, Any]:
        """The KV-cache group fields: vLLM 0.32 (map encoding, seen on the wire) sends ``group_idx: 0``
        on both events and ``kv_cache_spec_kind: "full_attention"`` on BlockStored; the array
        encoding of older vLLM is left without them."""
        if self.encoding != "map":
            return {}
        return {"group_idx": 0, **({"kv_cache_spec_kind": "full_attention"} if stored else {})}

    def cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    def flush(self) -> int | None:
        """Send this step's events as one batch; returns its seq, None when there was nothing."""
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        return self.publish(events)

    # ---- batches ------------------------------------------------------------------------
    def publish(self, events: Sequence[Event], *, send: bool = True, ts: float | None = None) -> int:
        """One batch with the next seq; ``send=False`` keeps it in the replay buffer only (a lost message)."""
        payload = encode_batch(events, time.time() if ts is None else ts, self.rank, self.encoding,
                               self.batch_encoding, self.hash_type)
        return self.publish_payload(payload, send=send)

    def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        """One batch already encoded (``encode_batch``) with the next seq: a load driver sends
        precomputed payloads without paying the encoding per step."""
        seq = self.next_seq
        self.next_seq += 1
        if send:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)
            self.sent += 1
        with self._lock:
            self._buffer.append((seq, payload))
        return seq

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on the live socket (for tests of malformed input)."""
        self._pub.send_multipart(list(frames))

    def subscriptions(self) -> int:
        """Subscription messages received so far (drains the XPUB's incoming side)."""
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return self._subscriptions
            if msg[:1] == b"\x01":
                self._subscriptions += 1

    def buffered(self) -> list[int]:
        with self._lock:
            return [s for s, _ in self._buffer]

    # ---- replay -------------------------------------------------------------------------
    def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while self._running:
            try:
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
            except zmq.ZMQError:
                return  # closed under us
            if len(frames) != 3:
                continue  # vLLM logs "Invalid replay request" and ignores it
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                todo = [(s, p) for s, p in self._buffer if s >= start]
            try:
                for seq, payload in todo:
                    if self.replay_topic:
                        router.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
                    else:
                        router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                if self.replay_topic:
                    router.send_multipart((client, b"", b"", END_SEQ, b""))
                else:
                    router.send_multipart((client, b"", END_SEQ, b""))
                self.replays_served += 1
            except zmq.ZMQError:
                if not self._running:
                    return

    def close(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
