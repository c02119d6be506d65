"""Does vLLM's per-request prefill time under-state a replica's prefill rate when prefills share steps?
One simulated replica (70B profile); closed loops of 20 s at 1, 2 and 4 in flight of ~9,500-token
prompts (3,500 fresh words), 16 output tokens; the rate the router measures (prefill KV tokens sum over
prefill time sum) against the replica's prefill tokens per second of wall time.

    prefix-router sim --profile llama-3.1-70b-h100-tp8 --base-port 8190 --max-num-seqs 64 &
    .venv/bin/python docs/results/overload/tenant-headroom/rate_probe.py http://127.0.0.1:8190
"""

import asyncio
import random
import re
import sys
import time

import aiohttp

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8190"


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def scrape(s: aiohttp.ClientSession) -> tuple[float, float]:
    """The replica's prefill KV tokens and prefill seconds so far (sums of vLLM's histograms)."""
    async with s.get(URL + "/metrics") as r:
        text = await r.text()
    return (metric(text, "vllm:request_prefill_kv_computed_tokens_sum"),
            metric(text, "vllm:request_prefill_time_seconds_sum"))


async def one(s: aiohttp.ClientSession, rng: random.Random, model: str) -> int:
    words = " ".join(f"w{rng.randrange(10**9)}" for _ in range(3500))
    body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 16, "stream": False}
    async with s.post(URL + "/v1/chat/completions", json=body) as r:
        return (await r.json())["usage"]["prompt_tokens"]


async def closed_loop(s: aiohttp.ClientSession, n: int, seconds: float, rng: random.Random, model: str) -> None:
    end = time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < end:
            await one(s, rng, model)

    await asyncio.gather(*(worker() for _ in range(n)))


async def main() -> None:
    rng = random.Random(0)
    async with aiohttp.ClientSession() as s:
        async with s.get(URL + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        print("prompt tokens of one request:", await one(s, rng, model))
        for n in (1, 2, 4):
            (tokens0, seconds0), wall0 = await scrape(s), time.monotonic()
            await closed_loop(s, n, 20, rng, model)
            (tokens1, seconds1), wall1 = await scrape(s), time.monotonic()
            print(f"{n} in flight: measured rate {(tokens1 - tokens0) / (seconds1 - seconds0):,.0f} tok/s; "
                  f"prefill tokens per wall second {(tokens1 - tokens0) / (wall1 - wall0):,.0f}")


if __name__ == "__main__":
    asyncio.run(main())
