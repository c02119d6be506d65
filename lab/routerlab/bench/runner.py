"""Run a scenario against each arm on a fresh fleet with the same seeded trace.

``run_bench(BenchConfig(...)) -> Report`` is the whole benchmark as a Python call (the
tests use it); the CLI and the demo are thin wrappers. Per arm: start the backend, start
the arm (router + Envoy, or a peer router), read the replicas' counters, run the load,
read them again, stop everything we started. (The ``overhead``, ``faults`` and ``soak``
scenarios are drills of their own: routerlab.bench.cli.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from extproc.process import event_loop
from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench import arms as arms_mod
from routerlab.bench import backends, loadgen, replica_metrics, router_restart
from routerlab.bench import progress as progress_mod
from routerlab.bench import report as report_mod
from routerlab.bench.oracle import oracle, parse
from routerlab.bench.scenarios import FleetEvent, FleetSpec, LoadSpec, Scenario
from routerlab.bench.scenarios import get as get_scenario
from routerlab.bench.trace import Trace
from routerlab.harness.proc_cpu import CpuMeter
from routerlab.realvllm.promtext import fetch_metrics, http_post_json, served_model
from routerlab.sim.hf_tokenizer import HfTokenizer

T = TypeVar("T")


@dataclass
class BenchConfig:
    """Everything a run needs; None means the scenario's default."""

    scenario: str = "sagemaker-8k"
    arms: Sequence[str] | None = None
    seed: int = 0
    out: Path | None = None
    quick: bool = False
    params: Mapping[str, Any] = field(default_factory=dict)
    replicas: int | None = None
    requests: int | None = None
    time_scale: float | None = None
    load_mode: str | None = None
    concurrency: int | None = None
    rate: float | None = None
    duration_s: float | None = None
    num_blocks: int | None = None
    profile: str | None = None
    block_size: int | None = None  # of the backend's KV cache (for the oracle)
    prefix_length: int | None = None
    balance_factor: int = arms_mod.DEFAULT_BALANCE_FACTOR
    router_settings: Mapping[str, str] = field(default_factory=dict)  # x-prefix-router-* for prefix arms
    router_flags: Sequence[str] = ()  # process flags for every prefix arm's router (--router-flag)
    backend_urls: Sequence[str] = ()
    backend_info: Mapping[str, Any] = field(default_factory=dict)  # what the URLs are, for the report
    plots: bool = True
    progress: progress_mod.Progress | None = None


def scenario_params(scenario: Scenario, cfg: BenchConfig) -> dict[str, Any]:
    overrides = dict(cfg.params)
    for key, value in (("replicas", cfg.replicas), ("requests", cfg.requests), ("time_scale", cfg.time_scale)):
        if value is not None and key in scenario.params:
            overrides[key] = value
    return scenario.resolve(overrides, quick=cfg.quick)


def _fleet(scenario: Scenario, params: Mapping[str, Any], cfg: BenchConfig) -> FleetSpec:
    spec = scenario.fleet(dict(params))
    changes: dict[str, Any] = {k: v for k, v in (("num_blocks", cfg.num_blocks), ("profile", cfg.profile),
                                 ("replicas", cfg.replicas),
                                 ("block_size", cfg.block_size)) if v is not None}
    return dataclasses.replace(spec, **changes)


def _load(scenario: Scenario, params: Mapping[str, Any], cfg: BenchConfig) -> LoadSpec:
    base = scenario.load_for(dict(params)) if scenario.load_for else scenario.load
    return LoadSpec(mode=cfg.load_mode or base.mode, concurrency=cfg.concurrency or base.concurrency,
                    rate=cfg.rate or base.rate, duration_s=cfg.duration_s or base.duration_s)


def _max_num_seqs(spec: FleetSpec) -> int:
    from routerlab.sim.profiles import get_profile

    return spec.max_num_seqs or get_profile(spec.profile).max_num_seqs


def _backend(spec: FleetSpec, cfg: BenchConfig) -> backends.Backend:
    if cfg.backend_urls:
        return backends.ExternalBackend(list(cfg.backend_urls), block_size=spec.block_size)
    return backends.SimBackend(spec)


def _model(spec: FleetSpec, cfg: BenchConfig) -> str:
    if cfg.backend_urls:
        return served_model(cfg.backend_urls[0])
    from routerlab.sim.profiles import get_profile

    return get_profile(spec.profile).model


def _arm_names(scenario: Scenario, cfg: BenchConfig, note: Callable[[str], None], fleet_changes: bool,
               several_models: bool = False) -> list[str]:
    names = list(cfg.arms or scenario.arms)
    out = []
    for name in names:
        arm = arms_mod.get(name)
        if arm.peer and fleet_changes:
            note(f"skipping {name}: this scenario changes the fleet mid-run, which only Envoy arms follow here")
        elif several_models and (arm.peer or arm.base == "envoy-fast.yaml"):
            note(f"skipping {name}: several models run through envoy/multi-model.yaml (ext_proc) here")
        elif arm.available:
            out.append(name)
        else:
            note(f"skipping {name}: not installed (pip install './lab[peers]')")
    return out


def with_real_tokenizer(spec: FleetSpec, trace: Trace, sample: int = 64) -> FleetSpec:
    """Every arm's fleet the same for a run with a precise arm, or a scenario whose fleet tokenises:
    the tiny real tokenizer (or the scenario's), publishing KV-cache events. It makes about twice
    the stand-in's tokens of the same text, so the KV size grows by the measured ratio and the
    scenario keeps the cache pressure it was designed with."""
    tokenizer = spec.tokenizer or str(TINY_BYTELEVEL)
    tok = HfTokenizer(tokenizer)
    bodies = [r.body for r in trace.requests[:sample]]
    real = sum(len(p) for b in bodies for p in parse(b, tok).prompts)
    standin = sum(len(p) for b in bodies for p in parse(b).prompts)
    blocks = math.ceil(spec.num_blocks * real / standin) if spec.num_blocks and standin else spec.num_blocks
    return dataclasses.replace(spec, tokenizer=tokenizer, kv_events=True, num_blocks=blocks)


def with_fleet_slots(settings: Mapping[str, str], slots: int) -> dict[str, str]:
    """The router settings with the fleet's ``--max-num-seqs``, unless they set it themselves (keys as
    ``--router-setting`` normalises them: underscores)."""
    return {"max_num_seqs": str(slots), **settings}


def run_bench(cfg: BenchConfig) -> report_mod.Report:
    scenario = get_scenario(cfg.scenario)
    params = scenario_params(scenario, cfg)
    spec = _fleet(scenario, params, cfg)
    load = _load(scenario, params, cfg)
    prog = cfg.progress or progress_mod.Quiet()
    model = _model(spec, cfg)
    trace = scenario.trace(params, cfg.seed, model)
    prefix_length = cfg.prefix_length or scenario.prefix_length
    names = _arm_names(scenario, cfg, prog.note, bool(scenario.events(params)), bool(spec.pools))
    if (spec.tokenizer or any(arms_mod.get(n).precise for n in names)) and not cfg.backend_urls:
        spec = with_real_tokenizer(spec, trace)
    if not cfg.backend_urls:  # what an operator sets from vLLM's --max-num-seqs (docs/pick-mode.md)
        cfg = dataclasses.replace(cfg, router_settings=with_fleet_slots(cfg.router_settings, _max_num_seqs(spec)))
    best = oracle(trace.requests, spec.block_size, spec.tokenizer).hit_rate
    pool_best = {m: oracle([r for r in trace.requests if scenario.classes and scenario.classes(r.group) == m],
                           spec.block_size, spec.tokenizer).hit_rate for m in spec.members()}
    report = report_mod.Report(
        scenario=scenario.name, summary=scenario.summary, seed=cfg.seed, params=params,
        fleet={**dataclasses.asdict(spec), "backend": "urls" if cfg.backend_urls else "sim", **cfg.backend_info},
        load={**dataclasses.asdict(load), "prefix_length": prefix_length,
              **({"router_settings": dict(cfg.router_settings)} if cfg.router_settings else {}),
              **({"router_flags": list(cfg.router_flags)} if cfg.router_flags else {})},
        oracle_hit_rate=best,
    )
    prog.note(f"{scenario.name}: {len(trace)} requests in {len(trace.sessions)} sessions, oracle hit rate "
              f"{best:.0%}, arms {', '.join(names)}")
    try:
        for name in names:
            summary, results = _run_arm(arms_mod.get(name), name, scenario, spec, load, trace, best, prefix_length,
                                      cfg, prog, pool_best)
            report.arms[name] = summary
            report.ttft_samples[name] = [r.ttft * 1000 for r in results if r.ok and r.ttft is not None]
            report.requests[name] = results
    finally:
        progress_mod.stop(prog)
    _add_notes(report)
    if cfg.out is not None:
        out = Path(cfg.out)
        if cfg.plots:
            from routerlab.bench import plots

            plots.write_all(report, out)
        report_mod.write(report, out)
    return report


def sim_control(url: str, **knobs: Any) -> None:
    """Flip a simulated replica's fault knobs (``POST /sim/control``)."""
    status, body = http_post_json(url.rstrip("/") + "/sim/control", knobs, timeout=10)
    if status != 200:
        raise RuntimeError(f"cannot set {knobs} on {url}: {status} {body}")


def set_health(url: str, healthy: bool) -> None:
    sim_control(url, healthy=healthy)


def start_outside(urls: Sequence[str], members: Sequence[int]) -> None:
    """Replicas not in ``members`` start failing health checks (they join later)."""
    for i in set(range(len(urls))) - set(members):
        set_health(urls[i], False)


def apply_event(running: arms_mod.RunningArm, urls: Sequence[str], event: FleetEvent) -> dict[str, Any] | None:
    """A replica joins (passes health checks, enters pick mode's endpoints), leaves (the reverse),
    goes down (crashes: empty cache, fails health checks, drops connections, stays listed) or
    restarts (empty cache, same port, up again); or a router restarts, and then what its metrics and the
    replicas' counters said just before is returned (its counters start again from 0). A replica that
    goes down or restarts is a new process whose counters start again from 0 too: what they said just
    before is returned (``{"replica_reset": index, "counters": ...}``, for ``replica_metrics.delta``)."""
    if event.action == "router-restart":
        each = [_predictions(port) for port in running.metrics_ports]
        snapshot = {"at_s": event.at_s, "predicted": _summed(each), "replicas": scrape_fleet(urls),
                    "restarted_predicted": each[event.replica] if event.replica < len(each) else {}}
        started = time.monotonic()
        running.restart_router(event.replica)
        snapshot["restart_s"] = round(time.monotonic() - started, 3)
        return snapshot
    if event.action == "redis-lost":  # killed; an arm whose routers share nothing has none to lose
        if running.redis is not None:
            running.redis.stop(grace=0)
        return None
    if event.action == "reset_cache":  # the process goes on, its prefix cache emptied (AllBlocksCleared)
        sim_control(urls[event.replica], reset_cache=True)
        return None
    if event.action in ("down", "restart"):
        counters = scrape_fleet([urls[event.replica]])
        if event.action == "down":  # crashed: its requests fail, its cache and event sequence are gone
            sim_control(urls[event.replica], restart=True, healthy=False, drop_connections=True)
        else:  # and up again, if it was down
            sim_control(urls[event.replica], restart=True, healthy=True, drop_connections=False)
        return {"replica_reset": event.replica, "counters": counters[0]} if counters else None
    joins = event.action == "join"
    set_health(urls[event.replica], joins)
    others = [i for i in running.endpoints if i != event.replica]
    running.set_endpoints(sorted([*others, event.replica] if joins else others))
    return None


def _event_label(e: FleetEvent) -> str:
    if e.action == "redis-lost":
        return "Redis lost"
    return f"router {e.replica} restart" if e.action == "router-restart" else f"{e.action} of replica {e.replica}"


async def _with_events(load: Coroutine[Any, Any, T], running: arms_mod.RunningArm, urls: Sequence[str],
                       events: Sequence[FleetEvent], note: Callable[[str], None],
                       snapshots: list[dict[str, Any]] | None = None) -> T:
    """Run ``load`` while replicas join and leave (or routers restart) at the events' times. An
    event under way when the load ends is finished first (its thread cannot be cancelled)."""
    applying: list[asyncio.Future[Any]] = []

    async def drive() -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for e in events:  # in time order
            await asyncio.sleep(max(0.0, t0 + e.at_s - loop.time()))
            applying[:] = [loop.run_in_executor(None, apply_event, running, urls, e)]
            snapshot = await asyncio.shield(applying[0])
            applying.clear()
            if snapshot is not None and snapshots is not None:
                snapshots.append(snapshot)
            took = f" (ready again after {snapshot['restart_s']:.1f} s)" if snapshot and "restart_s" in snapshot else ""
            note(f"t={e.at_s:.0f}s: {_event_label(e)}{took}")

    task = asyncio.create_task(drive())
    try:
        return await load
    finally:
        task.cancel()
        done = await asyncio.gather(task, *applying, return_exceptions=True)
        if snapshots is not None:  # a router restart the load's end overtook still counts
            snapshots += [d for d in done[1:] if isinstance(d, dict)]


def _run_arm(arm: arms_mod.ArmSpec, label: str, scenario: Scenario, spec: FleetSpec, load: LoadSpec,
             trace: Trace, oracle_rate: float, prefix_length: int, cfg: BenchConfig,
             prog: progress_mod.Progress, pool_oracle: Mapping[str, float] | None = None,
             ) -> tuple[dict[str, Any], list[loadgen.Result]]:
    if arm.scheduling_policy:
        spec = dataclasses.replace(spec, scheduling_policy=arm.scheduling_policy)
    backend = _backend(spec, cfg)
    events = sorted(scenario.events(dict(trace.params)), key=lambda e: e.at_s)
    members = [i for i in range(spec.replicas) if i not in {e.replica for e in events if e.action == "join"}]
    prog.note(f"{label}: starting fleet and arm")
    try:
        backend.start()  # inside the try: an interrupted start still stops what it started
        start_outside(backend.urls, members)
        with arms_mod.RunningArm(arm, backend.urls, prefix_length=prefix_length, balance_factor=cfg.balance_factor,
                                 router_settings=cfg.router_settings, endpoints=members,
                                 router_flags=cfg.router_flags, event_flags=backend.event_flags(),
                                 router_metrics=arm.pick, model_pools=spec.members()) as running:
            before = scrape_fleet(backend.urls)
            meter = CpuMeter({**backend.pids, **running.pids})
            prog.start(label, len(trace))
            snapshots: list[dict[str, Any]] = []
            result = event_loop.run(_with_events(loadgen.run_load(
                running.url, trace.sessions, mode=load.mode, concurrency=load.concurrency, rate=load.rate,
                duration_s=load.duration_s, seed=cfg.seed, on_done=prog.advance),
                running, backend.urls, events, prog.note, snapshots))
            cpu = meter.stop()
            after = scrape_fleet(backend.urls)
            envoy = running.envoy_stats()
            each_router = [_predictions(port) for port in running.metrics_ports]
            predicted = _summed(each_router)
            prices = [v for one in each_router for k, v in one.items() if k.startswith("eviction_price:")]
            if prices:  # a gauge per replica and router: the range, not a sum
                predicted["eviction_price_min"], predicted["eviction_price_max"] = min(prices), max(prices)
    finally:
        backend.stop()
    resets = [(s["replica_reset"], s["counters"]) for s in snapshots if "replica_reset" in s]
    snapshots = [s for s in snapshots if "replica_reset" not in s]
    fleet = replica_metrics.delta(before, after, resets) if before and after else None
    summary = report_mod.summarize(result, fleet, oracle_hit_rate=oracle_rate, total_requests=len(trace),
                                   backend_urls=backend.urls, cpu=cpu, envoy=envoy, classes=scenario.classes)
    if spec.pools and scenario.classes:
        summary["pools"] = report_mod.by_pool(result.results, fleet, spec.members(), backend.urls, pool_oracle or {},
                                              scenario.classes)
        summary["misrouted"] = sum(p["misrouted"] for p in summary["pools"].values())
    if predicted.get("flow_at_once", 0) + predicted.get("flow_held", 0):  # flow control's own counts
        summary["flow"] = _flow_counts(predicted)
        if len(each_router) > 1:  # how the routers shared the let-outs: each holds its own queue
            summary["flow_by_router"] = [_flow_counts(one) for one in each_router]
    if predicted and fleet is not None:  # with what each restarted router's old process predicted
        whole = _summed([predicted, *(s["restarted_predicted"] for s in snapshots)])
        summary["prediction"] = report_mod.prediction(whole, fleet)
    if events:
        labels = ["start"] + [f"after {_event_label(e)}" for e in events]
        summary["timeline"] = report_mod.timeline(result.results, [e.at_s for e in events], backend.urls, labels)
    restarted = ""
    if snapshots:
        summary["router_restart"] = router_restart.summary(result.results, snapshots[0], before, after, predicted,
                                                            oracle_rate)
        conv = summary["router_restart"]["convergence"]
        restarted = (f", hit rate back within 5 % after {conv['seconds']} s" if conv["seconds"] is not None
                     else ", hit rate not back within 5 % before the end")
    prog.finish(f"{label}: ttft p50 {summary['ttft_ms']['p50']} ms, hit rate {summary['kv_hit_rate']}, "
                f"{summary['throughput_rps']} req/s, success {summary['success_rate']:.1%}{restarted}")
    return summary, result.results


def _summed(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Figures of several routers (or processes of one), added up by name."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _flow_counts(predicted: Mapping[str, float]) -> dict[str, float]:
    """Flow control's counts from one router's (or the routers' summed) metrics, and the mean time a
    held request was held (let out or shed; s)."""
    out: dict[str, float] = {k: round(predicted.get(f"flow_{k}", 0)) for k in ("at_once", "held", "shed")}
    count = predicted.get("flow_wait_count", 0)
    out["mean_wait_s"] = round(predicted.get("flow_wait_sum", 0) / count, 3) if count else 0.0
    return out


_HISTOGRAMS: Final = {"prefix_router_flow_wait_seconds": "flow_wait",
                      "prefix_router_in_flight_sharing_delay_seconds": "sharing_delay"}


def _histogram_part(name: str) -> str | None:
    """``flow_wait_sum``, ``sharing_delay_count``, ...: a histogram's sum or count the report reads."""
    family, _, part = name.rpartition("_")
    return f"{_HISTOGRAMS[family]}_{part}" if family in _HISTOGRAMS and part in ("sum", "count") else None


def _predictions(port: int) -> dict[str, float]:
    """What one pick-mode router expected its choices to find cached, by view; and by which view its
    choices went ({} when it serves no metrics). ``_summed`` adds several routers' up."""
    try:
        samples = fetch_metrics(f"http://127.0.0.1:{port}")
    except OSError:
        return {}
    out: dict[str, float] = {}
    for s in samples:
        if s.name == "prefix_router_predicted_cached_tokens_total":
            key = s.labels["view"]
        elif s.name == "prefix_router_predicted_in_flight_tokens_total":
            key = "in_flight"
        elif s.name == "prefix_router_predicted_evicted_tokens_total":
            key = "evicted"
        elif s.name == "prefix_router_eviction_forecast_blocks_total":
            key = f"forecast_{s.labels['outcome']}"  # forecast_evicted, forecast_kept
        elif s.name == "prefix_router_cache_view_total":
            key = f"requests_{s.labels['view']}"
        elif s.name == "prefix_router_in_flight_sharing_continued_total":
            key = "sharing_continued"
        elif s.name == "prefix_router_flow_let_out_total":
            key = f"flow_{s.labels['how']}"  # flow_at_once, flow_held
        elif s.name == "prefix_router_flow_shed_total":
            key = "flow_shed"
        elif s.name == "prefix_router_replica_load" and s.labels.get("kind") == "eviction_price":
            key = f"eviction_price:{s.labels['replica']}"
        elif (part := _histogram_part(s.name)) is not None:
            key = part
        else:
            continue
        out[key] = out.get(key, 0.0) + s.value
    return out


def scrape_fleet(urls: Sequence[str]) -> list[replica_metrics.ReplicaCounters]:
    """Every replica's counters, or [] when one has no /metrics (then no hit rate)."""
    try:
        return replica_metrics.scrape_all(urls)
    except OSError:
        return []


def _add_notes(report: report_mod.Report) -> None:
    for name, a in report.arms.items():
        if report.scenario == "tenants" and a.get("cross_tenant_hit_tokens") is not None:
            report.notes.append(f"{name}: {a['cross_tenant_hit_tokens']} prefix-cache hit tokens were on blocks "
                                "computed for another tenant (counted by the simulated replicas).")
        client = a["client"]
        if client["saturated"]:
            report.notes.append(
                f"{name}: the load generator was saturated (CPU {client['cpu_fraction']:.0%} of a core, loop lag "
                f"p99 {client['loop_lag_p99_ms']:.0f} ms, schedule lag p99 {client['schedule_lag_p99_ms']:.0f} ms): "
                "its latencies include client queueing.")
        busy = a["cpu_s"].get("machine_busy_fraction")
        if busy is not None and busy > 0.9:
            ours = (client["cpu_s"] + sum(v for k, v in a["cpu_s"].items() if k != "machine_busy_fraction")) \
                / (client["wall_s"] * (os.cpu_count() or 1))
            report.notes.append(f"{name}: the machine's CPUs were {busy:.0%} busy ({ours:.0%} from this benchmark's "
                                "processes): latencies include CPU contention.")
        unkeyed = sum(v for k, v in a["envoy"].items() if k.endswith("failure_mode_allowed"))
        if unkeyed:
            report.notes.append(f"{name}: {unkeyed} requests went on unkeyed (ext_proc failure_mode_allow).")
        if a["success_rate"] < 1:
            report.notes.append(f"{name}: success rate {a['success_rate']:.1%} ({a['errors']}).")
        if a["trace_completed"] < 1 and a["success_rate"] == 1:
            report.notes.append(f"{name}: the duration bound stopped the arm with {a['trace_completed']:.1%} of the "
                                f"trace completed ({a['errors']}); rates are over the requests that finished.")
