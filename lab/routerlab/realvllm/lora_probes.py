"""What a vLLM-style server shows of its LoRA adapters, observed the same way on real vLLM and the
simulator (the probes of :mod:`routerlab.realvllm.lora_fidelity`).

Each probe talks HTTP to one server and returns plain JSON-able observations, with what legitimately
differs between two servers (timestamps, random permission ids) replaced by placeholders. Bounded:
every request has a timeout, every wait a deadline.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from routerlab.realvllm.promtext import Sample, parse_prometheus

LORA_INFO = "vllm:lora_requests_info"
BY_REASON = "vllm:num_requests_waiting_by_reason"


class Server:
    """One server: its URL, its base model's served name and its adapters' paths."""

    def __init__(self, url: str, model: str, adapters: dict[str, str]) -> None:
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.model = model
        self.adapters = adapters

    def call(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def scrape(self) -> list[Sample]:
        status, text = self.call("GET", "/metrics", timeout=10)
        assert status == 200, status
        return parse_prometheus(text.decode())

    def lora_info(self, samples: list[Sample] | None = None) -> list[tuple[dict[str, str], float]]:
        """Every ``vllm:lora_requests_info`` sample, newest (largest value) first."""
        found = [(s.labels, s.value) for s in (self.scrape() if samples is None else samples) if s.name == LORA_INFO]
        return sorted(found, key=lambda s: -s[1])

    def lora_info_text(self) -> list[str]:
        """The family's lines of the /metrics text, sample values replaced by <time>."""
        status, text = self.call("GET", "/metrics", timeout=10)
        lines = [ln for ln in text.decode().splitlines() if LORA_INFO in ln]
        return [re.sub(r"\} \S+$", "} <time>", ln) for ln in lines]


def completion_body(model: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    # the tiny model's text means nothing: ignore_eos and min_tokens make real vLLM produce every token
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, **extra}


def prompt_ids(seed: int, n: int) -> list[int]:
    """A token-id prompt (ids 10..4000, inside the tiny model's vocabulary), distinct per seed."""
    return [10 + (seed * 7919 + i * 104729) % 3990 for i in range(n)]


def _normalise(doc: Any) -> Any:
    """Placeholders for what differs per call or process: created times, permission ids."""
    if isinstance(doc, dict):
        out = {k: _normalise(v) for k, v in doc.items()}
        if "created" in out:
            out["created"] = "<time>"
        if isinstance(out.get("id"), str) and out["id"].startswith("modelperm-"):
            out["id"] = "modelperm-<id>"
        return out
    if isinstance(doc, list):
        return [_normalise(v) for v in doc]
    return doc


def answer_of(status: int, body: bytes) -> dict[str, Any]:
    """A status and body as compared: an error's type and message, or the text."""
    try:
        doc = json.loads(body)
    except ValueError:
        return {"status": status, "text": body.decode(errors="replace")}
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        err = doc["error"]
        return {"status": status, "type": err.get("type"), "message": err.get("message")}
    return {"status": status, "json": "<body>"}


# ---- probes ----------------------------------------------------------------------------------

def models(server: Server) -> Any:
    status, body = server.call("GET", "/v1/models")
    assert status == 200, body
    return _normalise(json.loads(body))


def keyed_blocks(server: Server, tokens: int = 300) -> list[dict[str, Any]]:
    """The same token-id prompt under adapter a, adapter b and the base model, twice: the cached
    tokens each reports (blocks keyed by adapter share nothing across adapters)."""
    prompt = prompt_ids(1, tokens)
    out = []
    for model in ("a", "b", server.model, "a", "b", server.model):
        name = model if model in server.adapters else "<base>"
        status, body = server.call("POST", "/v1/completions", completion_body(model, prompt, 1))
        usage = json.loads(body).get("usage", {}) if status == 200 else {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        out.append({"model": name, "status": status, "cached_tokens": cached})
    return out


class Stream:
    """A streamed completion read in a thread: the monotonic time of each chunk with a choice, and
    the final usage (real vLLM sends no chunk for a token whose text is still an incomplete UTF-8
    sequence, so chunks are not tokens)."""

    def __init__(self, server: Server, body: dict[str, Any]) -> None:
        self.times: list[float] = []
        self.usage: dict[str, Any] = {}
        self.status = 0
        self.done = threading.Event()
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        threading.Thread(target=self._read, args=(server, body), daemon=True).start()

    def _read(self, server: Server, body: dict[str, Any]) -> None:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            while line := resp.readline():
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("choices"):
                    self.times.append(time.monotonic())
                elif chunk.get("usage"):
                    self.usage = chunk["usage"]
        finally:
            conn.close()
            self.done.set()

    def first_token(self, timeout: float = 60.0) -> Stream:
        """Once the first token has arrived (or the stream ended, or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        while not self.times and not self.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        return self

    def join(self, timeout: float = 120.0) -> Stream:
        if not self.done.wait(timeout):
            raise TimeoutError("the stream did not end")
        return self


def batch(server: Server, long_tokens: int = 64) -> dict[str, Any]:
    """A (adapter a, ``long_tokens`` tokens) runs; B (adapter b, half as many) arrives after A's
    first token. Observed: whether they ran together (a label set naming both ever existed: the gauge
    keeps every label set, so this is the server's own record of every step), the newest
    ``vllm:lora_requests_info`` labels as they changed while A ran (polled every 20 ms) and the most
    ``vllm:num_requests_waiting_by_reason{reason="deferred"}`` seen then, the newest labels at the end,
    every label set, and, as seen by this client's threads (milliseconds of noise), the time from A's
    last chunk to B's first."""
    a = Stream(server, completion_body("a", prompt_ids(2, 64), long_tokens))
    a.first_token()
    b = Stream(server, completion_body("b", prompt_ids(3, 64), long_tokens // 2))
    seen: list[str] = []
    deferred = 0.0
    deadline = time.monotonic() + 120
    while not a.done.is_set() and time.monotonic() < deadline:
        scraped = server.scrape()
        deferred = max([deferred, *(s.value for s in scraped
                                    if s.name == BY_REASON and s.labels["reason"] == "deferred")])
        samples = server.lora_info(scraped)
        if samples:
            labels = samples[0][0]
            if seen and not labels["running_lora_adapters"]:
                break  # A's last step is over: its stream ends now
            view = f"running={labels['running_lora_adapters']!r} waiting={labels['waiting_lora_adapters']!r}"
            if not seen or seen[-1] != view:
                seen.append(view)
        time.sleep(0.02)
    a.join(), b.join()
    samples = _settled(server)
    return {
        "status": [a.status, b.status],
        "tokens": [a.usage.get("completion_tokens"), b.usage.get("completion_tokens")],
        "ran_together": any("," in s[0]["running_lora_adapters"] for s in samples),
        "client ms from A's last chunk to B's first": round((b.times[0] - a.times[-1]) * 1000, 1)
        if a.times and b.times else None,
        "newest_while_a_ran": seen,
        "most requests deferred while A ran": deferred,
        "newest_at_end": samples[0][0] if samples else None,
        "label_sets": sorted(s[0]["running_lora_adapters"] for s in samples),
        "max_lora": sorted({s[0]["max_lora"] for s in samples}),
    }


def _settled(server: Server, timeout: float = 5.0) -> list[tuple[dict[str, str], float]]:
    """The gauge once the newest sample names no adapter (the last step's statistics reach the
    metrics a moment after the last response), or as it is at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        samples = server.lora_info()
        if (samples and not samples[0][0]["running_lora_adapters"]) or time.monotonic() > deadline:
            return samples
        time.sleep(0.02)


def load_unload(server: Server, c_path: str) -> list[dict[str, Any]]:
    """The run-time endpoints' answers to one scripted sequence (adapter c not registered yet)."""
    steps: list[tuple[str, str, Any]] = [
        ("load: empty name", "/v1/load_lora_adapter", {"lora_name": "", "lora_path": c_path}),
        ("load: no name", "/v1/load_lora_adapter", {"lora_path": c_path}),
        ("load: the base model's name", "/v1/load_lora_adapter", {"lora_name": server.model, "lora_path": c_path}),
        ("load c", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": c_path}),
        ("load c again", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": c_path}),
        ("load c in place", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": c_path, "load_inplace": True}),
        ("request c", "/v1/completions", completion_body("c", prompt_ids(4, 16), 1)),
        ("unload c", "/v1/unload_lora_adapter", {"lora_name": "c"}),
        ("unload c again", "/v1/unload_lora_adapter", {"lora_name": "c"}),
        ("unload: empty name", "/v1/unload_lora_adapter", {"lora_name": ""}),
        ("request c after unload", "/v1/completions", completion_body("c", prompt_ids(4, 16), 1)),
        ("load: load_inplace not a boolean", "/v1/load_lora_adapter",
         {"lora_name": "d", "lora_path": c_path, "load_inplace": "maybe"}),
    ]
    out = []
    for what, path, body in steps:
        status, raw = server.call("POST", path, body)
        out.append({"step": what, **answer_of(status, raw)})
    status, raw = server.call("GET", "/v1/models")
    out.append({"step": "models after", "ids": [m["id"] if m["id"] != server.model else "<base>"
                                                for m in json.loads(raw)["data"]]})
    return out


def missing_path(server: Server) -> dict[str, Any]:
    """Loading from a path that does not exist (the simulator never reads paths: run it last)."""
    status, raw = server.call("POST", "/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": "/nonexistent/x"})
    return answer_of(status, raw)


def load_times(server: Server) -> dict[str, float]:
    """Latency (ms, one token, non-streamed) of a request of the base model (median of 5), then of one
    whose adapter should come from the CPU cache, one whose adapter holds the slot, and one whose
    adapter should come from disk, given the caches the earlier probes leave with --max-loras 1
    --max-cpu-loras 2 (CPU: b, c; slot: c). Informational: real vLLM on CPU copies nothing to a GPU,
    and the simulator prices a GPU's copies."""
    def ms(model: str) -> float:
        start = time.monotonic()
        status, _ = server.call("POST", "/v1/completions", completion_body(model, prompt_ids(5, 16), 1))
        return round((time.monotonic() - start) * 1000, 1) if status == 200 else -status

    out = {"base model (median of 5)": sorted(ms(server.model) for _ in range(5))[2]}
    for what, model in (("b: from the CPU cache", "b"), ("b: in the slot", "b"), ("a: from disk", "a")):
        out[what] = ms(model)
    return out
