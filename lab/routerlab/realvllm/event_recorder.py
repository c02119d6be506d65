"""Record every raw KV-cache event frame N publishers send, in arrival order, on a thread.

The lab's own subscriber, independent of the router's (extproc/pick/sources/kv_subscriber.py): the
capture command keeps its frames as test fixtures, and the end-to-end check uses it to know
how many batches each replica has published, so it can wait until the router applied them all.
Frames are kept raw (topic, seq bytes, payload bytes): whatever decodes them later sees exactly
what vLLM sent.

Decoding here is only what the waits need (stored-block counts per frame), done with the
router's decoder so an undecodable frame is visible as such.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from extproc.pick.events.kv_events import (
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    parse_frames,
    replay_request,
)


@dataclass(frozen=True)
class RawFrame:
    """One multipart message as received: which publisher, and its three frames."""

    replica: int
    topic: bytes
    seq: bytes
    payload: bytes
    t: float  # time.monotonic() at receipt

    @property
    def seq_int(self) -> int:
        return int.from_bytes(self.seq, "big", signed=True)

    def to_json(self) -> dict[str, object]:
        return {"replica": self.replica, "topic": base64.b64encode(self.topic).decode(),
                "seq": base64.b64encode(self.seq).decode(), "payload": base64.b64encode(self.payload).decode()}

    @classmethod
    def from_json(cls, d: dict) -> RawFrame:
        return cls(int(d["replica"]), base64.b64decode(d["topic"]), base64.b64decode(d["seq"]),
                   base64.b64decode(d["payload"]), 0.0)


def stored_blocks(frame: RawFrame) -> int:
    """Blocks announced stored in one frame (0 when it does not decode)."""
    try:
        batch = decode_batch(frame.payload).batch
    except EventDecodeError:
        return 0
    return sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))


def removed_blocks(frame: RawFrame) -> int:
    try:
        batch = decode_batch(frame.payload).batch
    except EventDecodeError:
        return 0
    return sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockRemoved))


def poll_until(ready: Callable[[], bool], timeout: float) -> bool:
    """Poll ``ready`` every 5 ms until true or ``timeout`` seconds passed; whether it became true."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class EventRecorder:
    """SUB sockets on every endpoint (one per replica); a thread appends each message to ``frames``."""

    def __init__(self, endpoints: Sequence[str], topic: str = "kv") -> None:
        self.endpoints = list(endpoints)
        self.topic = topic.encode()
        self.frames: list[RawFrame] = []
        self.stored: list[int] = [0] * len(self.endpoints)  # blocks announced stored, per replica
        self.last_seq: list[int] = [-1] * len(self.endpoints)
        self.bad = 0
        self._lock = threading.Lock()
        self._running = False
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()

    def start(self) -> EventRecorder:
        self._running = True
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True, name="event-recorder")
        self._thread.start()
        ready.wait(5)
        return self

    def _run(self, ready: threading.Event) -> None:
        socks = []
        poller = zmq.Poller()
        for url in self.endpoints:
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, self.topic)
            s.connect(url)
            socks.append(s)
            poller.register(s, zmq.POLLIN)
        index = {s: i for i, s in enumerate(socks)}
        ready.set()
        try:
            while self._running:
                for sock, _ in poller.poll(50):
                    parts = sock.recv_multipart()
                    self._add(index[sock], parts)
        finally:
            for s in socks:
                s.close(linger=0)

    def _add(self, replica: int, parts: list[bytes]) -> None:
        if len(parts) != 3:
            with self._lock:
                self.bad += 1
            return
        frame = RawFrame(replica, parts[0], parts[1], parts[2], time.monotonic())
        n = stored_blocks(frame)
        with self._lock:
            self.frames.append(frame)
            self.stored[replica] += n
            self.last_seq[replica] = max(self.last_seq[replica], frame.seq_int)

    def stop(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ctx.term()

    def __enter__(self) -> EventRecorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- reads -------------------------------------------------------------------------------
    def count(self) -> int:
        with self._lock:
            return len(self.frames)

    def batches(self) -> int:
        """Batches published so far by every replica, as seen here (last seq + 1, summed)."""
        with self._lock:
            return sum(s + 1 for s in self.last_seq)

    def stored_total(self, replica: int) -> int:
        with self._lock:
            return self.stored[replica]

    def since(self, start: int) -> list[RawFrame]:
        with self._lock:
            return self.frames[start:]

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """``poll_until`` (the recorder's thread fills the frames meanwhile)."""
        return poll_until(ready, timeout)


def replay(url: str, start: int = 0, timeout: float = 5.0) -> list[list[bytes]]:
    """Every buffered batch with seq >= ``start`` from a replay socket, raw, up to the end marker."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(url)
    out: list[list[bytes]] = []
    try:
        s.send_multipart(replay_request(start))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not s.poll(int(max(deadline - time.monotonic(), 0.001) * 1000)):
                break
            parts = s.recv_multipart()
            if parse_frames(parts).seq == -1:
                return out
            out.append(parts)
        raise TimeoutError(f"no end marker from {url} within {timeout} s ({len(out)} batches)")
    finally:
        s.close(linger=0)
        ctx.term()
