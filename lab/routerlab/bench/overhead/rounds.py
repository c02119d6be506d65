"""The measurement: a warm-up per (config, arm), then every phase of the schedule, each one
wrk run between readings of the counters and of every process's CPU."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from routerlab.bench.overhead.figures import phase_figures
from routerlab.bench.overhead.plan import Config, connection_levels
from routerlab.bench.overhead.rig import Rig, Stack
from routerlab.bench.overhead.wrk import run_wrk, wrk_argv
from routerlab.harness.proc_cpu import CpuMeter


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def settled(read: Callable[[], dict[str, float]], timeout: float = 10.0, interval: float = 0.1) -> dict[str, float]:
    """``read()`` once two readings ``interval`` apart agree (or at ``timeout``).

    When wrk stops, requests it already sent are still inside Envoy, and their calls to the
    floor or the router land a moment later: read too soon, they count in the next phase (a
    router phase once showed the floor's last 3 Checks)."""
    deadline = time.monotonic() + timeout
    last = read()
    while time.monotonic() < deadline:
        time.sleep(interval)
        now = read()
        if now == last:
            return now
        last = now
    return last


def measure(rig: Rig, stack: Stack, argv: list[str], seconds: int) -> dict[str, Any]:
    """One phase: counters (once settled) and CPU before, wrk, CPU and counters (settled) after."""
    before = settled(lambda: rig.counts(stack))
    backends = rig.backend_pids()
    meter = CpuMeter({**stack.pids(), **backends})
    t0 = time.monotonic()
    wrk = run_wrk(argv, seconds)
    cpu_raw = meter.stop()
    wall = time.monotonic() - t0
    counts = _delta(settled(lambda: rig.counts(stack)), before)
    busy = cpu_raw.pop("machine_busy_fraction", None)
    backend_cpu = [cpu_raw.get(name, 0.0) for name in backends]
    ext_proc = sum(v for k, v in cpu_raw.items() if k.startswith("ext_proc-"))
    cpu = {"envoy": cpu_raw.get("envoy", 0.0), **({"ext_proc": ext_proc} if stack.servers else {}),
           "backends": sum(backend_cpu), "generator": wrk["cpu_s"]}
    served = int(counts.pop("served"))
    return {
        "requests": wrk["requests"], "served": served, "wall_s": round(wall, 3),
        "errors": wrk["errors"], "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        **phase_figures(wrk, cpu, wall, served, os.cpu_count() or 1, busy),
        "backend_max_share": round(max(backend_cpu, default=0.0) / wall, 3),
        "counts": counts,
    }


def warm_up(rig: Rig, cfg: Config, binary: str, scripts: Mapping[int, Path]) -> None:
    if not cfg.warmup_s:
        return
    conns = max(connection_levels(cfg))
    for (config, arm), stack in rig.stacks.items():
        cfg.progress.note(f"warm-up {config} {arm}: {cfg.warmup_s} s at {conns} connections")
        run_wrk(wrk_argv(binary, stack.url, scripts[max(cfg.sizes)], conns, cfg.threads, cfg.warmup_s,
                         f"w{cfg.seed}{config}{arm}"), cfg.warmup_s)


def phases(rig: Rig, cfg: Config, binary: str, scripts: Mapping[int, Path],
            plan: Sequence[tuple[int, str, int, int, str]]) -> Iterator[dict[str, Any]]:
    prog = cfg.progress  # a line per phase: how far, how long left, what it measured
    t0 = time.monotonic()
    for i, (r, config, size, conns, arm) in enumerate(plan):
        stack = rig.stacks[(config, arm)]
        run_id = f"s{cfg.seed}r{r}p{i}"
        argv = wrk_argv(binary, stack.url, scripts[size], conns, cfg.threads, cfg.phase_s, run_id)
        phase = {"round": r, "config": config, "size_kb": size, "arm": arm, "connections": conns,
                 **measure(rig, stack, argv, cfg.phase_s)}
        errors = sum(phase["errors"].values())
        done = i + 1
        eta = (time.monotonic() - t0) / done * (len(plan) - done)
        cpu = phase["cpu_us_per_request"]
        prog.note(f"[{done}/{len(plan)}, {eta:.0f} s left] round {r + 1} {config} {size} KB c={conns} {arm}: "
                  f"{phase['rps']:.0f} req/s, p50 {phase['latency_ms']['p50']:.2f} ms, "
                  f"p99 {phase['latency_ms']['p99']:.2f} ms, CPU us/req Envoy {cpu['envoy']}"
                  + (f" ext_proc {cpu['ext_proc']}" if "ext_proc" in cpu else "")
                  + f", wrk {phase['cpu_share']['generator']:.0%} of a core"
                  + (f", {errors} errors" if errors else ""))
        yield phase
    prog.note(f"overhead: {len(plan)} phases in {time.monotonic() - t0:.0f} s")
