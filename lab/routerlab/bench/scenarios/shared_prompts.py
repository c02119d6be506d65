"""Single requests on shared prompts: the SageMaker shape, ShareGPT-like chat, SGLang's
generated-shared-prefix, a hot prefix, a fleet that scales, the fault drill's load, and the
no-sharing control."""

from __future__ import annotations

import dataclasses
import math
import random

from routerlab.assets import TINY_BYTELEVEL
from routerlab.bench.scenarios.parts import TEMPLATE_TOKENS, ask, blocks, prompt_blocks, single, zipf_weights
from routerlab.bench.scenarios.spec import (
    DEFAULT_ARMS,
    PICK_VARIANTS,
    FleetEvent,
    FleetSpec,
    LoadSpec,
    Params,
    Scenario,
)
from routerlab.bench.trace import TextSource, build_sessions, chat_body

# --- sagemaker-8k -----------------------------------------------------------------------

def _shared_prefix_requests(p: Params, rng: random.Random, model: str, weights: list[float] | None = None):
    """Requests = one of ``prefixes`` long system prompts + a short, fresh question."""
    text = TextSource(rng)
    prefixes = [text.text(p["prefix_tokens"], tag=f"prefix {i}") for i in range(p["prefixes"])]
    chains = []
    for _ in range(p["requests"]):
        i = rng.choices(range(len(prefixes)), weights=weights)[0] if weights else rng.randrange(len(prefixes))
        question = text.text(text.between(p["question_min"], p["question_max"]))
        chains.append(single(chat_body(model, ask(prefixes[i], question), p["output_tokens"]), f"prefix-{i}"))
    return build_sessions(chains)


def _sagemaker_fleet(p: Params) -> FleetSpec:
    per_prompt = prompt_blocks(p["prefix_tokens"], p["question_max"], p["output_tokens"])
    return FleetSpec(
        replicas=p["replicas"], time_scale=p["time_scale"],
        num_blocks=p["kv_prefixes_per_replica"] * per_prompt + 2 * per_prompt + 1,
        max_num_seqs=p["max_num_seqs"],
    )


SAGEMAKER_8K = Scenario(
    name="sagemaker-8k",
    summary="7 replicas, 8000-token shared prefixes + short questions, sustained load "
            "(SageMaker's benchmark shape); 70 prefixes, each replica caches 16",
    params=dict(requests=700, prefixes=70, prefix_tokens=8000, question_min=20, question_max=100,
                output_tokens=24, kv_prefixes_per_replica=16, replicas=7, time_scale=1.0, max_num_seqs=64),
    generate=_shared_prefix_requests,
    fleet=_sagemaker_fleet,
    load=LoadSpec(concurrency=14, rate=40.0),
    quick=dict(requests=72, prefixes=12, prefix_tokens=2000, kv_prefixes_per_replica=5, replicas=3,
               time_scale=20.0, output_tokens=8),
)


# --- short-chat -------------------------------------------------------------------------

def _short_chat(p: Params, rng: random.Random, model: str):
    """ShareGPT-like: Zipf-popular short system prompts, short user turns, short answers."""
    text = TextSource(rng)
    systems = [text.text(text.between(p["system_min"], p["system_max"]), tag=f"assistant {i}")
               for i in range(p["groups"])]
    weights = zipf_weights(len(systems), p["zipf"])
    chains = []
    for _ in range(p["requests"]):
        i = rng.choices(range(len(systems)), weights=weights)[0]
        question = text.text(text.between(p["question_min"], p["question_max"]))
        out = text.between(p["output_min"], p["output_max"])
        chains.append(single(chat_body(model, ask(systems[i], question), out), f"system-{i}"))
    return build_sessions(chains)


def _short_chat_fleet(p: Params) -> FleetSpec:
    mean_system = (p["system_min"] + p["system_max"]) / 2
    working_set = p["groups"] * blocks(int(mean_system))
    headroom = 8 * prompt_blocks(p["system_max"], p["question_max"], p["output_max"])
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"],
                     num_blocks=int(working_set * p["kv_share_per_replica"]) + headroom + 1)


SHORT_CHAT = Scenario(
    name="short-chat",
    summary="ShareGPT-like: 48 Zipf-popular system prompts of 256-1024 tokens, short questions "
            "and answers; router PrefixLength 1024 bytes (covers the system prompt only)",
    params=dict(requests=800, groups=48, system_min=256, system_max=1024, question_min=16, question_max=256,
                output_min=16, output_max=64, zipf=0.8, replicas=4, time_scale=1.0, kv_share_per_replica=0.35),
    generate=_short_chat,
    fleet=_short_chat_fleet,
    load=LoadSpec(concurrency=16, rate=60.0),
    prefix_length=1024,
    quick=dict(requests=60, groups=8, replicas=3, time_scale=20.0),
)

# --- gsp --------------------------------------------------------------------------------

def _gsp(p: Params, rng: random.Random, model: str):
    """SGLang's generated-shared-prefix: groups x prompts, shuffled, capped at ``requests``."""
    text = TextSource(rng)
    systems = [text.text(p["system_tokens"], tag=f"group {g}") for g in range(p["groups"])]
    pairs = [(g, text.text(p["question_tokens"])) for g in range(p["groups"]) for _ in range(p["prompts_per_group"])]
    rng.shuffle(pairs)
    chains = []
    for g, question in pairs[: p["requests"]]:
        chains.append(single(chat_body(model, ask(systems[g], question), p["output_tokens"]), f"group-{g}"))
    return build_sessions(chains)


def _gsp_fleet(p: Params) -> FleetSpec:
    per_group = blocks(p["system_tokens"] + TEMPLATE_TOKENS)
    headroom = 16 * prompt_blocks(p["system_tokens"], p["question_tokens"], p["output_tokens"])
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"],
                     num_blocks=int(p["groups"] * p["kv_share_per_replica"]) * per_group + headroom + 1)


GSP = Scenario(
    name="gsp",
    summary="SGLang generated-shared-prefix: 64 groups x 16 prompts, 2048-token system prompt, "
            "128-token question, 256 output tokens, shuffled",
    params=dict(requests=1024, groups=64, prompts_per_group=16, system_tokens=2048, question_tokens=128,
                output_tokens=256, replicas=4, time_scale=1.0, kv_share_per_replica=0.35),
    generate=_gsp,
    fleet=_gsp_fleet,
    load=LoadSpec(concurrency=16, rate=20.0),
    quick=dict(requests=64, groups=8, prompts_per_group=8, system_tokens=1100, output_tokens=8,
               replicas=3, time_scale=20.0),
)


# --- shared-prefix ----------------------------------------------------------------------

def _shared_prefix_fleet(p: Params) -> FleetSpec:
    """KV per replica so that every group's system prompt together is ``pressure`` times the
    fleet's KV: at most 1/pressure of the groups can be cached anywhere at once. The replicas
    tokenise with the lab's tiny tokenizer in every run, as the outside tool's fleet did, so a
    pick-mode arm run alone meets the same prompts as beside a precise one."""
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"], max_num_seqs=p["max_num_seqs"],
                     num_blocks=groups_kv_blocks(p["groups"], p["system_tokens"], p["replicas"], p["pressure"]),
                     tokenizer=str(TINY_BYTELEVEL))


def groups_kv_blocks(groups: int, system_tokens: int, replicas: int, pressure: float) -> int:
    """KV blocks per replica (the null block included) for which ``groups`` system prompts of
    ``system_tokens`` together are ``pressure`` times the fleet's KV."""
    return math.ceil(groups * blocks(system_tokens + TEMPLATE_TOKENS) / (replicas * pressure)) + 1


SHARED_PREFIX = Scenario(
    name="shared-prefix",
    summary="inference-perf's shared-prefix shape: 64 equally popular groups x 16 prompts, 2048-token system "
            "prompts, 128-token questions, 128 output tokens, 16 in flight on 4 replicas; every system prompt "
            "together is twice the fleet's KV",
    params=dict(requests=1024, groups=64, prompts_per_group=16, system_tokens=2048, question_tokens=128,
                output_tokens=128, replicas=4, time_scale=1.0, max_num_seqs=64, pressure=2.0),
    generate=_gsp,
    fleet=_shared_prefix_fleet,
    load=LoadSpec(concurrency=16, rate=20.0),
    arms=("round-robin", "least-request", "prefix-maglev", "prefix-pick", "prefix-pick-2routers", "prefix-precise",
          "prefix-precise-2routers"),
    quick=dict(requests=96, groups=16, prompts_per_group=6, system_tokens=1100, output_tokens=16, replicas=3,
               time_scale=20.0),
)


# --- hot-prefix -------------------------------------------------------------------------

def _hot_prefix(p: Params, rng: random.Random, model: str):
    """Prefix 0 takes ``hot_share`` of the requests, the others split the rest evenly."""
    cold = p["prefixes"] - 1
    weights = [p["hot_share"]] + [(1 - p["hot_share"]) / cold] * cold if cold else [1.0]
    return _shared_prefix_requests(p, rng, model, weights)


def _hot_prefix_fleet(p: Params) -> FleetSpec:
    per_prompt = prompt_blocks(p["prefix_tokens"], p["question_max"], p["output_tokens"])
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"], max_num_seqs=p["max_num_seqs"],
                     num_blocks=(p["prefixes"] // 2 + p["max_num_seqs"]) * per_prompt + 1)


HOT_PREFIX = Scenario(
    name="hot-prefix",
    summary="one prefix carries 70 % of the load, 15 others share the rest; replicas run at most "
            "8 sequences, so a replica that takes the whole hot key queues (spill-over must help)",
    params=dict(requests=600, prefixes=16, hot_share=0.7, prefix_tokens=2000, question_min=32, question_max=128,
                output_tokens=32, replicas=4, time_scale=1.0, max_num_seqs=8),
    generate=_hot_prefix,
    fleet=_hot_prefix_fleet,
    load=LoadSpec(concurrency=24, rate=80.0),
    arms=DEFAULT_ARMS,
    quick=dict(requests=60, prefixes=6, prefix_tokens=1100, replicas=3, time_scale=20.0, output_tokens=8),
)

# --- no-sharing -------------------------------------------------------------------------

def _no_sharing(p: Params, rng: random.Random, model: str):
    text = TextSource(rng)
    chains = []
    for r in range(p["requests"]):
        messages = [{"role": "user", "content": text.text(text.between(p["prompt_min"], p["prompt_max"]),
                                                          tag=f"unique {r}")}]
        chains.append(single(chat_body(model, messages, p["output_tokens"]), f"unique-{r}"))
    return build_sessions(chains)


NO_SHARING = Scenario(
    name="no-sharing",
    summary="control: every prompt distinct (500-2000 tokens); prefix routing must not be worse",
    params=dict(requests=400, prompt_min=500, prompt_max=2000, output_tokens=32, replicas=4, time_scale=1.0),
    generate=_no_sharing,
    fleet=lambda p: FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"]),
    load=LoadSpec(concurrency=16, rate=40.0),
    quick=dict(requests=48, replicas=3, time_scale=20.0, output_tokens=8, prompt_max=800),
)

# --- scale-out --------------------------------------------------------------------------

def _zipf_shared_prefixes(p: Params, rng: random.Random, model: str):
    """Shared-prefix requests whose prefixes are Zipf(``zipf``)-popular."""
    return _shared_prefix_requests(p, rng, model, zipf_weights(p["prefixes"], p["zipf"]))


def _scale_out_events(p: Params) -> tuple[FleetEvent, ...]:
    return (FleetEvent(p["join_at_s"], "join", p["replicas"]), FleetEvent(p["leave_at_s"], "leave", 0))


SCALE_OUT = Scenario(
    name="scale-out",
    summary="a replica joins the fleet mid-run and later another leaves (open-loop load, 40 Zipf-popular "
            "2000-token prefixes): hit rate and TTFT per phase, requests the newcomer gets",
    params=dict(requests=1200, prefixes=40, prefix_tokens=2000, question_min=20, question_max=100,
                output_tokens=32, zipf=0.9, replicas=4, time_scale=1.0, max_num_seqs=16,
                kv_prefixes_per_replica=14, join_at_s=30.0, leave_at_s=60.0),
    generate=_zipf_shared_prefixes,
    fleet=lambda p: dataclasses.replace(_sagemaker_fleet(p), replicas=p["replicas"] + 1),
    load=LoadSpec(mode="open", rate=13.0, duration_s=100.0),
    arms=("round-robin", "least-request", "prefix-bounded", "prefix-pick", *PICK_VARIANTS),
    events=_scale_out_events,
    # the newcomer is usable 0.5-1.5 s after it joins (the bench's health checks every 0.5 s, pick mode
    # re-reading its endpoints within 1 s), later on a busy machine: 6 s in the fleet leave room for that
    quick=dict(requests=200, prefixes=8, prefix_tokens=1100, replicas=2, time_scale=20.0, output_tokens=8,
               join_at_s=2.0, leave_at_s=8.0),
)


# --- the fault drill's load (routerlab.bench.faults; not a bench scenario of its own) ------

FAULT_LOAD = Scenario(
    name="fault-load",
    summary="sustained load for the fault drill: 24 Zipf-popular 2000-token prefixes, short questions",
    params=dict(requests=4000, prefixes=24, prefix_tokens=2000, question_min=20, question_max=100,
                output_tokens=32, zipf=0.9, replicas=4, time_scale=1.0, max_num_seqs=16,
                kv_prefixes_per_replica=10),
    generate=_zipf_shared_prefixes,
    fleet=_sagemaker_fleet,
    load=LoadSpec(concurrency=16),
)
