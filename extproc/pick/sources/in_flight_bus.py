"""The channel router replicas share their requests in flight on: Redis pub/sub (I/O around
extproc.pick.sources.shared_in_flight).

Publishing never waits on the request path: a pick or an end is queued and a sender task sends
the queue in one pipeline. A subscriber task applies the other routers' messages and forgets
routers that went quiet. If Redis is unreachable the router routes as it would alone (its own
requests only), drops what the others told it, and reconnects with backoff; it never fails a
request for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from extproc.pick.flow.room_share import Peer
from extproc.pick.sources.shared_in_flight import (
    Held,
    RemoteInFlight,
    end_message,
    heartbeat_message,
    held_message,
    pick_message,
)

log = logging.getLogger(__name__)

HEARTBEAT_S: Final = 1.0
MAX_QUEUED: Final = 10_000  # messages waiting to be sent; past it new ones are dropped (counted)
BACKOFF_S: Final = (0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(slots=True)
class BusStats:
    sent: int = 0
    send_failed: int = 0  # messages lost to a failed send or a full queue
    connected: bool = False


class InFlightBus:
    """This router's picks and ends out, the other routers' in (``remote``)."""

    def __init__(self, url: str, channel: str, remote: RemoteInFlight) -> None:
        self.url = url
        self.channel = channel
        self.remote = remote
        self.stats = BusStats()
        self._live: dict[int, None] = {}  # keys of this router's requests in flight, for the heartbeat
        self._held: Held = {}  # what its flow control holds, per pool and class
        self._held_changed = False  # a HELD message is due (one per send, with the latest counts)
        self._queue: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # --- the request path (PickCore calls these; no I/O) ---------------------------------
    def picked(self, key: int, address: str, prefill: int, run: Sequence[int]) -> None:
        self._live[key] = None
        self._send(pick_message(self.remote.router, key, address, prefill, run))

    def released(self, key: int) -> None:
        if key in self._live:
            del self._live[key]
            self._send(end_message(self.remote.router, key))

    def continued(self, run: Sequence[int]) -> int:
        return self.remote.continued(run)

    def held_here(self, pool: str, counts: Mapping[int, int], let_out: int) -> None:
        self._held[pool] = Peer(dict(counts), let_out)
        self._held_changed = True
        self._wake.set()

    def held_elsewhere(self, pool: str) -> list[Peer]:
        return self.remote.held(pool)

    def _send(self, payload: bytes) -> None:
        if len(self._queue) >= MAX_QUEUED:
            self.stats.send_failed += 1
            return
        self._queue.append(payload)
        self._wake.set()

    # --- background ----------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._subscribe(), name="in-flight-subscribe"),
                       asyncio.create_task(self._publish(), name="in-flight-publish"),
                       asyncio.create_task(self._heartbeat(), name="in-flight-heartbeat")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def _subscribe(self) -> None:
        failures = 0
        while True:
            client = aioredis.Redis.from_url(self.url, socket_connect_timeout=2.0)
            try:
                async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.stats.connected, failures = True, 0
                    log.info("sharing requests in flight on %s channel %r", _safe(self.url), self.channel)
                    while True:
                        message = await pubsub.get_message(timeout=HEARTBEAT_S)
                        if message is not None and message.get("type") == "message":
                            self.remote.on_message(message["data"])
                        self.remote.expire()
            except (RedisError, OSError) as exc:
                if self.stats.connected or not failures:
                    log.warning("in-flight sharing lost %s (%s); routing on this router's own requests until "
                                "it is back", _safe(self.url), exc)
            finally:
                self.stats.connected = False
                self.remote.clear()
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
            failures += 1

    async def _publish(self) -> None:
        client = aioredis.Redis.from_url(self.url, socket_connect_timeout=2.0, socket_timeout=2.0)
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._held_changed:  # however often it changed since the last send: the latest
                    self._held_changed = False
                    self._queue.append(held_message(self.remote.router, self._held))
                while self._queue:
                    batch = [self._queue.popleft() for _ in range(min(len(self._queue), 256))]
                    try:
                        async with client.pipeline(transaction=False) as pipe:
                            for payload in batch:
                                pipe.publish(self.channel, payload)
                            await pipe.execute()
                        self.stats.sent += len(batch)
                    except (RedisError, OSError):
                        self.stats.send_failed += len(batch)
                        await asyncio.sleep(BACKOFF_S[0])
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _heartbeat(self) -> None:
        while True:
            self._send(heartbeat_message(self.remote.router, self._live, time.time(), self._held))
            await asyncio.sleep(HEARTBEAT_S)


def _safe(url: str) -> str:
    """The URL without a password (logs)."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"
