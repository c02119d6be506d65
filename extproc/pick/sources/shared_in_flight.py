"""What the other router replicas have in flight, from the messages they publish (pure).

A router knows its own requests in flight per replica: they count towards the replica's load
until the next scrape sees them, and in precise mode their blocks count as there (being
computed) before the replica's events announce them. With several router replicas each knows
only its share, and a request that waits seconds in a replica's queue stays invisible to the
others until its blocks are stored: under KV pressure, one router that forgot half its own
requests in flight fell from 0.65-0.69 to 0.60 of the oracle hit rate (docs/results/precise/history.md). So each
router publishes its picks and their ends on a shared channel (a Redis pub/sub channel:
extproc.pick.sources.in_flight_bus), and applies the others' as if they were its own: load assigned and
released, block runs pending at the replica. Nothing is agreed on and nothing is stored: a lost
message costs a stale hint, which every router's heartbeat (the keys it still has in flight)
clears, and a router that goes quiet is forgotten after ``PEER_TIMEOUT_S``.

Messages (msgpack arrays): ``[PICK, router, key, address, prefill tokens, run]`` where run is the
request's own block hashes as little-endian uint64 bytes (the same on every router: the chain hash
has no per-process seed), ``[END, router, key]``, ``[HEARTBEAT, router, [keys in flight], sent at, held]``
(the sender's wall clock in seconds; older routers send neither of the last two, and read past
them) and ``[HELD, router, held]``, sent when flow control's held requests change (coalesced with the
other messages), where held is ``[[pool, [[priority class, count], ...], let out], ...]``: the
routers take turns at a saturated pool's room by it (extproc.pick.flow.room_share). A router older
than HELD counts it as a bad message and skips it. A heartbeat takes the picks' path through the
sender's queue and the receiver's loop, so its delay is theirs: how late a router hears of the
other's picks, and so how wide the window in which two routers' choices cannot see each other.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import msgpack

from extproc.pick.flow.room_share import Peer

PICK: Final = 0
END: Final = 1
HEARTBEAT: Final = 2
HELD: Final = 3
PEER_TIMEOUT_S: Final = 5.0  # a router unheard for this long has stopped: its requests are dropped


class Applies(Protocol):
    """What the remote requests are applied to (``PickCore``)."""

    def add_remote(self, address: str, prefill: int, run: Sequence[int], now: float) -> bool: ...

    def drop_remote(self, address: str, prefill: int, run: Sequence[int], counted: bool) -> None: ...


def pick_message(router: bytes, key: int, address: str, prefill: int, run: Sequence[int]) -> bytes:
    raw = run if isinstance(run, array) and run.typecode == "Q" else array("Q", run)
    if sys.byteorder != "little":
        raw = array("Q", raw)
        raw.byteswap()
    message: bytes = msgpack.packb([PICK, router, key, address, prefill, raw.tobytes()])
    return message


def end_message(router: bytes, key: int) -> bytes:
    message: bytes = msgpack.packb([END, router, key])
    return message


Held = dict[str, Peer]  # pool -> what flow control holds per priority class, and has let out


def heartbeat_message(router: bytes, keys: Iterable[int], sent_at: float | None = None,
                      held: Held | None = None) -> bytes:
    """``sent_at``: the sender's wall clock (seconds), so receivers can measure the channel's delay;
    ``held``: what its flow control holds (a lost HELD message is stale until the next heartbeat)."""
    tail: tuple[object, ...] = () if sent_at is None else (sent_at,) if held is None else (sent_at, _entries(held))
    message: bytes = msgpack.packb([HEARTBEAT, router, list(keys), *tail])
    return message


def held_message(router: bytes, held: Held) -> bytes:
    message: bytes = msgpack.packb([HELD, router, _entries(held)])
    return message


def _entries(held: Held) -> list[list[object]]:
    return [[pool, [[priority, n] for priority, n in peer.held.items() if n > 0], peer.let_out]
            for pool, peer in held.items()]


def _held(entries: Iterable[Sequence[Any]]) -> Held:
    return {str(pool): Peer({int(p): int(n) for p, n in counts}, int(let_out)) for pool, counts, let_out in entries}


def _run(raw: bytes) -> array[int]:
    run = array("Q")
    run.frombytes(raw)
    if sys.byteorder != "little":
        run.byteswap()
    return run


@dataclass(slots=True)
class _Peer:
    heard: float
    # key -> (address, prefill, run, whether its load was counted: the address was one of this router's)
    requests: dict[int, tuple[str, int, array[int], bool]] = field(default_factory=dict)
    held: Held = field(default_factory=dict)  # what its flow control holds, as it last said


@dataclass(slots=True)
class RemoteStats:
    received: dict[int, int] = field(default_factory=lambda: dict.fromkeys((PICK, END, HEARTBEAT, HELD), 0))
    bad: int = 0  # messages that did not decode (skipped)
    dropped: int = 0  # remote requests dropped without their end message (heartbeat, timeout, disconnect)
    continued: int = 0  # remote requests ended by a request that continues them, before their end message


class RemoteInFlight:
    """The other routers' requests in flight, applied to ``target`` as they come and go."""

    def __init__(self, target: Applies, router: bytes, clock: Callable[[], float],
                 wall: Callable[[], float] | None = None, on_delay: Callable[[float], None] | None = None) -> None:
        self.target = target
        self.router = router  # this router's id: its own messages come back on the channel
        self.clock = clock
        self.wall = wall  # wall-clock seconds, to time heartbeats
        self.on_delay = on_delay  # told each heartbeat's delay, sending to arrival (seconds; wall clocks)
        self.peers: dict[bytes, _Peer] = {}
        self.stats = RemoteStats()
        self._tails: dict[int, list[tuple[_Peer, int]]] = {}  # a remote run's last block hash -> (peer, key)

    def requests(self) -> int:
        return sum(len(p.requests) for p in self.peers.values())

    def held_total(self) -> int:
        """Every request the other routers said they hold, over pools and classes."""
        return sum(n for p in self.peers.values() for pool in p.held.values() for n in pool.held.values())

    def held(self, pool: str) -> list[Peer]:
        """What each other router last said its flow control holds of ``pool`` and let out."""
        return [p.held[pool] for p in self.peers.values() if pool in p.held]

    def on_message(self, payload: bytes) -> None:
        """Apply one message from the channel; one that does not decode is counted and skipped."""
        try:
            message = msgpack.unpackb(payload)
            kind, router = message[0], bytes(message[1])
            if router == self.router:
                return
            now = self.clock()
            peer = self.peers.get(router)
            if peer is None:
                peer = self.peers[router] = _Peer(now)
            peer.heard = now
            if kind == PICK:
                _, _, key, address, prefill, raw = message
                self._end(peer, int(key))  # a key seen twice: the newer request stands
                run = _run(raw)
                counted = self.target.add_remote(str(address), int(prefill), run, now)
                peer.requests[int(key)] = (str(address), int(prefill), run, counted)
                if run:
                    self._tails.setdefault(run[-1], []).append((peer, int(key)))
            elif kind == END:
                self._end(peer, int(message[2]))
            elif kind == HEARTBEAT:
                live = set(message[2])
                if self.on_delay is not None and self.wall is not None and len(message) > 3:
                    self.on_delay(max(0.0, self.wall() - float(message[3])))
                for key in [k for k in peer.requests if k not in live]:
                    self._end(peer, key)
                    self.stats.dropped += 1
                if len(message) > 4:
                    peer.held = _held(message[4])
            elif kind == HELD:
                peer.held = _held(message[2])
            else:
                raise ValueError(kind)
            self.stats.received[kind] += 1
        except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException):
            self.stats.bad += 1

    def expire(self) -> None:
        """Forget routers unheard for ``PEER_TIMEOUT_S`` (stopped, or cut off from the channel)."""
        now = self.clock()
        for router in [r for r, p in self.peers.items() if now - p.heard > PEER_TIMEOUT_S]:
            self._forget(router)

    def clear(self) -> None:
        """The channel is lost: what it told may be stale, and its ends would not arrive."""
        for router in list(self.peers):
            self._forget(router)

    def _forget(self, router: bytes) -> None:
        peer = self.peers.pop(router)
        for key in list(peer.requests):
            self._end(peer, key)
            self.stats.dropped += 1

    def continued(self, run: Sequence[int]) -> int:
        """End the remote requests that ``run`` (a request about to be routed) continues, returns how many.

        A chat client sends its next turn once it has the answer, so a request whose blocks hold a
        remote request's whole run and more follows a request that has ended, though its end message
        may still be on its way: it races the client's next turn, which reaches this router half the
        time. Counted in flight until then, it would charge the replica holding the conversation one
        request too many just when the conversation comes back to it. Chain hashes make the test one
        lookup per block: a remote run is a prefix of ``run`` if its last hash is in ``run``, before
        ``run``'s last block (a run the same length is the same prompt again: a retry, not a turn)."""
        tails = self._tails
        if not tails or len(run) < 2 or tails.keys().isdisjoint(run):
            return 0
        ended = 0
        for i in range(len(run) - 1):
            for peer, key in list(tails.get(run[i], ())):  # _end edits the list
                entry = peer.requests.get(key)
                if entry is not None and len(entry[2]) == i + 1:
                    self._end(peer, key)
                    ended += 1
        self.stats.continued += ended
        return ended

    def _end(self, peer: _Peer, key: int) -> None:
        entry = peer.requests.pop(key, None)
        if entry is not None:
            self.target.drop_remote(*entry)
            run = entry[2]
            tail = self._tails.get(run[-1]) if run else None
            if tail is not None:
                tail[:] = [t for t in tail if t[0] is not peer or t[1] != key]
                if not tail:
                    del self._tails[run[-1]]

