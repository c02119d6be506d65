"""Does vLLM's per-request prefill time under-state a replica's prefill rate when prefills share steps?
One simulated replica (70B profile); closed loops of 20 s at 1, 2 and 4 in flight of ~9,500-token
prompts (3,500 fresh words), 16 output tokens; the rate the router measures (prefill KV tokens sum over
prefill time sum) against the replica's prefill tokens per second of wall time.

    prefix-router sim --profile llama-3.1-70b-h100-tp8 --base-port 8190 --max-num-seqs 64 &
    .venv/bin/python docs/results/overload/tenant-headroom/rate_probe.py http://127.0.0.1:8190
"""
import asyncio, re, sys, time, random
import aiohttp

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8190"

def metric(text, name):
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0

async def scrape(s):
    async with s.get(URL + "/metrics") as r:
        t = await r.text()
    return (metric(t, "vllm:request_prefill_kv_computed_tokens_sum"), metric(t, "vllm:request_prefill_time_seconds_sum"))

async def one(s, rng, model):
    words = " ".join(f"w{rng.randrange(10**9)}" for _ in range(3500))
    body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 16, "stream": False}
    async with s.post(URL + "/v1/chat/completions", json=body) as r:
        d = await r.json()
    return d["usage"]["prompt_tokens"]

async def loop(s, n, seconds, rng, model):
    end = time.monotonic() + seconds
    async def worker():
        while time.monotonic() < end:
            await one(s, rng, model)
    await asyncio.gather(*(worker() for _ in range(n)))

async def main():
    rng = random.Random(0)
    async with aiohttp.ClientSession() as s:
        async with s.get(URL + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        print("prompt tokens of one request:", await one(s, rng, model))
        for n in (1, 2, 4):
            k0, t0 = await scrape(s); w0 = time.monotonic()
            await loop(s, n, 20, rng, model)
            k1, t1 = await scrape(s); w1 = time.monotonic()
            print(f"{n} in flight: measured rate {(k1 - k0) / (t1 - t0):,.0f} tok/s; "
                  f"prefill tokens per wall second {(k1 - k0) / (w1 - w0):,.0f}")

asyncio.run(main())
