"""extproc.pick.flow's parts alone: the fair queue (priority classes, the per-tenant virtual token
counter, shedding), the pool's room, what a request says of itself, and the asyncio gate driven by
a fake room, a fake clock and kick() (no ticker: its tick is an hour)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc import metrics
from extproc.core.decide import Decision, decide
from extproc.core.priority import priority_headers, priority_of
from extproc.core.settings import RouteSettings
from extproc.pick.choice.choose import ALL_BUSY, CHEAPEST, THRESHOLD_SPILL, choose
from extproc.pick.choice.saturation import UNBOUNDED, room
from extproc.pick.choice.state import ReplicaState, Snapshot
from extproc.pick.flow import fair_queue
from extproc.pick.flow.fair_queue import FairQueue, Held
from extproc.pick.flow.gate import ACTIVE_S, GONE, HELD, LET_OUT, QUEUE_FULL, WAITED, FlowGate, Ticket
from extproc.pick.flow.request import OUTPUT_WEIGHT, tenant_of, tokens_of
from extproc.pick.flow.room_share import PASS_S, Peer, Turns, room_share

# --- FairQueue ----------------------------------------------------------------------------------


def held(tenant: str, priority: int = 0, tokens: float = 10.0, value: str = "") -> Held[str]:
    return Held(tenant, priority, tokens, value or tenant)


def drain(queue: FairQueue[str]) -> list[str]:
    out = []
    while (h := queue.pop()) is not None:
        out.append(h.value)
    return out


def test_a_better_class_always_goes_first_lower_number_first() -> None:
    q: FairQueue[str] = FairQueue(100)
    for value, priority in [("p2", 2), ("p0", 0), ("pm5", -5), ("p1", 1), ("p0b", 0)]:
        assert q.push(held("t", priority, value=value)) is None
    assert q.lengths() == {2: 1, 0: 2, -5: 1, 1: 1}
    assert drain(q) == ["pm5", "p0", "p0b", "p1", "p2"]
    assert len(q) == 0 and q.lengths() == {} and q.pop() is None and q.peek() is None


def test_within_a_class_the_tenant_with_the_smallest_counter_goes_first() -> None:
    q: FairQueue[str] = FairQueue(100)
    q.push(held("a", value="a1"))
    q.push(held("b", value="b1"))
    q.charge("a", 50)  # a is waiting: no lift, its counter just grows
    assert q.counters["a"] == 50 and q.counters["b"] == 0
    assert q.peek() is not None and q.peek().value == "b1"  # type: ignore[union-attr]
    assert q.pop().value == "b1"  # type: ignore[union-attr]
    # b was served its last request: lifted to the waiting a's 50, then charged 10
    assert q.counters["b"] == 60
    assert q.pop().value == "a1"  # type: ignore[union-attr]


def test_fifo_within_a_tenant_and_a_better_class_beats_a_lower_counter() -> None:
    q: FairQueue[str] = FairQueue(100)
    for i in range(4):
        q.push(held("a", value=f"a{i}", tokens=0))
    q.push(held("rich", priority=-1, value="rich"))
    q.charge("rich", 10_000)  # far more served than a, but of a better class
    assert drain(q) == ["rich", "a0", "a1", "a2", "a3"]


def test_a_tenant_of_weight_two_is_let_out_twice_as_often() -> None:
    q: FairQueue[str] = FairQueue(1000, {"a": 2.0})
    for i in range(60):  # both stay backlogged through the 30 pops
        q.push(held("a", value=f"a{i}"))
        q.push(held("b", value=f"b{i}"))
    out = [q.pop().tenant for _ in range(30)]  # type: ignore[union-attr]
    assert out.count("a") == 20 and out.count("b") == 10
    for start in range(0, 30, 3):  # and interleaved so, not in bursts: every 3 pops, a twice and b once
        assert sorted(out[start:start + 3]) == ["a", "a", "b"]
    assert q.counters["a"] == q.counters["b"] == 100  # 20 x 10 / 2 and 10 x 10 / 1


def test_a_tenant_idle_for_long_gets_no_burst_of_credit() -> None:
    q: FairQueue[str] = FairQueue(100)
    q.charge("idle", 10)  # served once, long ago
    for _ in range(100):
        q.charge("busy", 10)  # then busy used the fleet alone
    busy = q.counters["busy"]
    assert q.counters["idle"] < busy
    for i in range(5):
        q.push(held("busy", value=f"busy{i}"))
    for i in range(5):
        q.push(held("idle", value=f"idle{i}"))
    assert q.counters["idle"] == busy  # lifted to the smallest counter waiting, not left 990 behind
    out = [h.tenant for h in iter(q.pop, None)]
    # alternates rather than idle going first five times; the tie its lift made goes to idle, served less
    assert out == ["idle", "busy"] * 5


def test_a_burst_allowance_lets_a_tenant_back_from_idle_go_first_for_that_many_tokens() -> None:
    def run(burst: int) -> list[str]:
        q: FairQueue[str] = FairQueue(100, burst=burst)
        for i in range(10):
            q.push(held("flood", value=f"f{i}"))
        for _ in range(5):
            q.pop()  # the flood has been served 50 tokens
        for i in range(4):
            q.push(held("steady", value=f"s{i}"))
        return drain(q)

    # 30 tokens of credit below the flood's counter (and the level): three requests go first, and the
    # fourth wins the tie, served less
    assert run(30) == ["s0", "s1", "s2", "s3", "f5", "f6", "f7", "f8", "f9"]
    assert run(0) == ["s0", "f5", "s1", "f6", "s2", "f7", "s3", "f8", "f9"]  # no allowance: they alternate


def test_credit_does_not_cascade_through_newcomers_while_others_wait_with_it() -> None:
    q: FairQueue[str] = FairQueue(100, burst=30)
    q.charge("x", 130)  # the level: 100
    for tenant in "abcdef":  # each arrives while the ones before it wait, below the level with credit
        q.push(held(tenant))
        assert q.counters[tenant] == 70  # the level less 30, not the last newcomer's less 30 again


def test_credit_never_lowers_the_service_level_so_it_cannot_pile_up() -> None:
    q: FairQueue[str] = FairQueue(100, burst=30)
    q.charge("a", 100)  # a back from idle at 0 - 30: 70, the level
    assert q.counters["a"] == 70
    q.charge("b", 10)  # lifted to 70 - 30: 50; the level stays 70
    assert q.counters["b"] == 50
    q.charge("c", 10)  # lifted from the level, not from b's lower counter
    assert q.counters["c"] == 50
    for _ in range(50):  # a uses twice b's service; b is never more than the allowance behind
        q.charge("a", 20)
        q.charge("b", 10)
        assert q.counters["a"] - q.counters["b"] <= 30 + 10


def test_a_newly_backlogged_tenant_with_none_waiting_starts_at_the_fleets_service_level() -> None:
    q: FairQueue[str] = FairQueue(100)
    q.charge("a", 30)
    q.charge("b", 5)  # b is lifted to a's 30 first: 35
    assert q.counters == {"a": 30, "b": 35}
    q.push(held("new"))
    assert q.counters["new"] == 35
    q.pop()
    q.push(held("a"))  # a (30) is lifted to the highest counter served: new's 45
    assert q.counters["a"] == 45
    other: FairQueue[str] = FairQueue(100)
    other.push(held("w"))  # waiting at 0: the floor
    other.charge("hi", 500)  # lifted to 0, then 500
    other.push(held("hi"))
    assert other.counters == {"w": 0, "hi": 500}  # a counter above the floor is never lowered
    assert drain(other) == ["w", "hi"]


def test_a_full_queue_sheds_the_newest_of_the_worst_class_of_its_most_served_tenant() -> None:
    q: FairQueue[str] = FairQueue(4)
    q.push(held("a", priority=0, value="a-best"))
    q.push(held("b", priority=2, value="b1"))
    q.push(held("c", priority=2, value="c1"))
    q.charge("b", 100)  # b, waiting, has been served the most
    q.push(held("c", priority=2, value="c2"))  # the newest held overall, but of c
    assert len(q) == 4
    shed = q.push(held("x", priority=1, value="x1"))
    assert shed is not None and shed.value == "b1"  # b's newest, not c2
    assert len(q) == 4 and q.lengths() == {0: 1, 2: 2, 1: 1}
    shed = q.push(held("y", priority=1, value="y1"))
    assert shed is not None and shed.value == "c2"  # class 2 is still the worst; c its only tenant
    assert sorted(h.value for h in q) == ["a-best", "c1", "x1", "y1"]


def test_a_full_queue_sheds_the_newcomer_when_nothing_held_is_of_a_worse_class() -> None:
    q: FairQueue[str] = FairQueue(2)
    q.push(held("a", priority=0, value="a1"))
    q.push(held("b", priority=1, value="b1"))
    for priority in (1, 2):
        newcomer = held("c", priority=priority, value=f"c{priority}")
        assert q.push(newcomer) is newcomer
    assert len(q) == 2 and sorted(h.value for h in q) == ["a1", "b1"]
    assert "c" not in q.counters  # the newcomer never entered: not lifted, not counted
    empty: FairQueue[str] = FairQueue(0)
    newcomer = held("a")
    assert empty.push(newcomer) is newcomer and len(empty) == 0


def test_remove_takes_out_exactly_the_request_given() -> None:
    q: FairQueue[str] = FairQueue(10)
    a1, a2, b1 = held("a", value="a1"), held("a", value="a2"), held("b", priority=3, value="b1")
    for h in (a1, a2, b1):
        q.push(h)
    assert q.remove(a1) is True
    assert q.remove(a1) is False  # not twice
    assert q.remove(held("a", value="stranger")) is False  # equal fields are not the same request
    assert q.remove(held("zzz", priority=9)) is False
    assert len(q) == 2 and q.lengths() == {0: 1, 3: 1}
    assert q.remove(b1) is True
    assert q.lengths() == {0: 1} and [h.value for h in q] == ["a2"]
    assert drain(q) == ["a2"] and len(q) == 0


def test_len_iter_and_lengths_agree() -> None:
    q: FairQueue[str] = FairQueue(50)
    for i in range(12):
        q.push(held(f"t{i % 3}", priority=i % 4, value=str(i)))
    assert len(q) == 12 == len(list(q)) == sum(q.lengths().values())
    assert q.lengths() == {0: 3, 1: 3, 2: 3, 3: 3}
    q.pop()
    assert len(q) == 11 == len(list(q)) == sum(q.lengths().values())
    assert q.lengths() == {0: 2, 1: 3, 2: 3, 3: 3}


def test_charging_a_new_tenant_past_the_prune_threshold_does_not_raise() -> None:
    q: FairQueue[str] = FairQueue(10)
    q.push(held("waiting"))  # the floor stays at its counter, 0
    for i in range(fair_queue._PRUNE_AT):  # each new tenant: lifted to 0, then charged 1
        q.charge(f"t{i}", 1)  # the last one: lifted to 0, pruned as the smallest idle counter, KeyError
    assert q.counters[f"t{fair_queue._PRUNE_AT - 1}"] == 1


# --- FairQueue: properties over random operations ----------------------------------------------

TENANTS = ("a", "b", "c")
operations = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(TENANTS), st.integers(-1, 1), st.integers(0, 100)),
        st.tuples(st.just("push"), st.sampled_from(TENANTS), st.just(0), st.integers(0, 100)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
        st.tuples(st.just("charge"), st.sampled_from(TENANTS), st.integers(0, 100)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations, limit=st.one_of(st.integers(0, 3), st.integers(4, 12)), weighted=st.booleans())
def test_the_queue_loses_nothing_and_respects_classes_and_its_limit(
        ops: list[tuple[Any, ...]], limit: int, weighted: bool) -> None:
    q: FairQueue[int] = FairQueue(limit, {"a": 2.0, "b": 0.5} if weighted else None)
    inside: dict[int, Held[int]] = {}  # what the queue should hold, by id
    out: list[int] = []  # every request that left: popped, removed or shed
    pushed = 0

    def let_out(h: Held[int]) -> None:
        # pop: never of a worse class than one held, the smallest counter of its class, the tenant's oldest
        best = min(x.priority for x in inside.values())
        assert h.priority == best
        same = [x for x in inside.values() if x.priority == best]
        assert q.counters.get(h.tenant, 0.0) == min(q.counters.get(x.tenant, 0.0) for x in same)
        assert h.value == min(x.value for x in same if x.tenant == h.tenant)

    for op in ops:
        if op[0] == "push":
            h = Held(op[1], op[2], float(op[3]), pushed)
            pushed += 1
            full = len(inside) >= limit
            worst = max((x.priority for x in inside.values()), default=None)
            expected: set[int] | None = None  # the newest of the worst class's most served tenant (or tenants, tied)
            if full and worst is not None and worst > h.priority:
                band = [x for x in inside.values() if x.priority == worst]
                top = max(q.counters.get(x.tenant, 0.0) for x in band)
                most = {x.tenant for x in band if q.counters.get(x.tenant, 0.0) == top}
                expected = {max(x.value for x in band if x.tenant == t) for t in most}
            shed = q.push(h)
            inside[h.value] = h
            if not full:
                assert shed is None
            elif expected is None:
                assert shed is h  # nothing held of a worse class: the newcomer
            else:
                assert shed is not None and shed.value in expected and shed.priority > h.priority
            if shed is not None:
                out.append(inside.pop(shed.value).value)
        elif op[0] == "pop":
            peeked = q.peek()
            if not inside:
                assert peeked is None and q.pop() is None
                continue
            assert peeked is not None
            let_out(peeked)
            popped = q.pop()
            assert popped is peeked
            out.append(inside.pop(popped.value).value)
        elif op[0] == "remove":
            if inside:
                victim = sorted(inside)[op[1] % len(inside)]
                assert q.remove(inside[victim]) is True
                assert q.remove(inside[victim]) is False
                out.append(inside.pop(victim).value)
        else:
            q.charge(op[1], float(op[2]))
        assert len(q) == len(inside) == len(list(q)) == sum(q.lengths().values())
        assert {h.value for h in q} == set(inside)
        assert len(q) <= limit
    while inside:
        head = q.peek()
        assert head is not None
        let_out(head)
        assert q.pop() is head
        out.append(inside.pop(head.value).value)
    assert q.pop() is None and len(q) == 0
    assert sorted(out) == list(range(pushed))  # every one came out, exactly once


# --- saturation.room ----------------------------------------------------------------------------


def replica(n: int, **kw: Any) -> ReplicaState:
    return ReplicaState(f"10.0.0.{n}:8000", **kw)


def test_room_is_one_for_each_healthy_unsaturated_replica() -> None:
    """One request a replica that can start one soon, whatever its free slots: what a request adds to
    the queue is known only once it is picked."""
    s = RouteSettings(flow_in_flight=8, flow_queue_tokens=1000)
    snap = Snapshot((
        replica(1, in_flight=3),  # 5 slots free: room for one
        replica(2, in_flight=8),  # full
        replica(3, in_flight=20),  # over full: no negative room
        replica(4, in_flight=0, backlog_tokens=1000),  # at the bound: still room
        replica(5, in_flight=0, backlog_tokens=600, token_cost=2.0),  # 1200 configured-rate tokens queued: none
        replica(6, in_flight=0, healthy=False),  # ignored
    ))
    assert room(snap, s) == 2


def test_room_is_unbounded_without_a_healthy_replica() -> None:
    s = RouteSettings(flow_in_flight=4)
    assert room(Snapshot(), s) == UNBOUNDED
    assert room(Snapshot((replica(1, healthy=False, in_flight=4),)), s) == UNBOUNDED
    # a healthy replica, saturated: 0, not unbounded
    assert room(Snapshot((replica(1, healthy=False), replica(2, in_flight=4))), s) == 0


def test_room_falls_back_to_max_num_seqs_when_flow_in_flight_is_zero() -> None:
    snap = Snapshot((replica(1, in_flight=10), replica(2, in_flight=2)))
    assert room(snap, RouteSettings(flow_in_flight=0, max_num_seqs=16)) == 2
    assert room(snap, RouteSettings(flow_in_flight=0, max_num_seqs=10)) == 1  # the first one full
    assert room(snap, RouteSettings(flow_in_flight=12, max_num_seqs=10)) == 2  # flow_in_flight wins
    assert room(snap, RouteSettings(flow_in_flight=0, max_num_seqs=0)) == 2  # no slot limit known


def test_a_replica_with_too_much_prefill_queued_gives_no_room() -> None:
    s = RouteSettings(flow_in_flight=4, flow_queue_tokens=100)
    assert room(Snapshot((replica(1, backlog_tokens=101),)), s) == 0
    assert room(Snapshot((replica(1, backlog_tokens=51, token_cost=2.0),)), s) == 0
    assert room(Snapshot((replica(1, backlog_tokens=200, token_cost=0.5),)), s) == 1  # a fast replica
    assert room(Snapshot((replica(1, backlog_tokens=101), replica(2, in_flight=1))), s) == 1


def test_room_leaves_the_replicas_kept_free_and_never_the_last_one() -> None:
    """``keep`` free replicas stay free (the worse class's reserve for a better one); a pool keeps at
    most all but one, so a worse class is never shut out of a replica alone; saturated ones are not free."""
    s = RouteSettings(flow_in_flight=4, flow_queue_tokens=0)
    four = Snapshot(tuple(replica(n) for n in range(1, 5)))
    assert [room(four, s, keep) for keep in (0, 1, 2, 3, 4, 9)] == [4, 3, 2, 1, 1, 1]
    busy = Snapshot((replica(1, backlog_tokens=10), replica(2, in_flight=4), replica(3), replica(4)))
    assert [room(busy, s, keep) for keep in (0, 1, 2, 3)] == [2, 1, 0, 0]
    assert room(Snapshot((replica(1),)), s, 1) == 1  # alone: nothing to keep
    assert room(Snapshot((replica(1), replica(2, healthy=False))), s, 1) == 1  # the healthy ones count
    assert room(Snapshot((replica(1, healthy=False),)), s, 1) == UNBOUNDED


def test_a_request_let_out_of_the_queue_passes_over_a_saturated_replica() -> None:
    """The replica holding the prompt has too much prefill queued: the cost may still choose it (its cache
    saves more than the queue costs), and does for a request that never waited; one flow control held and
    let out into a replica's room goes where there is room, and to the cheapest when every one is saturated."""
    home = replica(1, backlog_tokens=3000)
    other = replica(2)
    cached = {home.address: 8000}
    flow = RouteSettings(mode="pick", flow_queue_tokens=2000, flow_control=True)
    assert choose("k", 9000, cached, Snapshot((home, other)), flow).address == home.address
    spilled = choose("k", 9000, cached, Snapshot((home, other)), flow, avoid_saturated=True)
    assert (spilled.address, spilled.reason) == (other.address, THRESHOLD_SPILL)
    busy = replica(2, backlog_tokens=2500)
    assert choose("k", 9000, cached, Snapshot((home, busy)), flow, avoid_saturated=True)[:2] == (
        home.address, ALL_BUSY)
    roomy = RouteSettings(mode="pick", flow_queue_tokens=4000, flow_control=True)
    assert choose("k", 9000, cached, Snapshot((home, other)), roomy, avoid_saturated=True)[:2] == (
        home.address, CHEAPEST)


# --- request.py ---------------------------------------------------------------------------------


def decision(document: dict[str, Any] | None = None, normalized_bytes: int = 400,
             tenant: str | None = None) -> Decision:
    return Decision(key=None, tenant=tenant, tenant_source=None, normalize="raw", fallback=None, prefix_bytes=0,
                    normalized_bytes=normalized_bytes, preview=b"", document=document)


def test_tenant_of_names_no_tenant_as_the_dash() -> None:
    assert tenant_of(decision(tenant="acme")) == "acme"
    assert tenant_of(decision(tenant=None)) == metrics.NO_TENANT == "-"
    assert tenant_of(decision(tenant="")) == "-"


def test_priority_is_the_routes_without_a_trusted_header() -> None:
    s = RouteSettings(priority=3)
    assert priority_of(s, {}) == 3
    assert priority_of(s, {"x-priority": "-5"}) == 3  # no header trusted: none read


@pytest.mark.parametrize(("raw", "expected"), [
    ("5", 5), ("-7", -7), (" 12 ", 12), ("0", 0), ("-0", 0), ("1000", 1000), ("-1000", -1000), ("0042", 42),
    ("1001", 3), ("-1001", 3), ("99999", 3), ("100000", 3), ("abc", 3), ("", 3), ("1.5", 3), ("+4", 3),
    ("5x", 3), ("-", 3), ("1e3", 3), ("0x10", 3),
])
def test_a_trusted_header_sets_the_priority_when_it_is_an_integer_in_range(raw: str, expected: int) -> None:
    s = RouteSettings(priority=3, priority_header="x-priority")
    assert priority_of(s, {"x-priority": raw}) == expected
    assert priority_of(s, {"x-other": "1"}) == 3  # the header absent


@pytest.mark.parametrize("raw", ["--5", "²", "-²"])
def test_a_malformed_priority_header_is_ignored_not_raised(raw: str) -> None:
    s = RouteSettings(priority=3, priority_header="x-priority")
    assert priority_of(s, {"x-priority": raw}) == 3


def test_the_adapters_pass_the_priority_header_only_when_a_setting_reads_it() -> None:
    assert priority_headers(RouteSettings(priority_header="x-priority")) == ()
    assert priority_headers(RouteSettings(priority_header="x-priority", flow_control=True)) == ("x-priority",)
    assert priority_headers(RouteSettings(priority_header="x-priority", vllm_priority=True)) == ("x-priority",)
    assert priority_headers(RouteSettings(flow_control=True, vllm_priority=True)) == ()


def test_tokens_are_the_prompt_and_twice_the_output_asked_for() -> None:
    prompt = 400 / 4.0  # BYTES_PER_TOKEN
    assert OUTPUT_WEIGHT == 2.0
    assert tokens_of(decision({"max_tokens": 50})) == prompt + 100
    assert tokens_of(decision({"max_completion_tokens": 30, "max_tokens": 50})) == prompt + 60  # the newer field first
    for bad in (0, -1, True, False, "30", 30.0, None, [30]):  # not a positive int: the next field, else nothing
        assert tokens_of(decision({"max_completion_tokens": bad, "max_tokens": 50})) == prompt + 100
        assert tokens_of(decision({"max_tokens": bad})) == prompt
    assert tokens_of(decision({})) == prompt
    assert tokens_of(decision(None)) == prompt  # no document (not JSON, or a partial body): the prompt only
    assert tokens_of(decision({"max_tokens": 10**9})) == prompt + 2 * (1 << 20)  # capped
    assert tokens_of(decision({"max_tokens": 1}, normalized_bytes=0)) == 2


def test_tokens_of_a_real_decision_json_and_not() -> None:
    s = RouteSettings()
    d = decide(b'{"prompt": "hello world", "max_tokens": 7}', {}, s)
    assert d.document is not None and d.normalized_bytes > 0
    assert tokens_of(d) == d.normalized_bytes / 4.0 + 14
    raw = decide(b"not json at all", {}, s)
    assert raw.document is None and raw.normalized_bytes == 15
    assert tokens_of(raw) == 15 / 4.0


# --- FlowGate -----------------------------------------------------------------------------------


class Room:
    """A pool's room, set by the test: ``pools`` by name, else ``value``."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self.pools: dict[str, int] = {}
        self.calls = 0

    def __call__(self, pool: str, settings: RouteSettings, keep: int = 0) -> int:
        self.calls += 1
        return self.pools.get(pool, self.value)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


S = RouteSettings(flow_control=True, flow_max_wait=30.0, flow_burst_tokens=0)  # strict VTC: counters by hand


GateBody = Callable[[FlowGate, "Room", "Clock"], Coroutine[Any, Any, None]]


def gate_test(room: int = 0) -> Callable[[GateBody], Callable[[], None]]:
    """Runs the test's body on a fresh gate (``room`` to start with, a clock that stands still,
    no ticker) and closes the gate after it, pass or fail."""
    def wrap(body: GateBody) -> Callable[[], None]:
        async def main() -> None:
            r, c = Room(room), Clock()
            gate = FlowGate(r, tick=3600.0, clock=c)
            try:
                await body(gate, r, c)
            finally:
                await gate.close()

        def test() -> None:
            asyncio.run(main())

        # not functools.wraps: pytest would take the body's arguments for fixtures
        test.__name__, test.__doc__ = body.__name__, body.__doc__
        return test
    return wrap


def shed_count(tenant: str, priority: int, reason: str) -> float:
    return metrics.REGISTRY.get_sample_value(
        "prefix_router_flow_shed_total",
        {"tenant": metrics.tenant_label(tenant), "priority": str(priority), "reason": reason}) or 0.0


def held_gauge(pool: str, ticket: Ticket) -> float:
    return metrics.REGISTRY.get_sample_value(
        "prefix_router_flow_held", {"pool": pool, "tenant": ticket.labels[0], "priority": ticket.labels[1]}) or 0.0


@gate_test(2)
async def test_the_gate_lets_a_request_out_at_once_while_there_is_room_and_nothing_held(
        gate: FlowGate, r: Room, clock: Clock) -> None:
    first = gate.enter("pool", "a", 0, 10, S)
    assert first.state == LET_OUT and first.reserved and first.future is None and not first.held
    second = gate.enter("pool", "b", 0, 10, S)
    assert second.state == LET_OUT
    assert gate.queues["pool"].counters == {"a": 10, "b": 20}  # let out at once, still charged (b lifted)
    third = gate.enter("pool", "a", 0, 10, S)  # room 2, 2 reserved: held
    assert third.state == HELD and third.held and third.future is not None and not third.future.done()
    assert gate.held_count() == 1
    assert await gate.wait(first) == LET_OUT  # at once: nothing to wait for


@gate_test(1)
async def test_room_is_reserved_until_done_and_done_twice_frees_it_once(gate: FlowGate, r: Room, clock: Clock) -> None:
    a = gate.enter("pool", "a", 0, 10, S)
    assert a.state == LET_OUT
    b = gate.enter("pool", "b", 0, 10, S)
    assert b.state == HELD
    gate.kick()
    assert b.state == HELD  # a still holds the only room
    gate.done(a)
    assert not a.reserved and a.state == LET_OUT
    gate.kick()
    assert b.state == LET_OUT and b.future is not None and b.future.done()
    assert await gate.wait(b) == LET_OUT
    gate.done(a)  # again: nothing more freed
    c = gate.enter("pool", "c", 0, 10, S)
    assert c.state == HELD  # b holds the room (had a's second done freed it, c would go at once)
    gate.done(b)
    gate.kick()
    assert c.state == LET_OUT


@gate_test(0)
async def test_a_newcomer_waits_behind_the_held_even_with_room(gate: FlowGate, r: Room, clock: Clock) -> None:
    a = gate.enter("pool", "a", 0, 10, S)
    r.value = 5
    b = gate.enter("pool", "b", 0, 10, S)
    assert a.state == b.state == HELD  # something of the pool is held: no jumping it
    gate.kick()
    assert a.state == b.state == LET_OUT
    assert gate.held_count() == 0


@gate_test(0)
async def test_kick_lets_out_what_there_is_room_for_in_fair_order(gate: FlowGate, r: Room, clock: Clock) -> None:
    tickets = {name: gate.enter("pool", name[0], -1 if name == "c1" else 0, 10, S)
               for name in ("a1", "a2", "a3", "b1", "b2", "c1")}
    assert all(t.state == HELD for t in tickets.values())
    order: list[str] = []
    for n in range(1, 7):
        gate.kick()
        assert [k for k, t in tickets.items() if t.state == LET_OUT] == sorted(order)  # none without room
        r.value = n  # room for one more (none is done)
        gate.kick()
        new = [k for k, t in tickets.items() if t.state == LET_OUT and k not in order]
        assert len(new) == 1
        order += new
    # the better class first; then a and b alternate (a first: its request is older); a's in order
    assert order == ["c1", "a1", "b1", "a2", "b2", "a3"]
    assert gate.held_count() == 0 and len(gate.queues["pool"]) == 0
    assert all(t.future is not None and t.future.done() for t in tickets.values())
    assert [await gate.wait(t) for t in tickets.values()] == [LET_OUT] * 6


@gate_test(0)
async def test_pools_are_held_and_let_out_apart(gate: FlowGate, r: Room, clock: Clock) -> None:
    r.pools = {"full": 0, "free": 3}
    x = gate.enter("full", "a", 0, 10, S)
    y = gate.enter("free", "a", 0, 10, S)
    assert x.state == HELD and y.state == LET_OUT
    gate.kick()
    assert x.state == HELD
    r.pools["full"] = 1
    gate.kick()
    assert x.state == LET_OUT


class QueueRoom(Room):
    """Room that depends on the queue a request may find: ``value`` for the route's queue, ``strict``
    for a worse class's (``flow_worse_queue_tokens``, 0 here)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.strict = 0
        self.asked: list[int] = []

    def __call__(self, pool: str, settings: RouteSettings, keep: int = 0) -> int:
        self.asked.append(settings.flow_queue_tokens)
        return self.strict if settings.flow_queue_tokens == 0 else self.value


@gate_test(0)
async def test_a_worse_class_keeps_the_headroom_of_a_better_class_while_it_is_active(
        gate: FlowGate, r: Room, clock: Clock) -> None:
    """Batch (5) alone counts the route's queue; once interactive (0) has come it counts the worse class's
    (none queued) for ACTIVE_S, is held where interactive goes at once, and picks passing over saturated
    replicas; after ACTIVE_S without interactive, the route's queue again."""
    room = QueueRoom()
    gate.room = room
    room.value, room.strict = 1, 0
    alone = gate.enter("pool", "batch", 5, 10, S)
    assert alone.state == LET_OUT and not alone.yields and alone.settings is S and not alone.avoid_saturated
    gate.done(alone)
    interactive = gate.enter("pool", "app", 0, 10, S)
    assert interactive.state == LET_OUT and interactive.settings is S  # no better class: the route's queue
    gate.done(interactive)
    batch = gate.enter("pool", "batch", 5, 10, S)
    assert batch.state == HELD and batch.yields  # room for the route's queue, none for the worse class's
    assert batch.settings.flow_queue_tokens == S.flow_worse_queue_tokens == 0
    assert dataclasses.replace(batch.settings, flow_queue_tokens=S.flow_queue_tokens) == S  # nothing else
    room.strict = 1  # a replica with nothing queued
    gate.kick()
    assert batch.state == LET_OUT and batch.avoid_saturated
    gate.done(batch)
    clock.now += ACTIVE_S + 0.1
    room.strict = 0
    later = gate.enter("pool", "batch", 5, 10, S)
    assert later.state == LET_OUT and not later.yields and later.settings is S


class KeepRoom(Room):
    """Room that depends on the replicas a request must keep free: ``value`` less ``keep``."""

    def __init__(self) -> None:
        super().__init__(0)
        self.kept: list[int] = []

    def __call__(self, pool: str, settings: RouteSettings, keep: int = 0) -> int:
        self.kept.append(keep)
        return max(0, self.value - keep)


@gate_test(0)
async def test_a_worse_class_keeps_replicas_free_for_a_better_class_while_it_is_active(
        gate: FlowGate, r: Room, clock: Clock) -> None:
    """Batch alone keeps nothing free; while interactive is active it keeps ``flow_reserve_replicas``
    (2 here) free: held with two replicas free, let out with three; interactive keeps none."""
    room = KeepRoom()
    gate.room = room
    settings = dataclasses.replace(S, flow_reserve_replicas=2)
    room.value = 1
    alone = gate.enter("pool", "batch", 5, 10, settings)
    assert alone.state == LET_OUT and room.kept == [0]
    gate.done(alone)
    room.value = 2
    interactive = gate.enter("pool", "app", 0, 10, settings)
    assert interactive.state == LET_OUT and room.kept[-1] == 0
    gate.done(interactive)
    batch = gate.enter("pool", "batch", 5, 10, settings)
    assert batch.state == HELD and room.kept[-1] == 2
    room.value = 3
    gate.kick()
    assert batch.state == LET_OUT and batch.avoid_saturated
    gate.done(batch)


@gate_test(0)
async def test_a_better_request_goes_at_once_past_worse_ones_held(gate: FlowGate, r: Room, clock: Clock) -> None:
    """Batch requests are held; an interactive one that comes to a replica's room goes at once (the
    ticker, an hour here, is not what lets it out); one that comes to none is held ahead of them."""
    room = KeepRoom()
    gate.room = room
    keep = dataclasses.replace(S, flow_reserve_replicas=1)
    gate.done(gate.enter("pool", "app", 0, 10, keep))  # interactive is active
    held = [gate.enter("pool", "batch", 5, 10, keep) for _ in range(3)]
    assert all(t.state == HELD for t in held)
    room.value = keep.flow_reserve_replicas  # room only for what the batch keeps free
    interactive = gate.enter("pool", "app", 0, 10, keep)
    assert interactive.state == LET_OUT and all(t.state == HELD for t in held)
    gate.done(interactive)
    room.value = 0
    late = gate.enter("pool", "app", 0, 10, keep)
    assert late.state == HELD and gate.queues["pool"].peek().value is late  # type: ignore[union-attr]
    gate.done(late)
    assert gate.held_count() == 3


@gate_test(0)
async def test_a_held_worse_request_counts_the_route_queue_again_once_the_better_class_went_quiet(
        gate: FlowGate, r: Room, clock: Clock) -> None:
    room = QueueRoom()
    gate.room = room
    gate.done(gate.enter("pool", "app", 0, 10, S))  # interactive comes (held: no room), its client goes
    batch = gate.enter("pool", "batch", 5, 10, S)
    assert batch.state == HELD and batch.yields
    room.value = 1
    gate.kick()
    assert batch.state == HELD  # the route's queue has room, the worse class's none
    clock.now += ACTIVE_S + 0.1
    gate.kick()
    assert batch.state == LET_OUT and not batch.yields and batch.settings is S


@gate_test(0)
async def test_a_waiter_is_woken_by_kick(gate: FlowGate, r: Room, clock: Clock) -> None:
    t = gate.enter("pool", "a", 0, 10, S)
    waiting = asyncio.get_running_loop().create_task(gate.wait(t))
    await asyncio.sleep(0)  # let it start waiting (a yield, not a delay)
    assert not waiting.done()
    r.value = 1
    gate.kick()
    assert await waiting == LET_OUT


@gate_test(0)
async def test_a_held_request_is_shed_at_its_wait_bound_and_counted(gate: FlowGate, r: Room, clock: Clock) -> None:
    quick = RouteSettings(flow_control=True, flow_max_wait=0.05)
    t = gate.enter("pool", "waiter", 0, 10, quick)
    before, held_before = shed_count("waiter", 0, WAITED), held_gauge("pool", t)
    started = time.monotonic()
    assert await gate.wait(t) == WAITED  # the fake clock stands still: the bound is 0.05 s of real time
    assert time.monotonic() - started >= 0.04
    assert t.shed and not t.held and t.entry is None
    assert shed_count("waiter", 0, WAITED) == before + 1
    assert held_gauge("pool", t) == held_before - 1
    assert gate.held_count() == 0
    r.value = 1
    gate.kick()
    assert t.state == WAITED  # shed stays shed
    gate.done(t)
    assert t.state == WAITED
    # past its bound already by the clock: shed without waiting for real time
    late = gate.enter("pool", "waiter", 0, 10, RouteSettings(flow_control=True, flow_max_wait=5.0))
    assert late.state == LET_OUT  # room 1 now
    r.value = 0
    gate.done(late)
    t2 = gate.enter("pool", "waiter", 0, 10, RouteSettings(flow_control=True, flow_max_wait=5.0))
    clock.now += 5.0
    started = time.monotonic()
    assert await gate.wait(t2) == WAITED
    assert time.monotonic() - started < 1.0
    assert shed_count("waiter", 0, WAITED) == before + 2


@gate_test(0)
async def test_a_full_queue_sheds_the_newcomer_or_the_newest_of_a_worse_class(
        gate: FlowGate, r: Room, clock: Clock) -> None:
    three = RouteSettings(flow_control=True, flow_max_wait=30.0, flow_max_queue=3)
    two = RouteSettings(flow_control=True, flow_max_wait=30.0, flow_max_queue=2)
    a1 = gate.enter("pool", "a", 0, 10, three)
    a2 = gate.enter("pool", "a", 0, 10, three)
    b1 = gate.enter("pool", "b", 0, 10, three)
    r.value = 1
    gate.kick()
    assert a1.state == LET_OUT and a2.state == b1.state == HELD  # a (10) now served more than b (0)
    before_c, before_a = shed_count("c", 0, QUEUE_FULL), shed_count("a", 0, QUEUE_FULL)
    c1 = gate.enter("pool", "c", 0, 10, two)  # 2 held, 2 at most, none of a worse class: the newcomer goes
    assert c1.state == QUEUE_FULL and c1.future is None and c1.shed and c1.entry is None
    assert await gate.wait(c1) == QUEUE_FULL
    assert shed_count("c", 0, QUEUE_FULL) == before_c + 1
    assert gate.held_count() == 2
    d1 = gate.enter("pool", "d", -1, 10, two)  # a better class: a's newest goes (a served most), not b's
    assert d1.state == HELD
    assert a2.state == QUEUE_FULL and a2.entry is None
    assert a2.future is not None and a2.future.done()
    assert await gate.wait(a2) == QUEUE_FULL
    assert shed_count("a", 0, QUEUE_FULL) == before_a + 1
    assert b1.state == HELD and gate.held_count() == 2
    gate.done(a1)
    gate.kick()
    assert d1.state == LET_OUT and b1.state == HELD


@gate_test(0)
async def test_done_on_a_held_ticket_takes_it_out_as_gone(gate: FlowGate, r: Room, clock: Clock) -> None:
    a = gate.enter("pool", "gone-tenant", 0, 10, S)
    b = gate.enter("pool", "other", 0, 10, S)
    gauge = held_gauge("pool", a)
    gate.done(a)
    assert a.state == GONE and not a.held and not a.shed and a.entry is None
    assert held_gauge("pool", a) == gauge - 1
    assert gate.held_count() == 1 and [h.value for h in gate.queues["pool"]] == [b]
    assert await gate.wait(a) == GONE
    r.value = 5
    gate.kick()
    assert a.state == GONE and b.state == LET_OUT
    gate.done(a)  # again: nothing
    assert a.state == GONE


@gate_test(0)
async def test_retry_after_is_the_held_ahead_at_the_recent_rate_out_within_1_to_60(
        gate: FlowGate, r: Room, clock: Clock) -> None:
    t0 = clock.now
    tickets = [gate.enter("pool", f"t{i % 3}", 0, 10, S) for i in range(30)]
    assert gate.retry_after(tickets[0]) == 60  # nothing let out yet: no rate
    for i in range(10):  # one let out every 0.1 s
        clock.now = t0 + i * 0.1
        r.value = i + 1
        gate.kick()
    clock.now = t0 + 1.0
    assert gate.held_count() == 20
    assert gate.retry_after(tickets[-1]) == 2  # 20 held at 10 let out per second over the last second
    clock.now = t0 + 4.0  # the window still holds them all, the rate is lower: 10 in 4 s -> 8 s
    assert gate.retry_after(tickets[-1]) == 8
    clock.now = t0 + 11.0  # all older than 10 s: no rate
    assert gate.retry_after(tickets[-1]) == 60
    r.value = 100
    clock.now = t0 + 12.0
    gate.kick()  # all 20 at once: a high rate, nothing held
    assert gate.held_count() == 0
    assert gate.retry_after(tickets[-1]) == 1  # never 0


@gate_test(0)
async def test_retry_after_is_capped_at_60(gate: FlowGate, r: Room, clock: Clock) -> None:
    t0 = clock.now
    tickets = [gate.enter("pool", "a", 0, 10, S) for _ in range(200)]
    for i in range(2):
        clock.now = t0 + i * 9.0
        r.value = i + 1
        gate.kick()
    clock.now = t0 + 9.0  # 2 out in 9 s: 198 / 0.22 per s
    assert gate.retry_after(tickets[-1]) == 60



@gate_test(1)
async def test_a_pools_weights_and_burst_follow_the_settings(gate: FlowGate, r: Room, clock: Clock) -> None:
    gate.enter("pool", "a", 0, 10, RouteSettings(flow_control=True, tenant_weights=(("a", 2.0),)))
    assert gate.queues["pool"].weights == {"a": 2.0} and gate.queues["pool"].burst == 65536  # the default
    gate.enter("pool", "a", 0, 10, RouteSettings(flow_control=True, tenant_weights=(("a", 4.0),), flow_burst_tokens=7))
    assert gate.queues["pool"].weights == {"a": 4.0} and gate.queues["pool"].burst == 7


# --- vLLM's priority field (extproc.core.priority, written by decide) ---------------------------


def test_vllm_priority_writes_the_class_into_the_body_without_moving_the_key() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}], "priority": -50}'
    plain = decide(body, {}, RouteSettings())
    route = RouteSettings(vllm_priority=True, priority=7, priority_header="x-priority")
    written = decide(body, {}, route)
    assert written.key == plain.key and plain.body is None
    assert written.body is not None and json.loads(written.body)["priority"] == 7  # the client's -50 overridden
    assert json.loads(decide(body, {"x-priority": "2"}, route).body or b"")["priority"] == 2
    assert json.loads(decide(body, {"x-priority": "9999"}, route).body or b"")["priority"] == 7  # out of range
    assert decide(b"not json", {}, route).body is None
    raw = decide(body, {}, dataclasses.replace(route, normalize="raw"))
    assert raw.body is not None and json.loads(raw.body)["priority"] == 7


# --- several routers: turns at the room by what each holds (room_share) -------------------------


@pytest.mark.parametrize(("own", "others", "share"), [
    ({}, [], 1.0),  # alone
    ({0: 1}, [{0: 0}, {}], 1.0),  # the others hold nothing
    ({0: 3}, [{0: 3}], 0.5),  # alike
    ({}, [{0: 2}], 0.0),  # holding nothing: the room is theirs
    ({5: 4}, [{0: 1}], 0.0),  # only a worse class: it waits while another router holds a better one
    ({0: 1}, [{5: 9}], 1.0),  # the better class is only here
    ({0: 1, 5: 3}, [{0: 3}, {0: 0, 5: 2}], 0.25),  # the best class's held, over every router
])
def test_a_routers_share_of_the_room_is_its_part_of_the_best_class_held(
        own: dict[int, int], others: list[dict[int, int]], share: float) -> None:
    assert room_share(own, others) == share


def turns_taken(held: tuple[dict[int, int], dict[int, int]], rooms: int) -> str:
    """Two routers' accounts over ``rooms`` rooms, router a always looking first (its request ended):
    who took each."""
    accounts, let_out, taken = (Turns(), Turns()), [0, 0], ""
    for n in range(rooms):
        for me in (0, 1):
            if accounts[me].mine(held[me], [Peer(held[1 - me], let_out[1 - me])], now=float(n)):
                accounts[me].took()
                let_out[me] += 1
                taken += "ab"[me]
                break
    return taken


def test_two_routers_holding_alike_take_turns_though_one_always_looks_first() -> None:
    assert turns_taken(({0: 10}, {0: 10}), 8) == "abababab"


def test_a_router_holding_three_times_as_many_takes_three_rooms_in_four() -> None:
    taken = turns_taken(({0: 30}, {0: 10}), 40)
    assert taken.count("a") == 30 and "aaaa" not in taken


def test_a_router_holding_only_a_worse_class_leaves_the_room_until_it_was_left_too_long() -> None:
    turns = Turns()
    others = [Peer({0: 2}, 0)]
    assert not turns.mine({5: 4}, others, now=10.0)
    assert not turns.mine({5: 4}, [Peer({0: 2}, 7)], now=10.0 + PASS_S / 2)  # its let-outs credit nothing here
    assert turns.credit == 0.0
    assert turns.mine({5: 4}, others, now=10.0 + PASS_S)  # nobody took it (counts stale, router gone): taken
    turns.took()
    assert turns.passed_at is None


def test_with_the_others_holding_nothing_the_account_starts_again() -> None:
    turns = Turns(credit=-1.5, seen=3)
    assert turns.mine({0: 1}, [Peer({}, 9)], now=0.0)
    assert (turns.credit, turns.seen) == (0.0, 9)


class Elsewhere:
    """The other routers as one gate sees them (set by the test), and what it told them."""

    def __init__(self, *peers: Peer) -> None:
        self.peers = list(peers)
        self.told: list[tuple[str, dict[int, int], int]] = []

    def __call__(self, pool: str) -> list[Peer]:
        return self.peers

    def tell(self, pool: str, counts: Mapping[int, int], let_out: int) -> None:
        self.told.append((pool, {p: n for p, n in counts.items() if n}, let_out))


def shared_gate(room: Room, others: Elsewhere) -> FlowGate:
    return FlowGate(room, tick=3600.0, clock=Clock(), elsewhere=others, tell=others.tell)


def test_with_another_router_holding_a_newcomer_waits_then_the_two_take_turns() -> None:
    async def main() -> None:
        r, others = Room(1), Elsewhere(Peer({0: 1}, 0))
        gate = shared_gate(r, others)
        first = gate.enter("pool", "a", 0, 10, S)
        assert first.state == HELD  # room, but the other router holds one of its class
        gate.kick()  # an even account: its turn
        assert first.state == LET_OUT and others.told == [("pool", {0: 1}, 0), ("pool", {}, 1)]
        second = gate.enter("pool", "b", 0, 10, S)
        gate.done(first)
        gate.kick()
        assert second.state == HELD  # the other router's turn
        others.peers = [Peer({0: 1}, 1)]  # it took it
        gate.kick()
        assert second.state == LET_OUT and others.told[-1] == ("pool", {}, 2)
        await gate.close()
    asyncio.run(main())


def test_with_the_others_holding_nothing_of_its_class_the_gate_works_as_alone() -> None:
    async def main() -> None:
        r, others = Room(1), Elsewhere(Peer({5: 3}, 40))
        gate = shared_gate(r, others)
        assert gate.enter("pool", "a", 0, 10, S).state == LET_OUT  # they hold only a worse class
        held = gate.enter("pool", "b", 0, 10, S)  # room 1, reserved 1
        r.value = 2
        gate.kick()
        assert held.state == LET_OUT and others.told == [("pool", {}, 1), ("pool", {0: 1}, 1), ("pool", {}, 2)]
        await gate.close()
    asyncio.run(main())


@gate_test(0)
async def test_a_shed_or_gone_request_is_told_as_no_longer_held(gate: FlowGate, r: Room, clock: Clock) -> None:
    told: list[dict[int, int]] = []
    gate.tell = lambda pool, counts, let_out: told.append({p: n for p, n in counts.items() if n})
    a, b = gate.enter("pool", "a", 0, 10, S), gate.enter("pool", "b", 3, 10, S)
    gate.done(b)  # its client left
    quick = RouteSettings(flow_control=True, flow_max_wait=0.0)
    c = gate.enter("pool", "c", 0, 10, quick)
    assert await gate.wait(c) == WAITED
    assert told == [{0: 1}, {0: 1, 3: 1}, {0: 1}, {0: 2}, {0: 1}]
    assert a.held
