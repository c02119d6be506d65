"""Soak: a bounded open-loop load for a long time, the router's memory sampled as it runs.

``prefix-router bench --scenario soak --duration 600`` runs, per arm (hash mode on
envoy.yaml, pick mode on pick.yaml), Poisson traffic at ``--rate`` over many shared
prefixes with a fresh question each (so pick mode's index keeps learning and evicting),
samples the router's RSS every ``sample_s`` seconds, and after the load stops waits for the
router's open ext_proc streams (``prefix_router_streams_active``) to return to zero. The
verdict: RSS after warm-up (the first fifth of the run) stays within 10 % of its value at
the end of warm-up, and no stream is left open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.process import event_loop
from routerlab.bench import arms as arms_mod
from routerlab.bench import drill, loadgen
from routerlab.bench.backends import SimBackend
from routerlab.bench.scenarios import FleetSpec
from routerlab.bench.trace import Trace
from routerlab.harness.proc_cpu import process_rss_mb
from routerlab.harness.procs import wait_until
from routerlab.realvllm.promtext import fetch_metrics

STREAMS_METRIC = "prefix_router_streams_active"
INDEX_METRIC = "prefix_router_index_bytes"  # pick mode's learned index (its estimate), sampled with RSS
FLAT_WITHIN = 0.10
WARMUP_SHARE = 0.2


@dataclass
class Config(drill.Common):
    arms: Sequence[str] = ("prefix-bounded", "prefix-pick")
    duration_s: float = 600.0
    rate: float = 8.0
    sample_s: float = 30.0
    prefixes: int = 200


QUICK = dict(duration_s=8.0, rate=10.0, sample_s=1.0, replicas=2, prefixes=20, time_scale=20.0)
FLAGS = ("arms", "duration_s", "rate", "replicas", "time_scale")
PARAMS = {"sample_s": float, "prefixes": int}


def router_metric(metrics_port: int, name: str) -> float | None:
    """The first sample called ``name`` on the router's /metrics, or None when it has none."""
    return next((s.value for s in fetch_metrics(f"http://127.0.0.1:{metrics_port}") if s.name == name), None)


def streams_active(metrics_port: int) -> float:
    value = router_metric(metrics_port, STREAMS_METRIC)
    if value is None:
        raise ValueError(f"{STREAMS_METRIC} missing from the router's /metrics")
    return value


async def _sample(pids: dict[str, int], index_port: int | None, t0: float, every: float,
                  series: dict[str, list[list[float]]]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        t = round(time.monotonic() - t0, 1)
        for name, pid in pids.items():
            rss = process_rss_mb(pid)
            if rss is not None:
                series.setdefault(name, []).append([t, round(rss, 2)])
        if index_port is not None:  # pick mode
            index = await loop.run_in_executor(None, router_metric, index_port, INDEX_METRIC)
            if index is not None:
                series.setdefault("index_mb", []).append([t, round(index / 2**20, 2)])
        await asyncio.sleep(every)


async def _load(running: arms_mod.RunningArm, cfg: Config, sessions: Sequence[Any],
                series: dict[str, list[list[float]]]) -> loadgen.LoadResult:
    t0 = time.monotonic()
    pids = {k: v for k, v in running.pids.items() if k.startswith(("prefix_router", "envoy"))}
    index_port = running.metrics_ports[0] if running.arm.pick else None
    sampler = asyncio.create_task(_sample(pids, index_port, t0, cfg.sample_s, series))
    try:
        return await loadgen.run_load(running.url, sessions, mode="open", rate=cfg.rate,
                                      duration_s=cfg.duration_s, grace_s=30.0, seed=cfg.seed,
                                      on_done=cfg.progress.advance)
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)


def flatness(points: Sequence[Sequence[float]], duration_s: float) -> dict[str, float | None]:
    """RSS at the end of warm-up, the highest after it, and their ratio minus one."""
    warm = [rss for t, rss in points if t <= duration_s * WARMUP_SHARE]
    later = [rss for t, rss in points if t > duration_s * WARMUP_SHARE]
    if not warm or not later:
        return {"warm_rss_mb": None, "max_rss_after_warmup_mb": None, "growth_after_warmup": None}
    return {"warm_rss_mb": warm[-1], "max_rss_after_warmup_mb": max(later),
            "growth_after_warmup": round(max(later) / warm[-1] - 1, 4)}


def run_arm(name: str, cfg: Config, trace: Trace, spec: FleetSpec) -> dict[str, Any]:
    backend = SimBackend(spec)
    series: dict[str, list[list[float]]] = {}
    try:
        backend.start()
        with arms_mod.RunningArm(arms_mod.get(name), backend.urls, router_metrics=True) as running:
            cfg.progress.start(f"soak {name}", int(cfg.rate * cfg.duration_s))
            result = event_loop.run(_load(running, cfg, trace.sessions, series))
            stopped = time.monotonic()
            port = running.metrics_ports[0]
            try:
                wait_until(lambda: streams_active(port) == 0, 30, "the router's open streams to close", 0.1)
            except TimeoutError:
                pass
            drained_s = round(time.monotonic() - stopped, 2)
            left_open = streams_active(port)
    finally:
        backend.stop()
    router = series.get("prefix_router", [])
    row: dict[str, Any] = {
        "arm": name, "config": arms_mod.get(name).base,
        "requests": len(result.results), "failures": sum(not r.ok for r in result.results),
        "rss_mb": series, **flatness(router, cfg.duration_s),
        "streams_open_after_load": left_open, "streams_closed_within_s": drained_s,
    }
    row["flat"] = row["growth_after_warmup"] is not None and row["growth_after_warmup"] <= FLAT_WITHIN
    cfg.progress.finish(f"soak {name}: {row['requests']} requests, {row['failures']} failed, router RSS "
                        f"{row['warm_rss_mb']} -> max {row['max_rss_after_warmup_mb']} MiB after warm-up, "
                        f"{left_open:.0f} streams open after the load")
    return row


def run(cfg: Config) -> dict[str, Any]:
    report: dict[str, Any] = {
        "scenario": "soak",
        "params": drill.params(cfg),
        "arms": [],
    }
    trace, spec = drill.shared_prefix_load(cfg, int(cfg.rate * cfg.duration_s * 1.2) + 10, prefixes=cfg.prefixes)
    return drill.collect(report, "arms", (run_arm(name, cfg, trace, spec) for name in cfg.arms), cfg, write)


def markdown(report: dict[str, Any]) -> str:
    lines = ["| arm | requests | failures | router RSS at warm-up MiB | max after MiB | growth | flat (<= 10 %) | "
             "streams open after load |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    for a in report["arms"]:
        growth = "-" if a["growth_after_warmup"] is None else f"{a['growth_after_warmup']:+.1%}"
        lines.append(f"| {a['arm']} | {a['requests']} | {a['failures']} | {a['warm_rss_mb']} | "
                     f"{a['max_rss_after_warmup_mb']} | {growth} | {'yes' if a['flat'] else 'no'} | "
                     f"{a['streams_open_after_load']:.0f} |")
    series = ["", "Router RSS (MiB) every sample (pick mode: and its index's estimated size):", ""]
    for a in report["arms"]:
        for name, label in (("prefix_router", "RSS"), ("index_mb", "index")):
            points = ", ".join(f"{t:.0f}s {mb:.1f}" for t, mb in a["rss_mb"].get(name, []))
            if points:
                series.append(f"- {a['arm']} {label}: {points}")
    return "\n".join(lines + series)


def write(report: dict[str, Any], out: Path) -> None:
    from routerlab.bench import plots

    p = report["params"]
    drill.write(report, out, f"Soak: {p['duration_s']:.0f} s at {p['rate']} requests/s per arm, {p['replicas']} "
                f"simulated replicas", markdown(report))
    plots.soak_rss(report, out / "rss.png")
