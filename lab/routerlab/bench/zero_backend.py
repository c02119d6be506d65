"""Zero-work OpenAI-style backends for the ``overhead`` scenario.

Each port answers a chat or completions request at once with a fixed one-token SSE
stream (role, content, finish, usage, [DONE]), so latency and throughput through Envoy
measure the routing hop, not a model. Also /health, /v1/models and an empty /metrics.

Run: ``python -m routerlab.bench.zero_backend --ports 8100,8101`` (prints one ready line
per port, like the simulator). With ``--announce FILE --kv-events-port-offset N``, each port P
also publishes KV-cache events on P + N (replay on P + ``--kv-replay-port-offset``), announcing
the prompts in FILE (routerlab.bench.zero_events), so a precise-mode router covers it.
"""

from __future__ import annotations

import argparse
import asyncio
from contextlib import ExitStack
from pathlib import Path

from aiohttp import web

from extproc.process import event_loop
from extproc.process.signals import stop_on_signals
from routerlab.bench import zero_events
from routerlab.sim.kv_events import KvEventPublisher

MODEL = "zero"
_STREAM = b"".join(
    b"data: " + line + b"\n\n"
    for line in (
        b'{"id":"z","object":"chat.completion.chunk","model":"zero","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
        b'{"id":"z","object":"chat.completion.chunk","model":"zero","choices":[{"index":0,"delta":{"content":"ok"}}]}',
        b'{"id":"z","object":"chat.completion.chunk","model":"zero","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}',
        b'{"id":"z","object":"chat.completion.chunk","model":"zero","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}',
        b"[DONE]",
    )
)


def make_app(index: int) -> web.Application:
    counter = {"requests": 0}

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        counter["requests"] += 1
        return web.Response(body=_STREAM, content_type="text/event-stream",
                            headers={"x-sim-replica": str(index)})

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(_: web.Request) -> web.Response:
        text = f'vllm:request_success_total{{model_name="{MODEL}"}} {counter["requests"]}\n'
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.add_routes([
        web.post("/v1/chat/completions", complete), web.post("/v1/completions", complete),
        web.get("/health", health), web.get("/v1/models", models), web.get("/metrics", metrics),
    ])
    return app


async def serve(ports: list[int], announce: Path | None = None, events_offset: int = 0,
                replay_offset: int = 0) -> None:
    runners = []
    stop = stop_on_signals()
    with ExitStack() as closing:
        tasks = []
        if announce is not None and events_offset:
            events = zero_events.read_announcement(announce)
            for port in ports:
                publisher = KvEventPublisher(events_port=port + events_offset,
                                             replay_port=port + replay_offset if replay_offset else None)
                closing.callback(publisher.close)
                tasks.append(asyncio.create_task(zero_events.publish(publisher, events, stop)))
        for i, port in enumerate(ports):
            runner = web.AppRunner(make_app(i), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            print(f"replica {i} ready on http://127.0.0.1:{port}", flush=True)
        await stop.wait()
        await asyncio.gather(*tasks)
        for runner in runners:
            await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", required=True, help="comma-separated loopback ports")
    parser.add_argument("--announce", type=Path, help="JSON of the prompts each port announces as KV-cache events")
    parser.add_argument("--kv-events-port-offset", type=int, default=0, help="events on port + N (0: none)")
    parser.add_argument("--kv-replay-port-offset", type=int, default=0, help="replay on port + N (0: none)")
    args = parser.parse_args()
    event_loop.run(serve([int(p) for p in args.ports.split(",")], args.announce, args.kv_events_port_offset,
                         args.kv_replay_port_offset))


if __name__ == "__main__":
    main()
