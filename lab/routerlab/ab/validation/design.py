"""One design on a fresh simulated fleet: the router and a real Envoy on the design's shipped A/B
config, the trace sent through it (the switchback's driver flipping the share, the pool split's
counters read every slice), then Envoy's access log analysed as ``prefix-router ab analyze`` would
and the responses' usage hit rate per arm."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from extproc.process import event_loop
from routerlab.ab import accesslog, analysis, driver, record, windows
from routerlab.ab.stats import Change, quantile, ratio_change
from routerlab.ab.validation.context import CONFIGS, HIT_SOURCE, METRICS, TRUTH, Context, ValidateConfig, with_sessions
from routerlab.ab.validation.report import fmt_change
from routerlab.bench import arms as arms_mod
from routerlab.bench import loadgen
from routerlab.bench.backends import SimBackend
from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy
from routerlab.harness.procs import Process, free_ports, python_module, wait_until


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
        load_s = cast(float, duration) if design == "switchback" else ctx.load.duration_s  # switchback: one (above)
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
    changes: dict[str, Change | None] = {c.metric: c for c in a.changes}
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
    cfg.progress(f"{design}: " + "; ".join(f"{m} {fmt_change(est[m])}" for m in METRICS)
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
            key: int | str | None = next((w.index for w in (wf.windows if wf else []) if w.measure_start <= t < w.end
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
    stock = [(v[0], v[1]) for v in pairs["stock"].values()]  # (cached, prompt) per cluster
    prefix = [(v[0], v[1]) for v in pairs["prefix"].values()]
    return ratio_change(stock, prefix, metric="KV hit rate (usage)", unit=unit, seed=cfg.seed, draws=cfg.draws)
