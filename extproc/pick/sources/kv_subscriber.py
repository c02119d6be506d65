"""Precise mode's state gatherer: every replica's KV-cache events, over ZeroMQ, into the index.

One asyncio task per (endpoint, data-parallel rank). Each connects a SUB socket to
``tcp://HOST:events_port + rank`` (HOST: the endpoint's own host; vLLM's publisher binds there;
with ``ports_relative``, for replicas sharing one host, both ports are offsets from the
endpoint's own port)
and applies the batches in sequence order:

* expected = last applied + 1. Equal: apply. Greater: a gap; ask the replay socket (a DEALER on
  ``replay_port + rank``) for every batch from ``expected`` and apply them in order. When there is
  no replay socket, it does not answer, or its buffer no longer starts at ``expected``, the gap
  cannot be filled: the replica's view is reset (cause ``gap``; not when nothing has been applied
  since the last reset) and whatever the buffer did hold is applied.
* A live seq at or below the last live seq, or more than a replay window below the last applied
  one, is a new publisher process (vLLM counts from 0 per process): reset (cause ``restart``), then
  the new process's batches as for a gap from 0. A seq already applied otherwise (a replay ran
  ahead of the live stream) is a duplicate and skipped.
* On connect, and if that went unanswered, at the first live message, the whole replay buffer is
  asked for (from 0), so a router that starts while replicas are warm learns what their buffers
  still hold (origin ``replayed`` until the first live batch is applied, then ``events``). The
  buffer is bounded and there is no snapshot: blocks stored before it are not learned. Such a
  view is *partial* (origin ``partial``, see ``covers_from``), as is one whose batches were lost
  beyond the buffer (a gap); the request path then credits such a replica with the larger of
  what its events and the learned view say (``extproc.pick.views.partial``).
* A frame or payload that does not decode is counted (``bad_frames``) and skipped; a batch whose
  payload is bad still advances the sequence (its content is lost either way: a replay would
  return the same bytes). Nothing raises out of a task: an unexpected error is logged, and the
  stream starts a new session a second later with its sequence state kept.

Data-parallel ranks: in vLLM each rank is its own engine with its own cache, but Envoy sees one
``ip:port`` per endpoint, so the index is keyed by the endpoint address and all its ranks feed it
(the union of their caches: a block held by any rank counts as held by the replica, even though
the rank a request lands on may not hold it). A reset of one rank (restart, gap) resets the
address, so the other ranks of that endpoint are asked to replay their buffers from 0 again.

The counters are plain attributes (``stats``) for the integrator to export; ``on_reset(address,
cause)`` is called on every reset as it happens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import zmq
import zmq.asyncio
from zmq.utils import monitor as zmq_monitor

from extproc.pick.events.kv_events import (END_OF_REPLAY, EventDecodeError, Frame, decode_batch, parse_frames, replay_request,
                                    unplaceable_groups)
from extproc.pick.views.precise import PARTIAL

log = logging.getLogger("extproc.pick.sources.kv_subscriber")

CAUSES: Final = ("restart", "reconnect", "gap", "cleared", "left", "hybrid")
_NO_GROUPS: Final[frozenset[int]] = frozenset()
DRAIN: Final = 512  # live messages handled per wake-up before yielding to the request path
# Ingest time, over all streams together, per turn of the event loop: a stream charges each
# batch's time and yields once the slice is spent; a new slice starts on the loop's next turn
# (``_IngestSlice``). Without it every backlogged stream drained up to DRAIN batches per wake-up
# (about 0.2 ms each), a request's every step waited behind that for each stream, and under an
# ingest backlog requests starved (measured: 100,000 blocks/s over 8 replicas on a loaded 2-core
# machine, requests at 200/s answered after 7 s at p50; routerlab.bench.ingest).
SLICE_S: Final = 0.002


class Index(Protocol):
    def apply(self, address: str, events: Sequence[Any]) -> Any: ...
    def reset(self, address: str) -> None: ...
    def remove(self, address: str) -> None: ...


def covers_from(seq: int) -> bool:
    """Whether a rank's view is complete (its events cover everything its cache holds) when the
    first batch it learns, at the start or right after a hole, is ``seq``.

    Only at seq 0: vLLM counts from 0 per process, and a new process starts with an empty cache.
    (An ``AllBlocksCleared``, vLLM's ``reset_prefix_cache``, completes a view too: the cache is
    empty after it.) Later than 0 (a router that starts while the replica is warm and its replay
    buffer no longer starts at 0; no replay socket at all; batches lost beyond the buffer), the
    blocks stored before and still resident are unknown, and so is every block a request later
    chains onto them: vLLM announces a prefix-cache hit with nothing, and the router cannot hash
    a run whose parent it never saw. The view is then *partial*.

    A partial view becomes complete only by one of those two events, never by time or by eviction
    turnover: vLLM evicts least-recently-used free blocks, so the blocks that keep being hit (hot
    system prompts, the very ones worth routing on) stay resident and are never announced again,
    and any count of stores or removals could declare the view complete while the most valuable
    blocks are still missing. Until then the learned view (this router's own placements) fills
    in; its errors are bounded by its LRU capacity.
    """
    return seq == 0


@dataclass
class ReplicaView:
    """What is known of one replica's event stream (all its DP ranks)."""

    # "none" (nothing heard: the learned view) | "replayed" (built from a replay buffer that holds
    # the process's whole history) | "events" (live events flow, history complete) | "partial"
    # (events flow or were replayed, but they miss what the replica stored before them; ``covers_from``)
    origin: str = "none"
    complete: dict[int, bool] = field(default_factory=dict)  # rank -> its events cover all it holds
    last_seq: dict[int, int] = field(default_factory=dict)  # rank -> last applied seq
    last_event_time: float = 0.0  # wall clock when its last batch was applied
    lag: float = 0.0  # seconds from the last batch's ts to its application


@dataclass
class KvSubscriberStats:
    batches: int = 0  # batches applied (live and replayed)
    blocks: int = 0  # block hashes in applied BlockStored/BlockRemoved events
    events_skipped: int = 0  # inner events the decoder could not read
    gaps: int = 0  # missing seq ranges seen
    replays_asked: int = 0
    replays_served: int = 0  # replay requests answered up to the end marker
    replayed_batches: int = 0  # batches applied from replay answers
    bad_frames: int = 0
    # events of a hybrid model's KV-cache groups the view cannot follow (``kv_events.unplaceable_groups``:
    # Mamba, or a sliding window that does not say its window), set aside (docs/pick-mode.md)
    set_aside_events: int = 0
    apply_s: float = 0.0  # CPU time decoding and applying batches (thread time): the ingest path's share of the core
    resets: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    replicas: dict[str, ReplicaView] = field(default_factory=dict)


class _Stream:
    """One (endpoint, rank) event stream."""

    __slots__ = ("address", "rank", "events_url", "replay_url", "applied", "live", "synced", "resync", "task",
                 "dropped", "complete")

    def __init__(self, address: str, rank: int, events_url: str, replay_url: str | None) -> None:
        self.address = address
        self.rank = rank
        self.events_url = events_url
        self.replay_url = replay_url
        self.applied = -1  # last applied seq
        self.live = -1  # last seq received on the live socket
        self.synced = replay_url is None  # the initial replay answered (or there is none)
        self.resync = False  # the address was reset: replay from 0 again
        self.task: asyncio.Task[None] | None = None
        self.dropped = False  # the connection to the publisher went down since the last connect
        self.complete = False  # the batches applied since the last hole cover the cache (``covers_from``)


class _IngestSlice:
    """One ingest time slice per turn of the event loop, shared by every stream of a subscriber
    (see ``SLICE_S``).

    A stream charges each batch's time to it; once it is spent the stream asks for a new slice
    with ``loop.call_soon`` and yields (``await asyncio.sleep(0)``): that callback runs on the
    loop's next turn, after the I/O poll that brings the requests' own callbacks in, so a turn
    gives ingest about one slice in all however many streams are backlogged, and the requests'
    steps run in between. Only ingest time is charged, and a stream applies a batch before it
    looks, so the events always progress too, however long the requests' steps take."""

    __slots__ = ("used", "_asked")

    def __init__(self) -> None:
        self.used = 0.0
        self._asked = False

    def charge(self, seconds: float) -> bool:
        """Add one batch's time; True when the slice is spent (the caller should yield)."""
        self.used += seconds
        return self.used >= SLICE_S

    def renew_next_round(self) -> None:
        if not self._asked:
            self._asked = True
            asyncio.get_running_loop().call_soon(self._renew)

    def _renew(self) -> None:
        self._asked = False
        self.used = 0.0


# ZMQ options and flags as plain ints: pyzmq's enum operators cost more than the calls themselves
_FD: Final = int(zmq.FD)
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)
_NOBLOCK: Final = int(zmq.NOBLOCK)


class _Readable:
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


def _host(address: str) -> str:
    host = address.rpartition(":")[0]
    return host or address


def _origin(view: ReplicaView, live: bool) -> str:
    """A replica's origin after a batch: partial while any rank's events miss what it holds."""
    if not all(view.complete.values()):
        return PARTIAL
    return "events" if live or view.origin == "events" else "replayed"


def _cleared(result: Any) -> int:
    """How many AllBlocksCleared resets an ``ApplyResult`` reports (0 when it says nothing)."""
    n = getattr(result, "cleared", 0)
    return int(n) if n else 0


class KvEventSubscriber:
    """Subscribes to the KV-cache events of every endpoint and feeds them to ``index``."""

    def __init__(self, index: Index, events_port: int = 5557, replay_port: int | None = 5558, topic: str = "kv",
                 dp_ranks: int = 1, on_reset: Callable[[str, str], None] | None = None,
                 replay_timeout: float = 1.0, replay_total_timeout: float = 10.0, replay_window: int = 10_000,
                 rcvhwm: int = 100_000, poll_interval: float = 0.5, ports_relative: bool = False) -> None:
        self.index = index
        self.events_port = events_port
        self.replay_port = replay_port or None  # 0 (the setting's "none") as None
        self.ports_relative = ports_relative  # both ports are offsets from each endpoint's own port
        self.topic = topic
        self.dp_ranks = max(1, dp_ranks)
        self.on_reset = on_reset
        self.replay_timeout = replay_timeout  # per message of a replay answer
        self.replay_total_timeout = replay_total_timeout
        self.replay_window = replay_window
        self.rcvhwm = rcvhwm
        self.poll_interval = poll_interval  # longest wait before a stream looks at its resync flag again
        self.stats = KvSubscriberStats()
        self._streams: dict[str, list[_Stream]] = {}
        self._wanted: list[str] = []
        self._dirty: dict[str, bool] = {}  # applied anything since the last reset
        self._set_aside_groups: dict[str, set[int]] = {}  # address -> its groups the view cannot follow
        self._ctx: zmq.asyncio.Context | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._slice = _IngestSlice()

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        self._reconcile()

    async def stop(self, timeout: float = 2.0) -> None:
        tasks = [s.task for streams in self._streams.values() for s in streams if s.task] + list(self._closing)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        self._streams.clear()
        self._closing.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def set_endpoints(self, addresses: Sequence[str]) -> None:
        """The endpoint watcher's list: streams start for new endpoints, stop for those that left."""
        self._wanted = list(dict.fromkeys(addresses))
        if self._ctx is not None:
            self._reconcile()

    def _reconcile(self) -> None:
        wanted = set(self._wanted)
        for address in [a for a in self._streams if a not in wanted]:
            for st in self._streams.pop(address):
                if st.task is not None:
                    st.task.cancel()
                    self._closing.add(st.task)
                    st.task.add_done_callback(self._closing.discard)
            self.index.remove(address)
            self._dirty.pop(address, None)
            self._set_aside_groups.pop(address, None)
            self.stats.replicas.pop(address, None)
            self._count_reset(address, "left")
        loop = asyncio.get_running_loop()
        for address in self._wanted:
            if address in self._streams:
                continue
            host = _host(address)
            base = int(address.rpartition(":")[2]) if self.ports_relative else 0
            streams = []
            for rank in range(self.dp_ranks):
                replay = None if self.replay_port is None else f"tcp://{host}:{base + self.replay_port + rank}"
                st = _Stream(address, rank, f"tcp://{host}:{base + self.events_port + rank}", replay)
                st.task = loop.create_task(self._run(st), name=f"kv-events {address} rank {rank}")
                streams.append(st)
            self._streams[address] = streams
            self.stats.replicas[address] = ReplicaView()

    # ---- one stream ---------------------------------------------------------------------
    async def _run(self, st: _Stream) -> None:
        while True:
            try:
                await self._session(st)
            except asyncio.CancelledError:
                raise
            except Exception:  # the stream must outlive any one bad session
                log.exception("KV-event stream %s rank %d failed; reconnecting", st.address, st.rank)
            await asyncio.sleep(1.0)

    def _socket(self, kind: int, url: str) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if url.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
        sock.connect(url)
        return sock

    async def _session(self, st: _Stream) -> None:
        sock = self._socket(zmq.SUB, st.events_url)
        raw = zmq.Socket.shadow(sock.underlying)  # synchronous reads of what is already queued
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        raw_monitor = zmq.Socket.shadow(monitor.underlying)
        readable = _Readable(asyncio.get_running_loop(), (raw.getsockopt(_FD), raw_monitor.getsockopt(_FD)))
        try:
            if not st.synced:
                await self._initial_replay(st)
            while True:
                while raw_monitor.getsockopt(_EVENTS) & _POLLIN:  # first: a reconnect asks for a resync
                    self._on_monitor(st, raw_monitor.recv_multipart(_NOBLOCK))
                if st.resync:
                    st.resync = False
                    st.applied = -1
                    st.complete = False
                    await self._initial_replay(st)
                handled = 0
                while handled < DRAIN:
                    try:
                        frames = raw.recv_multipart(_NOBLOCK)
                    except zmq.Again:
                        break
                    started = time.perf_counter()
                    await self._on_live(st, frames)
                    handled += 1
                    if st.resync:
                        break  # the view is rebuilt from the replay buffer first (a hybrid model's group found)
                    if self._slice.charge(time.perf_counter() - started):  # the other streams' share counts too
                        self._slice.renew_next_round()
                        await asyncio.sleep(0)
                if handled == DRAIN:
                    await asyncio.sleep(0)  # more may be queued: let the request path run, then read on
                elif not (raw.getsockopt(_EVENTS) & _POLLIN or raw_monitor.getsockopt(_EVENTS) & _POLLIN):
                    await readable.wait(self.poll_interval)
        finally:
            readable.close()
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _on_monitor(self, st: _Stream, frames: list[bytes]) -> None:
        """A connection that comes back may lead to a new publisher process (a restarted replica
        whose first batches we may have missed, so its sequence need not look like a restart):
        the replica's view is rebuilt from what its buffer holds (cause ``reconnect``). Crediting
        blocks a restarted replica no longer has would be worse than forgetting a few it kept."""
        event = zmq_monitor.parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            st.dropped = True
        elif event == zmq.EVENT_CONNECTED and st.dropped:
            st.dropped = False
            if self._dirty.get(st.address):
                self._reset(st, "reconnect")
            st.live = -1
            st.resync = st.replay_url is not None
            st.applied = -1
            st.complete = False

    async def _on_live(self, st: _Stream, frames: list[bytes]) -> None:
        try:
            frame = parse_frames(frames)
        except EventDecodeError:
            self.stats.bad_frames += 1
            return
        if frame.seq < 0 or (self.topic and frame.topic != self.topic):
            if frame.seq < 0:
                self.stats.bad_frames += 1
            return  # another topic sharing our prefix
        if not st.synced:
            await self._initial_replay(st)
        if st.resync:
            return  # the replay the session runs next covers this batch
        seq = frame.seq
        if seq <= st.live or seq < st.applied - self.replay_window:
            # vLLM counts from 0 per process: the publisher restarted
            self._reset(st, "restart")
            st.applied = -1
            st.complete = False
        st.live = seq
        if seq == st.applied + 1:
            self._apply(st, frame, live=True)
        elif seq > st.applied + 1:
            await self._fill_gap(st, frame)
        # else: already applied from a replay answer

    async def _initial_replay(self, st: _Stream) -> None:
        if st.replay_url is None:
            st.synced = True
            return
        answered, frames = await self._ask(st, 0)
        if not answered:
            return  # publisher absent: ask again at its first live message
        st.synced = True
        if not frames and st.applied < 0:
            st.complete = True  # an empty buffer: the publisher never sent a batch, its cache is empty
        for fr in frames:
            if fr.seq > st.applied + 1:  # a buffer may start after 0: learn what it holds (a partial view)
                self._skip_to(st, fr.seq)
            if fr.seq == st.applied + 1:
                self._apply(st, fr, live=False)
        view = self.stats.replicas.get(st.address)
        if view is not None:  # an empty buffer answered is knowledge too: a fresh replica holds nothing
            view.complete[st.rank] = st.complete
            view.origin = _origin(view, live=False)

    async def _fill_gap(self, st: _Stream, frame: Frame) -> None:
        self.stats.gaps += 1
        expected = st.applied + 1
        answered, frames = (False, [])
        if st.replay_url is not None:
            answered, frames = await self._ask(st, expected)
        if answered and frames and frames[0].seq <= expected:
            for fr in frames:
                if fr.seq == st.applied + 1 and fr.seq < frame.seq:  # [expected, current); then current
                    self._apply(st, fr, live=False)
        if st.resync:
            return  # a hybrid model's group was found: the session replays the buffer next
        if st.applied < frame.seq - 1:  # not filled: the missing batches are gone
            log.info("KV events of %s rank %d: seq %d..%d lost", st.address, st.rank, st.applied + 1, frame.seq - 1)
            if self._dirty.get(st.address):
                self._reset(st, "gap")
            # What the buffer does still hold before this batch is true: learn it from its start.
            held = [fr for fr in frames if fr.seq < frame.seq] if answered else []
            self._skip_to(st, held[0].seq if held else frame.seq)
            for fr in held:
                if fr.seq == st.applied + 1:
                    self._apply(st, fr, live=False)
        if frame.seq == st.applied + 1:
            self._apply(st, frame, live=True)

    async def _ask(self, st: _Stream, start: int) -> tuple[bool, list[Frame]]:
        """Every buffered batch with seq >= start; (answered to the end marker, frames in order)."""
        assert st.replay_url is not None
        self.stats.replays_asked += 1
        dealer = self._socket(zmq.DEALER, st.replay_url)  # a fresh socket: no late answers of an old ask
        out: list[Frame] = []
        try:
            await dealer.send_multipart(replay_request(start))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.replay_total_timeout
            while True:
                wait = min(self.replay_timeout, deadline - loop.time())
                if wait <= 0 or not await dealer.poll(int(wait * 1000), zmq.POLLIN):
                    return False, out
                frames = await dealer.recv_multipart()
                try:
                    fr = parse_frames(frames)
                except EventDecodeError:
                    self.stats.bad_frames += 1
                    continue
                if fr.seq == END_OF_REPLAY:
                    self.stats.replays_served += 1
                    return True, out
                if fr.seq >= start and (not out or fr.seq > out[-1].seq):
                    out.append(fr)
        finally:
            dealer.close(linger=0)

    # ---- applying -----------------------------------------------------------------------
    @staticmethod
    def _skip_to(st: _Stream, seq: int) -> None:
        """The next batch applied is ``seq``, after a hole (or as the first): what came before is unknown."""
        st.applied = seq - 1
        st.complete = covers_from(seq)

    def _apply(self, st: _Stream, frame: Frame, live: bool) -> None:
        if st.resync:
            return  # this replica's view is rebuilt by the replay the session runs next
        st.applied = frame.seq
        if frame.seq == 0:
            st.complete = True  # a process's first batch: its cache was empty before it
        view = self.stats.replicas.get(st.address)
        if view is None:
            return  # the endpoint left while a replay was under way
        view.last_seq[st.rank] = frame.seq
        started = time.thread_time()
        try:
            decoded = decode_batch(frame.payload)
        except EventDecodeError:
            self.stats.bad_frames += 1
            return
        batch = decoded.batch
        events = batch.events
        aside: Set[int] = self._set_aside_groups.get(st.address, _NO_GROUPS)
        found = unplaceable_groups(events)
        if not found <= aside:
            self._set_aside(st, found)
            if st.resync:
                return  # the replay rebuilds the view, this batch included
            aside = self._set_aside_groups[st.address]
        stats = self.stats
        if aside:
            kept = [ev for ev in events if getattr(ev, "group_idx", None) not in aside]
            stats.set_aside_events += len(events) - len(kept)
            events = kept
        result = self.index.apply(st.address, events)
        self._dirty[st.address] = True
        stats.batches += 1
        stats.events_skipped += decoded.skipped
        stats.blocks += sum(len(getattr(ev, "block_hashes", ())) for ev in events)
        now = time.time()
        view.last_event_time = now
        view.lag = now - batch.ts
        if not live:
            stats.replayed_batches += 1
        cleared = _cleared(result)
        if cleared:
            st.complete = True  # the cache was emptied: everything after it is announced
        for _ in range(cleared):
            self._count_reset(st.address, "cleared")
        view.complete[st.rank] = st.complete
        view.origin = _origin(view, live)
        stats.apply_s += time.thread_time() - started

    def _set_aside(self, st: _Stream, groups: set[int]) -> None:
        """A hybrid model: the view cannot follow ``groups`` (``unplaceable_groups``). Their events are
        set aside from now on, and this replica's view, which may hold some of their blocks, is
        rebuilt from its replay buffer without them."""
        aside = self._set_aside_groups.setdefault(st.address, set())
        aside |= groups
        log.warning("replica %s has KV-cache groups %s that precise mode cannot follow (a hybrid model's: "
                    "Mamba, or a sliding window that does not say its window): their events are set aside, so "
                    "it can predict more cached tokens than vLLM finds where those groups no longer hold what a "
                    "hit needs (docs/pick-mode.md)", st.address, sorted(aside))
        self._reset(st, "hybrid")
        st.resync = st.replay_url is not None  # without a buffer to rebuild from the view stays partial

    def _reset(self, st: _Stream, cause: str) -> None:
        self.index.reset(st.address)
        self._dirty[st.address] = False
        view = self.stats.replicas.get(st.address)
        if view is not None and view.origin != "none":
            # nothing is known until the streams learn again; the learned view fills in meanwhile
            view.complete = dict.fromkeys(range(self.dp_ranks), False)
            view.origin = PARTIAL
        self._count_reset(st.address, cause)
        for other in self._streams.get(st.address, ()):
            if other is not st and other.replay_url is not None:
                other.resync = True  # its part of the union is gone too: replay its buffer again

    def _count_reset(self, address: str, cause: str) -> None:
        self.stats.resets[cause] += 1
        if self.on_reset is not None:
            try:
                self.on_reset(address, cause)
            except Exception:
                log.exception("on_reset callback failed")
