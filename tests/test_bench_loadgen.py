"""The load generator against a scripted in-process SSE server on 127.0.0.1.

Timing assertions are one-sided (a measured time can only be later than a scripted delay,
a run can only stop after its bound), so a busy machine cannot fail them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from routerlab.bench.loadgen import ClientStats, LoadResult, run_load
from routerlab.bench.trace import Request, Session

Script = Callable[[web.StreamResponse, dict[str, int]], Awaitable[None]]


def _sse(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


ROLE = _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKEN = _sse({"choices": [{"index": 0, "delta": {"content": "ok"}}]})
USAGE = _sse({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
                                        "prompt_tokens_details": {"cached_tokens": 32}}})
DONE = _sse(b"[DONE]")


async def _complete(resp: web.StreamResponse, _: dict[str, int]) -> None:
    await resp.write(ROLE + TOKEN + USAGE + DONE)


async def _slow(resp: web.StreamResponse, _: dict[str, int]) -> None:
    await asyncio.sleep(0.2)
    await resp.write(ROLE + TOKEN + USAGE + DONE)


async def _hang(resp: web.StreamResponse, _: dict[str, int]) -> None:
    await resp.write(ROLE)
    await asyncio.sleep(1.0)  # past deadline + grace; the same event loop fires the earlier timer first


async def _serve(script: Script) -> tuple[web.AppRunner, str, dict[str, int]]:
    state = {"in_flight": 0, "max_in_flight": 0, "requests": 0}

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        state["requests"] += 1
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-sim-replica": "7"})
            await resp.prepare(request)
            await script(resp, state)
            return resp
        finally:
            state["in_flight"] -= 1

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", state


def _sessions(n: int, turns: int = 1) -> tuple[Session, ...]:
    return tuple(Session(tuple(Request(rid=s * turns + t, body=b"{}", group=f"g{s}", max_tokens=3)
                               for t in range(turns))) for s in range(n))


def _run(script: Script, sessions: tuple[Session, ...], **kw: object) -> tuple[LoadResult, dict[str, int]]:
    async def main() -> tuple[LoadResult, dict[str, int]]:
        runner, url, state = await _serve(script)
        try:
            return await run_load(url, sessions, **kw), state  # type: ignore[arg-type]
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_ttft_is_the_first_content_chunk_not_the_role_chunk() -> None:
    async def late_content(resp: web.StreamResponse, _: dict[str, int]) -> None:
        await resp.write(ROLE)
        await asyncio.sleep(0.3)
        await resp.write(TOKEN + USAGE + DONE)

    load, _ = _run(late_content, _sessions(1))
    (r,) = load.results
    assert r.ok and r.replica == "7"
    assert r.ttft is not None and r.e2e is not None and 0.3 <= r.ttft <= r.e2e
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens) == (3, 40, 32)


def test_a_stream_cut_before_done_is_a_failure() -> None:
    async def cut(resp: web.StreamResponse, _: dict[str, int]) -> None:
        await resp.write(ROLE + TOKEN)

    load, _ = _run(cut, _sessions(2))
    assert [(r.ok, r.error) for r in load.results] == [(False, "truncated")] * 2


def test_closed_loop_keeps_at_most_concurrency_sessions_in_flight_and_turns_in_order() -> None:
    load, state = _run(_slow, _sessions(6, turns=2), concurrency=3)
    assert state["max_in_flight"] <= 3 and state["requests"] == 12
    assert [r.rid for r in load.results] == list(range(12)) and all(r.ok for r in load.results)
    for first, second in zip(load.results[::2], load.results[1::2]):  # a session's turns: one after the other
        assert second.start >= first.start + (first.e2e or 0)
    assert not load.timed_out and load.unsent == load.cancelled == 0


def test_throughput_window_runs_from_the_first_send_to_the_last_completion() -> None:
    # Open loop: the only session starts after a Poisson gap; that idle gap is not in the window.
    load, _ = _run(_complete, _sessions(1), mode="open", rate=4.0, duration_s=30)
    (r,) = load.results
    assert r.start > 0
    assert load.duration_s == pytest.approx(r.e2e)


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_load_stops_at_its_duration_and_counts_what_it_never_sent(mode: str) -> None:
    sessions = _sessions(200)
    load, _ = _run(_slow, sessions, mode=mode, concurrency=2, rate=10.0, duration_s=0.5, grace_s=5)
    assert load.timed_out and load.unsent > 150
    assert len(load.results) + load.cancelled + load.unsent == len(sessions)
    assert load.client.wall_s < 5  # the bound, not the trace, ended it
    # A bound is not a routing failure: success is over finished requests, coverage apart.
    from routerlab.bench.report import summarize

    summary = summarize(load, None, oracle_hit_rate=0.0, total_requests=len(sessions), backend_urls=[],
                        cpu={}, envoy={})
    assert summary["success_rate"] == 1.0
    assert summary["trace_completed"] == round(len(load.results) / len(sessions), 4) < 0.25
    assert summary["errors"]["unsent"] == load.unsent


def test_requests_still_running_after_the_grace_period_are_cancelled() -> None:
    load, _ = _run(_hang, _sessions(10), concurrency=2, duration_s=0.2, grace_s=0.3)
    assert load.cancelled == 2 and load.unsent == 8 and load.results == []
    assert load.client.wall_s < 10


def test_mode_must_be_closed_or_open() -> None:
    with pytest.raises(ValueError):
        _run(_complete, _sessions(1), mode="burst")


def test_client_is_saturated_by_cpu_loop_lag_or_a_late_send_schedule() -> None:
    calm = ClientStats(wall_s=10, cpu_s=2, max_rss_mb=50, loop_lag_p99_ms=3)
    assert not calm.saturated and calm.to_json()["cpu_fraction"] == 0.2
    assert ClientStats(wall_s=10, cpu_s=9, max_rss_mb=50, loop_lag_p99_ms=3).saturated
    assert ClientStats(wall_s=10, cpu_s=2, max_rss_mb=50, loop_lag_p99_ms=80).saturated
    assert ClientStats(wall_s=10, cpu_s=2, max_rss_mb=50, loop_lag_p99_ms=3, schedule_lag_p99_ms=200).saturated
