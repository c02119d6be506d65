"""The overhead rig with precise mode (``pick.yaml+events``): real zero backends publishing KV-cache
events, a real precise-mode router, Envoy and wrk. Asserts which cache view the requests took and
what the match found, never milliseconds: the machine is shared.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import orjson
import pytest

from extproc.cli import main as cli_main
from extproc.pick.events.block_hashes import block_hashes as own_hashes
from extproc.pick.tokens.prompt_tokens import ModelTokenizer
from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench import overhead, zero_events
from routerlab.bench.overhead import events
from routerlab.harness.procs import wait_until
from routerlab.realvllm.promtext import fetch_metrics, metric_sum

PRECISE = "pick.yaml+events"
RUN = dict(rounds=1, phase_s=1, sizes=(2,), connections=(16,), warmup_s=0)


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    return overhead.run(overhead.Config(configs=(PRECISE,), **RUN))


def test_the_precise_config_runs_every_arm_and_its_router_took_the_events_view(run: dict[str, Any]) -> None:
    assert {(c["config"], c["arm"]) for c in run["cells"]} == {(PRECISE, a) for a in overhead.ARMS}
    for origins in run["setup"]["kv_view_origins"][PRECISE]:
        assert len(origins) == 2 and set(origins.values()) <= events.COVERED, origins
    router = [p for p in run["phases"] if p["arm"] == "router"]
    assert router and all(p["errors"] == dict.fromkeys(p["errors"], 0) for p in router)
    for p in router:
        counts = p["counts"]
        assert counts["router_count"] > 0 and counts["events_covered"] == counts["router_count"], counts
        assert counts["not_covered"] == 0, counts
    assert any("0 times." in n and PRECISE in n for n in run["notes"]), run["notes"]


def _post(url: str, body: bytes) -> None:
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
        resp.read()


def test_with_the_id_at_the_end_the_match_finds_the_announced_prompt_on_a_backend() -> None:
    cfg = overhead.Config(configs=(PRECISE,), arms=("alone", "router"), id_at="end", **RUN)
    with overhead.Rig(cfg) as rig:
        stack = rig.stacks[(PRECISE, "router")]
        metrics = f"http://127.0.0.1:{stack.metrics_ports[0]}"
        prompt = events.announced_prompts([2], "end")[0]
        blocks = len(prompt) // events.BLOCK_SIZE
        wait_until(lambda: metric_sum(fetch_metrics(metrics), "prefix_router_kv_index_blocks") == 2 * blocks, 10,
                   "both backends' announced blocks in the router's index")
        head, tail = overhead.body_template(2, "end")
        for n in range(3):
            _post(stack.url, head + f"t-{n}".encode() + tail)
        samples = fetch_metrics(metrics)
    assert events.views(samples) == {"events_covered": 3, "not_covered": 0}
    predicted = sum(s.value for s in samples
                    if s.name == "prefix_router_predicted_cached_tokens_total" and s.labels["view"] == "events")
    # all but the blocks the id changes (the last ones) were announced: each request finds most of its prompt
    assert 3 * (blocks - 2) * events.BLOCK_SIZE <= predicted <= 3 * blocks * events.BLOCK_SIZE


def test_the_id_sits_at_the_start_of_the_system_prompt_or_the_end_of_the_prompt() -> None:
    for id_at in ("start", "end"):
        head, tail = overhead.body_template(32, id_at)
        doc = orjson.loads(head + b"ID" + tail)
        assert abs(len(head + tail) - 32 * 1024) < 64
        first, last = doc["messages"][0]["content"], doc["messages"][-1]["content"]
        assert first.startswith("ID") if id_at == "start" else (last.endswith(" ID") and "ID" not in first)
    with pytest.raises(ValueError, match="id_at"):
        overhead.body_template(2, "middle")


def test_the_announced_blocks_are_the_bodies_as_the_router_hashes_them() -> None:
    prompt = events.announced_prompts([2], "start")[0]
    ev = zero_events.stored(prompt, events.BLOCK_SIZE, "zero")
    n = len(prompt) // events.BLOCK_SIZE
    assert len(ev.block_hashes) == n and ev.token_ids == prompt[:n * events.BLOCK_SIZE] and ev.parent_block_hash is None
    assert len(set(ev.block_hashes)) == n
    # the router keys its index on its own hash of the token ids; a request with the same id matches all of it
    head, tail = overhead.body_template(2, "start")
    request = ModelTokenizer(TINY_BYTELEVEL).tokens_for(
        json.loads(head + events.ANNOUNCED_ID.encode() + tail), "chat")
    assert own_hashes(request, events.BLOCK_SIZE) == own_hashes(ev.token_ids, events.BLOCK_SIZE)


def test_events_need_a_picking_config_and_a_known_id_place(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--scenario", "overhead", "--param", "configs=envoy.yaml+events"]) == 2
    assert "needs a config whose router picks" in capsys.readouterr().err
    assert cli_main(["bench", "--scenario", "overhead", "--param", "id_at=middle"]) == 2
    assert "unknown id_at" in capsys.readouterr().err


def test_requests_not_on_the_events_view_are_counted_by_view_and_reason() -> None:
    from routerlab.realvllm.promtext import Sample
    samples = [Sample("prefix_router_cache_view_total", {"view": "events", "reason": "covered"}, 5.0),
               Sample("prefix_router_cache_view_total", {"view": "learned", "reason": "tokenizer_busy"}, 3.0),
               Sample("prefix_router_cache_view_total", {"view": "learned", "reason": "not_json"}, 0.0),
               Sample("prefix_router_cache_view_total", {"view": "events", "reason": "none_covered"}, 1.0)]
    assert events.views(samples) == {"events_covered": 5.0, "not_covered": 4.0,
                                     "not_covered:learned/tokenizer_busy": 3.0,
                                     "not_covered:events/none_covered": 1.0}


def test_mixed_sends_one_request_in_ten_all_new_and_the_others_sharing_the_system_prompt() -> None:
    from routerlab.bench.overhead.wrk import MIXED_NEW_EVERY, lua_script
    assert overhead.body_template(2, "mixed") == overhead.body_template(2, "end")  # what the backends announce
    script = lua_script(2, "mixed")
    shared, new = overhead.body_template(2, "end"), overhead.body_template(2, "start")
    for part in (*shared, *new):
        assert part.decode() in script
    assert f"local new_every = {MIXED_NEW_EVERY}" in script and MIXED_NEW_EVERY == 10
    assert "local new_every = 0" in lua_script(2, "start")
