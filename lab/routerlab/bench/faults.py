"""Fault drill: each fault injected under sustained load, through real Envoy and the shipped config.

``prefix-router bench --scenario faults --out DIR`` runs, for hash mode (envoy.yaml) and pick
mode (pick.yaml), one fresh fleet and arm per fault: shared-prefix chat at a fixed concurrency,
the fault at ``warm_s``, healed ``fault_s`` later, then ``after_s`` more of load. Every
replica is its own simulator process on a fixed port, so "killed" is a real SIGKILL (and a
restart on the same port) and "hung" a real SIGSTOP; routers are killed and frozen the same way.
Envoy's health checks run at the shipped intervals, so detection times are what you deploy.

Per fault, report.json's ``faults`` rows hold ``requests``, ``failures`` (``failures_started_stream``: the
replica had already sent the response headers, so no proxy can retry them),
``unkeyed`` (Envoy's ``ext_proc.failure_mode_allowed``: requests that went on without the
router), ``retries`` and ``recovery_s``, which means, per fault:

* router faults: seconds from the heal (restart, SIGCONT; for one of two routers killed, from
  the kill) to the last request Envoy sent on unkeyed, i.e. until routing was back;
* replica faults: seconds from the heal to the first request the replica served again;
* ``replica-leaves``: seconds from the leave to the last request it served;
  ``replica-joins``: from the join to its first request.

``keys_moved_other`` is the share of prefix keys, served both before the fault and after it
settled, that changed replica although their replica was not the one the fault touched: the
"only their keys move" check (the ``none`` row is the churn with no fault at all).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.core.decide import decide
from extproc.core.settings import RouteSettings
from extproc.process import event_loop
from routerlab.bench import arms as arms_mod
from routerlab.bench import drill, loadgen
from routerlab.bench import progress as progress_mod
from routerlab.bench.backends import SimBackend
from routerlab.bench.report import client_cached_rate
from routerlab.bench.runner import apply_event, sim_control, start_outside
from routerlab.bench.scenarios import FleetEvent, FleetSpec
from routerlab.bench.trace import Trace
from routerlab.harness.procs import free_port_run

UNKEYED_STAT = "http.llm.ext_proc.failure_mode_allowed"
RETRY_STAT = "cluster.vllm.upstream_rq_retry"
RETRY_OVERFLOW_STAT = "cluster.vllm.upstream_rq_retry_overflow"  # the retry budget said no
RETRY_LIMIT_STAT = "cluster.vllm.upstream_rq_retry_limit_exceeded"  # num_retries used up
MODES = {"hash": "prefix-bounded", "pick": "prefix-pick"}  # mode -> arm (shipped config)
SETTLE_S = 6.0  # after a fault starts, before "after" windows count (shipped health checks: 2 x 2 s)


class Replicas:
    """One simulator process per replica, each on its own fixed port (a restart keeps it)."""

    def __init__(self, spec: FleetSpec) -> None:
        base = free_port_run(spec.replicas)
        one = dataclasses.replace(spec, replicas=1)
        self.procs = [SimBackend(one, base_port=base + i) for i in range(spec.replicas)]
        self.urls = [f"http://127.0.0.1:{base + i}" for i in range(spec.replicas)]

    def start(self) -> Replicas:
        for p in self.procs:
            p.start()
        return self

    def kill(self, i: int) -> None:
        process = self.procs[i].process
        assert process is not None  # started
        process.signal(signal.SIGKILL)

    def restart(self, i: int) -> None:
        self.procs[i].stop()
        self.procs[i].start()

    def freeze(self, i: int, frozen: bool) -> None:
        process = self.procs[i].process
        assert process is not None  # started
        process.signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def fail(self, i: int, rate: float) -> None:
        sim_control(self.urls[i], fail_rate=rate)

    def stop(self) -> None:
        for i, p in enumerate(self.procs):
            if p.process is not None:
                self.freeze(i, False)  # a frozen process cannot act on SIGTERM
                p.stop()


Action = Callable[[Replicas, arms_mod.RunningArm], None]  # blocking: runs in a thread


def _leave(fleet: Replicas, arm: arms_mod.RunningArm) -> None:
    apply_event(arm, fleet.urls, FleetEvent(0.0, "leave", 0))


def _join(fleet: Replicas, arm: arms_mod.RunningArm) -> None:
    apply_event(arm, fleet.urls, FleetEvent(0.0, "join", len(fleet.urls) - 1))


@dataclass(frozen=True)
class Fault:
    name: str
    summary: str
    start: Action | None = None  # at warm_s
    heal: Action | None = None  # fault_s later (None: the fault stays)
    routers: int = 1
    touched: int | None = None  # the replica the fault is about (-1: the last); None for router faults
    joins: bool = False  # the touched replica is out of the fleet until the fault starts


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("none", "no fault: the control row (baseline failures, churn and hit rate)"),
    Fault("router-restart", "the router SIGKILLed, restarted fault_s later",
          lambda f, a: a.routers[-1].signal(signal.SIGKILL), lambda f, a: a.restart_router(len(a.routers) - 1)),
    Fault("router-one-of-two", "two routers behind the prefix_router cluster, one SIGKILLed for good",
          lambda f, a: a.routers[-1].signal(signal.SIGKILL), routers=2),
    Fault("router-slow", "the router frozen (SIGSTOP) past message_timeout for fault_s, then resumed",
          lambda f, a: a.routers[0].signal(signal.SIGSTOP), lambda f, a: a.routers[0].signal(signal.SIGCONT)),
    Fault("replica-killed", "replica 0 SIGKILLed, restarted on its port fault_s later (cold cache)",
          lambda f, a: f.kill(0), lambda f, a: f.restart(0), touched=0),
    Fault("replica-hung", "replica 0 frozen (SIGSTOP) for fault_s: accepts connections, never answers",
          lambda f, a: f.freeze(0, True), lambda f, a: f.freeze(0, False), touched=0),
    Fault("replica-500s", "replica 0 answers every inference request with a 500 for fault_s (health stays OK)",
          lambda f, a: f.fail(0, 1.0), lambda f, a: f.fail(0, 0.0), touched=0),
    Fault("replica-leaves", "replica 0 starts failing health checks (scale-in), never returns", _leave, touched=0),
    Fault("replica-joins", "the last replica starts unhealthy and joins the fleet at warm_s (scale-out)", _join,
          touched=-1, joins=True),
)}


@dataclass
class Config(drill.Common):
    modes: Sequence[str] = ("hash", "pick")
    faults: Sequence[str] = tuple(FAULTS)
    concurrency: int = 16
    warm_s: float = 8.0
    fault_s: float = 10.0
    after_s: float = 12.0

    @property
    def duration_s(self) -> float:
        return self.warm_s + self.fault_s + self.after_s


# after_s: a restarted replica serves again only after its process starts (1-2 s on this machine),
# Envoy's health checks pass twice 2 s apart and the router scrapes it; 5 s once missed that in CI
QUICK = dict(warm_s=3.0, fault_s=4.0, after_s=10.0, replicas=3, concurrency=8)
FLAGS = ("replicas", "concurrency", "time_scale")
PARAMS = {"faults": drill.names, "modes": drill.names, "warm_s": float, "fault_s": float, "after_s": float}


async def _drive(fault: Fault, fleet: Replicas, arm: arms_mod.RunningArm, cfg: Config, t0: float,
                 marks: dict[str, float], note: Callable[[str], None]) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + cfg.warm_s - time.monotonic()))
    marks["fault"] = time.monotonic() - t0
    if fault.start is not None:
        await loop.run_in_executor(None, fault.start, fleet, arm)
    note(f"t={marks['fault']:.1f}s: {fault.name} starts")
    if fault.heal is None:
        return
    await asyncio.sleep(max(0.0, t0 + cfg.warm_s + cfg.fault_s - time.monotonic()))
    await loop.run_in_executor(None, fault.heal, fleet, arm)
    marks["heal"] = time.monotonic() - t0
    note(f"t={marks['heal']:.1f}s: {fault.name} healed")


async def _poll_unkeyed(arm: arms_mod.RunningArm, t0: float, samples: list[tuple[float, int]],
                        every: float = 0.25) -> None:
    """(seconds, failure_mode_allowed) samples: when requests went on without the router."""
    loop = asyncio.get_running_loop()
    assert arm.envoy is not None
    while True:
        stats = await loop.run_in_executor(None, arm.envoy.stats, "ext_proc.failure_mode_allowed")
        samples.append((time.monotonic() - t0, stats.get(UNKEYED_STAT, 0)))
        await asyncio.sleep(every)


async def _load_with_fault(arm: arms_mod.RunningArm, fleet: Replicas, fault: Fault, trace: Trace, cfg: Config,
                           prog: progress_mod.Progress) -> tuple[loadgen.LoadResult, dict[str, float],
                                                                 list[tuple[float, int]]]:
    marks: dict[str, float] = {}
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    helpers = [asyncio.create_task(_drive(fault, fleet, arm, cfg, t0, marks, prog.note))]
    if fault.touched is None and fault.start is not None:  # only router faults read when requests went unkeyed
        helpers.append(asyncio.create_task(_poll_unkeyed(arm, t0, samples)))
    try:
        result = await loadgen.run_load(arm.url, trace.sessions, concurrency=cfg.concurrency,
                                        duration_s=cfg.duration_s, request_timeout_s=60.0, grace_s=20.0,
                                        seed=cfg.seed, on_done=prog.advance)
        await helpers[0]  # a heal still pending is applied before the fleet stops
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
    return result, marks, samples


def _keys(trace: Trace) -> dict[int, str]:
    """Each request's prefix key as the router computes it (the default settings of the arms)."""
    settings = RouteSettings()
    return {r.rid: decide(r.body, dict(r.headers), settings).key or "" for r in trace.requests}


def keys_moved(results: Sequence[loadgen.Result], keys: dict[int, str], split_s: float, settle_s: float,
               touched: str | None) -> float | None:
    """Share of keys (served before ``split_s`` and after ``split_s + settle_s``) whose main
    replica changed, among keys whose replica, before and after, was not ``touched``."""
    before: dict[str, Counter[str]] = defaultdict(Counter)
    after: dict[str, Counter[str]] = defaultdict(Counter)
    for r in results:
        if r.ok and r.replica:
            window = before if r.start < split_s else after if r.start >= split_s + settle_s else None
            if window is not None:
                window[keys[r.rid]][r.replica] += 1
    moved = total = 0
    for key in before.keys() & after.keys():
        a, b = before[key].most_common(1)[0][0], after[key].most_common(1)[0][0]
        if touched not in (a, b):
            total += 1
            moved += a != b
    return round(moved / total, 3) if total else None


def _recovery(fault: Fault, marks: dict[str, float], samples: list[tuple[float, int]],
              served: list[float]) -> float | None:
    """See the module docstring; ``served``: start times of requests the touched replica served."""
    if fault.start is None:
        return None
    if fault.touched is None:  # a router fault
        ref = marks.get("heal", marks.get("fault", 0.0))
        rises = [t for (t, v), (_, prev) in zip(samples[1:], samples) if v > prev and t > ref]
        return round(max(rises) - ref, 2) if rises else 0.0
    if fault.name == "replica-leaves":
        late = [t for t in served if t >= marks["fault"]]
        return round(max(late) - marks["fault"], 2) if late else 0.0
    ref = marks.get("heal", marks.get("fault", 0.0))
    again = [t for t in served if t >= ref]
    return round(min(again) - ref, 2) if again else None


def _row(mode: str, fault: str, result: loadgen.LoadResult, marks: dict[str, float],
         samples: list[tuple[float, int]], stats: tuple[dict[str, int], dict[str, int]],
         keys: dict[int, str], touched_url: str | None) -> dict[str, Any]:
    results = result.results
    touched = touched_url.split("://", 1)[1] if touched_url else None
    failed = [r for r in results if not r.ok]
    ok = [r for r in results if r.ok]
    before, after = stats
    return {
        "mode": mode, "fault": fault, "summary": FAULTS[fault].summary,
        "requests": len(results),
        "failures": len(failed),
        "failures_started_stream": sum(r.status == 200 for r in failed),  # headers were out: not retriable
        "errors": dict(Counter(r.error for r in failed)),
        "unkeyed": after.get(UNKEYED_STAT, 0) - before.get(UNKEYED_STAT, 0),
        "retries": after.get(RETRY_STAT, 0) - before.get(RETRY_STAT, 0),
        "retries_refused": {name: after.get(k, 0) - before.get(k, 0)
                            for name, k in (("budget", RETRY_OVERFLOW_STAT), ("limit", RETRY_LIMIT_STAT))},
        "recovery_s": _recovery(FAULTS[fault], marks, samples, sorted(r.start for r in ok if r.replica == touched)),
        "keys_moved_other": keys_moved(results, keys, marks.get("fault", 0.0), SETTLE_S, touched),
        "hit_rate": client_cached_rate(ok),
        "e2e_max_s": round(max((r.e2e for r in ok if r.e2e is not None), default=0.0), 2),  # stalls show here
        "marks_s": {k: round(v, 2) for k, v in marks.items()},
    }


def _stats(arm: arms_mod.RunningArm) -> dict[str, int]:
    assert arm.envoy is not None
    return arm.envoy.stats("ext_proc.failure_mode_allowed|cluster.vllm.upstream_rq_retry($|_overflow|_limit_exceeded)")


def run_fault(mode: str, fault: str, cfg: Config, trace: Trace, spec: FleetSpec,
              keys: dict[int, str]) -> dict[str, Any]:
    """One fault under load on a fresh fleet and arm; returns its report row."""
    prog = cfg.progress
    what = FAULTS[fault]
    arm = dataclasses.replace(arms_mod.get(MODES[mode]), routers=what.routers)
    fleet = Replicas(spec)
    members = list(range(spec.replicas - 1 if what.joins else spec.replicas))
    try:
        fleet.start()
        start_outside(fleet.urls, members)
        with arms_mod.RunningArm(arm, fleet.urls, endpoints=members, health_interval=None) as running:
            prog.start(f"{mode} {fault}", len(trace))
            before = _stats(running)
            result, marks, samples = event_loop.run(_load_with_fault(running, fleet, what, trace, cfg, prog))
            after = _stats(running)
    finally:
        fleet.stop()
    row = _row(mode, fault, result, marks, samples, (before, after), keys,
               fleet.urls[what.touched] if what.touched is not None else None)
    prog.finish(f"{mode} {fault}: {row['requests']} requests, {row['failures']} failed, {row['unkeyed']} unkeyed, "
                f"{row['retries']} retries, recovery {row['recovery_s']} s")
    return row


def run(cfg: Config) -> dict[str, Any]:
    unknown = [f for f in cfg.faults if f not in FAULTS] + [m for m in cfg.modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown fault or mode {', '.join(unknown)}; faults: {', '.join(FAULTS)}; "
                         f"modes: {', '.join(MODES)}")
    # long enough that the load never runs dry; the same keys recur throughout, so key moves show
    trace, spec = drill.shared_prefix_load(cfg, int(cfg.concurrency * cfg.duration_s * 4 * max(1.0, cfg.time_scale)))
    keys = _keys(trace)
    report: dict[str, Any] = {
        "scenario": "faults",
        "params": drill.params(cfg),
        "configs": {m: arms_mod.get(a).base for m, a in MODES.items() if m in cfg.modes},
        "faults": [],
    }
    rows = (run_fault(mode, fault, cfg, trace, spec, keys) for mode in cfg.modes for fault in cfg.faults)
    return drill.collect(report, "faults", rows, cfg, write)


def markdown(report: dict[str, Any]) -> str:
    head = ("| mode | fault | requests | failures | of which started streams | unkeyed | retries | "
            "recovery s | keys moved (others) | hit rate | slowest ok request s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["faults"]:
        lines.append(f"| {r['mode']} | {r['fault']} | {r['requests']} | {r['failures']} | "
                     f"{r['failures_started_stream']} | {r['unkeyed']} | {r['retries']} | "
                     f"{'-' if r['recovery_s'] is None else r['recovery_s']} | "
                     f"{'-' if r['keys_moved_other'] is None else r['keys_moved_other']} | {r['hit_rate']} | "
                     f"{r['e2e_max_s']} |")
    return "\n".join(lines)


def write(report: dict[str, Any], out: Path) -> None:
    p = report["params"]
    configs = ", ".join(f"{m}: envoy/{c}" for m, c in report["configs"].items())
    intro = (f"Shared-prefix chat (24 Zipf-popular 2000-token prefixes), {p['concurrency']} requests in "
             f"flight, {p['replicas']} simulated replicas (one process each). Each fault starts at "
             f"{p['warm_s']:.0f} s and is healed {p['fault_s']:.0f} s later; load runs "
             f"{p['warm_s'] + p['fault_s'] + p['after_s']:.0f} s per fault.")
    errors = [f"- {r['mode']} {r['fault']}: {r['errors']}" for r in report["faults"] if r["errors"]]
    table = "\n".join([intro, "", markdown(report), "", "Errors:", "", *errors])
    drill.write(report, out, f"Fault drill ({configs})", table)
