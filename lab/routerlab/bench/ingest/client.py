"""Requests for the router while it ingests: chat bodies of 2-32 KB straight over ext_proc gRPC.

Each request is one ext_proc stream as Envoy opens it with envoy/pick.yaml (the same stream
metadata; request headers, then the whole body buffered; the stream held open until the reply
naming the replica has arrived, then closed as Envoy does when the response ends). Envoy itself
is left out: it would add its own CPU on the shared cores and nothing to the router's work.

Bodies: a system prompt out of a few (so the router's tokenisation of shared prefixes is cached,
as for real chat traffic) and a user message of its own with a request id; sizes spread over
2-32 KB. ``fixed_rate`` sends open loop at a fixed rate, its latency taken from each request's
scheduled time (a slow router is not excused by sending less); ``closed_loop`` keeps
``concurrency`` requests in flight for the phase.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from routerlab.bench.zero_backend import MODEL
from routerlab.harness.extproc_messages import body_message, headers_message

# envoy/pick.yaml's initial_metadata for the router's stream
PICK_METADATA: Final = (("x-prefix-router-mode", "pick"), ("x-prefix-router-prefix-length", "4096"),
                        ("x-prefix-router-normalize", "prompt"), ("x-prefix-router-concurrency-threshold", "0"))
PICK_HEADER: Final = "x-prefix-pick"
MARKER: Final = "@@ID@@"
TIMEOUT_S: Final = 10.0
_WORDS: Final = ("the cache token prefix route replica envoy model server request latency policy customer order "
                 "invoice refund account shipping support answer question context document summary").split()


def _text(rng: random.Random, size: int) -> str:
    out: list[str] = []
    n = 0
    while n < size:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:size]


@dataclass(frozen=True)
class Bodies:
    """Chat bodies from ``systems`` system prompts (1.5-30 KB, log-spaced) and ``questions`` user
    messages (0.3-1.5 KB); request i gets its own id, so no two bodies are the same."""

    seed: int = 0
    systems: int = 8
    questions: int = 64
    templates: tuple[tuple[bytes, bytes], ...] = field(init=False, repr=False)
    system_texts: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        lo, hi = 1536, 30 * 1024
        sizes = [int(lo * (hi / lo) ** (k / max(1, self.systems - 1))) for k in range(self.systems)]
        systems = tuple(f"System prompt {k}. " + _text(rng, s) for k, s in enumerate(sizes))
        templates = []
        for q in range(self.questions):
            system = systems[q % self.systems]
            user = _text(rng, rng.randint(300, 1500)) + " " + MARKER
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            doc = {"model": MODEL, "messages": messages, "max_tokens": 128, "stream": True}
            head, _, tail = json.dumps(doc).encode().partition(MARKER.encode())
            templates.append((head, tail))
        object.__setattr__(self, "templates", tuple(templates))
        object.__setattr__(self, "system_texts", systems)

    def body(self, i: int) -> bytes:
        head, tail = self.templates[i % len(self.templates)]
        return head + f"request-{i}".encode() + tail

    def docs_for_prefix(self, system: int) -> list[dict]:
        """Two bodies sharing system prompt ``system`` (their common token prefix is what a replica caches of it)."""
        head_tail = [self.templates[q] for q in range(system, len(self.templates), self.systems)[:2]]
        return [json.loads(head + b"a" + tail) for head, tail in head_tail]


_HEADERS: Final = ((":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "127.0.0.1:10000"),
                   (":scheme", "http"), ("content-type", "application/json"))


def _picked(reply: pb.ProcessingResponse) -> bool:
    return any(o.header.key == PICK_HEADER for o in reply.request_body.response.header_mutation.set_headers)


@dataclass
class PhaseResult:
    """One phase's requests: latencies of those answered (seconds), failures, replies naming a replica."""

    mode: str
    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    picked: int = 0
    skipped: int = 0  # fixed rate: not sent because max_inflight were already waiting (the router fell behind)

    def summary(self) -> dict[str, float | int | str]:
        lat = sorted(self.latencies)

        def q(p: float) -> float:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 3) if lat else float("nan")

        return {"mode": self.mode, "requests": len(lat), "errors": self.errors, "skipped": self.skipped,
                "picked": self.picked, "rps": round(len(lat) / self.seconds, 1) if self.seconds else 0.0,
                "p50_ms": q(0.50), "p99_ms": q(0.99)}


class Client:
    """One gRPC channel to the router (Envoy's ext_proc cluster uses one HTTP/2 connection too)."""

    def __init__(self, target: str, bodies: Bodies) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.bodies = bodies
        self.headers = headers_message(_HEADERS)
        self.sent = 0

    async def close(self) -> None:
        await self.channel.close()

    async def one(self, result: PhaseResult, started: float) -> None:
        """One request's stream; its latency from ``started`` (perf_counter) to the reply naming the replica."""
        i = self.sent
        self.sent += 1
        try:
            call = self.stub.Process(metadata=PICK_METADATA, timeout=TIMEOUT_S)
            await call.write(self.headers)
            await call.write(body_message(self.bodies.body(i)))
            await call.read()  # the headers reply
            reply = await call.read()
            done = time.perf_counter()
            await call.done_writing()  # the response ended: Envoy closes the stream, the router releases the replica
            while await call.read() is not grpc.aio.EOF:
                pass
        except Exception:  # noqa: BLE001  any stream that fails (deadline, reset, grpc's own batch errors) is an error
            result.errors += 1
            return
        if not isinstance(reply, pb.ProcessingResponse):
            result.errors += 1
            return
        result.latencies.append(done - started)
        result.picked += _picked(reply)


async def fixed_rate(client: Client, rate: float, seconds: float, max_inflight: int = 256) -> PhaseResult:
    """Open loop: request i scheduled at i / rate; at most ``max_inflight`` waiting (the rest skipped, counted)."""
    result = PhaseResult("fixed", seconds)
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()
    for i in range(int(rate * seconds)):
        at = t0 + i / rate
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= max_inflight:
            result.skipped += 1
            continue
        task = asyncio.create_task(client.one(result, at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks, timeout=TIMEOUT_S + 5)
    result.seconds = max(seconds, time.perf_counter() - t0) if result.latencies else seconds
    return result


async def closed_loop(client: Client, concurrency: int, seconds: float) -> PhaseResult:
    """``concurrency`` requests in flight, each sent when the one before it answered, for ``seconds``."""
    result = PhaseResult("closed", seconds)
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            await client.one(result, time.perf_counter())

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.seconds = time.perf_counter() - t0
    return result


def hot_prefixes(bodies: Bodies, tokens_for: Callable[[dict], Sequence[int]], block_size: int) -> list[list[int]]:
    """Per system prompt, the full blocks of the token prefix its bodies share (what a replica that
    served them holds for good); ``tokens_for(doc)`` is the router's own tokenisation."""
    out = []
    for s in range(bodies.systems):
        a, b = (list(tokens_for(d)) for d in bodies.docs_for_prefix(s))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        out.append(a[:n // block_size * block_size])
    return out
