"""Async load generator: closed loop (fixed sessions in flight), open loop (Poisson), or scheduled (each
session at its own ``start_s``: rates that change over the run, per tenant).

One aiohttp session with a connection pool sized to the load, so the client stays light.
TTFT is the arrival of the first SSE chunk that carries content (not the role chunk).
Every run is bounded by the trace length and by ``duration_s``; requests still running
at the deadline get ``grace_s`` more and are then cancelled (counted as timeouts).

The client watches itself: CPU seconds (``time.process_time``), event-loop lag (how
late a 10 ms timer fires) and, in open loop, how far sends fall behind the schedule. A
client busy for most of a core, or lagging, is the bottleneck and says so (``saturated``).
"""

from __future__ import annotations

import asyncio
import random
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np
import orjson

from routerlab.bench.trace import Request, Session
from routerlab.harness.arm import ROUTED_HEADER
from routerlab.sim.api import ARRIVED_HEADER

MODES = ("closed", "open", "scheduled")
OPEN_CONNECTIONS = 4096  # connections an open or scheduled load may hold at once
SATURATED_CPU = 0.85  # fraction of one core
SATURATED_LAG_MS = 50.0


@dataclass(slots=True)
class Result:
    """One request as the client saw it (times in seconds from the run's start)."""

    rid: int
    group: str
    start: float
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    arm: str = ""  # the response's x-ab-arm (A/B configs), "" elsewhere
    routed: bool = False  # the router chose its replica (ROUTED_HEADER): not sent on unkeyed by Envoy
    # send to the simulated replica's server having the whole request (its x-sim-arrived, the same
    # machine's monotonic clock): the way through Envoy and the router; None from other backends
    to_replica: float | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class ClientStats:
    """How hard the load generator itself worked (to tell its limits from the system's)."""

    wall_s: float
    cpu_s: float
    max_rss_mb: float
    loop_lag_p99_ms: float
    schedule_lag_p99_ms: float = 0.0

    @property
    def cpu_fraction(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0

    @property
    def saturated(self) -> bool:
        """Busy for most of a core, or late: its own timers or (open loop) its send schedule."""
        return (self.cpu_fraction > SATURATED_CPU
                or max(self.loop_lag_p99_ms, self.schedule_lag_p99_ms) > SATURATED_LAG_MS)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cpu_fraction": round(self.cpu_fraction, 3), "saturated": self.saturated}


@dataclass
class LoadResult:
    results: list[Result]
    client: ClientStats
    started: float  # time.monotonic() at start
    duration_s: float  # first send to last completion: the throughput window
    timed_out: bool = False
    unsent: int = 0  # never sent: the deadline came first
    cancelled: int = 0  # sent, still running at deadline + grace
    extras: dict[str, Any] = field(default_factory=dict)


def _content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or ()
    if not choices:
        return ""
    first = choices[0]
    delta = first.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return first.get("text") or ""


async def _send(http: aiohttp.ClientSession, base_url: str, req: Request, t0: float,
                timeout_s: float) -> Result:
    start = time.monotonic()
    res = Result(rid=req.rid, group=req.group, start=start - t0)
    headers = {"content-type": "application/json", **dict(req.headers)}
    try:
        async with http.post(base_url + req.path, data=req.body, headers=headers,
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            res.status = resp.status
            res.replica = resp.headers.get("x-upstream-host") or resp.headers.get("x-sim-replica") or ""
            res.arm = resp.headers.get("x-ab-arm", "")
            res.routed = bool(resp.headers.get(ROUTED_HEADER))
            arrived = resp.headers.get(ARRIVED_HEADER)
            if arrived:
                res.to_replica = float(arrived) - start
            if resp.status != 200:
                res.error = f"http {resp.status}"
                await resp.read()
                return res
            chunks = 0
            finished = False
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    finished = True
                    break
                chunk = orjson.loads(data)
                if _content(chunk):
                    chunks += 1
                    if res.ttft is None:
                        res.ttft = time.monotonic() - start
                usage = chunk.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens") or 0
                    res.prompt_tokens = usage.get("prompt_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
            res.e2e = time.monotonic() - start
            res.output_tokens = res.output_tokens or chunks
            if not finished:  # the stream ended without [DONE]: a cut-off response
                res.error = "truncated"
            elif res.ttft is None and res.output_tokens:
                res.error = "no content"
            res.ok = not res.error
    except TimeoutError:
        res.error = "timeout"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        res.error = type(exc).__name__
    return res


async def _lag_monitor(samples: list[float], stop: asyncio.Event, every: float = 0.01) -> None:
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(every)
        samples.append(max(0.0, time.monotonic() - t - every))


def _p99(values: Sequence[float]) -> float:
    """Same definition as the report's percentiles (numpy's linear interpolation)."""
    return float(np.percentile(values, 99)) if values else 0.0


async def run_load(
    base_url: str,
    sessions: Sequence[Session],
    *,
    mode: str = "closed",
    concurrency: int = 16,
    rate: float = 10.0,
    duration_s: float = 120.0,
    request_timeout_s: float = 120.0,
    grace_s: float = 30.0,
    seed: int = 0,
    on_done: Callable[[Result], None] | None = None,
) -> LoadResult:
    """Send ``sessions`` to ``base_url``; bounded by their count and by ``duration_s``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    results: list[Result] = []
    lag: list[float] = []
    schedule_lag: list[float] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    deadline = t0 + duration_s
    cpu0 = time.process_time()
    # open and scheduled loads send on time whatever is in flight: a pool that ran out of connections
    # would queue requests in the client (behind requests a router holds), which real clients do not
    pool = concurrency if mode == "closed" else max(concurrency, OPEN_CONNECTIONS)
    connector = aiohttp.TCPConnector(limit=pool, force_close=False, ttl_dns_cache=None)
    sent = 0

    async def run_session(session: Session) -> None:
        nonlocal sent
        for req in session.requests:
            if time.monotonic() >= deadline:
                return
            sent += 1
            res = await _send(http, base_url, req, t0, request_timeout_s)
            results.append(res)
            if on_done:
                on_done(res)

    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as http:
        monitor = asyncio.create_task(_lag_monitor(lag, stop))
        if mode == "closed":
            queue = list(reversed(sessions))

            async def worker() -> None:
                while queue and time.monotonic() < deadline:
                    await run_session(queue.pop())

            tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(sessions)))]
        else:
            rng = random.Random(seed)
            tasks = []
            due = t0
            for session in sessions:
                due = t0 + session.start_s if mode == "scheduled" else due + rng.expovariate(rate)
                if due >= deadline:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                schedule_lag.append(max(0.0, time.monotonic() - due))
                tasks.append(asyncio.create_task(run_session(session)))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()) + grace_s) \
            if tasks else (set(), set())
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        stop.set()
        await monitor
    wall = time.monotonic() - t0
    total = sum(len(s.requests) for s in sessions)
    first = min((r.start for r in results), default=0.0)
    end = max((r.start + r.e2e for r in results if r.e2e is not None), default=0.0)
    client = ClientStats(
        wall_s=wall, cpu_s=time.process_time() - cpu0,
        max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        loop_lag_p99_ms=_p99(lag) * 1000, schedule_lag_p99_ms=_p99(schedule_lag) * 1000,
    )
    return LoadResult(results=sorted(results, key=lambda r: r.rid), client=client, started=t0,
                      duration_s=(end - first) if end > first else wall,
                      timed_out=bool(pending) or sent < total, unsent=total - sent, cancelled=sent - len(results))
