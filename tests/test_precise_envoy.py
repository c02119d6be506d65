"""Precise mode end to end: real Envoy (pick.yaml), the router subscribed to the replicas' KV-cache
events, and simulated vLLM replicas that tokenise with a real (tiny) tokenizer and publish events.

The check that counts: for every request, the router's exact view (asked on its /debug/pick just
before the request goes through Envoy) names the same prompt length as the replica's
``usage.prompt_tokens``, and the same cached tokens, for the replica that served it, as the
replica's own ``prompt_tokens_details.cached_tokens``, through a multi-turn trace with evictions.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest

from routerlab.assets import TINY_BYTELEVEL, TINY_METASPACE
from routerlab.bench.arms import ARMS, UPSTREAM_HEADER, RunningArm
from routerlab.bench.backends import SimBackend
from routerlab.bench.scenarios import FleetSpec
from routerlab.harness.procs import wait_until

from support import metric, send

MODEL = "sim-tiny"
INLINE_CHARS = 300
SYSTEMS = [f"You are assistant number {i} of the ACME platform team; answer with runbook steps, briefly. " * 6
           for i in range(3)]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


class Stack:
    def __init__(self, fleet: SimBackend, arm: RunningArm) -> None:
        self.fleet = fleet
        self.arm = arm
        self.port = int(arm.url.rsplit(":", 1)[1])
        self.metrics_port = arm.metrics_ports[0]

    def published(self) -> int:
        """Event batches the replicas have published so far."""
        return sum(get_json(f"{url}/sim/state")["kv_events"]["next_seq"] for url in self.fleet.urls)

    def caught_up(self) -> None:
        """Until the router has applied every batch the replicas published (no fixed sleep)."""
        wait_until(lambda: metric(self.metrics_port, "prefix_router_kv_batches_total") >= self.published(), 10,
                   "the router to apply every published event batch")

    def explain(self, body: bytes) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.metrics_port}/debug/pick", data=body,
                                         method="POST", headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.loads(resp.read())


@pytest.fixture(scope="module", params=["prefix-precise", "prefix-precise-fast"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """pick.yaml's ext_proc hop, or pick-fast.yaml's ext_authz over HTTP (the ends from Envoy's access log)."""
    # 2 replicas of 48 blocks of 16 tokens: a few conversations evict each other's blocks
    spec = FleetSpec(replicas=2, profile="tiny", time_scale=0.05, block_size=16, num_blocks=48,
                     tokenizer=str(TINY_BYTELEVEL), kv_events=True)
    fleet = SimBackend(spec).start()
    try:
        # new text longer than 300 characters is tokenised on the router's worker thread, not in the pick
        with RunningArm(ARMS[request.param], fleet.urls, router_metrics=True, event_flags=fleet.event_flags(),
                        router_flags=("--tokenize-inline-chars", str(INLINE_CHARS))) as arm:
            stack = Stack(fleet, arm)
            wait_until(lambda: metric(stack.metrics_port, "prefix_router_kv_view_origin", origin="none") == 0
                       and metric(stack.metrics_port, "prefix_router_kv_view_origin") == 2, 15,
                       "the router to hear from both replicas")
            if request.param.endswith("-fast"):  # Envoy opens its access-log stream with its first entry
                assert send(stack.port, body=chat_body("hello")).status == 200
                wait_until(lambda: metric(stack.metrics_port, "prefix_router_access_log_streams") == 1, 10,
                           "Envoy's access-log stream to the router")
            yield stack
    finally:
        fleet.stop()


def conversation(system: str, turns: int, tag: str) -> Iterator[list[dict]]:
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"{tag}: question {t} about the deploy, in detail please."})
        yield list(messages)
        messages.append({"role": "assistant", "content": f"Answer {t} for {tag}: restart the pods, then check."})


def test_the_router_knows_each_replicas_cached_tokens_exactly(stack: Stack) -> None:
    bodies = []
    convs = [conversation(SYSTEMS[i % 3], 6, f"user{i}") for i in range(6)]
    for _ in range(6):  # interleave the conversations turn by turn
        for conv in convs:
            msgs = next(conv, None)
            if msgs is not None:
                bodies.append(json.dumps({"model": MODEL, "messages": msgs, "max_tokens": 4}).encode())
    rows = []
    for body in bodies:
        stack.caught_up()
        seen = stack.explain(body)
        reply = send(stack.port, body=body)
        assert reply.status == 200, reply.body
        usage = reply.json()["usage"]
        served = reply.headers[UPSTREAM_HEADER]
        predicted = {c["address"]: c for c in seen["candidates"]}[served]
        assert predicted["view"] == "events" and predicted["events_origin"] in ("events", "replayed")
        rows.append((seen["prompt_tokens"], usage["prompt_tokens"], predicted["cached_tokens"],
                     usage["prompt_tokens_details"]["cached_tokens"]))
    assert [r[0] for r in rows] == [r[1] for r in rows]  # the prompt length, exact, every request
    assert [r[2] for r in rows] == [r[3] for r in rows]  # the cached tokens on the serving replica, exact
    assert sum(r[3] for r in rows) > 0 and any(r[2] < r[0] - 16 for r in rows)  # hits, and misses
    evicted = sum(get_json(f"{url}/sim/state")["evictions"] for url in stack.fleet.urls)
    assert evicted > 0, rows  # the trace outgrew the caches: the view followed evictions too


def test_a_request_that_cannot_be_tokenised_is_routed_on_the_learned_view(stack: Stack) -> None:
    before = metric(stack.metrics_port, "prefix_router_cache_view_total", reason="multimodal", view="learned")
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}).encode()
    reply = send(stack.port, body=body)  # the replica refuses it (as vLLM would a non-vision model)
    assert reply.status == 400
    after = metric(stack.metrics_port, "prefix_router_cache_view_total", reason="multimodal", view="learned")
    assert after == before + 1


@pytest.mark.parametrize("outcome,system", [
    # 120 words never seen (767 chars): more new words than the word cache may take, so the worker
    ("done", " ".join(f"rq{i:03d}z" for i in range(120)) + " ACME change requests."),
    # one sentence nine times (747 chars): its words are seen after the first, so the word cache on the loop
    ("words", "You review ACME change requests for risk and answer in three short bullet points. " * 9),
], ids=["new-words-on-the-worker", "words-seen-on-the-loop"])
def test_a_long_new_prompt_is_tokenised_before_the_pick_and_routed_on_the_events(stack: Stack, outcome: str,
                                                                                 system: str) -> None:
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "Is a schema migration risky?"}]}).encode()
    assert len(system) > INLINE_CHARS
    if outcome == "words":  # a short request first (tokenised in its pick) brings the sentence's words
        sentence = system[:system.index(".") + 1]
        assert send(stack.port, body=json.dumps({"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": sentence}]}).encode()).status == 200
    before = metric(stack.metrics_port, "prefix_router_tokenize_ahead_total", outcome=outcome)
    events = metric(stack.metrics_port, "prefix_router_cache_view_total", view="events", reason="covered")
    stack.caught_up()
    reply = send(stack.port, body=body)
    assert reply.status == 200, reply.body
    assert metric(stack.metrics_port, "prefix_router_tokenize_ahead_total", outcome=outcome) == before + 1
    assert metric(stack.metrics_port, "prefix_router_cache_view_total", view="events", reason="covered") == events + 1
    assert metric(stack.metrics_port, "prefix_router_cache_view_total", reason="tokenizer_busy") == 0
    # the text tokenised ahead is what vLLM computed: the router's prompt length is the replica's
    assert stack.explain(body)["prompt_tokens"] == reply.json()["usage"]["prompt_tokens"]


def chat_body(text: str) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": text}]}).encode()


def test_the_router_checks_its_tokenizer_against_the_replicas_own(stack: Stack) -> None:
    """The first request of a model is checked against the replica's POST /tokenize: they agree."""
    assert send(stack.port, body=chat_body("is the tokenizer right?")).status == 200
    wait_until(lambda: metric(stack.metrics_port, "prefix_router_tokenizer_checks_total", result="match") >= 1, 10,
               "a tokenizer check")
    assert metric(stack.metrics_port, "prefix_router_tokenizer_checks_total", result="mismatch") == 0
    assert metric(stack.metrics_port, "prefix_router_tokenizer_trusted", model=MODEL) == 1
    # the chat texts were spliced (the tiny template only copies contents), and no splice disagreed with Jinja
    assert metric(stack.metrics_port, "prefix_router_chat_renders_total", how="spliced") >= 1
    assert metric(stack.metrics_port, "prefix_router_chat_renders_total", how="disagreed") == 0


def test_a_router_given_the_wrong_tokenizer_notices_and_routes_on_the_learned_view(stack: Stack) -> None:
    """A second router pointed at another tokenizer family (Metaspace, not the replicas' byte-level
    BPE): its first check disagrees, it says so in a metric and routes that model on the learned view."""
    wrong = [f"--tokenizer={MODEL}={TINY_METASPACE}", "--tokenizer-check-every=1"]
    with RunningArm(ARMS["prefix-precise"], stack.fleet.urls, router_metrics=True,
                    event_flags=stack.fleet.event_flags(), router_flags=wrong) as arm:
        port, metrics_port = int(arm.url.rsplit(":", 1)[1]), arm.metrics_ports[0]
        assert send(port, body=chat_body("first, checked")).status == 200
        wait_until(lambda: metric(metrics_port, "prefix_router_tokenizer_checks_total", result="mismatch") >= 1, 10,
                   "the tokenizer check to find the mismatch")
        assert metric(metrics_port, "prefix_router_tokenizer_trusted", model=MODEL) == 0
        assert send(port, body=chat_body("second, after the check")).status == 200
        assert metric(metrics_port, "prefix_router_cache_view_total", view="learned", reason="tokenizer_mismatch") >= 1
