"""One ingest run: per replica count, a fresh router; per step of offered ingest rate, requests at
a fixed rate and then closed loop while the driver publishes, and what the router applied.

A step keeps up when, once the driver stops, the router has applied every batch sent within
``drain_s`` (so the backlog was bounded), no gap or view reset happened, and the blocks it
applied while the step ran are at least 97 % of those sent (the rest being the backlog at the
step's end, drained after). Steps go up until one does not keep up (``all_steps``: run all).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench.ingest import client as load
from routerlab.bench.ingest.procs import DriverProc, start_replicas, start_router
from routerlab.bench.ingest.workload import BLOCK_SIZE
from routerlab.bench.overhead.events import COVERED, origins
from routerlab.harness.proc_cpu import machine_busy_s, process_cpu_s, process_rss_mb
from routerlab.harness.procs import wait_until
from routerlab.realvllm.promtext import Sample, fetch_metrics, metric_sum

KEPT_UP_SHARE: Final = 0.97
COVER_TIMEOUT_S: Final = 60.0
SAMPLE_S: Final = 0.5
METRICS_TIMEOUT_S: Final = 30.0
COUNTERS: Final = {"blocks": "prefix_router_kv_blocks_total", "batches": "prefix_router_kv_batches_total",
                   "gaps": "prefix_router_kv_gaps_total", "resets": "prefix_router_kv_view_resets_total",
                   "bad_frames": "prefix_router_kv_bad_frames_total", "apply_s": "prefix_router_kv_apply_seconds_total",
                   "index_blocks": "prefix_router_kv_index_blocks"}


@dataclass(frozen=True)
class Config:
    replicas: tuple[int, ...] = (8, 64)
    rates: tuple[int, ...] = (0, 25_000, 50_000, 100_000, 200_000, 400_000, 800_000)  # blocks/s offered
    phase_s: float = 10.0  # each of the two request phases of a step
    request_rate: float = 200.0  # fixed-rate phase, requests/s
    concurrency: int = 16  # closed-loop phase
    capacity: int = 4096  # tail blocks each replica holds (plus its hot prefixes)
    step_blocks: int = 32  # mean blocks stored per engine step (as many evicted)
    settle_s: float = 1.0  # after a rate change, before measuring
    drain_s: float = 15.0  # after a step, for the router to apply the rest
    all_steps: bool = False
    seed: int = 0


@dataclass
class Snapshot:
    t: float
    router: dict[str, float]
    driver: dict[str, Any]
    router_cpu_s: float
    machine: tuple[float, float]


@dataclass
class Phase:
    """One request phase of a step: the requests' figures and, over the same window, the ingest's
    (blocks/s applied, the router's CPU and the ingest path's share of it, in % of one core)."""

    requests: dict[str, Any] = field(default_factory=dict)
    applied: float = 0.0
    router_cpu_pct: float = 0.0
    apply_pct: float = 0.0
    lag_max_ms: float | None = None  # None at rate 0: the gauge then holds the last batch's, not a live lag


@dataclass
class Step:
    """One offered rate's figures (rates in blocks/s, CPU in % of one core)."""

    replicas: int
    offered: int
    sent: float = 0.0
    applied: float = 0.0
    driver_cpu_pct: float = 0.0
    machine_busy_pct: float = 0.0
    backlog_batches: int = 0  # sent but not applied when the step's phases ended
    drain_s: float | None = None  # None: not drained within the bound
    gaps: int = 0
    resets: int = 0
    bad_frames: int = 0
    sent_blocks: int = 0  # over the step, drain included
    applied_blocks: int = 0
    index_blocks: float = 0.0  # after the drain: ``held`` when every batch was applied as sent
    held: int = 0  # blocks the replicas hold after the warm-up and after every step of their cycles
    router_rss_mb: float = 0.0
    fixed: Phase = field(default_factory=Phase)
    closed: Phase = field(default_factory=Phase)
    kept_up: bool = False


def router_counters(samples: list[Sample]) -> dict[str, float]:
    return {k: metric_sum(samples, name) for k, name in COUNTERS.items()}


def lag_max(samples: list[Sample]) -> float:
    return max((s.value for s in samples if s.name == "prefix_router_kv_lag_seconds"), default=0.0)


def phase(a: Snapshot, b: Snapshot, requests: dict[str, Any], lag_s: float | None) -> Phase:
    wall = b.t - a.t
    return Phase(requests, (b.router["blocks"] - a.router["blocks"]) / wall,
                 100 * (b.router_cpu_s - a.router_cpu_s) / wall,
                 100 * (b.router["apply_s"] - a.router["apply_s"]) / wall, None if lag_s is None else lag_s * 1000)


class Sampler:
    """Polls the router's lag while a phase runs and prints a progress line every few seconds."""

    def __init__(self, metrics_url: str, note: Callable[[str], None], label: str) -> None:
        self.url, self.note, self.label = metrics_url, note, label
        self.lag = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()
        self._last = self._t0
        self._blocks0: float | None = None

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                samples = fetch_metrics(self.url)
            except OSError:
                continue
            self.lag = max(self.lag, lag_max(samples))
            blocks = metric_sum(samples, COUNTERS["blocks"])
            if self._blocks0 is None:
                self._blocks0 = blocks
            now = time.monotonic()
            if now - self._last >= 3.0:
                self._last = now
                rate = (blocks - self._blocks0) / (now - self._t0)
                self.note(f"{self.label}: {now - self._t0:.0f}s, applied {rate:,.0f} blocks/s, "
                          f"lag max {self.lag * 1000:.0f} ms")


class Harness:
    """A started router over n replicas whose events the driver publishes."""

    def __init__(self, cfg: Config, n: int, workdir: Path, note: Callable[[str], None]) -> None:
        self.cfg, self.n, self.note = cfg, n, note
        self.bodies = load.Bodies(seed=cfg.seed)
        self._stack = ExitStack()
        try:
            self._start(workdir)
        except BaseException:
            self._stack.close()
            raise

    def _start(self, workdir: Path) -> None:
        tok = ModelTokenizer(TINY_BYTELEVEL)
        hot = load.hot_prefixes(self.bodies, lambda d: tok.tokens_for(d, "chat"), BLOCK_SIZE)
        hot_file = workdir / "hot-prefixes.json"
        hot_file.write_text(json.dumps(hot))
        base, replicas = start_replicas(self.n)
        self._stack.callback(replicas.stop)
        self.note(f"{self.n} replicas up; building their event cycles")
        self.driver = DriverProc(base, self.n, hot_file, self.cfg.capacity, self.cfg.step_blocks, self.cfg.seed,
                                 workdir / f"driver-{self.n}.log")
        self._stack.callback(self.driver.stop)
        self.held = int(sum(self.driver.ready["held"]))
        self.router, port, metrics_port = start_router(base, self.n, TINY_BYTELEVEL)
        self._stack.callback(self.router.stop)
        self.target = f"127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}"
        addresses = [f"127.0.0.1:{base + i}" for i in range(self.n)]

        def covered() -> bool:
            samples = fetch_metrics(self.metrics_url)
            seen = origins(samples)
            return (all(seen.get(a) in COVERED for a in addresses)
                    and metric_sum(samples, COUNTERS["index_blocks"]) == self.held
                    and self.driver.stats()["subscribed"] >= 1)

        wait_until(covered, COVER_TIMEOUT_S,
                   f"the router to replay all {self.n} replicas' warm-up ({self.held} blocks)", interval=0.2)
        self.note(f"router covers {self.n} replicas from their events: {self.held:,} blocks held")
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # grpc.aio binds its channel to the loop it is made in

        async def connect() -> load.Client:
            return load.Client(self.target, self.bodies)

        self.client = self.loop.run_until_complete(connect())

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.client.close())
            self.loop.close()
        except AttributeError:
            pass
        self._stack.close()

    def snapshot(self) -> Snapshot:
        # first: the backlog read after it is an upper bound; a router far past its capacity answers slowly
        router = router_counters(fetch_metrics(self.metrics_url, timeout=METRICS_TIMEOUT_S))
        driver = self.driver.stats()
        return Snapshot(time.monotonic(), router, driver, process_cpu_s(self.router.pid) or 0.0, machine_busy_s())

    def drain(self, timeout: float) -> float | None:
        """Seconds until the router applied every batch sent (None: not within ``timeout``)."""
        t0 = time.monotonic()
        sent = self.driver.stats()["sent_batches"]
        try:
            wait_until(lambda: router_counters(fetch_metrics(self.metrics_url, timeout=METRICS_TIMEOUT_S))["batches"]
                       >= sent + self.n,
                       timeout, "the router to apply every batch sent", interval=0.1)
        except TimeoutError:
            return None
        return time.monotonic() - t0

    def step(self, rate: int) -> Step:
        cfg, out = self.cfg, Step(self.n, rate, held=self.held)
        label = f"{self.n} replicas, {rate:,} blocks/s"
        start = self.snapshot()
        self.driver.rate(rate)
        time.sleep(cfg.settle_s)  # measure the steady state, not the rate change
        a = self.snapshot()
        with Sampler(self.metrics_url, self.note, label) as sampler:
            self.note(f"{label}: {cfg.request_rate:g} req/s fixed for {cfg.phase_s:g}s")
            fixed = self.loop.run_until_complete(load.fixed_rate(self.client, cfg.request_rate, cfg.phase_s))
        m = self.snapshot()
        out.fixed = phase(a, m, fixed.summary(), sampler.lag if rate else None)
        with Sampler(self.metrics_url, self.note, label) as sampler:
            self.note(f"{label}: closed loop, {cfg.concurrency} in flight, for {cfg.phase_s:g}s")
            closed = self.loop.run_until_complete(load.closed_loop(self.client, cfg.concurrency, cfg.phase_s))
        b = self.snapshot()
        out.closed = phase(m, b, closed.summary(), sampler.lag if rate else None)
        self.driver.rate(0)
        out.drain_s = self.drain(cfg.drain_s)
        c = self.snapshot()
        wall = b.t - a.t
        out.sent = (b.driver["sent_blocks"] - a.driver["sent_blocks"]) / wall
        out.applied = (b.router["blocks"] - a.router["blocks"]) / wall
        out.driver_cpu_pct = 100 * (b.driver["cpu_s"] - a.driver["cpu_s"]) / (b.driver["t"] - a.driver["t"])
        busy, total = b.machine[0] - a.machine[0], b.machine[1] - a.machine[1]
        out.machine_busy_pct = 100 * busy / total if total else math.nan
        out.backlog_batches = int(b.driver["sent_batches"] - (b.router["batches"] - self.n))
        out.gaps = int(c.router["gaps"] - start.router["gaps"])
        out.resets = int(c.router["resets"] - start.router["resets"])
        out.bad_frames = int(c.router["bad_frames"] - start.router["bad_frames"])
        out.sent_blocks = int(c.driver["sent_blocks"] - start.driver["sent_blocks"])
        out.applied_blocks = int(c.router["blocks"] - start.router["blocks"])
        out.index_blocks = c.router["index_blocks"]
        out.router_rss_mb = process_rss_mb(self.router.pid) or 0.0
        out.kept_up = (out.drain_s is not None and out.gaps == 0 and out.resets == 0 and out.bad_frames == 0
                       and out.applied >= KEPT_UP_SHARE * out.sent)
        f, c_ = out.fixed, out.closed
        self.note(f"{label}: sent {out.sent:,.0f}, applied {out.applied:,.0f} blocks/s, "
                  f"{'kept up' if out.kept_up else 'DID NOT KEEP UP'}; fixed rate: router CPU {f.router_cpu_pct:.0f} % "
                  f"(ingest {f.apply_pct:.0f} %), p50/p99 {f.requests['p50_ms']}/{f.requests['p99_ms']} ms; "
                  f"closed loop: "
                  f"{c_.requests['rps']} req/s, router CPU {c_.router_cpu_pct:.0f} %")
        return out


def run(cfg: Config, workdir: Path, note: Callable[[str], None],
        on_step: Callable[[list[dict[str, Any]]], None] = lambda _: None) -> list[dict[str, Any]]:
    """Every replica count's steps, as dicts (``Step`` fields); ``on_step`` gets the list after each
    step (the report is written as the run goes, so a run stopped midway keeps what it measured).
    A step whose router stops answering its metrics (starved past its capacity) ends that replica
    count's steps, noted."""
    steps: list[dict[str, Any]] = []
    for n in cfg.replicas:
        harness = Harness(cfg, n, workdir, note)
        try:
            for rate in cfg.rates:
                try:
                    step = harness.step(rate)
                except (OSError, TimeoutError) as exc:
                    note(f"{n} replicas, {rate:,} blocks/s: the router did not answer ({exc}); stopping here")
                    break
                steps.append(asdict(step))
                on_step(steps)
                if not step.kept_up and not cfg.all_steps:
                    note(f"{n} replicas: stopped stepping up at {rate:,} blocks/s")
                    break
        finally:
            harness.close()
    return steps


def rates_arg(text: str) -> tuple[int, ...]:
    return tuple(int(float(v)) for v in text.split(",") if v.strip())


def ints_arg(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def counts(steps: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """Blocks sent and applied over all steps (the end-to-end test's check)."""
    return sum(s["sent_blocks"] for s in steps), sum(s["applied_blocks"] for s in steps)
