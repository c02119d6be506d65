"""Named, seeded traffic scenarios (pure: parameters + seed + model name -> Trace).

Each scenario documents its parameters (``params``, overridable with ``--param k=v``),
the fleet it is meant for (replica count and per-replica KV capacity, sized from the
parameters so that the prefix working set exceeds one replica's cache but fits the
fleet's), and the load it runs under. ``quick`` holds the small overrides the tests and
the demo use. See docs/benchmark.md for the reasoning behind each default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from routerlab.bench.trace import Session, TextSource, Trace, build_sessions, chat_body, encode

Params = dict[str, Any]
TEMPLATE_TOKENS = 16  # chat-template framing per message, rounded up (a few tokens each)

STOCK_ARMS = ("round-robin", "least-request", "random")
PREFIX_ARMS = ("prefix-maglev", "prefix-ring", "prefix-bounded", "prefix-pick", "raw-bytes")
ENVOY_ARMS = STOCK_ARMS + PREFIX_ARMS


@dataclass(frozen=True)
class FleetSpec:
    """Simulated fleet shape; None means the simulator profile's default."""

    replicas: int = 4
    profile: str = "llama-3.1-70b-h100-tp8"
    time_scale: float = 1.0
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None


@dataclass(frozen=True)
class LoadSpec:
    """How traffic is offered: closed loop (``concurrency`` sessions in flight) or open
    loop (sessions start as a Poisson process of ``rate`` per second)."""

    mode: str = "closed"
    concurrency: int = 16
    rate: float = 20.0
    duration_s: float = 180.0  # hard bound per arm (and per phase)


@dataclass(frozen=True)
class FleetEvent:
    """At ``at_s`` seconds into an arm's load, replica ``replica`` joins or leaves the fleet.

    A joining replica is running but failing health checks (and absent from pick mode's
    endpoints) until then; a leaving one starts failing them (and leaves the endpoints).
    """

    at_s: float
    action: str  # "join" or "leave"
    replica: int


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    params: Mapping[str, Any]
    generate: Callable[[Params, random.Random, str], tuple[Session, ...]]
    fleet: Callable[[Params], FleetSpec]
    load: LoadSpec = LoadSpec()
    prefix_length: int = 4096  # router PrefixLength (bytes of the normalised prompt)
    arms: tuple[str, ...] = ENVOY_ARMS
    quick: Mapping[str, Any] = field(default_factory=dict)
    events: Callable[[Params], tuple[FleetEvent, ...]] = lambda p: ()  # fleet changes during the load

    def resolve(self, overrides: Mapping[str, Any] | None = None, quick: bool = False) -> Params:
        """Defaults, then ``quick`` overrides, then the caller's; unknown names are errors."""
        params: Params = dict(self.params)
        for source in ((self.quick if quick else {}), overrides or {}):
            for key, value in source.items():
                if key not in params:
                    raise KeyError(f"scenario {self.name!r} has no parameter {key!r}; "
                                   f"choose from {', '.join(sorted(params))}")
                params[key] = _coerce(params[key], value)
        return params

    def trace(self, params: Params, seed: int, model: str) -> Trace:
        rng = random.Random(f"{self.name}:{seed}")
        return Trace(self.name, seed, model, self.generate(params, rng, model), dict(params))


def _coerce(default: Any, value: Any) -> Any:
    """CLI strings to the default's type (bools accept true/false/1/0)."""
    if not isinstance(value, str) or isinstance(default, str):
        return value
    if isinstance(default, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value


def blocks(tokens: int, block_size: int = 16) -> int:
    return math.ceil(tokens / block_size)


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def _prompt_blocks(prefix: int, question: int, output: int) -> int:
    """KV blocks of one running request: prefix, question, answer and template framing."""
    return blocks(prefix + question + output + 3 * TEMPLATE_TOKENS)


def _ask(system: str, question: str) -> list[dict[str, Any]]:
    """The messages of a single-turn request: a (shared) system prompt, then the question."""
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _single(body: dict[str, Any], group: str, headers: tuple[tuple[str, str], ...] = (),
            encoded: bytes | None = None) -> list[tuple[bytes, str, int, tuple[tuple[str, str], ...]]]:
    """A session of one request (``encoded``: the exact bytes to send, if not the default)."""
    return [(encoded if encoded is not None else encode(body), group, body["max_tokens"], headers)]


# --- sagemaker-8k -----------------------------------------------------------------------

def _shared_prefix_requests(p: Params, rng: random.Random, model: str, weights: list[float] | None = None):
    """Requests = one of ``prefixes`` long system prompts + a short, fresh question."""
    text = TextSource(rng)
    prefixes = [text.text(p["prefix_tokens"], tag=f"prefix {i}") for i in range(p["prefixes"])]
    chains = []
    for _ in range(p["requests"]):
        i = rng.choices(range(len(prefixes)), weights=weights)[0] if weights else rng.randrange(len(prefixes))
        question = text.text(text.between(p["question_min"], p["question_max"]))
        chains.append(_single(chat_body(model, _ask(prefixes[i], question), p["output_tokens"]), f"prefix-{i}"))
    return build_sessions(chains)


def _sagemaker_fleet(p: Params) -> FleetSpec:
    per_prompt = _prompt_blocks(p["prefix_tokens"], p["question_max"], p["output_tokens"])
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
    weights = _zipf_weights(len(systems), p["zipf"])
    chains = []
    for _ in range(p["requests"]):
        i = rng.choices(range(len(systems)), weights=weights)[0]
        question = text.text(text.between(p["question_min"], p["question_max"]))
        out = text.between(p["output_min"], p["output_max"])
        chains.append(_single(chat_body(model, _ask(systems[i], question), out), f"system-{i}"))
    return build_sessions(chains)


def _short_chat_fleet(p: Params) -> FleetSpec:
    mean_system = (p["system_min"] + p["system_max"]) / 2
    working_set = p["groups"] * blocks(int(mean_system))
    headroom = 8 * _prompt_blocks(p["system_max"], p["question_max"], p["output_max"])
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


# --- multi-turn -------------------------------------------------------------------------

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


# --- gsp --------------------------------------------------------------------------------

def _gsp(p: Params, rng: random.Random, model: str):
    """SGLang's generated-shared-prefix: groups x prompts, shuffled, capped at ``requests``."""
    text = TextSource(rng)
    systems = [text.text(p["system_tokens"], tag=f"group {g}") for g in range(p["groups"])]
    pairs = [(g, text.text(p["question_tokens"])) for g in range(p["groups"]) for _ in range(p["prompts_per_group"])]
    rng.shuffle(pairs)
    chains = []
    for g, question in pairs[: p["requests"]]:
        chains.append(_single(chat_body(model, _ask(systems[g], question), p["output_tokens"]), f"group-{g}"))
    return build_sessions(chains)


def _gsp_fleet(p: Params) -> FleetSpec:
    per_group = blocks(p["system_tokens"] + TEMPLATE_TOKENS)
    headroom = 16 * _prompt_blocks(p["system_tokens"], p["question_tokens"], p["output_tokens"])
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


# --- hot-prefix -------------------------------------------------------------------------

def _hot_prefix(p: Params, rng: random.Random, model: str):
    """Prefix 0 takes ``hot_share`` of the requests, the others split the rest evenly."""
    cold = p["prefixes"] - 1
    weights = [p["hot_share"]] + [(1 - p["hot_share"]) / cold] * cold if cold else [1.0]
    return _shared_prefix_requests(p, rng, model, weights)


def _hot_prefix_fleet(p: Params) -> FleetSpec:
    per_prompt = _prompt_blocks(p["prefix_tokens"], p["question_max"], p["output_tokens"])
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
    arms=ENVOY_ARMS,
    quick=dict(requests=60, prefixes=6, prefix_tokens=1100, replicas=3, time_scale=20.0, output_tokens=8),
)


# --- tenants ----------------------------------------------------------------------------

def _tenants(p: Params, rng: random.Random, model: str):
    """The same documents sent by several tenants (tenant header, and cache_salt if ``salt``)."""
    text = TextSource(rng)
    docs = [text.text(p["prefix_tokens"], tag=f"shared doc {d}") for d in range(p["documents"])]
    chains = []
    for _ in range(p["requests"]):
        t, d = rng.randrange(p["tenants"]), rng.randrange(p["documents"])
        tenant = f"tenant-{t}"
        question = text.text(text.between(p["question_min"], p["question_max"]))
        extra = {"cache_salt": tenant} if p["salt"] else {}
        body = chat_body(model, _ask(docs[d], question), p["output_tokens"], **extra)
        chains.append(_single(body, f"{tenant}/doc-{d}", (("x-prefix-aware-id", tenant),)))
    return build_sessions(chains)


def _shared_chains_fleet(p: Params, chains: int) -> FleetSpec:
    """Each replica holds ``kv_share_per_replica`` of the ``chains`` shared prompts, plus 8 running."""
    per_prompt = _prompt_blocks(p["prefix_tokens"], p["question_max"], p["output_tokens"])
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"],
                     num_blocks=int(chains * p["kv_share_per_replica"] + 8) * per_prompt + 1)


def _tenants_fleet(p: Params) -> FleetSpec:
    return _shared_chains_fleet(p, p["tenants"] * p["documents"] if p["salt"] else p["documents"])


TENANTS = Scenario(
    name="tenants",
    summary="8 tenants send the same 6 documents (2000 tokens) with their tenant header and "
            "cache_salt: identical text, isolated caches",
    params=dict(requests=480, tenants=8, documents=6, salt=True, prefix_tokens=2000, question_min=32,
                question_max=96, output_tokens=32, replicas=4, time_scale=1.0, kv_share_per_replica=0.35),
    generate=_tenants,
    fleet=_tenants_fleet,
    load=LoadSpec(concurrency=16, rate=40.0),
    # with --param salt=false the clients do not salt: only the *-isolated arms keep tenants apart
    arms=("round-robin", "prefix-bounded", "prefix-bounded-isolated", "prefix-pick", "prefix-pick-isolated"),
    quick=dict(requests=60, tenants=4, documents=2, prefix_tokens=1100, replicas=3, time_scale=20.0,
               output_tokens=8),
)


# --- serialization ----------------------------------------------------------------------

def _serialize_variant(body: dict[str, Any], rng: random.Random) -> bytes:
    """Same prompt, different bytes: key order, whitespace and sampling fields vary."""
    body = dict(body)
    body["temperature"] = rng.choice((0, 0.2, 0.7, 1.0))
    if rng.random() < 0.5:
        body["top_p"] = rng.choice((0.9, 0.95, 1.0))
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1000)
    keys = list(body)
    rng.shuffle(keys)
    body = {k: body[k] for k in keys}
    style = rng.randrange(3)
    if style == 0:
        return json.dumps(body, separators=(",", ":")).encode()
    if style == 1:
        return json.dumps(body).encode()
    return json.dumps(body, indent=rng.choice((1, 2))).encode()


def _serialization(p: Params, rng: random.Random, model: str):
    text = TextSource(rng)
    prompts = [text.text(p["prefix_tokens"], tag=f"prompt {i}") for i in range(p["prefixes"])]
    chains = []
    for _ in range(p["requests"]):
        i = rng.randrange(len(prompts))
        question = text.text(text.between(p["question_min"], p["question_max"]))
        body = chat_body(model, _ask(prompts[i], question), p["output_tokens"])
        chains.append(_single(body, f"prompt-{i}", encoded=_serialize_variant(body, rng)))
    return build_sessions(chains)


SERIALIZATION = Scenario(
    name="serialization",
    summary="24 shared 2000-token prompts, each request serialised differently (key order, "
            "whitespace, temperature/top_p/seed): raw-byte keys scatter, prompt keys do not",
    params=dict(requests=480, prefixes=24, prefix_tokens=2000, question_min=16, question_max=64,
                output_tokens=32, replicas=4, time_scale=1.0, kv_share_per_replica=0.35),
    generate=_serialization,
    fleet=lambda p: _shared_chains_fleet(p, p["prefixes"]),
    load=LoadSpec(concurrency=16, rate=40.0),
    quick=dict(requests=60, prefixes=6, prefix_tokens=1100, replicas=3, time_scale=20.0, output_tokens=8),
)


# --- no-sharing -------------------------------------------------------------------------

def _no_sharing(p: Params, rng: random.Random, model: str):
    text = TextSource(rng)
    chains = []
    for r in range(p["requests"]):
        messages = [{"role": "user", "content": text.text(text.between(p["prompt_min"], p["prompt_max"]),
                                                          tag=f"unique {r}")}]
        chains.append(_single(chat_body(model, messages, p["output_tokens"]), f"unique-{r}"))
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


def _zipf_chat(p: Params, rng: random.Random, model: str):
    """Conversations on a few Zipf-popular long system prompts, each resending its history."""
    text = TextSource(rng)
    systems = [text.text(p["system_tokens"], tag=f"assistant {i}") for i in range(p["systems"])]
    weights = _zipf_weights(len(systems), p["zipf"])
    reply = _assistant_reply(p["output_tokens"])
    chains = []
    for c in range(p["conversations"]):
        s = rng.choices(range(len(systems)), weights=weights)[0]
        tenant = rng.randrange(p["tenants"])
        headers = (("x-prefix-aware-id", f"tenant-{tenant}"),)
        messages: list[dict[str, Any]] = [{"role": "system", "content": systems[s]}]
        chain = []
        for _ in range(rng.randint(1, p["max_turns"])):
            messages.append({"role": "user", "content": text.text(text.between(p["user_min"], p["user_max"]))})
            body = chat_body(model, list(messages), p["output_tokens"])
            chain.append((_tenant_encoding(body, tenant), f"system-{s}/conv-{c}", p["output_tokens"], headers))
            messages.append({"role": "assistant", "content": reply})
        chains.append(chain)
    return build_sessions(chains)


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
    quick=dict(conversations=30, systems=4, system_tokens=1100, max_turns=4, replicas=3, time_scale=20.0,
               output_tokens=8),
)


# --- scale-out --------------------------------------------------------------------------

def _zipf_shared_prefixes(p: Params, rng: random.Random, model: str):
    """Shared-prefix requests whose prefixes are Zipf(``zipf``)-popular."""
    return _shared_prefix_requests(p, rng, model, _zipf_weights(p["prefixes"], p["zipf"]))


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
    arms=("round-robin", "least-request", "prefix-bounded", "prefix-pick"),
    events=_scale_out_events,
    quick=dict(requests=120, prefixes=8, prefix_tokens=1100, replicas=2, time_scale=20.0, output_tokens=8,
               join_at_s=2.0, leave_at_s=5.0),  # the newcomer is usable ~1.5 s after it joins
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


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    SAGEMAKER_8K, SHORT_CHAT, MULTI_TURN, GSP, HOT_PREFIX, TENANTS, SERIALIZATION, NO_SHARING, ZIPF_CHAT,
    SCALE_OUT)}


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}") from None
