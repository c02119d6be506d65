"""Validate the A/B designs against the truth on the simulated fleet (issue 18, item 4).

The truth: each arm alone on the whole fleet with the same seeded trace, on a fresh fleet
each, which is what ``prefix-router bench --arms round-robin,prefix-bounded`` measures (TTFT
p50 / p90 at the client, the KV hit rate from the replicas' counters). The designs send the
same trace (``routerlab.bench.trace`` / ``loadgen``, the scenario's load shape), every request
with ``x-session-id`` = its trace session, through a real Envoy on the shipped A/B config, the
hash-mode router and a fresh simulated fleet:

- ``switchback``: envoy/ab.yaml, ``routerlab.ab.driver`` flipping ``ab.prefix_share`` 0 / 100 in
  randomised windows with burn-in; the driver reads the fleet's counters at every edge;
- ``pools``: envoy/ab-pools.yaml, the first half of the replicas the prefix pool, the second
  half the stock pool, weights = pool sizes; each pool's counters read every ``slice_s``;
- ``shared``: envoy/ab.yaml at ``ab.prefix_share`` 50: both arms on every replica, so the
  counters cannot split the hit rate by arm: only the responses' usage can
  (``cached_tokens / prompt_tokens`` grouped by ``x-ab-arm``).

Each design's Envoy access log (and windows file) is analysed with ``routerlab.ab.analysis``,
as ``prefix-router ab analyze`` would; its change prefix vs stock (TTFT p50, p90, KV hit rate)
is set beside the truth's: the error in percentage points and whether the truth lies in the
95 % interval. Writes ``validation.json`` and ``validation.md`` into ``--out``.

    python -m routerlab.ab.validate --scenario zipf-chat --replicas 4 \\
        --design truth,switchback,pools,shared --seed 5 --out DIR

Every process is started and stopped by this module (by PID, through ``Process``); every load
is bounded by the trace and by its duration.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.process import event_loop
from routerlab.ab import accesslog, analysis, driver, record, windows
from routerlab.ab.stats import Change, quantile, ratio_change
from routerlab.bench import arms as arms_mod
from routerlab.bench import loadgen, runner
from routerlab.bench.backends import SimBackend
from routerlab.bench.scenarios import get as get_scenario
from routerlab.bench.trace import Session, Trace
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy, envoy_binary, envoy_version
from routerlab.harness.procs import Process, free_ports, python_module, wait_until

DESIGNS = ("truth", "switchback", "pools", "shared")
METRICS = ("TTFT p50", "TTFT p90", "KV hit rate")
MODES = ("hash", "pick")
# per mode: the truth's bench arms (each alone on the whole fleet) and each design's shipped config
TRUTH = {"hash": {"stock": "round-robin", "prefix": "prefix-bounded"},
         "pick": {"stock": "round-robin", "prefix": "prefix-pick"}}
CONFIGS = {"hash": {"switchback": "ab.yaml", "pools": "ab-pools.yaml", "shared": "ab.yaml"},
           "pick": {"switchback": "ab-pick.yaml", "pools": "ab-pools-pick.yaml", "shared": "ab-pick.yaml"}}
SESSION_HEADER = "x-session-id"
HIT_SOURCE = {
    "truth": "replicas' counters, each arm alone on a fresh fleet",
    "switchback": "fleet counters per window (after burn-in), interval over windows",
    "pools": "each pool's counters per time slice, interval over slices",
    "shared": "responses' usage (cached / prompt tokens) by x-ab-arm, interval over sessions: the counters "
              "cannot split a shared fleet by arm",
}


@dataclass
class ValidateConfig:
    scenario: str = "zipf-chat"
    designs: Sequence[str] = DESIGNS
    mode: str = "hash"  # the router's mode: hash (ab.yaml, ab-pools.yaml) or pick (ab-pick.yaml, ab-pools-pick.yaml)
    seed: int = 5
    out: Path = Path("ab-validate-out")
    replicas: int | None = None
    quick: bool = False
    params: Mapping[str, Any] = field(default_factory=dict)
    time_scale: float | None = None
    duration_s: float | None = None  # the switchback's run; default: from the truth arms' durations
    load_s: float | None = None  # every run's bound on the load (truth arms, splits); default: the scenario's
    windows: int = 12  # switchback windows planned (in balanced pairs), lengths +-20 % around duration / windows
    burn_in: float | None = None  # default: a quarter of the shortest window
    slice_s: float | None = None  # pools: how often each pool's counters are read (default duration / 12)
    draws: int = 2000
    progress: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr, flush=True))


@dataclass
class Context:
    """The scenario resolved once: every design and the truth send these sessions."""

    bench: runner.BenchConfig
    params: dict[str, Any]
    spec: Any  # FleetSpec
    load: Any  # LoadSpec
    trace: Trace
    prefix_length: int


def context(cfg: ValidateConfig) -> Context:
    scenario = get_scenario(cfg.scenario)
    bench = runner.BenchConfig(scenario=cfg.scenario, arms=[TRUTH[cfg.mode]["stock"], TRUTH[cfg.mode]["prefix"]],
                               seed=cfg.seed, out=Path(cfg.out) / "truth", quick=cfg.quick, params=dict(cfg.params),
                               replicas=cfg.replicas, time_scale=cfg.time_scale, plots=False,
                               duration_s=cfg.load_s)
    params = runner.scenario_params(scenario, bench)
    spec = runner._fleet(scenario, params, bench)
    load = runner._load(scenario, bench)
    trace = scenario.trace(params, cfg.seed, runner._model(spec, bench))
    return Context(bench, params, spec, load, trace, bench.prefix_length or scenario.prefix_length)


def with_sessions(trace: Trace) -> tuple[list[Session], dict[int, str]]:
    """The trace's sessions, every request carrying ``x-session-id: s<session index>``; and rid -> session."""
    out, by_rid = [], {}
    for i, s in enumerate(trace.sessions):
        sid = f"s{i}"
        reqs = []
        for r in s.requests:
            headers = tuple(h for h in r.headers if h[0].lower() != SESSION_HEADER) + ((SESSION_HEADER, sid),)
            reqs.append(dataclasses.replace(r, headers=headers))
            by_rid[r.rid] = sid
        out.append(Session(tuple(reqs)))
    return out, by_rid


# ------------------------------------------------------------------------------ the truth
def run_truth(ctx: Context, cfg: ValidateConfig) -> dict[str, Any]:
    cfg.progress(f"truth: prefix-router bench --scenario {cfg.scenario} --arms {','.join(TRUTH[cfg.mode].values())} "
                 f"(each arm alone on a fresh fleet of {ctx.spec.replicas})")
    report = runner.run_bench(ctx.bench)
    arms = {}
    for arm, name in TRUTH[cfg.mode].items():
        a = report.arms[name]
        arms[arm] = {"bench_arm": name, "ttft_ms": {k: a["ttft_ms"][k] for k in ("p50", "p90", "p99")},
                     "kv_hit_rate": a["kv_hit_rate"], "client_cached_rate": a["client_cached_rate"],
                     "duration_s": a["duration_s"], "requests": a["requests"], "ok": a["ok"],
                     "success_rate": a["success_rate"], "trace_completed": a["trace_completed"]}
        cfg.progress(f"truth {arm} ({name}): TTFT p50 {a['ttft_ms']['p50']} ms, p90 {a['ttft_ms']['p90']} ms, "
                     f"hit rate {a['kv_hit_rate']}, {a['duration_s']} s")
    s, p = arms["stock"], arms["prefix"]
    changes = {
        "TTFT p50": _rel(p["ttft_ms"]["p50"], s["ttft_ms"]["p50"]),
        "TTFT p90": _rel(p["ttft_ms"]["p90"], s["ttft_ms"]["p90"]),
        "KV hit rate": _rel(p["kv_hit_rate"], s["kv_hit_rate"]),
    }
    return {"arms": arms, "changes": changes,
            "usage_hit_rate_change": _rel(p["client_cached_rate"], s["client_cached_rate"]),
            "notes": list(report.notes), "report": str(Path(ctx.bench.out or ".") / "report.json")}


def _rel(treatment: float | None, control: float | None) -> float | None:
    if treatment is None or control is None or control <= 0:
        return None
    return treatment / control - 1


# ------------------------------------------------------------------------------ a design
def design_pools(design: str, urls: list[str]) -> dict[str, list[str]]:
    """Each arm's replicas: for the pool split the first half of the fleet the prefix pool, else all."""
    if design != "pools":
        return {"prefix": list(urls), "stock": list(urls)}
    half = len(urls) // 2
    if half < 1:
        raise ValueError("the pool split needs at least 2 replicas")
    return {"prefix": urls[:half], "stock": urls[half:]}


def _envoy_config(design: str, mode: str, pools: dict[str, list[str]], listener: int, admin: int, grpc: int,
                  log: Path, prefix_length: int) -> envoy_config.Config:
    """The shipped config localised to the pools."""
    urls = list(dict.fromkeys(pools["prefix"] + pools["stock"]))
    backends = arms_mod.host_ports(urls)
    cfg = envoy_config.localize(envoy_config.load(CONFIGS[mode][design]), listener_port=listener, admin_port=admin,
                                backends=backends, extproc_port=grpc, health_interval=0.5)
    # the router's settings as the truth's prefix arm sends them (the config's others kept: pick mode's)
    envoy_config.set_stream_metadata(cfg, {**envoy_config.stream_metadata(cfg),
                                           "x-prefix-router-prefix-length": str(prefix_length),
                                           "x-prefix-router-normalize": arms_mod.get(TRUTH[mode]["prefix"]).normalize})
    if design == "pools":
        half = len(pools["prefix"])
        envoy_config.set_endpoints(cfg, "vllm", backends[:half], hash_key_prefix="vllm")
        envoy_config.set_endpoints(cfg, "vllm_stock", backends[half:], hash_key_prefix="vllm")
        for route in envoy_config.routes(cfg):
            for c in route.get("route", {}).get("weighted_clusters", {}).get("clusters", []):
                c["weight"] = len(pools["prefix" if c["name"] == "vllm" else "stock"])
    (logger,) = envoy_config.http_manager(cfg)["access_log"]
    logger["typed_config"]["path"] = str(log)
    return cfg


def switchback_plan(cfg: ValidateConfig, duration: float) -> tuple[list[driver.Planned], float]:
    mean = duration / max(cfg.windows, 4)
    wmin, wmax = 0.8 * mean, 1.2 * mean
    burn_in = cfg.burn_in if cfg.burn_in is not None else round(0.25 * wmin, 3)
    if burn_in >= wmin:
        raise ValueError(f"--burn-in {burn_in:g} s is not shorter than the shortest window ({wmin:.3g} s: 0.8 x "
                         f"{duration:.0f} s / {cfg.windows} windows): fewer windows, or a longer --load-duration")
    return driver.plan(duration, wmin, wmax, cfg.seed), burn_in


def run_design(design: str, ctx: Context, cfg: ValidateConfig, duration: float | None) -> dict[str, Any]:
    out = Path(cfg.out) / design
    out.mkdir(parents=True, exist_ok=True)
    log_path, windows_path = out / "access.log", out / "windows.jsonl"
    log_path.write_text("")
    sessions, session_of = with_sessions(ctx.trace)
    backend = SimBackend(ctx.spec)
    router: Process | None = None
    envoy: Envoy | None = None
    info: dict[str, Any] = {"config": f"envoy/{CONFIGS[cfg.mode][design]}", "access_log": str(log_path)}
    planned: list[driver.Planned] = []
    burn_in = 0.0
    if design == "switchback":
        if not duration:
            raise ValueError("switchback needs a duration (--duration, or run the truth first)")
        planned, burn_in = switchback_plan(cfg, duration)
        info.update(duration_s=round(duration, 3), burn_in_s=burn_in, windows_planned=len(planned),
                    window_s=[p.seconds for p in planned], windows_file=str(windows_path))
    cfg.progress(f"{design}: starting a fresh fleet of {ctx.spec.replicas}, the router and Envoy on "
                 f"{info['config']}")
    try:
        backend.start()
        urls = list(backend.urls)
        listener, admin_port, grpc = free_ports(3)
        pools = design_pools(design, urls)
        # pick mode: the router chooses among the prefix arm's replicas (its pool, in a pool split)
        endpoints = (["--endpoints", ",".join(f"{h}:{p}" for h, p in arms_mod.host_ports(pools["prefix"]))]
                     if cfg.mode == "pick" else [])
        router = Process(python_module("extproc", "serve", "--port", str(grpc), "--metrics-port", "0",
                                       "--log-level", "warning", "--drain-seconds", "1", *endpoints),
                         name="prefix-router", env=arms_mod.ROUTER_ENV)
        router.wait_for_line("prefix-router ready", timeout=30)
        ecfg = _envoy_config(design, cfg.mode, pools, listener, admin_port, grpc, log_path, ctx.prefix_length)
        envoy = Envoy(ecfg, concurrency=1, extra_args=("--file-flush-interval-msec", "100"))
        envoy.start()
        envoy.wait_healthy("vllm", len(pools["prefix"]))
        envoy.wait_healthy("vllm_stock", len(pools["stock"]))
        envoy.wait_healthy("prefix_router", 1)
        admin = driver.Admin(f"http://127.0.0.1:{admin_port}")
        info["pools"] = pools
        if design == "shared":
            admin.set_share(50)
        elif design == "switchback":
            admin.set_share(driver.SHARE[planned[0].arm])  # the first window's arm from the first request on
        url = f"http://127.0.0.1:{listener}"
        load_s = duration if design == "switchback" else ctx.load.duration_s
        every = cfg.slice_s or max(0.5, (duration or 60.0) / 12)
        recorder = None
        if design == "pools":  # each pool's counters per slice, as `prefix-router ab record` reads them
            recorder = record.Recorder("pools", {"prefix": pools["prefix"], "stock": pools["stock"]}, windows_path)
            recorder.open()  # the first edge before the first request
            info["windows_file"] = str(windows_path)

        async def main() -> tuple[loadgen.LoadResult, Any]:
            stop = threading.Event()
            slicer = asyncio.create_task(asyncio.to_thread(
                recorder.record, 2 * (load_s or 60.0) + 60, every, lambda _: None, stop)) if recorder else None
            load = asyncio.create_task(loadgen.run_load(
                url, sessions, mode=ctx.load.mode, concurrency=ctx.load.concurrency, rate=ctx.load.rate,
                duration_s=load_s, seed=cfg.seed))
            header = None
            if design == "switchback":
                header = await asyncio.to_thread(driver.run, admin, windows_path, planned, burn_in, urls,
                                                 lambda text: cfg.progress(f"switchback: {text}"), cfg.seed)
            result = await load
            stop.set()  # a last edge after the last response: every request started inside a slice
            if slicer is not None:
                await slicer
            return result, header

        wall0 = time.time()
        result, header = event_loop.run(main())
        info["load"] = {"requests": len(result.results), "ok": sum(r.ok for r in result.results),
                        "unsent": result.unsent, "cancelled": result.cancelled,
                        "duration_s": round(result.duration_s, 3),
                        "client": result.client.to_json()}
        if header is not None:
            info["driver"] = {k: header.get(k) for k in ("windows_done", "interrupted")}
        answered = sum(1 for r in result.results if r.status)
        wait_until(lambda: _lines(log_path) >= answered, 20, f"{answered} access-log lines from Envoy")
    finally:
        for part in (envoy, router):
            if part is not None:
                part.stop()
        backend.stop()

    log = accesslog.read(log_path)
    wf = windows.read(windows_path) if design in ("switchback", "pools") else None
    a = analysis.analyze(log, design, wf, seed=cfg.seed, draws=cfg.draws)
    (out / "analysis.json").write_text(json.dumps(a.to_json(), indent=1))
    changes = {c.metric: c for c in a.changes}
    usage = _usage_change(design, result.results, session_of, wf, wall0, cfg)
    if design == "shared":
        changes["KV hit rate"] = dataclasses.replace(usage, metric="KV hit rate") if usage else None
    elapsed = (sum(w.end - w.start for w in wf.windows) if design == "switchback" and wf
               else info["load"]["duration_s"])
    client = {arm: _client_arm(result.results, arm) for arm in accesslog.ARMS}
    summary = {"design": design, **info, "elapsed_s": round(elapsed, 3),
               "arms": {arm: {"requests": a.arms.get(arm, {}).get("requests"),
                              "ttft_ms": a.arms.get(arm, {}).get("ttft_ms"),
                              "kv_hit_rate": a.arms.get(arm, {}).get("kv_hit_rate"),
                              "clusters": a.arms.get(arm, {}).get("windows" if design == "switchback" else "sessions"),
                              "client": client[arm]} for arm in accesslog.ARMS},
               "changes": {m: (c.to_json() if c else None) for m, c in changes.items()},
               "usage_hit_rate_change": usage.to_json() if usage else None,
               "hit_rate_source": HIT_SOURCE[design],
               "fatal": a.fatal, "warnings": a.warnings, "notes": a.notes, "verdicts": a.verdicts}
    est = {m: summary["changes"].get(m) for m in METRICS}
    cfg.progress(f"{design}: " + "; ".join(f"{m} {_fmt_change(est[m])}" for m in METRICS)
                 + (f" ({'; '.join(a.fatal)})" if a.fatal else ""))
    return summary


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _client_arm(results: Sequence[loadgen.Result], arm: str) -> dict[str, Any]:
    ok = [r for r in results if r.ok and r.arm == arm]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {"requests": len(ok), "ttft_ms": {"p50": quantile(ttft, 0.5), "p90": quantile(ttft, 0.9)},
            "usage_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None}


def _usage_change(design: str, results: Sequence[loadgen.Result], session_of: dict[int, str],
                  wf: windows.WindowsFile | None, wall0: float, cfg: ValidateConfig) -> Change | None:
    """cached / prompt tokens of the responses per arm, the interval over the design's clusters
    (windows for the switchback, by the request's start; sessions otherwise)."""
    pairs: dict[str, dict[Any, list[float]]] = {arm: defaultdict(lambda: [0.0, 0.0]) for arm in accesslog.ARMS}
    for r in results:
        if not r.ok or r.arm not in pairs or not r.prompt_tokens:
            continue
        if design == "switchback":
            t = wall0 + r.start
            key = next((w.index for w in (wf.windows if wf else []) if w.measure_start <= t < w.end
                        and w.arm == r.arm), None)
            if key is None:
                continue
        else:
            key = session_of.get(r.rid)
        pairs[r.arm][key][0] += r.cached_tokens
        pairs[r.arm][key][1] += r.prompt_tokens
    if not pairs["stock"] or not pairs["prefix"]:
        return None
    unit = "windows" if design == "switchback" else "sessions"
    return ratio_change([tuple(v) for v in pairs["stock"].values()], [tuple(v) for v in pairs["prefix"].values()],
                        metric="KV hit rate (usage)", unit=unit, seed=cfg.seed, draws=cfg.draws)


# ------------------------------------------------------------------------------ the table
def _pct(x: float | None, signed: bool = True) -> str:
    return "n/a" if x is None else (f"{x * 100:+.0f} %" if signed else f"{x * 100:.0f} %")


def _fmt_change(c: dict[str, Any] | None) -> str:
    if not c or c.get("change") is None:
        return "n/a"
    lo, hi = c.get("ci95") or (None, None)
    if lo is None or hi is None:
        return f"{c['change'] * 100:+.0f} % (no interval)"
    return f"{c['change'] * 100:+.0f} % [{lo * 100:+.0f}, {hi * 100:+.0f}]"


def compare(truth: dict[str, Any] | None, designs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per design and metric: the estimate, its interval, the truth, the error and whether the truth is inside."""
    rows = []
    for design, d in designs.items():
        for metric in METRICS:
            c = d["changes"].get(metric)
            est = c.get("change") if c else None
            lo, hi = (c.get("ci95") or (None, None)) if c else (None, None)
            true = truth["changes"].get(metric) if truth else None
            err = est - true if est is not None and true is not None else None
            rows.append({
                "design": design, "metric": metric, "estimate": est, "ci95": [lo, hi], "truth": true,
                "error_pp": round(err * 100, 1) if err is not None else None,
                "error_of_truth": round(abs(err) / abs(true), 3) if err is not None and true else None,
                "truth_in_ci": (lo <= true <= hi) if None not in (lo, hi, true) else None,
                "clusters": c.get("clusters") if c else None, "unit": c.get("unit") if c else None,
            })
    return rows


def target(rows: list[dict[str, Any]]) -> dict[str, bool | None]:
    """Switchback: within 10 % of the true change, or the truth inside its interval (per metric)."""
    out: dict[str, bool | None] = {}
    for r in rows:
        if r["design"] != "switchback":
            continue
        within = r["error_of_truth"] is not None and r["error_of_truth"] <= 0.10
        out[r["metric"]] = None if r["estimate"] is None or r["truth"] is None else bool(within or r["truth_in_ci"])
    return out


def run_time(designs: dict[str, dict[str, Any]], effects: Sequence[float] = (0.05, 0.10, 0.20, 0.50)
             ) -> list[dict[str, Any]]:
    """Minutes in all to resolve a change of each size: elapsed x (half-width / effect)^2, the
    1/sqrt(clusters) rule of routerlab.ab.verdict, from this run's interval widths."""
    rows = []
    for design, d in designs.items():
        for metric in METRICS:
            c = d["changes"].get(metric)
            lo, hi = (c.get("ci95") or (None, None)) if c else (None, None)
            if lo is None or hi is None:
                continue
            half = (hi - lo) / 2
            minutes = d["elapsed_s"] / 60
            rows.append({"design": design, "metric": metric, "half_width": half, "elapsed_min": round(minutes, 2),
                         "minutes": {f"{e:g}": round(minutes * (half / e) ** 2, 2) for e in effects}})
    return rows


def conditions(ctx: Context, cfg: ValidateConfig, started: float) -> dict[str, Any]:
    try:
        load1 = os.getloadavg()
    except OSError:
        load1 = None
    return {"scenario": cfg.scenario, "mode": cfg.mode, "seed": cfg.seed, "quick": cfg.quick, "params": ctx.params,
            "fleet": {"replicas": ctx.spec.replicas, "profile": ctx.spec.profile, "time_scale": ctx.spec.time_scale,
                      "num_blocks": ctx.spec.num_blocks, "max_num_seqs": ctx.spec.max_num_seqs},
            "load": dataclasses.asdict(ctx.load),
            "trace": {"requests": len(ctx.trace), "sessions": len(ctx.trace.sessions)},
            "prefix_length": ctx.prefix_length, "envoy": envoy_version(envoy_binary()), "cpus": os.cpu_count(),
            "machine": platform.platform(), "loadavg_end": load1, "wall_s": round(time.time() - started, 1),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}


def markdown(doc: dict[str, Any]) -> str:
    c = doc["conditions"]
    truth = doc.get("truth")
    lines = [f"# A/B designs vs the truth: {c['scenario']}, {c['fleet']['replicas']} replicas, "
             f"{c.get('mode', 'hash')} mode, seed {c['seed']}", "",
             f"`{doc['command']}`", "",
             f"Conditions: {c['trace']['requests']} requests in {c['trace']['sessions']} sessions; fleet "
             f"{c['fleet']['replicas']} x {c['fleet']['profile']}, time scale {c['fleet']['time_scale']:g}, "
             f"num_blocks {c['fleet']['num_blocks']}, max_num_seqs {c['fleet']['max_num_seqs']}; load "
             f"{c['load']['mode']}, {c['load']['concurrency']} in flight; Envoy {c['envoy']}, --concurrency 1; "
             f"{c['cpus']} CPUs, load average at the end {', '.join(f'{x:.2f}' for x in c['loadavg_end'] or [])}; "
             f"{c['wall_s']:.0f} s in all.", ""]
    sb = doc["designs"].get("switchback")
    if sb:
        lines += [f"Switchback: {sb['duration_s']:.1f} s, {sb['windows_planned']} windows of "
                  f"{min(sb['window_s']):.2f}-{max(sb['window_s']):.2f} s, burn-in {sb['burn_in_s']:g} s.", ""]
    if truth:
        lines += ["| truth (each arm alone, `prefix-router bench`) | TTFT p50 | TTFT p90 | KV hit rate |",
                  "|---|---:|---:|---:|"]
        for arm in ("stock", "prefix"):
            a = truth["arms"][arm]
            lines.append(f"| {arm} ({a['bench_arm']}) | {a['ttft_ms']['p50']:.0f} ms | {a['ttft_ms']['p90']:.0f} ms | "
                         f"{_pct(a['kv_hit_rate'], False)} |")
        lines.append("")
    lines += ["| design | metric | estimate [95 % CI] | truth | error (pp) | truth in CI | over |",
              "|---|---|---:|---:|---:|:---:|---|"]
    for r in doc["rows"]:
        inside = {True: "yes", False: "no", None: "n/a"}[r["truth_in_ci"]]
        over = f"{sum(r['clusters'])} {r['unit']}" if r["clusters"] else ""
        est = _fmt_change({"change": r["estimate"], "ci95": r["ci95"]})
        err = "n/a" if r["error_pp"] is None else f"{r['error_pp']:+.1f}"
        lines.append(f"| {r['design']} | {r['metric']} | {est} | {_pct(r['truth'])} | {err} | {inside} | {over} |")
    lines.append("")
    if doc.get("target"):
        lines.append("Switchback target (within 10 % of the true change, or the truth inside the interval): "
                     + ", ".join(f"{m} {'met' if ok else 'missed' if ok is False else 'n/a'}"
                                 for m, ok in doc["target"].items()) + ".")
        lines.append("")
    lines.append("Hit rate per design: " + "; ".join(f"{d}: {HIT_SOURCE[d]}" for d in doc["designs"]) + ".")
    usage = [f"{d}: {_fmt_change(v.get('usage_hit_rate_change'))}" for d, v in doc["designs"].items()]
    if truth:
        usage.insert(0, f"truth: {_pct(truth.get('usage_hit_rate_change'))}")
    lines += ["", "The responses' usage hit rate (cached / prompt tokens) change, for comparison: "
              + "; ".join(usage) + ".", ""]
    for d, v in doc["designs"].items():
        for text in v["fatal"] + v["warnings"]:
            lines.append(f"- {d}: {text}")
    if doc["run_time"]:
        effects = list(doc["run_time"][0]["minutes"])
        lines += ["", "Minutes in all to resolve a change of each size (elapsed x (half-width / effect)^2, from "
                  "this run's intervals):", "",
                  "| design | metric | half-width now | run so far | " + " | ".join(
                      f"{float(e) * 100:g} %" for e in effects) + " |",
                  "|---|---|---:|---:|" + "---:|" * len(effects)]
        for r in doc["run_time"]:
            lines.append(f"| {r['design']} | {r['metric']} | {r['half_width'] * 100:.1f} pp | "
                         f"{r['elapsed_min']:.1f} min | "
                         + " | ".join(f"{m:.1f}" for m in r["minutes"].values()) + " |")
    return "\n".join(lines) + "\n"


def validate(cfg: ValidateConfig, command: str = "") -> dict[str, Any]:
    started = time.time()
    unknown = [d for d in cfg.designs if d not in DESIGNS]
    if unknown:
        raise ValueError(f"unknown design(s) {', '.join(unknown)}; choose from {', '.join(DESIGNS)}")
    ctx = context(cfg)
    if "switchback" in cfg.designs:  # a burn-in that outlasts the windows: say so before the truth runs
        switchback_plan(cfg, cfg.duration_s or 0.95 * ctx.load.duration_s)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    cfg.progress(f"{cfg.scenario}: {len(ctx.trace)} requests in {len(ctx.trace.sessions)} sessions, "
                 f"{ctx.spec.replicas} replicas, seed {cfg.seed}, designs {', '.join(cfg.designs)}")
    truth = run_truth(ctx, cfg) if "truth" in cfg.designs else None
    duration = cfg.duration_s
    if duration is None and truth:
        # the switchback runs about as long as the trace lasts with each arm alone (the faster arm's time)
        duration = 0.95 * min(truth["arms"][arm]["duration_s"] for arm in TRUTH[cfg.mode])
    designs = {d: run_design(d, ctx, cfg, duration) for d in cfg.designs if d != "truth"}
    rows = compare(truth, designs)
    doc = {"command": command, "conditions": conditions(ctx, cfg, started), "truth": truth, "designs": designs,
           "rows": rows, "target": target(rows) if truth and "switchback" in designs else {},
           "run_time": run_time(designs)}
    out = Path(cfg.out)
    (out / "validation.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "validation.md").write_text(markdown(doc))
    cfg.progress(f"wrote {out / 'validation.md'} and {out / 'validation.json'}")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routerlab.ab.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="zipf-chat")
    p.add_argument("--mode", choices=MODES, default="hash", help="the router's mode: hash (envoy/ab.yaml, "
                   "ab-pools.yaml; truth prefix-bounded) or pick (ab-pick.yaml, ab-pools-pick.yaml; truth prefix-pick)")
    p.add_argument("--design", default=",".join(DESIGNS), help=f"comma list of {', '.join(DESIGNS)}")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--replicas", type=int)
    p.add_argument("--out", default="ab-validate-out")
    p.add_argument("--quick", action="store_true", help="the scenario's test scale (time scale 20)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--time-scale", type=float)
    p.add_argument("--duration", type=float, help="the switchback's length in s (default: 0.95 x the faster "
                   "truth arm's run)")
    p.add_argument("--load-duration", type=float, help="every run's bound on the load in s, the truth arms' and "
                   "the splits' (default: the scenario's); the trace must be long enough to fill it")
    p.add_argument("--windows", type=int, default=12, help="switchback windows (balanced pairs), default 12")
    p.add_argument("--burn-in", type=float, help="seconds left out at each window's start (default: a quarter "
                   "of the shortest window)")
    p.add_argument("--slice", type=float, help="pool split: seconds between reads of each pool's counters")
    p.add_argument("--draws", type=int, default=2000)
    args = p.parse_args(argv)
    params = {}
    for kv in args.param:
        key, sep, value = kv.partition("=")
        if not sep:
            p.error(f"--param wants KEY=VALUE, not {kv!r}")
        params[key] = value
    cfg = ValidateConfig(scenario=args.scenario, mode=args.mode, designs=[d.strip() for d in args.design.split(",") if d.strip()],
                         seed=args.seed, out=Path(args.out), replicas=args.replicas, quick=args.quick, params=params,
                         time_scale=args.time_scale, duration_s=args.duration, load_s=args.load_duration,
                         windows=args.windows,
                         burn_in=args.burn_in, slice_s=args.slice, draws=args.draws)
    command = "python -m routerlab.ab.validate " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        doc = validate(cfg, command)
    except (ValueError, KeyError, driver.DriverError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
