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
  view is *partial* (origin ``partial``, see ``replica_views.covers_from``), as is one whose
  batches were lost beyond the buffer (a gap); the request path then credits such a replica with
  the larger of what its events and the learned view say (``extproc.pick.views.partial``).
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

This module is the order of things (which batch is applied when, and the sessions and endpoints
that bring them); what applying one does to the index and to the replica's view is
replica_views.py, and the sockets, the wait on them and the replay request are zmq_sockets.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final

import zmq
import zmq.asyncio
from zmq.utils import monitor as zmq_monitor

from extproc.pick.events.kv_events import EventDecodeError, Frame, parse_frames
from extproc.pick.sources.replica_views import (
    Index,
    KvSubscriberStats,
    RankStream,
    ReplicaView,
    ViewKeeper,
    view_origin,
)
from extproc.pick.sources.zmq_sockets import EVENTS, FD, NOBLOCK, POLLIN, Readable, ask_replay, open_socket, shadow

log = logging.getLogger("extproc.pick.sources.kv_subscriber")

DRAIN: Final = 512  # live messages handled per wake-up before yielding to the request path
# Ingest time, over all streams together, per turn of the event loop: a stream charges each
# batch's time and yields once the slice is spent; a new slice starts on the loop's next turn
# (``_IngestSlice``). Without it every backlogged stream drained up to DRAIN batches per wake-up
# (about 0.2 ms each), a request's every step waited behind that for each stream, and under an
# ingest backlog requests starved (measured: 100,000 blocks/s over 8 replicas on a loaded 2-core
# machine, requests at 200/s answered after 7 s at p50; routerlab.bench.ingest).
SLICE_S: Final = 0.002


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


def _host(address: str) -> str:
    host = address.rpartition(":")[0]
    return host or address


class KvEventSubscriber(ViewKeeper):
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
        self._streams: dict[str, list[RankStream]] = {}
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
                st = RankStream(address, rank, f"tcp://{host}:{base + self.events_port + rank}", replay)
                st.task = loop.create_task(self._run(st), name=f"kv-events {address} rank {rank}")
                streams.append(st)
            self._streams[address] = streams
            self.stats.replicas[address] = ReplicaView()

    # ---- one stream ---------------------------------------------------------------------
    async def _run(self, st: RankStream) -> None:
        while True:
            try:
                await self._session(st)
            except asyncio.CancelledError:
                raise
            except Exception:  # the stream must outlive any one bad session
                log.exception("KV-event stream %s rank %d failed; reconnecting", st.address, st.rank)
            await asyncio.sleep(1.0)

    async def _session(self, st: RankStream) -> None:
        assert self._ctx is not None
        sock = open_socket(self._ctx, zmq.SUB, st.events_url, self.rcvhwm, self.topic)
        raw = shadow(sock)  # synchronous reads of what is already queued
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        raw_monitor = shadow(monitor)
        readable = Readable(asyncio.get_running_loop(), (raw.getsockopt(FD), raw_monitor.getsockopt(FD)))
        try:
            if not st.synced:
                await self._initial_replay(st)
            while True:
                while raw_monitor.getsockopt(EVENTS) & POLLIN:  # first: a reconnect asks for a resync
                    self._on_monitor(st, raw_monitor.recv_multipart(NOBLOCK))
                if st.resync:
                    st.resync = False
                    st.applied = -1
                    st.complete = False
                    await self._initial_replay(st)
                handled = 0
                while handled < DRAIN:
                    try:
                        frames = raw.recv_multipart(NOBLOCK)
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
                elif not (raw.getsockopt(EVENTS) & POLLIN or raw_monitor.getsockopt(EVENTS) & POLLIN):
                    await readable.wait(self.poll_interval)
        finally:
            readable.close()
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _on_monitor(self, st: RankStream, frames: list[bytes]) -> None:
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

    async def _on_live(self, st: RankStream, frames: list[bytes]) -> None:
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

    async def _initial_replay(self, st: RankStream) -> None:
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
                st.skip_to(fr.seq)
            if fr.seq == st.applied + 1:
                self._apply(st, fr, live=False)
        view = self.stats.replicas.get(st.address)
        if view is not None:  # an empty buffer answered is knowledge too: a fresh replica holds nothing
            view.complete[st.rank] = st.complete
            view.origin = view_origin(view, live=False)

    async def _fill_gap(self, st: RankStream, frame: Frame) -> None:
        self.stats.gaps += 1
        expected = st.applied + 1
        answered = False
        frames: list[Frame] = []
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
            st.skip_to(held[0].seq if held else frame.seq)
            for fr in held:
                if fr.seq == st.applied + 1:
                    self._apply(st, fr, live=False)
        if frame.seq == st.applied + 1:
            self._apply(st, frame, live=True)

    async def _ask(self, st: RankStream, start: int) -> tuple[bool, list[Frame]]:
        """Every buffered batch with seq >= start; (answered to the end marker, frames in order)."""
        assert st.replay_url is not None and self._ctx is not None
        return await ask_replay(self._ctx, st.replay_url, start, self.stats, self.replay_timeout,
                                self.replay_total_timeout)
