"""Two base models of different sizes behind one Envoy: the model header chooses the cluster, the
router picks within the model's replicas.

Each model has its own system prompts (Zipf popularity) and replicas; a request names one model.
Every arm routes through envoy/multi-model.yaml's shape (a cluster per model, routes matching
``x-gateway-model-name``): prefix arms get the header from the router (a client's copy is
dropped), stock arms from the client (what an operator without the router would do: the header
set by the client or a body-based-routing filter). ``only=MODEL`` runs that model's requests alone
on its own replicas at its share of the rate: each pool benchmarked alone, to compare with.
"""

from __future__ import annotations

import dataclasses
import random

from routerlab.bench.scenarios.parts import ask, prompt_blocks, single, zipf_weights
from routerlab.bench.scenarios.spec import FleetSpec, LoadSpec, Params, Scenario
from routerlab.bench.trace import TextSource, build_sessions, chat_body

MODEL_HEADER = "x-gateway-model-name"  # what multi-model.yaml's routes match (the router's default)
BIG, SMALL = "llama-3.1-70b", "llama-3.1-8b"
PROFILES = {BIG: "llama-3.1-70b-h100-tp8", SMALL: "llama-3.1-8b-h100"}
LOAD = LoadSpec(mode="open", rate=24.0, concurrency=48)


def model_of(group: str) -> str | None:
    """A request's base model from its group (``MODEL|prefix-I``)."""
    model, sep, _ = group.partition("|")
    return model if sep else None


def _share(p: Params, model: str) -> float:
    return p["small_share"] if model == SMALL else 1.0 - p["small_share"]


def _models(p: Params) -> tuple[str, ...]:
    if p["only"] and p["only"] not in PROFILES:
        raise ValueError(f"multi-model: only={p['only']!r} is not one of {', '.join(PROFILES)}")
    return (p["only"],) if p["only"] else (BIG, SMALL)


def _multi_model(p: Params, rng: random.Random, model: str):
    """Each request names the small model with probability ``small_share`` (else the big one), then
    one of that model's ``prefixes`` system prompts (Zipf ``zipf``) and a fresh question. The whole
    trace is drawn before ``only`` keeps one model's requests, so they are the same requests."""
    text = TextSource(rng)
    systems = {m: [text.text(p["prefix_tokens"], tag=f"{m} prefix {i}") for i in range(p["prefixes"])]
               for m in PROFILES}
    weights = zipf_weights(p["prefixes"], p["zipf"])
    keep = _models(p)
    chains = []
    for _ in range(p["requests"]):
        m = SMALL if rng.random() < p["small_share"] else BIG
        i = rng.choices(range(p["prefixes"]), weights=weights)[0]
        question = text.text(text.between(p["question_min"], p["question_max"]))
        if m in keep:
            chains.append(single(chat_body(m, ask(systems[m][i], question), p["output_tokens"]), f"{m}|prefix-{i}",
                                 headers=((MODEL_HEADER, m),)))
    return build_sessions(chains)


def _multi_model_fleet(p: Params) -> FleetSpec:
    per_prompt = prompt_blocks(p["prefix_tokens"], p["question_max"], p["output_tokens"])
    counts = {BIG: p["big_replicas"], SMALL: p["small_replicas"]}
    pools = tuple((m, counts[m], PROFILES[m]) for m in _models(p))
    return FleetSpec(replicas=sum(n for _, n, _ in pools), profile=PROFILES[pools[0][0]], time_scale=p["time_scale"],
                     num_blocks=p["kv_prefixes_per_replica"] * per_prompt + 2 * per_prompt + 1,
                     max_num_seqs=p["max_num_seqs"], pools=pools)


def _multi_model_load(p: Params) -> LoadSpec:
    """Open loop at ``rate``; a model alone at its share of it (the arrivals it meets beside the other)."""
    rate = p["rate"] * (_share(p, p["only"]) if p["only"] else 1.0)
    return dataclasses.replace(LOAD, rate=rate)


MULTI_MODEL = Scenario(
    name="multi-model",
    summary="two base models (Llama 3.1 70B on TP8 and 8B on one GPU, simulated), 4 replicas each, behind one "
            "Envoy (envoy/multi-model.yaml); each with 24 system prompts of Zipf popularity, open loop",
    params=dict(requests=1600, small_share=0.5, prefixes=24, zipf=0.8, prefix_tokens=3000, question_min=20,
                question_max=100, output_tokens=32, big_replicas=4, small_replicas=4, kv_prefixes_per_replica=5,
                max_num_seqs=64, rate=LOAD.rate, time_scale=1.0, only=""),
    generate=_multi_model,
    fleet=_multi_model_fleet,
    load=LOAD,
    load_for=_multi_model_load,
    prefix_length=4096,
    arms=("round-robin", "least-request", "prefix-maglev", "prefix-bounded", "prefix-pick", "prefix-precise"),
    quick=dict(requests=96, prefixes=8, prefix_tokens=1500, output_tokens=8, big_replicas=2, small_replicas=2,
               kv_prefixes_per_replica=3, time_scale=20.0, rate=12.0),
    classes=model_of,
)
