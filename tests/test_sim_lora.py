"""Base models and LoRA adapters in the simulated vLLM: the batch's adapter limit, the adapter
caches and their load times, /v1/models, run-time load and unload, vllm:lora_requests_info, and
prefix-cache blocks keyed by adapter. Real sockets on 127.0.0.1 (fleets in-process; the CLI once
in a subprocess); what vLLM 0.32 does is in the modules' docstrings and docs/simulator-api.md."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import orjson
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from routerlab.harness.procs import free_port_run, free_ports
from routerlab.realvllm import lora_fidelity
from routerlab.realvllm.lora_probes import Server, Stream
from routerlab.sim import cli
from routerlab.sim.fleet import FleetThread, Pool, SimConfig
from routerlab.sim.kv_cache import KVCache, extra_keys
from routerlab.sim.kv_events import KvEventPublisher
from routerlab.sim.lora import AdapterCache, LoraConfig, LoraModule
from routerlab.sim.profiles import get_profile
from routerlab.sim.scheduler import Scheduler, Sequence

from test_sim_http import Client, sim_cli, unique_text

MODEL = "sim-tiny"


def modules(*names: str) -> tuple[LoraModule, ...]:
    return tuple(LoraModule(n, f"/adapters/{n}") for n in names)


@contextlib.contextmanager
def serving(lora: LoraConfig | None = None, time_scale: float = 20.0, **config: Any) -> Iterator[list[Client]]:
    ft = FleetThread(SimConfig(base_port=0, time_scale=time_scale, lora=lora, **config))
    fleet = ft.start()
    try:
        yield [Client(u) for u in fleet.urls]
    finally:
        ft.stop()


def until(check: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return value


def completion(model: str, prompt: str, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **extra}


def cached(c: Client, model: str, prompt: str) -> int:
    status, body = c.post("/v1/completions", completion(model, prompt))
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def stream(c: Client, body: dict[str, Any]) -> Stream:
    """A streamed completion read in a thread (the fidelity probes' reader)."""
    return Stream(Server(c.url, MODEL, {}), body)


# ---- the batch rule (vLLM v1 scheduler) -----------------------------------------------------

def seq(req_id: str, lora_id: int = 0, lora: str | None = None, max_tokens: int = 3) -> Sequence:
    prompt = [7, 8, 9, 10, 11] * 4
    return Sequence(req_id, prompt, max_tokens, extra_keys(lora or MODEL, None), lora_id=lora_id, lora_name=lora)


def run_to_end(sched: Scheduler, steps: int = 100) -> list[set[str]]:
    """Every step's adapters (by name) until nothing is left (bounded)."""
    seen: list[set[str]] = []
    now = 0.0
    for _ in range(steps):
        if not sched.has_work():
            return seen
        plan = sched.schedule()
        seen.append({s.lora_name for s, _ in plan.scheduled if s.lora_name})
        now += plan.duration
        sched.complete(plan, now)
    raise AssertionError("the scheduler did not drain")


def test_a_request_whose_adapter_finds_no_slot_is_skipped_and_those_behind_it_still_run() -> None:
    sched = Scheduler(get_profile("tiny"), adapters=AdapterCache(1, 4, 0.0, 0.0))
    for s in (seq("a1", 1, "a"), seq("b1", 2, "b"), seq("a2", 1, "a"), seq("base"), seq("c1", 3, "c")):
        sched.add(s)
    plan = sched.schedule()
    assert [s.req_id for s, _ in plan.scheduled] == ["a1", "a2", "base"]
    assert [s.req_id for s in sched.waiting] == ["b1", "c1"]  # still waiting, at their places
    assert sched.counters.lora_slot_waits == 2 and sched.deferred == 2
    steps = run_to_end(sched, 100)
    assert all(len(names) <= 1 for names in steps)  # never two adapters in one step
    order = [next(iter(n)) for n in steps if n]
    assert order.index("b") < order.index("c") and "a" not in order[order.index("b"):]  # FCFS among adapters
    assert sched.counters.lora_slot_waits == 2  # a request counts once, however many steps it waits
    assert sched.deferred == 0


def test_with_two_slots_two_adapters_share_a_step_and_a_third_waits() -> None:
    sched = Scheduler(get_profile("tiny"), adapters=AdapterCache(2, 4, 0.0, 0.0))
    for s in (seq("a1", 1, "a"), seq("b1", 2, "b"), seq("c1", 3, "c"), seq("b2", 2, "b")):
        sched.add(s)
    plan = sched.schedule()
    assert [s.req_id for s, _ in plan.scheduled] == ["a1", "b1", "b2"]
    assert [s.req_id for s in sched.waiting] == ["c1"]
    assert all(len(names) <= 2 for names in run_to_end(sched))


def test_over_http_a_second_adapter_starts_only_after_the_first_adapters_request_ends() -> None:
    """max_loras=1: B (adapter b) arrives while A (adapter a) runs; B's first token comes after A's
    last. With max_loras=2 they overlap. Real time (time scale 1): A runs 60 steps of ~2 ms."""
    for max_loras in (1, 2):
        with serving(LoraConfig(max_loras, modules=modules("a", "b")), time_scale=1.0) as (c,):
            a = stream(c, completion("a", unique_text("A", 200), max_tokens=60)).first_token()
            b = stream(c, completion("b", unique_text("B", 200), max_tokens=3))
            a.join(), b.join()
            assert a.status == b.status == 200 and len(a.times) == 60
            waits = c.get_json("/sim/state")["lora_slot_waits"]
            if max_loras == 1:
                assert b.times[0] > a.times[-1] and waits == 1
            else:
                assert b.times[0] < a.times[-1] and waits == 0


# ---- the adapter caches and their load times ----------------------------------------------

def test_the_cpu_cache_evicts_the_least_recently_used_adapter_and_each_load_is_priced() -> None:
    cache = AdapterCache(slots=1, cpu_capacity=2, load_s=0.5, activate_s=0.01)

    def load(lora_id: int) -> tuple[int, int, float]:
        cost = cache.apply([lora_id])
        return cost.from_disk, cost.from_cpu, round(cost.seconds, 6)

    assert load(1) == (1, 0, 0.51)  # disk, then into the slot
    assert load(1) == (0, 0, 0.0)  # holds the slot
    assert load(2) == (1, 0, 0.51)
    assert load(1) == (0, 1, 0.01)  # in CPU memory, not in the slot
    assert load(3) == (1, 0, 0.51)  # the CPU cache is full: 2, the least recently used, goes
    assert list(cache.cpu) == [1, 3] and load(2) == (1, 0, 0.51) and list(cache.cpu) == [3, 2]
    two = AdapterCache(slots=2, cpu_capacity=2, load_s=0.5, activate_s=0.01)
    two.apply([1, 2])
    two.apply([3])  # evicting 1 from CPU memory takes it out of its slot too
    assert list(two.gpu) == [2, 3] and list(two.cpu) == [2, 3]


def test_a_load_lengthens_the_step_that_needs_it_and_the_counters_say_from_where() -> None:
    """Start: a, b, c preloaded in order (CPU cache of 2: b, c; the one slot: c). TTFT in model
    seconds from the replica's own histogram: a disk load costs load_s + activate_s, a CPU one
    activate_s, an adapter holding the slot nothing."""
    lora = LoraConfig(1, 2, modules("a", "b", "c"), load_s=2.0, activate_s=0.2)
    with serving(lora) as (c,):
        ttft = "vllm:time_to_first_token_seconds_sum" + '{engine="0",model_name="sim-tiny"}'

        def first_token_s(model: str) -> float:
            before = c.metrics()[ttft]
            assert cached(c, model, unique_text(model, 80)) == 0
            return c.metrics()[ttft] - before

        assert 2.2 <= first_token_s("a") < 2.4  # CPU memory holds b, c: from disk, b leaves
        assert 2.2 <= first_token_s("b") < 2.4  # CPU memory holds c, a: from disk again, c leaves
        assert 0.2 <= first_token_s("a") < 0.4  # in CPU memory (a, b), not in the slot
        assert first_token_s("a") < 0.1  # holds the slot
        assert first_token_s(MODEL) < 0.1  # the base model needs no adapter
        st = c.get_json("/sim/state")
        assert (st["lora_loads_disk"], st["lora_loads_cpu"]) == (2, 1)
        assert st["lora_adapters"] == {"a": 1, "b": 2, "c": 3}
        assert st["lora_cpu_cache"] == [2, 1] and st["lora_gpu_slots"] == [1]
        text = c.request("GET", "/metrics")[1].decode()
        assert 'sim:lora_adapter_loads_total{engine="0",model_name="sim-tiny",source="disk"} 2.0' in text
        assert 'sim:lora_adapter_loads_total{engine="0",model_name="sim-tiny",source="cpu"} 1.0' in text


# ---- /v1/models, load and unload -----------------------------------------------------------

PERMISSION_KEYS = ["id", "object", "created", "allow_create_engine", "allow_sampling", "allow_logprobs",
                   "allow_search_indices", "allow_view", "allow_fine_tuning", "organization", "group", "is_blocking"]


def test_models_lists_the_base_model_then_each_adapter_with_its_parent_and_path() -> None:
    with serving(LoraConfig(1, modules=modules("a", "b"))) as (c,):
        data = c.get_json("/v1/models")["data"]
    assert [(m["id"], m["root"], m["parent"], m["max_model_len"]) for m in data] == [
        (MODEL, MODEL, None, 8192), ("a", "/adapters/a", MODEL, None), ("b", "/adapters/b", MODEL, None)]
    for card in data:
        assert list(card) == ["id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"]
        assert (card["object"], card["owned_by"], len(card["permission"])) == ("model", "vllm", 1)
        perm = card["permission"][0]
        assert list(perm) == PERMISSION_KEYS and perm["id"].startswith("modelperm-")
        assert (perm["object"], perm["allow_sampling"], perm["organization"]) == ("model_permission", True, "*")


def test_load_and_unload_answer_as_vllm_and_change_what_the_replica_serves() -> None:
    with serving(LoraConfig(1, modules=modules("a"))) as (c,):  # run-time updating off: no such routes
        assert c.request("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})[0] == 404
    with serving(LoraConfig(1, modules=modules("a"), runtime_updating=True)) as (c,):
        def post(path: str, body: Any) -> tuple[int, Any]:
            status, data, _ = c.request("POST", path, body)
            return status, data.decode() if status == 200 else orjson.loads(data)["error"]

        def ids() -> list[str]:
            return [m["id"] for m in c.get_json("/v1/models")["data"]]

        status, err = post("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/x"})
        assert (status, err["message"], err["type"]) == (400, "Both 'lora_name' and 'lora_path' must be provided.",
                                                         "InvalidUserInput")
        assert post("/v1/load_lora_adapter", {"lora_path": "/x"})[0] == 400
        status, err = post("/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "/x"})
        assert status == 400 and "conflicts with a served base model" in err["message"]
        assert post("/v1/completions", completion("x", "hello"))[0] == 404  # unknown, and uses up id 2
        assert post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}) == (
            200, "Success: LoRA adapter 'x' added successfully.")
        st = c.get_json("/sim/state")
        assert st["lora_adapters"] == {"a": 1, "x": 3} and st["lora_loads_disk"] == 1
        assert st["lora_gpu_slots"] == [3]  # loaded and activated, as vLLM's add_lora
        assert ids() == [MODEL, "a", "x"] and post("/v1/completions", completion("x", "hello"))[0] == 200
        status, err = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})
        assert status == 400 and err["message"].startswith("The lora adapter 'x' has already been loaded.")
        assert post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x2", "load_inplace": True})[0] == 200
        st = c.get_json("/sim/state")
        assert st["lora_adapters"] == {"a": 1, "x": 3} and st["lora_loads_disk"] == 2  # same id, read again
        assert c.get_json("/v1/models")["data"][2]["root"] == "/x2"
        assert post("/v1/unload_lora_adapter", {"lora_name": "x"}) == (
            200, "Success: LoRA adapter 'x' removed successfully.")
        assert ids() == [MODEL, "a"]
        status, err = post("/v1/completions", completion("x", "hello"))
        assert (status, err["message"]) == (404, f"The model `x` does not exist. Valid aliases: {MODEL}.")
        status, err = post("/v1/unload_lora_adapter", {"lora_name": "x"})
        assert (status, err["message"], err["type"]) == (404, "The lora adapter 'x' cannot be found.", "NotFoundError")
        assert post("/v1/unload_lora_adapter", {"lora_name": ""})[0] == 400
        assert post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})[0] == 200
        assert c.get_json("/sim/state")["lora_adapters"]["x"] == 5  # a new id (4 went to the unknown `x`)


def test_a_restart_keeps_the_started_adapters_and_loses_the_ones_loaded_at_run_time() -> None:
    with serving(LoraConfig(1, modules=modules("a", "b"), runtime_updating=True)) as (c,):
        assert c.request("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})[0] == 200
        assert cached(c, "a", unique_text("before", 80)) == 0
        st = c.control(restart=True)
        assert st["lora_adapters"] == {"a": 1, "b": 2} and st["lora_gpu_slots"] == [2]  # as at start
        assert (st["lora_loads_disk"], st["lora_loads_cpu"]) == (0, 0)
        assert c.post("/v1/completions", completion("x", "hello"))[0] == 404
        assert cached(c, "a", unique_text("after", 80)) == 0 and lora_info(c)[0][0]["max_lora"] == "1"


# ---- vllm:lora_requests_info --------------------------------------------------------------------

def lora_info(c: Client) -> list[tuple[dict[str, str], float]]:
    """Every sample of the gauge, newest (largest value) first."""
    text = c.request("GET", "/metrics")[1].decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families["vllm:lora_requests_info"]
    assert family.type == "gauge" and family.documentation == "Running stats on lora requests."
    return sorted(((s.labels, s.value) for s in family.samples), key=lambda s: -s[1])


def test_lora_requests_info_names_the_adapters_past_their_first_token_with_the_newest_sample_current() -> None:
    with serving(LoraConfig(1, modules=modules("a", "b")), time_scale=1.0) as (c,):
        assert lora_info(c) == []  # no step yet: the family without a sample, as vLLM
        a = stream(c, completion("a", unique_text("A", 200), max_tokens=80)).first_token()
        b = stream(c, completion("b", unique_text("B", 200), max_tokens=2))
        until(lambda: c.get_json("/sim/state")["lora_slot_waits"] == 1, "B waiting for the slot")
        waiting = c.metrics()
        reason = 'vllm:num_requests_waiting_by_reason{engine="0",model_name="sim-tiny",reason="%s"}'
        assert (waiting[reason % "deferred"], waiting[reason % "capacity"]) == (1.0, 0.0)  # vLLM 0.32's split
        (labels, value), *_ = lora_info(c)
        # vLLM 0.32 learns of a request with its first token, and both labels list the same adapters
        assert labels == {"max_lora": "1", "running_lora_adapters": "a", "waiting_lora_adapters": "a"}
        assert abs(value - time.time()) < 5  # a Unix time, set at the last step
        a.join(), b.join()
        samples = lora_info(c)
        assert samples[0][0] == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        running = [s[0]["running_lora_adapters"] for s in samples]
        assert sorted(running) == ["", "a", "b"]  # label sets stay, each with the time it was last current
        assert running.index("b") < running.index("a")  # b ran after a


def test_without_lora_there_is_no_lora_metric_and_no_adapter_state() -> None:
    with serving() as (c,):
        assert cached(c, MODEL, unique_text("base", 80)) == 0
        assert "lora" not in c.request("GET", "/metrics")[1].decode()
        assert not any("lora" in k for k in c.get_json("/sim/state"))
        assert c.post("/v1/completions", completion("a", "hello"))[0] == 404


# ---- prefix-cache blocks keyed by adapter ----------------------------------------------------

def test_the_same_prompt_under_two_adapters_shares_no_block_and_under_one_adapter_hits() -> None:
    with serving(LoraConfig(2, modules=modules("a", "b"))) as (c,):
        prompt = unique_text("shared", 400)  # 100 tokens: a repeat hits 96
        assert cached(c, "a", prompt) == 0
        assert cached(c, "b", prompt) == 0
        assert cached(c, MODEL, prompt) == 0
        assert cached(c, "a", prompt) == 96
        assert cached(c, "b", prompt) == 96
        assert cached(c, MODEL, prompt) == 96


def test_kv_events_carry_the_adapter_as_vllm_s_do() -> None:
    """BlockStored of an adapter's request: lora_id, lora_name, and the name in every block's extra
    keys (the salt after it on block 0); on the wire as vLLM's publisher sends them."""
    (events,) = free_ports(1)
    pub = KvEventPublisher(events_port=events, replay_port=None, encoding="map")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{events}")
        until(lambda: pub.subscriptions() >= 1, "the subscription")
        sched = Scheduler(get_profile("tiny"), KVCache(64, 4, pub), adapters=AdapterCache(1, 1, 0.0, 0.0))
        tokens = list(range(100, 110))  # 2 full blocks of 4, then 2 tokens
        sched.add(Sequence("r", tokens, 1, extra_keys("a", "salt", "/adapters/a"), cache_salt="salt", lora_id=7,
                           lora_name="a"))
        sched.add(Sequence("base", [t + 50 for t in tokens], 1, extra_keys(MODEL, None)))
        sched.complete(sched.schedule(), 0.0)
        pub.flush()
        assert sub.poll(5000), "no event batch"
        _, _, payload = sub.recv_multipart()
        stored = [e for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored"]
        assert [(e["lora_id"], e["lora_name"], e["extra_keys"]) for e in stored] == [
            (7, "a", [["a", "salt"], ["a"]]), (None, None, [None, None])]
    finally:
        sub.close(linger=0)
        pub.close()


# ---- several base models -------------------------------------------------------------------

def test_a_fleet_of_two_models_serves_each_on_its_pool_and_adapters_on_their_base() -> None:
    lora = LoraConfig(1, modules=(LoraModule("a-small", "/s", "small"), LoraModule("any", "/any")))
    with serving(lora, pools=(Pool("small", 2), Pool("big", 1, "llama-3.1-70b-h100-tp8"))) as fleet:
        assert len(fleet) == 3
        served = [[m["id"] for m in c.get_json("/v1/models")["data"]] for c in fleet]
        assert served == [["small", "a-small", "any"]] * 2 + [["big", "any"]]
        parents = [m["parent"] for m in fleet[2].get_json("/v1/models")["data"]]
        assert parents == [None, "big"]
        states = [c.get_json("/sim/state") for c in fleet]
        assert [(s["model"], s["profile"]) for s in states] == [
            ("small", "tiny"), ("small", "tiny"), ("big", "llama-3.1-70b-h100-tp8")]
        assert cached(fleet[0], "a-small", "hello there") == 0
        status, body = fleet[2].post("/v1/completions", completion("small", "hello"))
        assert (status, body["error"]["message"]) == (404, "The model `small` does not exist. Valid aliases: big.")
        assert 'model_name="big"' in fleet[2].request("GET", "/metrics")[1].decode()


def test_pools_adapters_and_their_settings_are_checked_up_front() -> None:
    assert Pool.parse("meta/llama-8b=4:tiny") == Pool("meta/llama-8b", 4, "tiny")
    assert Pool.parse("m=2") == Pool("m", 2)
    for bad in ("m", "m=0", "=2", "m=x", "m=2:nope"):
        with pytest.raises(ValueError):
            Pool.parse(bad)
    assert LoraModule.parse("a=/p/a") == LoraModule("a", "/p/a")
    assert LoraModule.parse('{"name": "a", "path": "/p", "base_model_name": "m"}') == LoraModule("a", "/p", "m")
    for bad in ('{"name": "a"}', "{oops", '{"name": "a", "path": "/p", "rank": 8}'):
        with pytest.raises(ValueError):
            LoraModule.parse(bad)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoraConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError):
        SimConfig(model="m", pools=(Pool("a", 1),))
    with pytest.raises(ValueError):
        SimConfig(replicas=3, pools=(Pool("a", 1), Pool("b", 1)))
    with pytest.raises(ValueError):
        SimConfig(pools=(Pool("a", 1), Pool("a", 1)))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for argv in (["--lora-modules", "a=/p"], ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"],
                 ["--pool", "a=1", "--model", "b"], ["--pool", "a=two"]):
        assert cli.run(parser.parse_args(argv)) == 2, argv


def test_cli_serves_two_models_and_adapters() -> None:
    base = free_port_run(2)
    args = ["--pool", "small=1", "--pool", "big=1:tiny", "--base-port", str(base), "--time-scale", "20",
            "--enable-lora", "--max-loras", "2", "--lora-modules", "a=/a",
            '{"name": "b", "path": "/b", "base_model_name": "big"}']
    with sim_cli(args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as lines:
        assert [ln.split(" block_size")[0] for ln in lines[:2]] == ["sim: profile=tiny model=small",
                                                                    "sim: profile=tiny model=big"], lines
        assert lines[2] == "sim: lora max_loras=2 max_cpu_loras=2 modules=a,b runtime_updating=true", lines
        small, big = Client(f"http://127.0.0.1:{base}"), Client(f"http://127.0.0.1:{base + 1}")
        assert cached(small, "a", "hello") == 0 and cached(big, "b", "hello") == 0
        assert small.post("/v1/completions", completion("b", "hello"))[0] == 404
        assert small.request("POST", "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/c"})[0] == 200


# ---- the real-vLLM comparison tool, on two simulators ------------------------------------------

def test_the_lora_fidelity_probes_find_two_simulators_alike() -> None:
    """routerlab.realvllm.lora_fidelity compares real vLLM with the simulator (docs/fidelity.md);
    here both sides are simulators, so every observation must agree and show the batch rule."""
    paths = {n: f"/adapters/{n}" for n in "abc"}
    lora = LoraConfig(1, 2, modules("a", "b"), runtime_updating=True)
    seen = []
    for _ in range(2):
        with serving(lora, time_scale=1.0, model="/models/tiny") as (c,):
            # A decodes 400 tokens (about a second of 2 ms steps): B, sent after A's first token, must
            # reach the replica and be seen deferred while A runs, on a busy machine too (24 tokens,
            # 50 ms, missed it once)
            seen.append(lora_fidelity.observe(Server(c.url, "/models/tiny", {"a": paths["a"], "b": paths["b"]}),
                                              paths["c"], long_tokens=400))
    table = lora_fidelity.rows(*seen)
    assert all(r["same"] for r in table if r["same"] is not None), [r for r in table if r["same"] is False]
    times = seen[0]["load_times_ms"]  # the tiny profile: 20 ms from disk, 1 ms from CPU memory
    assert times["a: from disk"] > 20 > times["b: from the CPU cache"]
    batch = seen[0]["batch"]
    assert not batch["ran_together"] and batch["newest_while_a_ran"] == ["running='a' waiting='a'"]
    assert [r["cached_tokens"] for r in seen[0]["keyed_blocks"]] == [0, 0, 0, 288, 288, 288]  # 300 tokens, blocks of 16
    assert "| batch: ran_together | false | false | yes |" in lora_fidelity.markdown(table, 1)
