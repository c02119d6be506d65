"""Measure how many requests/s one simulator process sustains (docs/simulator.md).

Starts ``prefix-router sim`` in a subprocess (as a benchmark would), then runs a bounded
aiohttp client loop: ``--concurrency`` workers send short /v1/completions requests
round robin over the replicas for at most ``--duration`` seconds / ``--max-requests``.

    python -m routerlab.sim.loadcheck --replicas 8 --concurrency 32 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import orjson

from routerlab.harness.proc_cpu import process_cpu_s


async def _load(urls: list[str], model: str, concurrency: int, duration: float,
                max_requests: int, max_tokens: int, stream: bool) -> dict[str, float]:
    counter = itertools.count()
    done = errors = 0
    latencies: list[float] = []
    deadline = time.monotonic() + duration
    conn = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker(w: int) -> None:
            nonlocal done, errors
            while time.monotonic() < deadline:
                i = next(counter)
                if i >= max_requests:
                    return
                body = {"model": model, "max_tokens": max_tokens, "stream": stream,
                        "prompt": f"shared system prompt for tenant {i % 50}. " * 8 + f"question {i}"}
                t0 = time.monotonic()
                try:
                    async with session.post(urls[i % len(urls)] + "/v1/completions",
                                            data=orjson.dumps(body),
                                            headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    done += 1
                    latencies.append(time.monotonic() - t0)
                else:
                    errors += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.monotonic() - t0
        e2e_sum = e2e_count = snapped = 0.0
        for url in urls:  # the replicas' own view, in model seconds
            async with session.get(url + "/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith("vllm:e2e_request_latency_seconds_sum"):
                        e2e_sum += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:e2e_request_latency_seconds_count"):
                        e2e_count += float(line.rsplit(" ", 1)[1])
            async with session.get(url + "/sim/state") as r:
                snapped += (await r.json())["snapped_model_s"]
    latencies.sort()
    p50 = latencies[len(latencies) // 2] if latencies else float("nan")
    p99 = latencies[int(len(latencies) * 0.99)] if latencies else float("nan")
    return {"requests": done, "errors": errors, "seconds": elapsed, "rps": done / elapsed,
            "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3,
            "model_e2e_mean_ms": 1e3 * e2e_sum / e2e_count if e2e_count else float("nan"),
            "lag_model_s_per_replica": snapped / max(1, len(urls))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds (hard cap)")
    ap.add_argument("--max-requests", type=int, default=200_000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--time-scale", type=float, default=100.0)
    args = ap.parse_args(argv)
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc", "sim", "--replicas", str(args.replicas), "--base-port", "0",
         "--profile", args.profile, "--time-scale", str(args.time_scale)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    urls: list[str] = []
    model = ""
    killer = threading.Timer(60, proc.kill)  # bounds the wait for "fleet ready"
    killer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("sim: profile="):
                model = line.split("model=")[1].split()[0]
            if line.startswith("replica "):
                urls.append(line.rsplit(" ", 1)[1].strip())
            if line.startswith("fleet ready"):
                break
        killer.cancel()
        if not urls or not model:
            print("loadcheck: the simulator did not become ready", file=sys.stderr)
            return 1
        cpu0 = process_cpu_s(proc.pid) or 0.0
        result = asyncio.run(_load(urls, model, args.concurrency, args.duration,
                                   args.max_requests, args.max_tokens, args.stream))
        result["sim_cpu_percent"] = 100 * ((process_cpu_s(proc.pid) or 0.0) - cpu0) / result["seconds"]
    finally:
        killer.cancel()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
