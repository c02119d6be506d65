"""The KV-event subscriber's ZeroMQ side: its sockets to a vLLM publisher, a cheap wait on them,
and the replay request.

vLLM's publisher (vLLM's vllm/distributed/kv_events.py, ``ZmqEventPublisher``) sends each batch
as ``(topic, seq, payload)`` on a PUB socket and answers a replay request (a start seq) on a
ROUTER socket with every buffered batch from that seq, then an end marker (seq -1). Split from
kv_subscriber.py, which decides what to ask and when, because this is only how: the socket
options, the wait that costs least per batch on a shared event loop, the request and its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final, Protocol, cast

import zmq
import zmq.asyncio

from extproc.pick.events.kv_events import END_OF_REPLAY, EventDecodeError, Frame, parse_frames, replay_request
from extproc.pick.sources.replica_views import KvSubscriberStats

# ZMQ options and flags as plain ints: pyzmq's enum operators cost more than the calls themselves
FD: Final = int(zmq.FD)
EVENTS: Final = int(zmq.EVENTS)
POLLIN: Final = int(zmq.POLLIN)
NOBLOCK: Final = int(zmq.NOBLOCK)


class RawSocket(Protocol):
    """A synchronous shadow of an asyncio socket, as a stream reads it (FD and EVENTS are int options)."""

    def getsockopt(self, option: int) -> int: ...

    def recv_multipart(self, flags: int) -> list[bytes]: ...


def shadow(sock: zmq.asyncio.Socket) -> RawSocket:
    """``sock``'s synchronous shadow: reads of what is already queued, without a future each."""
    return cast(RawSocket, zmq.Socket.shadow(sock.underlying))


class Readable:
    """Wakes a stream when its SUB or monitor socket may have something to read, or on timeout.

    The event loop watches the sockets' ZMQ_FD (readable while ZMQ has unprocessed commands for
    the socket, cleared by reading ZMQ_EVENTS or receiving); the stream drains with non-blocking
    receives, checks ZMQ_EVENTS, and only then waits here. zmq.asyncio's Poller did the same with a
    future, a poller and enum flag arithmetic per wait; without it the subscriber's CPU per batch
    beside decoding and applying went from 112 to 89 us at 1,500 batches/s and from 247 to 164 us
    at 300 batches/s (8 streams, each batch about 160-200 us to decode and apply).
    """

    __slots__ = ("_loop", "_fds", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, fds: Sequence[int]) -> None:
        self._loop = loop
        self._fds = tuple(fds)
        self._waiter: asyncio.Future[None] | None = None
        for fd in self._fds:
            loop.add_reader(fd, self._fire)

    def _fire(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        self._waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, self._fire)
        try:
            await self._waiter
        finally:
            timer.cancel()
            self._waiter = None

    def close(self) -> None:
        for fd in self._fds:
            self._loop.remove_reader(fd)


def open_socket(ctx: zmq.asyncio.Context, kind: int, url: str, rcvhwm: int, topic: str) -> zmq.asyncio.Socket:
    """A connected socket of ``kind``; a SUB one holds up to ``rcvhwm`` messages and subscribes to ``topic``."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if url.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
    sock.connect(url)
    return sock


async def ask_replay(ctx: zmq.asyncio.Context, url: str, start: int, stats: KvSubscriberStats, timeout: float,
                     total_timeout: float) -> tuple[bool, list[Frame]]:
    """Every batch the replay socket at ``url`` buffers with seq >= start; (answered to the end
    marker, frames in order). ``timeout``: the longest wait for each message of the answer,
    ``total_timeout``: for all of it. Counted in ``stats`` (asked, served, bad frames)."""
    stats.replays_asked += 1
    dealer = open_socket(ctx, zmq.DEALER, url, 0, "")  # a fresh socket: no late answers of an old ask
    out: list[Frame] = []
    try:
        await dealer.send_multipart(replay_request(start))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total_timeout
        while True:
            wait = min(timeout, deadline - loop.time())
            # pyzmq's _future.pyi gives the socket the Poller's poll(timeout); the socket's takes flags
            if wait <= 0 or not await dealer.poll(int(wait * 1000), zmq.POLLIN):  # type: ignore[call-arg]
                return False, out
            frames = await dealer.recv_multipart()
            try:
                fr = parse_frames(frames)
            except EventDecodeError:
                stats.bad_frames += 1
                continue
            if fr.seq == END_OF_REPLAY:
                stats.replays_served += 1
                return True, out
            if fr.seq >= start and (not out or fr.seq > out[-1].seq):
                out.append(fr)
    finally:
        dealer.close(linger=0)
