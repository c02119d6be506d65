"""Model pools in pick mode: ``--pools``, which replicas serve which model, and a pick within them."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from extproc import metrics
from extproc.core.decide import decide
from extproc.core.settings import PoolSpec, RouteSettings, SettingError, parse_value, server_settings
from extproc.pick.choice.pools import NO_MODEL, UNKNOWN_MODEL, Pools, Served
from extproc.pick.choice.state import ReplicaState
from extproc.pick.core import PickCore
from extproc.pick.sources.served_models import ModelLister, parse_models
from routerlab.harness.procs import free_ports

L1, L2, Q1, Q2 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.1.1:8000", "10.0.1.2:8000"
PICK = RouteSettings(mode="pick")


def body(model: str | None, system: str = "You are a helpful assistant. " * 40, question: str = "hi") -> bytes:
    doc: dict[str, object] = {"messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": question}]}
    if model is not None:
        doc["model"] = model
    return json.dumps(doc).encode()


def two_pools() -> PickCore:
    core = PickCore(pools=Pools(["llama", "qwen"]), clock=lambda: 0.0)
    core.set_pool("llama", [L1, L2])
    core.set_pool("qwen", [Q1, Q2])
    return core


# --- settings -----------------------------------------------------------------------------

def test_pools_setting_reads_each_models_source() -> None:
    pools = parse_value("pools", "llama=10.0.0.1:8000,10.0.0.2:8000;\n qwen=dns:vllm-qwen.ns.svc:8000;"
                        "mistral=file:/etc/pools/mistral", "--pools")
    assert pools == (PoolSpec("llama", endpoints=(L1, L2)), PoolSpec("qwen", endpoints_dns="vllm-qwen.ns.svc:8000"),
                     PoolSpec("mistral", endpoints_file="/etc/pools/mistral"))
    assert parse_value("pools", " ", "--pools") == ()


@pytest.mark.parametrize("raw", ["llama", "a=", "=10.0.0.1:8000", "a=10.0.0.1:8000;a=10.0.0.2:8000", "a=dns:nameonly",
                                 "a=file:", "a b=10.0.0.1:8000", "a=not-an-address"])
def test_a_bad_pools_setting_names_the_setting(raw: str) -> None:
    with pytest.raises(SettingError, match="--pools"):
        parse_value("pools", raw, "--pools")


def test_pools_and_another_endpoint_source_are_refused_together() -> None:
    with pytest.raises(SettingError, match="--endpoints and --pools"):
        server_settings(None, {"PREFIX_ROUTER_ENDPOINTS": L1, "PREFIX_ROUTER_POOLS": f"m={L2}"})
    assert server_settings(None, {"PREFIX_ROUTER_POOLS": f"m={L2}"}).pools == (PoolSpec("m", endpoints=(L2,)),)


# --- which pool -----------------------------------------------------------------------------

def test_a_model_resolves_to_its_pool_by_name_alias_or_adapter() -> None:
    pools = Pools(["llama", "qwen"])
    pools.set_members("llama", [L1, L2])
    pools.set_members("qwen", [Q1])
    assert pools.resolve("llama") == ("llama", None)
    assert pools.resolve(None) == (None, NO_MODEL)
    assert pools.resolve("sql-lora") == (None, UNKNOWN_MODEL)
    assert pools.served(L2, [Served("llama"), Served("meta/llama-3.1-8b"), Served("sql-lora", "llama")])
    assert not pools.served(L2, [Served("llama"), Served("meta/llama-3.1-8b"), Served("sql-lora", "llama")])
    assert pools.resolve("sql-lora") == pools.resolve("meta/llama-3.1-8b") == ("llama", None)
    # a pool's own name is never taken by a name another pool's replica lists
    assert pools.served(Q1, [Served("qwen"), Served("llama")]) and pools.resolve("llama") == ("llama", None)
    assert not pools.served("10.9.9.9:1", [Served("x")])  # not a member of any pool: ignored
    pools.set_members("llama", [L1])  # L2 left: what it served goes with it
    assert pools.resolve("sql-lora") == (None, UNKNOWN_MODEL)
    assert pools.pool_of(Q1) == "qwen" and pools.pool_of(L2) is None


# --- the pick ---------------------------------------------------------------------------------

def test_a_request_is_picked_only_among_its_models_replicas() -> None:
    core = two_pools()
    for i in range(20):
        for model, members in (("llama", {L1, L2}), ("qwen", {Q1, Q2})):
            d = decide(body(model, question=f"q{i}"), {}, PICK)
            choice = core.pick(d, PICK)
            assert choice.address in members and choice.pool == model
            assert {c.address for c in choice.candidates} == members
            core.release(choice)
    assert all(core.load.own(a) == 0 for a in (L1, L2, Q1, Q2))


def test_the_load_of_one_pool_never_moves_the_other() -> None:
    core = two_pools()
    held = [core.pick(decide(body("llama", system=f"prompt {i} " * 200), {}, PICK), PICK) for i in range(6)]
    assert {c.address for c in held} == {L1, L2}  # cold prompts spread over llama's two replicas
    before = [core.evaluate(decide(body("qwen", question=f"x{i}"), {}, PICK), PICK)[0] for i in range(8)]
    assert all(c.candidates and {x.in_flight for x in c.candidates} == {0} for c in before)


@pytest.mark.parametrize(("model", "reason"), [(None, NO_MODEL), ("mistral", UNKNOWN_MODEL)])
def test_a_request_no_pool_serves_is_left_to_envoy_and_counted(model: str | None, reason: str) -> None:
    core = two_pools()
    before = metrics.POOL_PICKS.labels("", reason)._value.get()
    choice = core.pick(decide(body(model), {}, PICK), PICK)
    assert (choice.address, choice.reason, choice.pool) == (None, reason, None)
    assert metrics.POOL_PICKS.labels("", reason)._value.get() - before == 1
    assert core.explain(decide(body(model), {}, PICK), PICK)["reason"] == reason


def test_explain_and_state_carry_the_pool_and_a_saved_state_picks_the_same() -> None:
    core = two_pools()
    core.on_models(Q2, [Served("qwen"), Served("chat-lora", "qwen")])
    for address in (L1, Q2):
        core.load.restore(ReplicaState(address, in_flight=3))
    d = decide(body("chat-lora"), {}, PICK)
    live = core.explain(d, PICK)
    assert live["pool"] == "qwen" and {c["address"] for c in live["candidates"]} == {Q1, Q2}
    state = json.loads(json.dumps(core.state()))
    assert state["pools"] == {"llama": [L1, L2], "qwen": [Q1, Q2]} and state["models"]["chat-lora"] == "qwen"
    saved = PickCore.from_state(state)
    assert saved.explain(d, PICK)["address"] == live["address"] == Q1  # Q2 is busier


def test_replica_pool_series_follow_the_members() -> None:
    core = two_pools()
    assert metrics.REPLICA_POOL.labels(Q1, "qwen")._value.get() == 1
    core.set_pool("qwen", [Q2])
    assert (Q1, "qwen") not in {tuple(labels) for labels in metrics.REPLICA_POOL._metrics}
    assert core.load.addresses() == sorted([L1, L2, Q2])


# --- /v1/models ---------------------------------------------------------------------------------

VLLM_MODELS = {  # vLLM's /v1/models with one adapter (fields as vLLM 0.x answers them)
    "object": "list",
    "data": [
        {"id": "llama", "object": "model", "created": 1, "owned_by": "vllm", "root": "/models/llama",
         "parent": None, "max_model_len": 4096, "permission": []},
        {"id": "sql-lora", "object": "model", "created": 1, "owned_by": "vllm", "root": "/adapters/sql",
         "parent": "llama", "max_model_len": None, "permission": []},
    ],
}


def test_parse_models_reads_ids_and_parents_and_refuses_what_is_no_list() -> None:
    assert parse_models(json.dumps(VLLM_MODELS).encode()) == [Served("llama"), Served("sql-lora", "llama")]
    for bad in (b"not json", b"[]", b'{"data": 3}'):
        with pytest.raises(ValueError):
            parse_models(bad)
    assert parse_models(b'{"data": [{"id": 7}, {"id": "x", "parent": 5}, "y"]}') == [Served("x")]


async def _list_models(ports: list[int]) -> dict[str, list[Served]]:
    """Two real HTTP servers on loopback (one answers /v1/models as vLLM does, one answers 500) and a
    port with nothing on it, listed once; what the lister heard, by address."""
    async def models(_: web.Request) -> web.Response:
        return web.json_response(VLLM_MODELS)

    async def broken(_: web.Request) -> web.Response:
        return web.Response(status=500)

    runners = []
    try:
        for port, handler in zip(ports, (models, broken), strict=True):
            app = web.Application()
            app.router.add_get("/v1/models", handler)
            runner = web.AppRunner(app)
            runners.append(runner)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        heard: dict[str, list[Served]] = {}
        addresses = [f"127.0.0.1:{port}" for port in ports]
        lister = ModelLister(lambda: [*addresses, "127.0.0.1:1"], 1.0, lambda a, m: heard.__setitem__(a, list(m)))
        await lister.poll_once()
        await lister.stop()
        return heard
    finally:
        for runner in runners:
            await runner.cleanup()


def test_the_lister_reads_each_replicas_models_and_keeps_quiet_about_a_broken_one() -> None:
    ports = free_ports(2)
    heard = asyncio.run(_list_models(ports))
    assert heard == {f"127.0.0.1:{ports[0]}": [Served("llama"), Served("sql-lora", "llama")]}
