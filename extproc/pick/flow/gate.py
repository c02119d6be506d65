"""Flow control's gate: holds requests while their pool is saturated and lets them out fairly.

Each pool has a ``FairQueue``. A request enters; if nothing of its pool is held and the pool has
room (``room``: extproc.pick.choice.saturation, minus the requests let out and not yet picked), it
goes at once; else it is held until the gate lets it out (``kick``: a request ended, or the ticker
every ``tick`` seconds while anything is held, as queued prefill drains), until it has waited its
bound, or until a full queue sheds it. The adapter picks a replica for a request let out and then
says so (``done``), which turns the room it reserved into the pick's own load. With other router
replicas holding requests of the pool too (``elsewhere``), it takes the room in turns with them
(extproc.pick.flow.room_share), and tells them what it holds and has let out (``tell``).

Classes: while a better class than a request's own has come to its pool within ``ACTIVE_S``, the
request counts a replica as saturated past ``flow_worse_queue_tokens`` of queued prefill instead of
``flow_queue_tokens`` (its ``settings``, which the adapter then picks with), and leaves
``flow_reserve_replicas`` of the free replicas free: a worse class takes only what the better leaves,
never queues on a replica ahead of it, and the better class finds a replica free when it comes. vLLM
does not preempt a prefill that has begun for a better request, so room the worse class took is room
the better one waits for.

Asyncio state around the pure parts (the queue, the room), kept out of the pick core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Final

from extproc import metrics
from extproc.core.settings import RouteSettings
from extproc.pick.flow.fair_queue import FairQueue, Held
from extproc.pick.flow.room_share import Counts, Peer, Turns, room_share

HELD: Final = "held"
LET_OUT: Final = "let_out"
GONE: Final = "gone"  # its client left while held
# why a request is shed (answered 429)
WAITED: Final = "waited"  # held past flow_max_wait
QUEUE_FULL: Final = "queue_full"  # flow_max_queue held; it was of the worst class
SHED_REASONS: Final = (WAITED, QUEUE_FULL)
_RATE_WINDOW: Final = 256  # the last let-outs that say how fast the queue drains (retry-after)
ACTIVE_S: Final = 10.0  # a class that sent a request within this many seconds is expected to send again


class Ticket:
    """One request through the gate."""

    __slots__ = ("pool", "tenant", "priority", "settings", "state", "future", "entered", "reserved", "entry",
                 "labels", "yields", "route")

    def __init__(self, pool: str, tenant: str, priority: int, settings: RouteSettings, entered: float) -> None:
        self.pool = pool
        self.tenant = tenant
        self.priority = priority
        self.settings = settings
        self.state = HELD
        self.future: asyncio.Future[None] | None = None
        self.entered = entered
        self.reserved = False  # let out and counted in its pool's room until done()
        self.entry: Held[Ticket] | None = None  # its place in the queue, while held
        self.labels = (metrics.tenant_label(tenant), str(priority))  # its metrics' tenant and priority
        self.yields = False  # a better class is active: its settings keep that class's headroom
        self.route = settings  # the route's own (``settings`` may be them with the worse class's queue)

    @property
    def held(self) -> bool:
        return self.state == HELD

    @property
    def waited(self) -> bool:
        """It was held (its pool saturated when it came): let out into a replica's room."""
        return self.future is not None

    @property
    def shed(self) -> bool:
        return self.state in SHED_REASONS

    @property
    def avoid_saturated(self) -> bool:
        """Its pick must pass over a saturated replica while another is not: it was let out into a
        replica's room (held, or keeping a better class's headroom)."""
        return self.waited or self.yields


class FlowGate:
    """``room(pool, settings, keep)``: requests the pool can start soon with ``keep`` free replicas left
    free; ``tick``: how often held requests are reconsidered besides each request's end;
    ``elsewhere(pool)``: what each other router replica holds of the pool and has let out;
    ``tell(pool, counts, let_out)``: what this one holds (per class) and has let out, each time that
    changes."""

    def __init__(self, room: Callable[[str, RouteSettings, int], int], *, tick: float = 0.01,
                 clock: Callable[[], float] = time.monotonic,
                 elsewhere: Callable[[str], list[Peer]] | None = None,
                 tell: Callable[[str, Counts, int], None] | None = None) -> None:
        self.room = room
        self.tick = tick
        self.clock = clock
        self.elsewhere = elsewhere
        self.tell = tell
        self.turns: dict[str, Turns] = {}
        self.let_outs: dict[str, int] = {}  # per pool, every request this router let out
        self.queues: dict[str, FairQueue[Ticket]] = {}
        self._reserved: dict[str, int] = {}
        self._weights: dict[str, tuple[tuple[str, float], ...]] = {}
        self._let_out: deque[float] = deque(maxlen=_RATE_WINDOW)
        self._ticker: asyncio.Task[None] | None = None
        self._seen: dict[str, dict[int, float]] = {}  # per pool, when each class last came

    def _queue(self, pool: str, settings: RouteSettings) -> FairQueue[Ticket]:
        queue = self.queues.get(pool)
        if queue is None:
            queue = self.queues[pool] = FairQueue(settings.flow_max_queue)
        queue.limit, queue.burst = settings.flow_max_queue, settings.flow_burst_tokens
        if self._weights.get(pool) != settings.tenant_weights:  # the last request's route's weights
            self._weights[pool] = settings.tenant_weights
            queue.weights = dict(settings.tenant_weights)
        return queue

    def enter(self, pool: str, tenant: str, priority: int, tokens: float, settings: RouteSettings) -> Ticket:
        """A request of ``tenant`` (charged ``tokens`` when let out) wants a replica of ``pool``."""
        ticket = Ticket(pool, tenant, priority, settings, self.clock())
        self._seen.setdefault(pool, {})[priority] = ticket.entered
        queue = self._queue(pool, settings)
        if not queue and self._has_room(ticket) and not self._held_elsewhere(pool, priority):
            queue.charge(tenant, tokens)
            self._reserve(ticket)
            self._counted(pool, queue)
            metrics.FLOW_LET_OUT.labels("at_once").inc()
            return ticket
        held = Held(tenant, priority, tokens, ticket)
        shed = queue.push(held)
        if shed is held:
            self._shed(ticket, QUEUE_FULL)
            return ticket
        self._told(pool, queue)
        if shed is not None:  # already out of the queue
            self._forget(shed.value)
            self._shed(shed.value, QUEUE_FULL)
            shed.value.future.set_result(None)  # type: ignore[union-attr]  # a held ticket has one
        ticket.future = asyncio.get_running_loop().create_future()
        ticket.entry = held
        metrics.FLOW_HELD.labels(pool, *ticket.labels).inc()
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        # it goes before those already held (a better class, a tenant under its share): not at the next tick
        if len(queue) > 1 and queue.peek() is held:
            self.kick()
        return ticket

    async def wait(self, ticket: Ticket) -> str:
        """Until ``ticket`` is let out or shed (at its bound: ``flow_max_wait``); its state then."""
        if ticket.held and ticket.future is not None:
            bound = max(0.0, ticket.entered + ticket.settings.flow_max_wait - self.clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(ticket.future), bound)
            if ticket.held:
                self._unhold(ticket)
                self._shed(ticket, WAITED)
        return ticket.state

    def done(self, ticket: Ticket) -> None:
        """The adapter is through with ``ticket``: picked (its room now counted as the pick's load) or
        gone (its client left while it was held)."""
        if ticket.reserved:
            ticket.reserved = False
            self._reserved[ticket.pool] -= 1
        elif ticket.held:
            self._unhold(ticket)
            ticket.state = GONE

    def retry_after(self, ticket: Ticket) -> int:
        """Seconds a shed client should wait: the held requests ahead at the recent rate out, 1..60."""
        queue = self.queues.get(ticket.pool)
        held = len(queue) if queue is not None else 0
        now = self.clock()
        recent = [t for t in self._let_out if now - t <= 10.0]
        rate = len(recent) / max(now - recent[0], 0.1) if len(recent) >= 2 else 0.0
        return 60 if rate <= 0 else min(60, max(1, math.ceil(held / rate)))

    def kick(self) -> None:
        """Let out what each pool has room for (a request ended, queued prefill drained)."""
        for pool, queue in self.queues.items():
            while queue:
                head = queue.peek()
                assert head is not None  # the queue is not empty
                if not self._has_room(head.value):
                    break
                turns = self._turns(pool)
                if turns is not None and not turns.mine(queue.lengths(), self._elsewhere(pool), self.clock()):
                    break  # another router's turn: it sees the same room
                queue.pop()
                if turns is not None:
                    turns.took()
                ticket = head.value
                self._forget(ticket)
                self._reserve(ticket)
                self._let_out.append(self.clock())
                metrics.FLOW_LET_OUT.labels("held").inc()
                metrics.FLOW_WAIT.labels(*ticket.labels).observe(self.clock() - ticket.entered)
                assert ticket.future is not None  # held tickets have one
                ticket.future.set_result(None)
                self._counted(pool, queue)

    def held_count(self) -> int:
        """How many requests the gate holds, over every pool."""
        return sum(map(len, self.queues.values()))

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def _tick(self) -> None:
        while any(self.queues.values()):
            await asyncio.sleep(self.tick)
            self.kick()

    def _reserve(self, ticket: Ticket) -> None:
        ticket.state = LET_OUT
        ticket.reserved = True
        self._reserved[ticket.pool] = self._reserved.get(ticket.pool, 0) + 1

    def _unhold(self, ticket: Ticket) -> None:
        """Take a held ticket out of its queue, unserved."""
        assert ticket.entry is not None  # held
        queue = self.queues[ticket.pool]
        queue.remove(ticket.entry)
        self._forget(ticket)
        self._told(ticket.pool, queue)

    def _yielding(self, ticket: Ticket) -> RouteSettings:
        """``ticket``'s settings for the room and its pick, now: a better class active in its pool makes
        it count the worse class's queue (``flow_worse_queue_tokens``)."""
        now = self.clock()
        better = any(p < ticket.priority and now - t <= ACTIVE_S for p, t in self._seen[ticket.pool].items())
        if better != ticket.yields:
            ticket.yields = better
            route = ticket.route
            ticket.settings = (dataclasses.replace(route, flow_queue_tokens=route.flow_worse_queue_tokens)
                               if better else route)
        return ticket.settings

    def _has_room(self, ticket: Ticket) -> bool:
        """``ticket``'s pool can start one more than this router let out and has not yet picked (for a
        worse class while a better one is active: with ``flow_reserve_replicas`` free replicas kept)."""
        settings = self._yielding(ticket)
        keep = ticket.route.flow_reserve_replicas if ticket.yields else 0
        return self.room(ticket.pool, settings, keep) > self._reserved.get(ticket.pool, 0)

    def _elsewhere(self, pool: str) -> list[Peer]:
        return self.elsewhere(pool) if self.elsewhere is not None else []

    def _held_elsewhere(self, pool: str, priority: int) -> bool:
        """Another router holds a request of ``pool`` of ``priority``'s class or better."""
        return room_share({priority: 1}, (p.held for p in self._elsewhere(pool))) < 1.0

    def _turns(self, pool: str) -> Turns | None:
        """The pool's account of turns with the other routers (None: alone)."""
        if self.elsewhere is None:
            return None
        return self.turns.setdefault(pool, Turns())

    def _counted(self, pool: str, queue: FairQueue[Ticket]) -> None:
        """One more let out of ``pool``."""
        self.let_outs[pool] = self.let_outs.get(pool, 0) + 1
        self._told(pool, queue)

    def _told(self, pool: str, queue: FairQueue[Ticket]) -> None:
        """The other routers hear what this one now holds of ``pool`` and has let out."""
        if self.tell is not None:
            self.tell(pool, queue.lengths(), self.let_outs.get(pool, 0))

    def _forget(self, ticket: Ticket) -> None:
        """``ticket`` is no longer in its queue."""
        ticket.entry = None
        metrics.FLOW_HELD.labels(ticket.pool, *ticket.labels).dec()

    def _shed(self, ticket: Ticket, reason: str) -> None:
        if ticket.future is not None:  # it was held
            metrics.FLOW_WAIT.labels(*ticket.labels).observe(self.clock() - ticket.entered)
        ticket.state = reason
        metrics.FLOW_SHED.labels(*ticket.labels, reason).inc()
