"""Conversations that resend their growing history: multi-turn, and zipf-chat at saturation."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from routerlab.bench.scenarios.parts import TEMPLATE_TOKENS, blocks, zipf_weights
from routerlab.bench.scenarios.spec import (
    DEFAULT_ARMS,
    SHARED_VARIANT,
    FleetEvent,
    FleetSpec,
    LoadSpec,
    Params,
    Scenario,
)
from routerlab.bench.trace import TextSource, build_sessions, chat_body, encode

# --- multi-turn -------------------------------------------------------------------------

@lru_cache(maxsize=1024)
def _assistant_reply(tokens: int) -> str:
    """What the simulator generates for ``tokens`` output tokens (its deterministic filler)."""
    from routerlab.sim.tokenizer import output_token

    return "".join(output_token(i)[1] for i in range(tokens))


def _multi_turn(p: Params, rng: random.Random, model: str):
    """Conversations: a per-conversation context, then turns whose history grows."""
    text = TextSource(rng)
    conversations = max(1, math.ceil(p["requests"] / p["turns"]))
    reply = _assistant_reply(p["output_tokens"])
    chains = []
    for c in range(conversations):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": text.text(p["context_tokens"], tag=f"conversation {c}")}]
        chain = []
        for _ in range(p["turns"]):
            messages.append({"role": "user", "content": text.text(text.between(p["user_min"], p["user_max"]))})
            chain.append((encode(chat_body(model, list(messages), p["output_tokens"])), f"conv-{c}",
                          p["output_tokens"], ()))
            messages.append({"role": "assistant", "content": reply})
        chains.append(chain)
    return build_sessions(chains)


def _multi_turn_fleet(p: Params) -> FleetSpec:
    final = p["context_tokens"] + p["turns"] * (p["user_max"] + p["output_tokens"] + 2 * TEMPLATE_TOKENS)
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"],
                     num_blocks=p["kv_conversations_per_replica"] * blocks(final) + 1)


MULTI_TURN = Scenario(
    name="multi-turn",
    summary="40 conversations x 6 turns; each starts from its own 1200-token context and the "
            "history grows turn by turn (8 conversations in flight)",
    params=dict(requests=240, turns=6, context_tokens=1200, user_min=32, user_max=128, output_tokens=48,
                replicas=4, time_scale=1.0, kv_conversations_per_replica=4),
    generate=_multi_turn,
    fleet=_multi_turn_fleet,
    load=LoadSpec(concurrency=8, rate=4.0),
    quick=dict(requests=48, turns=4, replicas=3, time_scale=20.0, output_tokens=8),
)

# --- zipf-chat --------------------------------------------------------------------------

def _tenant_encoding(body: dict[str, Any], tenant: int) -> bytes:
    """Each tenant's client serialises its own way (key order, whitespace, sampling fields)."""
    if tenant % 4 == 0:
        return encode(body)
    if tenant % 4 == 1:
        return json.dumps(body).encode()
    if tenant % 4 == 2:
        return json.dumps({**body, "temperature": 0.7, "top_p": 0.95}, indent=2).encode()
    return json.dumps(dict(reversed(list(body.items()))), separators=(", ", ": ")).encode()


def _tenant_conversations(p: Params, rng: random.Random, model: str, output_tokens: Callable[[], int]):
    """Conversations on Zipf-popular long system prompts, each resending its history, from tenants
    that serialise their JSON their own way; ``output_tokens()`` sizes each answer."""
    text = TextSource(rng)
    systems = [text.text(p["system_tokens"], tag=f"assistant {i}") for i in range(p["systems"])]
    weights = zipf_weights(len(systems), p["zipf"])
    chains = []
    for c in range(p["conversations"]):
        s = rng.choices(range(len(systems)), weights=weights)[0]
        tenant = rng.randrange(p["tenants"])
        headers = (("x-prefix-aware-id", f"tenant-{tenant}"),)
        messages: list[dict[str, Any]] = [{"role": "system", "content": systems[s]}]
        chain = []
        for _ in range(rng.randint(1, p["max_turns"])):
            out = output_tokens()
            messages.append({"role": "user", "content": text.text(text.between(p["user_min"], p["user_max"]))})
            body = chat_body(model, list(messages), out)
            chain.append((_tenant_encoding(body, tenant), f"system-{s}/conv-{c}", out, headers))
            messages.append({"role": "assistant", "content": _assistant_reply(out)})
        chains.append(chain)
    return build_sessions(chains)


def _zipf_chat(p: Params, rng: random.Random, model: str):
    return _tenant_conversations(p, rng, model, lambda: p["output_tokens"])


def _zipf_chat_fleet(p: Params) -> FleetSpec:
    final = p["system_tokens"] + p["max_turns"] * (p["user_max"] + p["output_tokens"] + 2 * TEMPLATE_TOKENS)
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"], max_num_seqs=p["max_num_seqs"],
                     num_blocks=p["kv_conversations_per_replica"] * blocks(final) + 1)


ZIPF_CHAT = Scenario(
    name="zipf-chat",
    summary="multi-turn chat at saturation: 8 Zipf-popular 2500-token system prompts, conversations of "
            "1-12 turns resending their history, 4 tenants serialising JSON differently, 48 in flight "
            "on 4 replicas of 8 sequences each",
    params=dict(conversations=240, systems=8, system_tokens=2500, zipf=1.1, tenants=4, max_turns=12,
                user_min=32, user_max=192, output_tokens=48, replicas=4, time_scale=1.0, max_num_seqs=8,
                kv_conversations_per_replica=12),
    generate=_zipf_chat,
    fleet=_zipf_chat_fleet,
    load=LoadSpec(concurrency=48, rate=20.0),
    arms=(*DEFAULT_ARMS, SHARED_VARIANT),
    quick=dict(conversations=30, systems=4, system_tokens=1100, max_turns=4, replicas=3, time_scale=20.0,
               output_tokens=8),
)

# --- kv-pressure ------------------------------------------------------------------------

def _kv_pressure(p: Params, rng: random.Random, model: str):
    """Many tenants' conversations on many system prompts, with long and varied answers: the
    working set is larger than the fleet's KV, so replicas evict what a router may still credit."""
    return _tenant_conversations(p, rng, model, lambda: rng.randint(p["output_min"], p["output_max"]))


def _kv_pressure_fleet(p: Params) -> FleetSpec:
    """KV per replica so that the working set (every system prompt, plus the histories in flight)
    is ``pressure`` times the fleet's KV."""
    history = p["max_turns"] * ((p["user_min"] + p["user_max"]) // 2 + (p["output_min"] + p["output_max"]) // 2
                                + 2 * TEMPLATE_TOKENS) // 2
    working_set = p["systems"] * blocks(p["system_tokens"]) + p["in_flight"] * blocks(history)
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"], max_num_seqs=p["max_num_seqs"],
                     num_blocks=math.ceil(working_set / (p["replicas"] * p["pressure"])) + 1)


KV_PRESSURE = Scenario(
    name="kv-pressure",
    summary="working set 1.75x the fleet's KV: 24 Zipf-popular 2000-token system prompts, 16 tenants, "
            "conversations of 1-8 turns with 16-384-token answers, 48 in flight on 4 replicas",
    params=dict(conversations=300, systems=24, system_tokens=2000, zipf=0.8, tenants=16, max_turns=8,
                user_min=32, user_max=192, output_min=16, output_max=384, replicas=4, time_scale=1.0,
                max_num_seqs=8, in_flight=48, pressure=1.75,
                # 0: no restart; else replica 0 restarts (or is reset) then, as in the restart scenario
                restart_at_s=0.0, restart_down_s=0.0, restart_kind="restart"),
    generate=_kv_pressure,
    fleet=_kv_pressure_fleet,
    load=LoadSpec(concurrency=48, rate=20.0),
    arms=("round-robin", "prefix-bounded", "prefix-pick", "prefix-pick-2routers", "prefix-precise",
          "prefix-precise-2routers", SHARED_VARIANT),
    events=lambda p: _restart_events(p) if p["restart_at_s"] > 0 else (),
    quick=dict(conversations=40, systems=6, system_tokens=1100, max_turns=4, replicas=3, time_scale=20.0,
               output_min=4, output_max=24, in_flight=12),
)

# --- restart ----------------------------------------------------------------------------

def _restart_events(p: Params) -> tuple[FleetEvent, ...]:
    """Replica 0 restarts at once, or after ``restart_down_s`` seconds down (a vLLM process takes
    tens of seconds to load its model again; meanwhile its conversations go elsewhere); with
    ``restart_kind=reset_cache`` its prefix cache is emptied instead, the process going on (vLLM's
    ``POST /reset_prefix_cache``: its counters continue, its events say AllBlocksCleared)."""
    if p["restart_kind"] not in ("restart", "reset_cache"):
        raise ValueError(f"restart_kind {p['restart_kind']!r}: must be restart or reset_cache")
    if p["restart_kind"] == "reset_cache":
        return (FleetEvent(p["restart_at_s"], "reset_cache", 0),)
    down = p["restart_down_s"]
    if down > 0:
        return FleetEvent(p["restart_at_s"], "down", 0), FleetEvent(p["restart_at_s"] + down, "restart", 0)
    return (FleetEvent(p["restart_at_s"], "restart", 0),)


RESTART = Scenario(
    name="restart",
    summary="zipf-chat, and replica 0 restarts mid-run (empty cache, same port): hit rate and TTFT "
            "before and after, and how fast each router stops crediting what the replica lost",
    params={**ZIPF_CHAT.params, "conversations": 400, "restart_at_s": 30.0, "restart_down_s": 0.0,
            "restart_kind": "restart"},
    generate=_zipf_chat,
    fleet=_zipf_chat_fleet,
    load=LoadSpec(concurrency=48, rate=20.0, duration_s=70.0),
    arms=("prefix-bounded", "prefix-pick", "prefix-pick-2routers", "prefix-precise", "prefix-precise-2routers",
          SHARED_VARIANT),
    events=_restart_events,
    quick={**ZIPF_CHAT.quick, "conversations": 60, "restart_at_s": 2.0},
)

# --- router-restart ---------------------------------------------------------------------

def _router_restart_events(p: Params) -> tuple[FleetEvent, ...]:
    return (FleetEvent(p["restart_router_at_s"], "router-restart", 0),)


def _router_restart_fleet(p: Params) -> FleetSpec:
    return dataclasses.replace(_zipf_chat_fleet(p), kv_buffer_steps=p["kv_buffer_steps"])


ROUTER_RESTART = Scenario(
    name="router-restart",
    summary="zipf-chat, and the router restarts mid-run while the replicas stay warm: how long its rolling "
            "hit rate takes to come back, with a replay buffer that holds everything (kv_buffer_steps=10000) "
            "or only the last few seconds (e.g. 200)",
    params={**ZIPF_CHAT.params, "conversations": 400, "restart_router_at_s": 30.0, "kv_buffer_steps": 10_000},
    generate=_zipf_chat,
    fleet=_router_restart_fleet,
    load=LoadSpec(concurrency=48, rate=20.0, duration_s=75.0),
    arms=("prefix-pick", "prefix-precise"),
    events=_router_restart_events,
    quick={**ZIPF_CHAT.quick, "conversations": 60, "restart_router_at_s": 2.0},
)
