"""--share-in-flight: router replicas tell each other their requests in flight.

The pure part (extproc.pick.sources.shared_in_flight) through real PickCores in precise mode, the bus
(extproc.pick.sources.in_flight_bus) through a real Redis (Debian's redis-server; .ci/machine installs it),
and two `prefix-router serve` processes behind a real Envoy sharing through one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import msgpack
import pytest

from extproc.core.decide import decide
from extproc.core.settings import RouteSettings, SettingError, server_settings
from extproc.pick.choice.load import LoadTracker
from extproc.pick.core import PickCore, Remote, Share
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.flow.room_share import Peer
from extproc.pick.sources.in_flight_bus import InFlightBus
from extproc.pick.sources.shared_in_flight import (
    PEER_TIMEOUT_S,
    RemoteInFlight,
    end_message,
    heartbeat_message,
    held_message,
    pick_message,
)
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.pick.views.event_view import EventView
from extproc.pick.views.learned import LearnedView
from extproc.pick.views.partial import CombinedView
from extproc.pick.views.precise import PreciseView
from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench.arms import ARMS, RunningArm
from routerlab.bench.backends import SimBackend
from routerlab.bench.runner import apply_event
from routerlab.bench.scenarios import FleetEvent, FleetSpec
from routerlab.harness.procs import Process, free_ports, redis_server, wait_until

from support import metric, send

BS = 16
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
PICK = RouteSettings(mode="pick")
SYSTEM = "You review pull requests for the storage team and answer with a numbered list. " * 40


class Live:
    origin = "events"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(TINY_BYTELEVEL)


def precise_view(tokenizer: ModelTokenizer) -> CombinedView:
    """Precise mode's view over A and B, both covered by events that hold nothing yet."""
    precise = PreciseView(EventIndex(), {"*": tokenizer}, {A: Live(), B: Live()})
    precise.block_size_hint = BS
    return CombinedView(EventView(precise), LearnedView())


def precise_core(tokenizer: ModelTokenizer, clock: Callable[[], float] = time.monotonic,
                 share: Share | None = None, view: CombinedView | None = None,
                 load: LoadTracker | None = None) -> PickCore:
    """Pick mode in precise mode over A and B (``precise_view``), told ``share`` of its picks."""
    core = PickCore(view or precise_view(tokenizer), load=load, share=share, clock=clock)
    core.set_endpoints([A, B])
    return core


def remote_to(core: PickCore, router: bytes, **kwargs: Any) -> RemoteInFlight:
    """The other routers' requests, as they reach ``core``: its load and its view."""
    return RemoteInFlight(Remote(core.load, core.view), router, core.clock, **kwargs)


def pending(core: PickCore) -> dict[str, list[Sequence[int]]]:
    view = core.view
    assert isinstance(view, CombinedView)
    return view.events.precise.pending


def body(question: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": question}]}).encode()


def in_flight(core: PickCore, address: str) -> int:
    return next(r.in_flight for r in core.load.snapshot().replicas if r.address == address)


def test_another_routers_request_counts_as_load_and_as_blocks_in_flight_until_it_ends(
        tokenizer: ModelTokenizer) -> None:
    sent: list[bytes] = []

    class Sends:
        def picked(self, key: int, address: str, prefill: int, run: object) -> None:
            sent.append(pick_message(b"first", key, address, prefill, run))  # type: ignore[arg-type]

        def released(self, key: int) -> None:
            sent.append(end_message(b"first", key))

        def continued(self, run: object) -> int:
            return 0

    first, second = precise_core(tokenizer, share=Sends()), precise_core(tokenizer)
    remote = remote_to(second, b"second")
    choice = first.pick(decide(body("Is this migration safe?"), {}, PICK), PICK)
    assert choice.address is not None and len(sent) == 1
    other = B if choice.address == A else A
    # before the message: a request sharing the system prompt sees nothing cached anywhere
    alone = second.evaluate(decide(body("What does this test cover?"), {}, PICK), PICK)[0]
    assert all(c.cached_tokens == 0 for c in alone.candidates)
    remote.on_message(sent[0])
    assert in_flight(second, choice.address) == 1 and in_flight(second, other) == 0
    shared = second.evaluate(decide(body("What does this test cover?"), {}, PICK), PICK)[0]
    assert shared.address == choice.address
    held = {c.address: c.cached_tokens for c in shared.candidates}
    assert held[choice.address] >= len(SYSTEM) // 4 and held[other] == 0  # the system prompt's blocks, in flight
    first.release(choice)
    remote.on_message(sent[1])
    assert in_flight(second, choice.address) == 0 and not pending(second)
    assert remote.requests() == 0 and remote.stats.received == {0: 1, 1: 1, 2: 0, 3: 0}


def test_heartbeats_and_silence_drop_what_an_end_message_would_have(tokenizer: ModelTokenizer) -> None:
    clock = Clock()
    core = precise_core(tokenizer, clock)
    remote = remote_to(core, b"me")
    for key in (1, 2):
        remote.on_message(pick_message(b"peer", key, A, 100, [11, 12, 13]))
    remote.on_message(pick_message(b"me", 9, A, 100, [11]))  # its own message, back from the channel: ignored
    assert in_flight(core, A) == 2 and len(pending(core)[A]) == 2
    remote.on_message(heartbeat_message(b"peer", [2]))  # key 1's end was lost
    assert in_flight(core, A) == 1 and remote.stats.dropped == 1
    clock.now += PEER_TIMEOUT_S - 0.1
    remote.expire()
    assert in_flight(core, A) == 1
    clock.now += 0.2  # the peer went quiet
    remote.expire()
    assert in_flight(core, A) == 0 and not remote.peers and not pending(core) and remote.stats.dropped == 2


def test_a_request_that_continues_a_remote_one_ends_it_before_its_end_message(tokenizer: ModelTokenizer) -> None:
    core = precise_core(tokenizer)
    remote = remote_to(core, b"me")
    remote.on_message(pick_message(b"peer", 1, A, 100, [11, 12, 13]))
    remote.on_message(pick_message(b"peer", 2, B, 100, [11, 12, 14]))  # the same system prompt, another question
    remote.on_message(pick_message(b"other", 1, A, 100, [11, 12, 13]))  # another router's key 1: the same prompt
    assert (in_flight(core, A), in_flight(core, B)) == (2, 1)
    assert remote.continued([11, 12, 13]) == 0  # the same prompt again (a retry): not a turn after it
    assert remote.continued([11, 12]) == 0 and remote.continued([11, 12, 15, 16]) == 0
    assert remote.continued([11, 12, 13, 21, 22]) == 2  # the next turn: both requests it holds whole had answered
    assert (in_flight(core, A), in_flight(core, B)) == (0, 1) and remote.stats.continued == 2
    assert len(pending(core).get(A, ())) == 0 and remote.requests() == 1
    for router in (b"peer", b"other"):
        remote.on_message(end_message(router, 1))  # the end messages, late: nothing left to end
    assert (in_flight(core, A), in_flight(core, B)) == (0, 1) and core.load.own(A) == 0
    remote.on_message(pick_message(b"peer", 3, A, 100, [11, 12, 13]))  # the index forgot the ended ones
    assert remote.continued([11, 12, 13, 31]) == 1 and remote.stats.continued == 3
    remote.on_message(end_message(b"peer", 2))
    assert remote.requests() == 0 and not remote._tails


def test_the_next_turn_through_the_other_router_finds_its_replica_free_of_the_turn_before(
        tokenizer: ModelTokenizer) -> None:
    """Router 1 routed turn 1; turn 2 (turn 1's whole prompt, its answer, a new question) reaches router 2
    before turn 1's end message does: router 2 counts turn 1 as ended when it picks, not when it explains."""
    class Sends:
        def __init__(self, sent: list[bytes] | None = None) -> None:
            self.sent = sent

        def picked(self, key: int, address: str, prefill: int, run: object) -> None:
            if self.sent is not None:
                self.sent.append(pick_message(b"first", key, address, prefill, run))  # type: ignore[arg-type]

        def released(self, key: int) -> None: ...

        def continued(self, run: object) -> int:
            return remote.continued(run)  # type: ignore[arg-type]

    sent: list[bytes] = []
    first, second = precise_core(tokenizer, share=Sends(sent)), precise_core(tokenizer, share=Sends())
    remote = remote_to(second, b"second")
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is this migration safe?"}]
    choice = first.pick(decide(json.dumps({"model": "m", "messages": turn1}).encode(), {}, PICK), PICK)
    remote.on_message(sent[0])
    assert in_flight(second, choice.address) == 1
    turn2 = json.dumps({"model": "m", "messages": [*turn1, {"role": "assistant", "content": "Yes, " * 40},
                                                   {"role": "user", "content": "And the rollback?"}]}).encode()
    second.evaluate(decide(turn2, {}, PICK), PICK)  # explain: no state changes
    assert in_flight(second, choice.address) == 1
    other = second.pick(decide(body("Something else entirely?"), {}, PICK), PICK)  # shares the system prompt only
    assert in_flight(second, choice.address) == 1 + (other.address == choice.address)
    second.release(other)
    picked = second.pick(decide(turn2, {}, PICK), PICK)
    assert remote.stats.continued == 1 and remote.requests() == 0
    assert picked.address == choice.address and in_flight(second, choice.address) == 1  # turn 2 alone


def test_heartbeats_carry_their_sending_time_and_the_receiver_times_the_channel(tokenizer: ModelTokenizer) -> None:
    core = precise_core(tokenizer)
    delays: list[float] = []
    remote = remote_to(core, b"me", wall=lambda: 1000.25, on_delay=delays.append)
    remote.on_message(heartbeat_message(b"peer", [], 1000.0))
    remote.on_message(heartbeat_message(b"skewed", [], 1001.0))  # a sender's clock ahead of ours: no delay
    remote.on_message(heartbeat_message(b"old", []))  # a router from before heartbeats were timed
    assert delays == [0.25, 0.0] and remote.stats.received[2] == 3 and remote.stats.bad == 0
    assert msgpack.unpackb(heartbeat_message(b"old", [1])) == [2, b"old", [1]]


def test_what_the_others_hold_comes_in_held_messages_and_heartbeats_and_goes_with_them(
        tokenizer: ModelTokenizer) -> None:
    """Flow control's held counts per pool and class, and its let-outs: a HELD message replaces the
    sender's, a heartbeat that carries them does too (a lost HELD message is stale a second at most),
    one from an older router leaves them, and a router forgotten takes them along."""
    clock = Clock()
    remote = remote_to(precise_core(tokenizer, clock), b"me")
    remote.on_message(held_message(b"peer", {"m": Peer({0: 3, 5: 0}, 12), "n": Peer({5: 2}, 0)}))
    remote.on_message(held_message(b"me", {"m": Peer({0: 9}, 1)}))  # its own, back from the channel
    assert remote.held("m") == [Peer({0: 3}, 12)] and remote.held("n") == [Peer({5: 2}, 0)]
    assert remote.held("x") == [] and remote.held_total() == 5
    remote.on_message(heartbeat_message(b"peer", [], 1000.0, {"m": Peer({0: 1}, 14)}))
    assert remote.held("m") == [Peer({0: 1}, 14)] and remote.held("n") == []
    remote.on_message(heartbeat_message(b"peer", [], 1000.0))  # an older router's: says nothing of it
    assert remote.held("m") == [Peer({0: 1}, 14)]
    remote.on_message(held_message(b"other", {"m": Peer({5: 4}, 2)}))
    assert remote.held("m") == [Peer({0: 1}, 14), Peer({5: 4}, 2)] and remote.stats.received[3] == 2
    clock.now += PEER_TIMEOUT_S + 1
    remote.expire()
    assert remote.held("m") == [] and remote.stats.bad == 0


def test_a_request_to_a_replica_this_router_does_not_know_yet_never_counts_against_its_own(
        tokenizer: ModelTokenizer) -> None:
    core = precise_core(tokenizer)
    remote = remote_to(core, b"me")
    c = "10.0.0.3:8000"
    remote.on_message(pick_message(b"peer", 1, c, 100, [5, 6]))  # the peer's endpoints are ahead of ours
    core.set_endpoints([A, B, c])
    own = core.pick(decide(body("Is this migration safe?"), {}, PICK), PICK)
    assert core.load.own(own.address) == 1
    remote.on_message(end_message(b"peer", 1))
    assert core.load.own(own.address) == 1 and core.load.own(c) == (own.address == c)
    assert c not in pending(core)


def test_a_bad_message_is_counted_and_skipped(tokenizer: ModelTokenizer) -> None:
    core = precise_core(tokenizer)
    remote = remote_to(core, b"me")
    for bad in (b"\xc1", msgpack.packb([7, b"peer"]), msgpack.packb([0, b"peer", 1]), msgpack.packb("x")):
        remote.on_message(bad)
    assert remote.stats.bad == 4 and remote.requests() == 0 and in_flight(core, A) == 0
    remote.on_message(pick_message(b"peer", 1, A, 0, []))  # a learned-view pick: load only
    assert in_flight(core, A) == 1 and not pending(core)


def test_the_setting_must_be_a_redis_url_and_needs_pick_mode() -> None:
    with pytest.raises(SettingError, match="PREFIX_ROUTER_SHARE_IN_FLIGHT .* must be a Redis URL"):
        server_settings(None, {"PREFIX_ROUTER_SHARE_IN_FLIGHT": "http://redis:6379", "PREFIX_ROUTER_ENDPOINTS": A})
    with pytest.raises(SettingError, match="--share-in-flight is for pick mode"):
        server_settings(None, {"PREFIX_ROUTER_SHARE_IN_FLIGHT": "redis://127.0.0.1:6379/0"})
    cfg = server_settings(None, {"PREFIX_ROUTER_SHARE_IN_FLIGHT": "redis://127.0.0.1:6379/0",
                                 "PREFIX_ROUTER_ENDPOINTS": A})
    assert cfg.share_in_flight == "redis://127.0.0.1:6379/0"


# --- through a real Redis --------------------------------------------------------------------

@pytest.fixture()
def redis_port() -> Iterator[int]:
    port = free_ports(1)[0]
    server = redis_server(port)
    try:
        yield port
    finally:
        server.stop()


async def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def sharing_pair(tokenizer: ModelTokenizer, url: str) -> AsyncIterator[tuple[list[PickCore], list[InFlightBus]]]:
    """Two precise-mode routers sharing their requests in flight over the Redis at ``url``."""
    views, loads = [precise_view(tokenizer) for _ in range(2)], [LoadTracker() for _ in range(2)]
    buses = [InFlightBus(url, "test:in-flight", RemoteInFlight(Remote(load, view), bytes([i]) * 8, time.monotonic))
             for i, (view, load) in enumerate(zip(views, loads))]
    cores = [precise_core(tokenizer, share=bus, view=view, load=load) for bus, view, load in zip(buses, views, loads)]
    for bus in buses:
        await bus.start()
    try:
        await _until(lambda: all(b.stats.connected for b in buses), "both subscribed")
        yield cores, buses
    finally:
        for bus in buses:
            await bus.stop()


def knows(bus: InFlightBus, key: int) -> bool:
    return any(key in peer.requests for peer in bus.remote.peers.values())


def test_two_routers_share_their_requests_over_redis(tokenizer: ModelTokenizer, redis_port: int) -> None:
    async def run() -> None:
        async with sharing_pair(tokenizer, f"redis://127.0.0.1:{redis_port}/0") as (cores, buses):
            choice = cores[0].pick(decide(body("Is this migration safe?"), {}, PICK), PICK)
            assert choice.address is not None
            await _until(lambda: in_flight(cores[1], choice.address) == 1, "the pick reached the other router")
            assert pending(cores[1])[choice.address]
            assert in_flight(cores[0], choice.address) == 1  # its own, counted once
            cores[0].release(choice)
            await _until(lambda: in_flight(cores[1], choice.address) == 0, "the end reached the other router")
            await _until(lambda: buses[1].remote.stats.received[2] > 0, "a heartbeat")
            assert buses[0].remote.stats.received[0] == 0  # nothing came back to the first as someone else's

    asyncio.run(run())


def test_two_routers_tell_each_other_what_they_hold_over_redis(tokenizer: ModelTokenizer, redis_port: int) -> None:
    async def run() -> None:
        async with sharing_pair(tokenizer, f"redis://127.0.0.1:{redis_port}/0") as (cores, buses):
            cores[0].held_here("m", {0: 2, 5: 1}, 7)
            cores[0].held_here("m", {0: 3, 5: 1}, 7)  # changes before the send coalesce: the latest goes
            await _until(lambda: cores[1].held_elsewhere("m") == [Peer({0: 3, 5: 1}, 7)],
                         "the counts reached the other")
            assert cores[0].held_elsewhere("m") == []  # nothing came back to the first as someone else's
            cores[0].held_here("m", {}, 8)
            await _until(lambda: cores[1].held_elsewhere("m") == [Peer({}, 8)], "the emptied queue reached it too")
            assert buses[1].remote.stats.bad == 0

    asyncio.run(run())


def test_a_router_whose_redis_goes_away_forgets_the_others_and_comes_back(tokenizer: ModelTokenizer) -> None:
    port = free_ports(1)[0]

    async def run() -> None:
        server: Process | None = redis_server(port)
        try:
            async with sharing_pair(tokenizer, f"redis://127.0.0.1:{port}/0") as (cores, buses):
                choice = cores[0].pick(decide(body("Is this migration safe?"), {}, PICK), PICK)
                await _until(lambda: knows(buses[1], id(choice)), "the pick reached the other router")
                server.stop()
                server = None
                await _until(lambda: not buses[1].stats.connected, "the loss seen")
                assert buses[1].remote.requests() == 0 and in_flight(cores[1], choice.address) == 0  # stale: dropped
                again = cores[0].pick(decide(body("Who owns this service?"), {}, PICK), PICK)  # routing goes on
                assert again.address is not None
                server = await asyncio.to_thread(redis_server, port)
                await _until(lambda: all(b.stats.connected for b in buses), "both back", timeout=20)
                third = cores[0].pick(decide(body("Where is the runbook?"), {}, PICK), PICK)
                await _until(lambda: knows(buses[1], id(third)), "a new pick after the return")
                assert not knows(buses[1], id(choice))  # what was dropped with the loss stays dropped
        finally:
            if server is not None:
                server.stop()

    asyncio.run(run())


# --- end to end: real Envoy (pick.yaml), two routers, simulated replicas publishing events ----

def test_two_routers_behind_envoy_hear_every_pick_of_the_other() -> None:
    spec = FleetSpec(replicas=2, profile="tiny", time_scale=0.05, block_size=16, num_blocks=256,
                     tokenizer=str(TINY_BYTELEVEL), kv_events=True)
    fleet = SimBackend(spec).start()
    try:
        with RunningArm(ARMS["prefix-precise-2routers-shared"], fleet.urls, router_metrics=True,
                        event_flags=fleet.event_flags()) as arm:
            ports = arm.metrics_ports
            assert len(ports) == 2 and arm.redis is not None
            wait_until(lambda: all(metric(p, "prefix_router_in_flight_sharing_peers") == 1 for p in ports), 15,
                       "each router to hear the other's heartbeat")
            port = int(arm.url.rsplit(":", 1)[1])
            sent = 24
            for i in range(sent):
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}]
                payload = json.dumps({"model": "sim-tiny", "messages": messages, "max_tokens": 2}).encode()
                reply = send(port, body=payload)
                assert reply.status == 200, reply.body

            def received(kind: str) -> float:
                return sum(metric(p, "prefix_router_in_flight_sharing_messages_total", direction="received", kind=kind)
                           for p in ports)

            # each pick is heard by the one other router, and so is its end
            wait_until(lambda: received("pick") == sent and received("end") == sent, 10,
                       "every pick and end heard by the other router")
            picks = [metric(p, "prefix_router_pick_decisions_total") for p in ports]
            assert sum(picks) == sent and min(picks) > 0, picks  # Envoy spread the streams over both
            assert received("bad") == 0
            assert all(metric(p, "prefix_router_in_flight_sharing_requests") == 0 for p in ports)
            # the channel's delay, timed on the other's heartbeats: one a second each, none lost on loopback
            wait_until(lambda: all(metric(p, "prefix_router_in_flight_sharing_delay_seconds_count") >= 2
                                   for p in ports), 10, "each router to time the other's heartbeats")
            assert all(0 < metric(p, "prefix_router_in_flight_sharing_delay_seconds_sum") for p in ports)
            # the drill's event: the Redis killed, each router forgets the other and routes on alone
            apply_event(arm, fleet.urls, FleetEvent(0.0, "redis-lost", 0))
            assert not arm.redis.alive()
            wait_until(lambda: all(metric(p, "prefix_router_in_flight_sharing_peers") == 0 for p in ports), 15,
                       "each router to forget the other")
            alone = [send(port, body=json.dumps({"model": "sim-tiny", "max_tokens": 2, "messages": [
                {"role": "user", "content": f"after the loss {i}"}]}).encode()).status for i in range(4)]
            assert alone == [200] * 4
    finally:
        fleet.stop()
