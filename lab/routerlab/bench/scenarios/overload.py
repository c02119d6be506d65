"""Overload: tenants at steady rates, then one floods (``noisy-tenant``); interactive and batch classes
over a saturated fleet (``priority``). Open loop on a schedule, so the load does not slow down when the
fleet does, as real clients do not.

Every request's group is ``TENANT|PHASE`` (``noisy-tenant``: before, flood, after the flood) or
``CLASS|PHASE`` (``priority``: alone, while batch runs), and the report gives each its own TTFT.
"""

from __future__ import annotations

import random

from routerlab.bench.scenarios.parts import ask
from routerlab.bench.scenarios.spec import FleetEvent, FleetSpec, LoadSpec, Params, Scenario
from routerlab.bench.trace import Request, Session, TextSource, chat_body, encode

TENANT_HEADER = "x-prefix-aware-id"
PRIORITY_HEADER = "x-priority"  # what the flow arms trust (flow_priority_header): in a mesh, set by it
FLOW_ARMS = ("round-robin", "prefix-bounded", "prefix-pick", "prefix-pick-flow")


def phase_of(group: str) -> str | None:
    """A request's class in the report: its whole group (``TENANT|PHASE``)."""
    return group if "|" in group else None


def _arrivals(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    """Poisson send times at ``rate`` per second in [start, end)."""
    times: list[float] = []
    t = start
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= end:
            return times
        times.append(t)
    return times


Send = tuple[float, str, str, tuple[tuple[str, str], ...]]  # model time, who, phase, headers


def _requests(p: Params, rng: random.Random, model: str, sends: list[Send]) -> tuple[Session, ...]:
    """One session a send (sent at its model time over ``time_scale``): one of ``who``'s ``documents``
    system prompts and a fresh question of ``question_tokens`` (mostly new prefill: the fleet is busy computing)."""
    text = TextSource(rng)
    names = sorted({who for _, who, _, _ in sends})
    docs = {who: [text.text(p["prefix_tokens"], tag=f"{who} doc {d}") for d in range(p["documents"])]
            for who in names}
    sessions = []
    for rid, (at, who, phase, headers) in enumerate(sorted(sends)):
        question = text.text(p["question_tokens"])
        body = chat_body(model, ask(rng.choice(docs[who]), question), p["output_tokens"])
        sessions.append(Session((Request(rid, encode(body), f"{who}|{phase}", p["output_tokens"],
                                         headers=headers),), start_s=at / p["time_scale"]))
    return tuple(sessions)


def _noisy_tenant(p: Params, rng: random.Random, model: str) -> tuple[Session, ...]:
    """Every tenant sends ``rate`` requests a second throughout; ``tenant-0`` sends ``flood`` times that
    from ``warm_s`` for ``flood_s`` seconds."""
    sends: list[Send] = []
    flood_start, flood_end = p["warm_s"], p["warm_s"] + p["flood_s"]
    end = flood_end + p["after_s"]
    for t in range(p["tenants"]):
        tenant = f"tenant-{t}"
        rates = [(0.0, flood_start, p["rate"]), (flood_start, flood_end, p["rate"] * (p["flood"] if t == 0 else 1)),
                 (flood_end, end, p["rate"])]
        for (start, stop, rate), phase in zip(rates, ("before", "flood", "after")):
            sends += [(at, tenant, phase, ((TENANT_HEADER, tenant),)) for at in _arrivals(rng, rate, start, stop)]
    return _requests(p, rng, model, sends)


def _priority(p: Params, rng: random.Random, model: str) -> tuple[Session, ...]:
    """Interactive requests (priority 0) at ``rate`` throughout; batch requests (priority 5) at
    ``batch_rate`` from ``warm_s`` for ``batch_s`` seconds, more than the fleet can take."""
    sends: list[Send] = []
    batch_start, batch_end = p["warm_s"], p["warm_s"] + p["batch_s"]
    end = batch_end + p["after_s"]
    for start, stop, phase in ((0.0, batch_start, "alone"), (batch_start, batch_end, "with-batch"),
                               (batch_end, end, "after")):
        sends += [(at, "interactive", phase, ((TENANT_HEADER, "app"), (PRIORITY_HEADER, "0")))
                  for at in _arrivals(rng, p["rate"], start, stop)]
    sends += [(at, "batch", "with-batch", ((TENANT_HEADER, "batch-job"), (PRIORITY_HEADER, "5")))
              for at in _arrivals(rng, p["batch_rate"], batch_start, batch_end)]
    return _requests(p, rng, model, sends)


def _fleet(p: Params) -> FleetSpec:
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"], max_num_seqs=p["max_num_seqs"])


def _load(p: Params) -> LoadSpec:
    """Sends end with the schedule; the bound leaves what queued during the overload time to drain."""
    schedule = p["warm_s"] + p.get("flood_s", p.get("batch_s", 0)) + p["after_s"]
    return LoadSpec(mode="scheduled", concurrency=64, duration_s=schedule / p["time_scale"] * 1.5 + 10)


def _noisy_events(p: Params) -> tuple[FleetEvent, ...]:
    """With ``redis_lost_at_s`` (model seconds, >= 0) the routers' shared Redis is killed then: does
    each router keep its own fairness?"""
    at = p["redis_lost_at_s"]
    return (FleetEvent(at / p["time_scale"], "redis-lost", 0),) if at >= 0 else ()


_COMMON = dict(documents=4, prefix_tokens=1000, question_tokens=6000, output_tokens=16, replicas=4, time_scale=1.0,
               max_num_seqs=64)

NOISY_TENANT = Scenario(
    name="noisy-tenant",
    summary="4 tenants at 2.5 requests a second each (about two thirds of what 4 replicas take); tenant-0 "
            "sends 5 times that for a minute: does everyone else's time to first token hold?",
    params=dict(tenants=4, rate=2.5, flood=5.0, warm_s=40.0, flood_s=60.0, after_s=20.0, redis_lost_at_s=-1.0,
                **_COMMON),
    generate=_noisy_tenant,
    fleet=_fleet,
    load_for=_load,
    events=_noisy_events,
    arms=FLOW_ARMS,
    classes=phase_of,
    # two replicas at full time: the flood still saturates them (the suite checks flow control's bookkeeping)
    quick=dict(rate=1.2, warm_s=4.0, flood_s=8.0, after_s=3.0, replicas=2, output_tokens=4),
)

PRIORITY = Scenario(
    name="priority",
    summary="interactive requests at a third of what 4 replicas take, then a batch job offering twice what they "
            "take for a minute: does interactive keep its time to first token while batch absorbs the overload?",
    params=dict(rate=5.0, batch_rate=30.0, warm_s=30.0, batch_s=60.0, after_s=20.0, **_COMMON),
    generate=_priority,
    fleet=_fleet,
    load_for=_load,
    arms=FLOW_ARMS,
    classes=phase_of,
    quick=dict(rate=2.0, batch_rate=14.0, warm_s=4.0, batch_s=8.0, after_s=3.0, replicas=2, output_tokens=4),
)
