"""How long precise mode's short requests wait while long new prompts are tokenised, worker on and off.

``python -m routerlab.bench.stall``: one event loop runs the router's request path as the gRPC
adapter does (``decide``, ``Picker.prepare``'s tokenising ahead, ``pick``, ``release``; no sockets)
for two streams of requests at fixed intervals: short ones (a 32 KB system prompt the tokenizer has
seen, and a new 30-word question) and long ones (a 32 KB prompt nobody has seen, so all of it is
tokenised). Each request's time from its arrival to its pick is recorded, first with every text
tokenised in the pick, on the loop (``--tokenize-inline-chars 0``, the router before the worker),
then with long new text tokenised on the worker thread (``extproc.pick.sources.tokenize_ahead``). Prints
p50 / p99 / max per stream and how many long requests got the events view; the tiny tokenizer, 8
replicas covered by events, half of them holding the system prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from extproc.core.decide import decide
from extproc.core.settings import RouteSettings
from extproc.pick.core import PickCore
from extproc.pick.sources.tokenize_ahead import TokenizeAhead
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from extproc.process import event_loop
from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench.micro.bodies import chat_body, questions
from routerlab.bench.micro.precise import precise_core, precise_of

PICK = RouteSettings(mode="pick")


def _fleet(replicas: int, system: str) -> tuple[PickCore, ModelTokenizer]:
    tokenizer = ModelTokenizer(TINY_BYTELEVEL)
    ids = tokenizer.token_array({"model": "llama", "messages": [{"role": "system", "content": system}]}, "chat")
    return precise_core(tokenizer, replicas, ids.tolist()), tokenizer


def _bodies(n_short: int, n_long: int, size_kb: int, system: str) -> tuple[list[bytes], list[bytes]]:
    long = [chat_body(size_kb * 1024, 1000 + i, marker=f"unseen {i} ") for i in range(n_long)]
    return questions(system, n_short, seed=3), long


async def _run(core: PickCore, ahead: TokenizeAhead | None, short: Sequence[bytes], long: Sequence[bytes],
               short_every: float, long_every: float) -> dict[str, Any]:
    """Both streams at their intervals; each request's seconds from arrival to pick, per stream.

    A feeder thread hands each request to the loop at its time (``time.sleep`` is exact to
    microseconds, the loop's timers to a millisecond), so a loop busy tokenising shows as the
    time the request waits to start."""
    waits: dict[str, list[float]] = {"short": [], "long": []}
    views = {"events": 0, "learned": 0}
    loop = asyncio.get_running_loop()
    schedule = sorted([(i * short_every, "short", b) for i, b in enumerate(short)]
                      + [(i * long_every, "long", b) for i, b in enumerate(long)], key=lambda r: r[0])
    finished = asyncio.Event()
    left = [len(schedule)]
    tasks: set[asyncio.Task[None]] = set()

    async def one(kind: str, body: bytes, arrived: float) -> None:
        decision = decide(body, {}, PICK)
        limit = await ahead.prepare(decision) if ahead is not None else 0
        choice = core.pick(decision, PICK, limit)
        waits[kind].append(time.perf_counter() - arrived)
        if kind == "long":
            view = next(c.view for c in choice.candidates if c.address == choice.address)
            views["events" if view == "events" else "learned"] += 1
        core.release(choice)
        left[0] -= 1
        if not left[0]:
            finished.set()

    def start(kind: str, body: bytes, arrived: float) -> None:
        task = loop.create_task(one(kind, body, arrived))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def feed() -> None:
        origin = time.perf_counter()
        for offset, kind, body in schedule:
            delay = origin + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            loop.call_soon_threadsafe(start, kind, body, time.perf_counter())

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    await asyncio.wait_for(finished.wait(), timeout=max(short_every * len(short), long_every * len(long)) + 60)
    feeder.join()
    return {"waits": waits, "long_views": views}


def _stats(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {"p50": statistics.median(ms), "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "max": ms[-1],
            "n": len(ms)}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    system = json.loads(chat_body(args.size_kb * 1024, 0))["messages"][0]["content"]
    rows = []
    for inline in (0, args.inline_chars):
        core, tokenizer = _fleet(args.replicas, system)
        short, long = _bodies(int(args.seconds / args.short_every), int(args.seconds / args.long_every),
                              args.size_kb, system)
        tokenizer.encode(tokenizer.render_chat(json.loads(short[0])))  # the system prompt: seen before
        ahead = TokenizeAhead(precise_of(core), inline, args.queue_seconds) if inline else None
        started = time.perf_counter()
        try:
            out = event_loop.run(_run(core, ahead, short, long, args.short_every, args.long_every))
        finally:
            if ahead is not None:
                ahead.close()
        rows.append({"tokenize_inline_chars": inline, "wall_s": time.perf_counter() - started,
                     "short_ms": _stats(out["waits"]["short"]), "long_ms": _stats(out["waits"]["long"]),
                     "long_views": out["long_views"]})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m routerlab.bench.stall", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="how long each stream sends")
    parser.add_argument("--short-every", type=float, default=0.004, help="seconds between short requests")
    parser.add_argument("--long-every", type=float, default=0.05, help="seconds between long new requests")
    parser.add_argument("--size-kb", type=int, default=32, help="body size of both kinds")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--inline-chars", type=int, default=2048, help="--tokenize-inline-chars of the second run")
    parser.add_argument("--queue-seconds", type=float, default=0.1, help="--tokenize-queue-seconds")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    rows = measure(args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"arrival to pick, ms: a short request every {args.short_every * 1000:g} ms, a long new one every "
          f"{args.long_every * 1000:g} ms, {args.seconds:g} s, {args.size_kb} KB bodies\n")
    print("| long new text tokenised | short p50 | short p99 | short max | long p50 | long p99 "
          "| long on the events view |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        where = "in the pick, on the loop" if not r["tokenize_inline_chars"] else (
            f"on the worker (> {r['tokenize_inline_chars']} new chars)")
        s, lg, v = r["short_ms"], r["long_ms"], r["long_views"]
        print(f"| {where} | {s['p50']:.2f} | {s['p99']:.2f} | {s['max']:.2f} | {lg['p50']:.2f} | {lg['p99']:.2f} | "
              f"{v['events']} of {v['events'] + v['learned']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
