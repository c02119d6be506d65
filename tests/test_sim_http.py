"""HTTP tests of the simulated vLLM fleet: real sockets on 127.0.0.1, fleet in-process
(and once through the CLI in a subprocess)."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from routerlab.harness.procs import free_port_run
from routerlab.sim import tokenizer
from routerlab.sim.fleet import FleetThread, SimConfig

MODEL = "sim-tiny"
ROOT = Path(__file__).resolve().parents[1]


class Client:
    """Tiny blocking HTTP client for one replica."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                timeout: float = 10.0, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
            sent = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
            conn.request(method, path, body=data, headers=sent)
            resp = conn.getresponse()
            return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, data, _ = self.request("POST", path, body)
        return status, orjson.loads(data) if data and not data.startswith(b"data:") else data

    def get_json(self, path: str) -> Any:
        status, data, _ = self.request("GET", path)
        assert status == 200, data
        return orjson.loads(data)

    def control(self, **kw: Any) -> dict[str, Any]:
        status, body = self.post("/sim/control", kw)
        assert status == 200, body
        return body

    def metrics(self) -> dict[str, float]:
        status, data, headers = self.request("GET", "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        out: dict[str, float] = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out


def sse_events(data: bytes) -> list[Any]:
    """Split an SSE body; asserts vLLM's exact framing (``data: ...\\n\\n`` only)."""
    text = data.decode()
    assert text.endswith("data: [DONE]\n\n")
    parts = text.split("\n\n")
    assert parts[-1] == ""
    events: list[Any] = []
    for p in parts[:-1]:
        assert p.startswith("data: "), p
        payload = p[len("data: "):]
        events.append("[DONE]" if payload == "[DONE]" else orjson.loads(payload))
    return events


def lbl(name: str, **labels: str) -> str:
    labels = {"engine": "0", "model_name": MODEL, **labels}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def expected_hit(n_tokens: int, block: int = 16) -> int:
    return (n_tokens - 1) // block * block


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Client]]:
    ft = FleetThread(SimConfig(replicas=3, base_port=0, profile="tiny", time_scale=20.0))
    f = ft.start()
    try:
        yield [Client(u) for u in f.urls]
    finally:
        ft.stop()


@pytest.fixture
def c(fleet: list[Client]) -> Iterator[Client]:
    client = fleet[0]
    yield client
    client.control(healthy=True, fail_rate=0.0, drop_connections=False, slow_factor=1.0)


def wait_state(c: Client, done: Any, timeout: float = 10.0) -> dict[str, Any]:
    """Poll /sim/state until ``done(state)`` (bounded); returns the last state."""
    deadline = time.monotonic() + timeout
    st = c.get_json("/sim/state")
    while not done(st) and time.monotonic() < deadline:
        time.sleep(0.02)
        st = c.get_json("/sim/state")
    return st


def unique_text(tag: str, n_bytes: int = 400) -> str:
    base = f"[{tag} {time.perf_counter_ns()}] "
    return (base + "the quick brown fox jumps over the lazy dog " * (n_bytes // 40 + 1))[:n_bytes]


# ---- plain endpoints -----------------------------------------------------------------------

def test_models_health_load_ping(c: Client) -> None:
    models = c.get_json("/v1/models")
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 8192
    status, body, _ = c.request("GET", "/health")
    assert (status, body) == (200, b"")
    assert c.request("GET", "/ping")[0] == 200
    assert c.request("POST", "/ping")[0] == 200
    assert c.get_json("/load") == {"server_load": 0}


def test_health_503_after_control(c: Client) -> None:
    state = c.control(healthy=False)
    assert state["healthy"] is False
    assert c.request("GET", "/health")[0] == 503
    assert c.request("GET", "/ping")[0] == 503
    # requests are still served while "unhealthy"
    assert c.post("/v1/completions", {"model": MODEL, "prompt": "hi there", "max_tokens": 1})[0] == 200
    c.control(healthy=True)
    assert c.request("GET", "/health")[0] == 200


def _cached_prompt(c: Client, tag: str) -> tuple[dict, int]:
    """A completions body the replica now holds in its cache, and its restart count."""
    body = {"model": MODEL, "prompt": unique_text(tag, 800), "max_tokens": 1}
    assert c.post("/v1/completions", body)[0] == 200
    assert c.post("/v1/completions", body)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    return body, c.get_json("/sim/state")["restarts"]


def _event(c: Client, action: str) -> dict | None:
    """The bench's fleet event ``action`` on this replica, as the restart scenario applies it."""
    from routerlab.bench.runner import apply_event
    from routerlab.bench.scenarios import FleetEvent

    return apply_event(None, [c.url], FleetEvent(0.0, action, 0))  # type: ignore[arg-type]


def test_a_replica_that_goes_down_crashes_and_stays_away_until_it_restarts(c: Client) -> None:
    """The bench's ``down`` then ``restart`` events (the restart scenario's ``restart_down_s``)."""
    body, restarts = _cached_prompt(c, "down")
    reset = _event(c, "down")
    assert reset is not None and reset["replica_reset"] == 0 and reset["counters"].requests >= 2  # counted before
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        c.post("/v1/completions", body)  # dropped without an answer
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        c.request("GET", "/health")
    assert c.get_json("/sim/state")["restarts"] == restarts + 1  # it crashed: its cache is gone
    _event(c, "restart")
    assert c.request("GET", "/health")[0] == 200
    status, answer = c.post("/v1/completions", body)
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert c.get_json("/sim/state")["restarts"] == restarts + 2


def test_a_replica_whose_prefix_cache_is_reset_goes_on_with_an_empty_cache(c: Client) -> None:
    """The bench's ``reset_cache`` event (the restart scenario's ``restart_kind=reset_cache``)."""
    body, restarts = _cached_prompt(c, "reset")
    assert _event(c, "reset_cache") is None
    status, answer = c.post("/v1/completions", body)
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert c.get_json("/sim/state")["restarts"] == restarts  # the same process


# ---- completions -------------------------------------------------------------------------

def test_completion_non_streaming_and_cached_tokens(c: Client) -> None:
    prompt = unique_text("cmpl", 400)  # 100 tokens
    status, r = c.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5})
    assert status == 200
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    assert r["choices"][0]["text"] == "lorem ipsum dolor si"
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": 100, "total_tokens": 105, "completion_tokens": 5,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    status, r2 = c.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5,
                                            "temperature": 0.3})
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


def test_default_max_tokens_and_max_completion_tokens(c: Client) -> None:
    r = c.post("/v1/completions", {"model": MODEL, "prompt": "abc", "stream": None,
                                   "max_tokens": None})[1]
    assert r["usage"]["completion_tokens"] == 16
    r = c.post("/v1/chat/completions", {"model": MODEL, "max_completion_tokens": 2,
                                        "messages": [{"role": "user", "content": "x"}]})[1]
    assert r["usage"]["completion_tokens"] == 2


def test_completion_streaming_sequence(c: Client) -> None:
    body = {"model": MODEL, "prompt": unique_text("cs", 200), "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    status, data, headers = c.request("POST", "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    ev = sse_events(data)
    assert len(ev) == 4 + 1 + 1
    texts = [e["choices"][0]["text"] for e in ev[:4]]
    assert "".join(texts) == "lorem ipsum dolo"
    assert [e["choices"][0]["finish_reason"] for e in ev[:4]] == [None, None, None, "length"]
    assert all(e["object"] == "text_completion" for e in ev[:5])
    assert ev[4]["choices"] == [] and ev[4]["usage"]["completion_tokens"] == 4
    assert ev[5] == "[DONE]"
    # without include_usage: no usage chunk
    body.pop("stream_options")
    ev = sse_events(c.request("POST", "/v1/completions", body)[1])
    assert len(ev) == 5 and all("usage" not in e for e in ev[:4])


def test_chat_streaming_exact_sequence_and_usage_cached_tokens(c: Client) -> None:
    msgs = [{"role": "system", "content": unique_text("sys", 300)},
            {"role": "user", "content": "Say three words."}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    ev1 = sse_events(c.request("POST", "/v1/chat/completions", body)[1])
    ev2 = sse_events(c.request("POST", "/v1/chat/completions", body)[1])
    for ev in (ev1, ev2):
        assert len(ev) == 1 + 3 + 1 + 1
        assert ev[0]["object"] == "chat.completion.chunk"
        assert ev[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
        assert [e["choices"][0]["delta"] for e in ev[1:4]] == [
            {"content": "lore"}, {"content": "m ip"}, {"content": "sum "}]
        assert [e["choices"][0]["finish_reason"] for e in ev[1:4]] == [None, None, "length"]
        assert ev[4]["choices"] == []
        assert len({e["id"] for e in ev[:5]}) == 1 and ev[0]["id"].startswith("chatcmpl-")
        assert ev[5] == "[DONE]"
    n_prompt = ev1[4]["usage"]["prompt_tokens"]
    assert ev1[4]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ev2[4]["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit(n_prompt)
    assert ev2[4]["usage"]["total_tokens"] == n_prompt + 3


def test_continuous_usage_needs_include_usage_and_counts_per_choice(c: Client) -> None:
    """vLLM: per-chunk usage only with include_usage too; it counts that choice's prompt and
    output so far, without prompt_tokens_details; the final usage chunk sums everything."""
    body = {"model": MODEL, "prompt": [[1] * 20, [2] * 30], "max_tokens": 3, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    ev = sse_events(c.request("POST", "/v1/completions", body)[1])
    assert all("usage" not in e for e in ev[:-1])
    body["stream_options"]["include_usage"] = True
    ev = sse_events(c.request("POST", "/v1/completions", body)[1])
    *content, final, done = ev
    got = {0: 0, 1: 0}
    for e in content:
        (ch,) = e["choices"]
        got[ch["index"]] += len(ch["text"]) // 4  # one 4-byte filler piece per token
        prompt = 20 if ch["index"] == 0 else 30
        assert e["usage"] == {"prompt_tokens": prompt, "completion_tokens": got[ch["index"]],
                              "total_tokens": prompt + got[ch["index"]]}
    assert got == {0: 3, 1: 3}
    assert final["choices"] == [] and done == "[DONE]"
    assert final["usage"]["prompt_tokens"] == 50 and final["usage"]["completion_tokens"] == 6
    assert "prompt_tokens_details" in final["usage"]


def test_chat_stream_n2_sends_every_role_chunk_first(c: Client) -> None:
    body = {"model": MODEL, "n": 2, "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": unique_text("n2", 64)}],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ev = sse_events(c.request("POST", "/v1/chat/completions", body)[1])
    n_prompt = ev[-2]["usage"]["prompt_tokens"]
    assert [e["choices"] for e in ev[:2]] == [
        [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
          "finish_reason": None}] for k in (0, 1)]
    assert all(e["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0,
                              "total_tokens": n_prompt} for e in ev[:2])
    deltas = [e["choices"][0] for e in ev[2:-2]]
    assert all("role" not in d["delta"] for d in deltas)
    assert sorted(d["index"] for d in deltas if d["finish_reason"] == "length") == [0, 1]
    assert ev[-2]["usage"]["completion_tokens"] == 4


def test_chat_non_streaming(c: Client) -> None:
    status, r = c.post("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]})
    assert status == 200 and r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["role"] == "assistant"
    assert r["choices"][0]["message"]["content"] == "lorem ip"
    # "<|user|>\nhello<|end|>\n<|assistant|>\n" = 34 bytes -> 9 tokens
    assert r["usage"]["prompt_tokens"] == 9


def test_token_id_prompts_and_exact_counters(c: Client) -> None:
    ids = [(7 * i + 13) % 30000 for i in range(100)]
    m0 = c.metrics()
    q = lbl("vllm:prefix_cache_queries_total")
    h = lbl("vllm:prefix_cache_hits_total")
    r1 = c.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})[1]
    m1 = c.metrics()
    assert r1["usage"]["prompt_tokens"] == 100
    assert (m1[q] - m0[q], m1[h] - m0[h]) == (100, 0)
    r2 = c.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})[1]
    m2 = c.metrics()
    assert (m2[q] - m1[q], m2[h] - m1[h]) == (100, 96)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    # list of lists: two engine requests, one choice each
    r3 = c.post("/v1/completions", {"model": MODEL, "prompt": [ids[:64] + [1, 2, 3], ids[:40]],
                                    "max_tokens": 1})[1]
    m3 = c.metrics()
    assert [ch["index"] for ch in r3["choices"]] == [0, 1]
    assert (m3[q] - m2[q], m3[h] - m2[h]) == (67 + 40, 64 + 32)
    # token ids pass through: the text prompt with the same ids hits the same blocks
    text = "abcd" * 40
    c.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    r4 = c.post("/v1/completions", {"model": MODEL, "prompt": tokenizer.encode(text), "max_tokens": 1})[1]
    assert r4["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hit(40) == 32


def test_cross_tenant_hits_are_counted_unless_salts_differ(c: Client) -> None:
    name = lbl("sim:cross_tenant_prefix_cache_hits_total")
    text = unique_text("shared", 800)

    def ask(tenant: str, **extra: Any) -> int:
        body = {"model": MODEL, "prompt": text, "max_tokens": 1, **extra}
        status, data, _ = c.request("POST", "/v1/completions", body, headers={"x-prefix-aware-id": tenant})
        assert status == 200, data
        return orjson.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]

    m0 = c.metrics()[name]
    assert ask("a") == 0
    hit = ask("b")  # b reuses blocks a computed
    assert hit > 0 and c.metrics()[name] - m0 == hit
    assert ask("a") == hit and c.metrics()[name] - m0 == hit  # a's own blocks: not a crossing
    assert ask("a", cache_salt="salt-a") == 0 and ask("b", cache_salt="salt-b") == 0
    assert c.metrics()[name] - m0 == hit


def test_batch_string_prompts(c: Client) -> None:
    r = c.post("/v1/completions", {"model": MODEL, "prompt": ["one prompt", "another one"],
                                   "max_tokens": 2})[1]
    assert [ch["index"] for ch in r["choices"]] == [0, 1]
    assert all(ch["text"] == "lorem ip" for ch in r["choices"])
    assert r["usage"]["completion_tokens"] == 4


def test_cache_salt_isolates(c: Client) -> None:
    prompt = unique_text("salt", 400)
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    c.post("/v1/completions", {**base, "cache_salt": "tenant-a"})
    hit = lambda **kw: c.post("/v1/completions", {**base, **kw})[1]["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert hit(cache_salt="tenant-b") == 0
    assert hit() == 0
    assert hit(cache_salt="tenant-a") == 96


def test_invocations_dispatch_by_shape(c: Client) -> None:
    s, r = c.post("/invocations", {"model": MODEL, "prompt": "x y z", "max_tokens": 1})
    assert s == 200 and r["object"] == "text_completion"
    s, r = c.post("/invocations", {"model": MODEL, "messages": [{"role": "user", "content": "q"}],
                                   "max_tokens": 1})
    assert s == 200 and r["object"] == "chat.completion"
    s, r = c.post("/invocations", {"model": MODEL, "inputs": "nope"})
    assert s == 400 and r["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("raw, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (orjson.dumps({"prompt": "hi"}), "model"),
    (orjson.dumps({"model": MODEL}), "prompt"),
    (orjson.dumps({"model": MODEL, "prompt": ""}), "prompt"),
    (orjson.dumps({"model": MODEL, "prompt": [1, -2]}), "prompt"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}), "max_tokens"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 9000}), "max_tokens"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}), "stream_options"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "cache_salt": ""}), "cache_salt"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "cache_salt": "x" * 129}), "cache_salt"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "cache_salt": "a@b"}), "cache_salt"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "cache_salt": "a/b"}), "cache_salt"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "cache_salt": "a\\b"}), "cache_salt"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "cache_salt": "a\x00b"}), "cache_salt"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "cache_salt": 5}), "cache_salt"),
    (orjson.dumps({"model": MODEL, "prompt": "hi", "n": 16385}), "n"),  # vLLM's max n
    (orjson.dumps({"model": MODEL, "prompt": ["a", "b"], "n": 8193}), "n"),  # fan-out bound
    (orjson.dumps({"model": MODEL, "prompt": ["hi"] * 1025}), "prompt"),  # vLLM's max prompts
])
def test_completions_400_errors(c: Client, raw: bytes, param: str | None) -> None:
    status, body, headers = c.request("POST", "/v1/completions", raw=raw)
    assert status == 400 and headers["content-type"].startswith("application/json")
    err = orjson.loads(body)["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
    assert isinstance(err["message"], str) and err["message"]


def test_chat_errors_and_unknown_model(c: Client) -> None:
    s, r = c.post("/v1/chat/completions", {"model": MODEL})
    assert s == 400 and r["error"]["param"] == "messages"
    s, r = c.post("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]})
    assert s == 400
    s, r = c.post("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    assert s == 404 and r["error"]["type"] == "NotFoundError"
    assert c.get_json("/v1/models")["data"][0]["id"] == MODEL  # still alive
    ok = c.post("/v1/chat/completions", {"model": MODEL, "cache_salt": "x" * 128,
                                         "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert ok[0] == 200


# ---- faults --------------------------------------------------------------------------------

def test_fail_rate_one_gives_500(c: Client) -> None:
    c.control(fail_rate=1.0)
    for _ in range(3):
        s, r = c.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert s == 500 and r["error"]["code"] == 500
    assert c.get_json("/sim/state")["failed"] >= 3
    c.control(fail_rate=0.0)
    assert c.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})[0] == 200


def test_fail_rate_fraction(c: Client) -> None:
    c.control(fail_rate=0.5, seed=1)
    codes = [c.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})[0]
             for _ in range(40)]
    assert 8 <= codes.count(500) <= 32 and set(codes) == {200, 500}


def test_drop_connections_closes_without_response(c: Client) -> None:
    c.control(drop_connections=True)
    for path, method in (("/v1/completions", "POST"), ("/health", "GET")):
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError, http.client.BadStatusLine)):
            c.request(method, path, {"model": MODEL, "prompt": "x"} if method == "POST" else None)
    assert c.get_json("/sim/state")["dropped"] >= 2  # /sim/* still answers
    c.control(drop_connections=False)
    assert c.request("GET", "/health")[0] == 200


def test_reset_cache_makes_repeat_a_miss(c: Client) -> None:
    body = {"model": MODEL, "prompt": unique_text("reset", 400), "max_tokens": 1}
    c.post("/v1/completions", body)
    assert c.post("/v1/completions", body)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    state = c.control(reset_cache=True)
    assert state["blocks_cached"] == 0
    assert c.post("/v1/completions", body)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_slow_factor_slows_steps(fleet: list[Client]) -> None:
    """Decode steps take slow_factor x the profile's step time, in model time.

    ITL sum = the 39 decode steps after the first token plus any clock snaps (loop stalls
    on a busy machine); /sim/state counts the snaps, so the difference is exact.
    """
    c = fleet[1]
    body = {"model": MODEL, "prompt": "tick", "max_tokens": 40}
    itl = lbl("vllm:inter_token_latency_seconds_sum")
    step = 0.002 + 0.05e-3  # tiny profile, one decoding sequence

    def decode_model_seconds(slow: float) -> tuple[float, float]:
        c.control(slow_factor=slow)
        try:
            m0, s0 = c.metrics()[itl], c.get_json("/sim/state")["snapped_model_s"]
            t0 = time.perf_counter()
            assert c.post("/v1/completions", body)[0] == 200
            wall = time.perf_counter() - t0
            m1, s1 = c.metrics()[itl], c.get_json("/sim/state")["snapped_model_s"]
        finally:
            c.control(slow_factor=1.0)
        return (m1 - m0) - (s1 - s0), wall

    fast, _ = decode_model_seconds(1.0)
    slow, slow_wall = decode_model_seconds(6.0)
    assert fast == pytest.approx(39 * step, rel=1e-6)
    assert slow == pytest.approx(6 * 39 * step, rel=1e-6)
    assert slow_wall >= 6 * 40 * step / 20 * 0.99  # wall >= model / time_scale


def test_non_streaming_client_disconnect_aborts(fleet: list[Client]) -> None:
    c = fleet[1]
    before = c.get_json("/sim/state")["aborted"]
    with socket.create_connection((c.host, c.port), timeout=5) as s:
        body = orjson.dumps({"model": MODEL, "prompt": "long", "max_tokens": 4000})
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_state(c, lambda st: st["running"] == 1)["running"] == 1  # in the engine
    st = wait_state(c, lambda st: st["aborted"] > before and st["running"] == 0)
    assert st["aborted"] == before + 1 and st["running"] == 0 and st["blocks_used"] == 0


def test_control_rejects_bad_fields(c: Client) -> None:
    for bad in ({"healthy": "no"}, {"fail_rate": 2}, {"slow_factor": 0}, {"bogus": 1}):
        s, r = c.post("/sim/control", bad)
        assert s == 400 and r["error"]["type"] == "BadRequestError"
    state = c.get_json("/sim/state")
    for key in ("healthy", "slow_factor", "fail_rate", "drop_connections", "requests",
                "prefix_cache_queries", "prefix_cache_hits", "running", "waiting",
                "blocks_free", "blocks_used"):
        assert key in state


def test_stream_client_disconnect_aborts(fleet: list[Client]) -> None:
    c = fleet[2]
    before = c.get_json("/sim/state")["aborted"]
    conn = http.client.HTTPConnection(c.host, c.port, timeout=5)
    conn.request("POST", "/v1/completions", orjson.dumps(
        {"model": MODEL, "prompt": "long one", "max_tokens": 2000, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    st = wait_state(c, lambda st: st["aborted"] > before and st["running"] == 0)
    assert st["aborted"] == before + 1 and st["running"] == 0 and st["blocks_used"] == 0


def test_failed_engine_step_fails_in_flight_requests_and_recovers() -> None:
    """A step that raises answers its requests with 503 instead of retrying forever."""
    ft = FleetThread(SimConfig(replicas=1, base_port=0, profile="tiny", time_scale=20.0))
    f = ft.start()
    try:
        sched = f.replicas[0].engine.sched
        real_schedule = sched.schedule

        def fail_once() -> Any:
            sched.schedule = real_schedule
            raise RuntimeError("injected step failure")

        sched.schedule = fail_once
        c = Client(f.urls[0])
        body = {"model": MODEL, "prompt": "x y z", "max_tokens": 2}
        s, r = c.post("/v1/completions", body)
        assert s == 503 and r["error"]["type"] == "ServiceUnavailableError"
        assert c.post("/v1/completions", body)[0] == 200
        st = c.get_json("/sim/state")
        assert (st["aborted"], st["finished"], st["running"], st["blocks_used"]) == (1, 1, 0, 0)
        m = c.metrics()
        assert m[lbl("vllm:request_success_total", finished_reason="abort")] == 1
    finally:
        ft.stop()


# ---- metrics -----------------------------------------------------------------------------

def test_metrics_names_labels_and_counters(fleet: list[Client]) -> None:
    c = fleet[2]
    status, data, _ = c.request("GET", "/metrics")
    text = data.decode()
    for name, kind in (
        ("vllm:prefix_cache_queries", "counter"), ("vllm:prefix_cache_hits", "counter"),
        ("vllm:prompt_tokens", "counter"), ("vllm:generation_tokens", "counter"),
        ("vllm:request_success", "counter"), ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"), ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:cache_config_info", "gauge"), ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"), ("vllm:request_queue_time_seconds", "histogram"),
        ("vllm:request_prefill_time_seconds", "histogram"), ("vllm:request_prefill_kv_computed_tokens", "histogram"),
    ):
        exposed = name + "_total" if kind == "counter" else name
        assert f"# TYPE {exposed} {kind}\n" in text, name
    assert re.search(r'vllm:cache_config_info\{[^}]*block_size="16"[^}]*enable_prefix_caching="True"'
                     r'[^}]*num_gpu_blocks="2048"[^}]*\} 1\.0', text)
    buckets = re.findall(r'vllm:time_to_first_token_seconds_bucket\{engine="0",le="([^"]+)",'
                         r'model_name="sim-tiny"\}', text)
    assert buckets == ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25",
                       "0.5", "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0",
                       "160.0", "640.0", "2560.0", "+Inf"]
    for reason in ("stop", "length", "abort", "error", "repetition"):  # vLLM 0.32's set
        assert lbl("vllm:request_success_total", finished_reason=reason) in c.metrics()
    m0 = c.metrics()
    prompt = [5] * 50
    c.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3})
    c.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3})
    m1 = c.metrics()
    d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)  # noqa: E731
    assert d(lbl("vllm:prefix_cache_queries_total")) == 100
    assert d(lbl("vllm:prefix_cache_hits_total")) == 48
    assert d(lbl("vllm:prompt_tokens_total")) == 100
    assert d(lbl("vllm:generation_tokens_total")) == 6
    assert d(lbl("vllm:request_success_total", finished_reason="length")) == 2
    assert d(lbl("vllm:time_to_first_token_seconds_count")) == 2
    assert d(lbl("vllm:e2e_request_latency_seconds_count")) == 2
    assert d(lbl("vllm:request_prefill_time_seconds_count")) == d(lbl("vllm:request_queue_time_seconds_count")) == 2
    assert d(lbl("vllm:request_prefill_time_seconds_sum")) > 0  # each computed some prompt (model time)
    assert d(lbl("vllm:request_prefill_kv_computed_tokens_sum")) == 100 - 48  # the prompt tokens not cached
    assert m1[lbl("vllm:num_requests_running")] == 0
    assert 0.0 <= m1[lbl("vllm:kv_cache_usage_perc")] <= 1.0


def test_cached_prompt_ttft_much_lower_over_http() -> None:
    """llama profile: cold 8k-token prompt vs the same prompt cached (ratio, model time)."""
    ft = FleetThread(SimConfig(replicas=1, base_port=0, profile="llama-3.1-70b-h100-tp8",
                               time_scale=2.0))
    f = ft.start()
    try:
        c = Client(f.urls[0])
        model = "meta-llama/Llama-3.1-70B-Instruct"
        ttft = lbl("vllm:time_to_first_token_seconds_sum", model_name=model)
        body = {"model": model, "prompt": list(range(8192)), "max_tokens": 1}
        walls = []
        sums = [c.metrics()[ttft]]
        for _ in range(2):
            t0 = time.perf_counter()
            assert c.post("/v1/completions", body)[0] == 200
            walls.append(time.perf_counter() - t0)
            sums.append(c.metrics()[ttft])
        cold, warm = sums[1] - sums[0], sums[2] - sums[1]
        # model seconds, as a real replica would report: one 8192-token prefill step is
        # 0.38 s cold; cached, one 16-token block is recomputed (~13 ms). Wake-up delays on
        # a busy machine add (wall x time scale) to both, hence the margins.
        assert 0.38 <= cold < 0.6
        assert warm < cold / 6
        assert walls[1] < walls[0] / 3  # client-observed: >= 190 ms wall cold
    finally:
        ft.stop()


# ---- CLI in a subprocess -------------------------------------------------------------------

@contextlib.contextmanager
def sim_cli(args: list[str], env: dict[str, str] | None = None) -> Iterator[list[str]]:
    """``python -m extproc sim ARGS`` in a subprocess; yields its lines up to ``fleet ready`` (at most
    20 s), then stops it with SIGTERM and checks that it exits 0 cleanly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc", "sim", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    lines: list[str] = []
    timer = threading.Timer(20, proc.kill)
    try:
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("fleet ready"):
                break
        timer.cancel()
        yield lines
    finally:
        timer.cancel()
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    assert proc.returncode == 0, rest
    assert "sim: stopped" in rest
    assert "Traceback" not in rest


def test_cli_three_replicas_subprocess() -> None:
    base = free_port_run(3)
    with sim_cli(["--replicas", "3", "--base-port", str(base), "--profile", "tiny", "--time-scale", "20",
                  "--num-blocks", "512"]) as lines:
        ready = [ln for ln in lines if ln.startswith("replica ")]
        assert ready == [f"replica {i} ready on http://127.0.0.1:{base + i}" for i in range(3)], lines
        for i in range(3):
            c = Client(f"http://127.0.0.1:{base + i}")
            assert c.request("GET", "/health")[0] == 200
            r = c.post("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2})[1]
            assert r["usage"]["completion_tokens"] == 2
            assert c.get_json("/sim/state")["replica"] == i
            assert 'num_gpu_blocks="512"' in c.request("GET", "/metrics")[1].decode()
        # the --control helper flips replica 1 only
        out = subprocess.run(
            [sys.executable, "-m", "extproc", "sim", "--control", f"http://127.0.0.1:{base + 1}",
             "--set", "healthy=false"], cwd=ROOT, capture_output=True, text=True, timeout=20)
        assert out.returncode == 0 and orjson.loads(out.stdout)["healthy"] is False
        assert Client(f"http://127.0.0.1:{base + 1}").request("GET", "/health")[0] == 503
        assert Client(f"http://127.0.0.1:{base}").request("GET", "/health")[0] == 200


def test_cli_bad_settings_exit_cleanly() -> None:
    """A flag the engine cannot run with exits 2; an unreachable --control URL exits 1."""
    bad = subprocess.run([sys.executable, "-m", "extproc", "sim", "--base-port", "0",
                          "--max-num-batched-tokens", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "max_num_batched_tokens must be >= 1" in bad.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "extproc", "sim", "--control",
                          f"http://127.0.0.1:{closed}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "Traceback" not in out.stderr and str(closed) in out.stderr


# ---- concurrency -------------------------------------------------------------------------

def test_concurrent_load_with_kv_pressure_and_max_num_seqs() -> None:
    """24 concurrent requests, 4 seqs max, KV for ~3 of them: all succeed, limits hold."""
    import asyncio

    import aiohttp

    ft = FleetThread(SimConfig(replicas=1, base_port=0, profile="tiny", time_scale=5.0,
                               num_blocks=30, max_num_seqs=4, max_num_batched_tokens=128))
    f = ft.start()
    url = f.urls[0]

    async def drive() -> tuple[list[int], list[dict[str, Any]]]:
        samples: list[dict[str, Any]] = []
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> int:
                body = {"model": MODEL, "prompt": list(range(i, i + 100)), "max_tokens": 30,
                        "stream": i % 2 == 0}
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    return r.status

            async def sample() -> None:
                for _ in range(200):
                    async with s.get(url + "/sim/state") as r:
                        samples.append(await r.json())
                    await asyncio.sleep(0.01)

            sampler = asyncio.ensure_future(sample())
            statuses = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(24))), 20)
            sampler.cancel()
        return list(statuses), samples

    try:
        statuses, samples = asyncio.run(drive())
        state = Client(url).get_json("/sim/state")
    finally:
        ft.stop()
    assert statuses == [200] * 24
    assert max(x["running"] for x in samples) <= 4
    assert max(x["waiting"] for x in samples) > 0
    assert state["finished"] == 24 and state["running"] == 0 and state["waiting"] == 0
    assert state["blocks_used"] == 0 and state["preemptions"] > 0
    assert state["prefix_cache_queries"] == 24 * 100
