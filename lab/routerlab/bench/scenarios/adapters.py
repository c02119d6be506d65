"""Many LoRA adapters on one base model: where an adapter's requests go decides who waits.

vLLM runs at most ``max_loras`` distinct adapters in a batch; a request whose adapter would be one
more waits, and an adapter not resident loads first. The mix is the point: half the adapters'
tenants share system prompts (prefix affinity already keeps such an adapter together), the other
half's requests share nothing (only adapter affinity can keep those together).
"""

from __future__ import annotations

import random

from routerlab.bench.scenarios.parts import TEMPLATE_TOKENS, ask, blocks, prompt_blocks, single, zipf_weights
from routerlab.bench.scenarios.spec import FleetSpec, LoadSpec, Params, Scenario
from routerlab.bench.trace import TextSource, build_sessions, chat_body

SHARED, UNSHARED = "shared", "unshared"  # the two classes of adapters, as the report splits requests


def adapter_names(n: int) -> tuple[str, ...]:
    return tuple(f"lora-{i:02d}" for i in range(n))


def adapter_class(group: str) -> str | None:
    """A request's class from its group (``shared:ADAPTER:SYSTEM`` or ``unshared:ADAPTER``)."""
    head = group.partition(":")[0]
    return head if head in (SHARED, UNSHARED) else None


def _multi_lora(p: Params, rng: random.Random, model: str):
    """Each request names one of ``adapters`` adapters (Zipf popularity, the order shuffled so the
    two classes share the popular ones): an even-numbered adapter's requests start with one of its
    ``systems_per_adapter`` system prompts; an odd-numbered one's are fresh text of the same length."""
    text = TextSource(rng)
    names = adapter_names(p["adapters"])
    systems = {name: [text.text(p["system_tokens"], tag=f"{name} system {s}") for s in range(p["systems_per_adapter"])]
               for name in names[::2]}
    ranked = list(names)
    rng.shuffle(ranked)
    weights = zipf_weights(len(ranked), p["zipf"])
    chains = []
    for _ in range(p["requests"]):
        name = rng.choices(ranked, weights=weights)[0]
        question = text.text(text.between(p["question_min"], p["question_max"]))
        if name in systems:
            s = rng.randrange(len(systems[name]))
            body, group = chat_body(name, ask(systems[name][s], question), p["output_tokens"]), f"{SHARED}:{name}:{s}"
        else:
            fresh = text.text(p["system_tokens"])
            body, group = chat_body(name, ask(fresh, question), p["output_tokens"]), f"{UNSHARED}:{name}"
        chains.append(single(body, group))
    return build_sessions(chains)


def _multi_lora_fleet(p: Params) -> FleetSpec:
    """KV per replica for ``kv_systems_per_replica`` shared system prompts plus the requests running."""
    per_system = blocks(p["system_tokens"] + TEMPLATE_TOKENS)
    running = p["max_num_seqs"] * prompt_blocks(p["system_tokens"], p["question_max"], p["output_tokens"]) // 4
    return FleetSpec(replicas=p["replicas"], time_scale=p["time_scale"], max_num_seqs=p["max_num_seqs"],
                     num_blocks=p["kv_systems_per_replica"] * per_system + running + 1,
                     lora_adapters=adapter_names(p["adapters"]), max_loras=p["max_loras"],
                     max_cpu_loras=p["max_cpu_loras"])


MULTI_LORA = Scenario(
    name="multi-lora",
    summary="one base model on 8 replicas serving 40 LoRA adapters (Zipf popularity, max_loras 4): half "
            "the adapters' tenants share system prompts, the other half's requests share nothing",
    params=dict(requests=1600, adapters=40, zipf=1.0, systems_per_adapter=2, system_tokens=1024,
                question_min=32, question_max=128, output_tokens=64, replicas=8, time_scale=1.0,
                max_num_seqs=32, max_loras=4, max_cpu_loras=12, kv_systems_per_replica=12),
    generate=_multi_lora,
    fleet=_multi_lora_fleet,
    load=LoadSpec(concurrency=48, rate=40.0),
    prefix_length=1024,  # within the shortest system prompt (quick's 512 tokens): hash mode keys a group alike
    arms=("round-robin", "least-request", "prefix-maglev", "prefix-bounded", "prefix-pick",
          "prefix-pick-no-adapter", "prefix-precise", "prefix-precise-no-adapter"),
    quick=dict(requests=120, adapters=12, replicas=3, time_scale=20.0, max_loras=2, max_cpu_loras=4,
               system_tokens=512, output_tokens=8, kv_systems_per_replica=6),
    classes=adapter_class,
)
