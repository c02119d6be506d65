"""Same text, different clients: tenants (their header and cache_salt) and serialisation (each
request's JSON bytes differ)."""

from __future__ import annotations

import json
import random
from typing import Any

from routerlab.bench.scenarios.parts import ask, prompt_blocks, single
from routerlab.bench.scenarios.spec import PICK_VARIANTS, FleetSpec, LoadSpec, Params, Scenario
from routerlab.bench.trace import TextSource, build_sessions, chat_body

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
        body = chat_body(model, ask(docs[d], question), p["output_tokens"], **extra)
        chains.append(single(body, f"{tenant}/doc-{d}", (("x-prefix-aware-id", tenant),)))
    return build_sessions(chains)


def _shared_chains_fleet(p: Params, chains: int) -> FleetSpec:
    """Each replica holds ``kv_share_per_replica`` of the ``chains`` shared prompts, plus 8 running."""
    per_prompt = prompt_blocks(p["prefix_tokens"], p["question_max"], p["output_tokens"])
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
    arms=("round-robin", "prefix-bounded", "prefix-bounded-isolated", "prefix-pick", "prefix-pick-isolated",
          *PICK_VARIANTS),
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
        body = chat_body(model, ask(prompts[i], question), p["output_tokens"])
        chains.append(single(body, f"prompt-{i}", encoded=_serialize_variant(body, rng)))
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
