"""Replica profiles: engine limits plus a first-order step-time model.

Step time (model seconds) = base + per_prefill_token * prefill tokens in the step
+ per_decode * decoding sequences in the step. The llama profiles follow the derived
first-order models in docs/simulator.md (+-30 %): Llama 3.1 70B on TP8 (8x H100) and
Llama 3.1 8B on one H100, e.g. the two sizes of a two-model fleet (``--pool``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class Profile:
    """Engine limits and step cost of one simulated replica."""

    name: str
    model: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    step_base_s: float
    per_prefill_token_s: float
    per_decode_s: float
    # LoRA adapter costs (model seconds), docs/simulator.md "Models and LoRA adapters": reading one
    # adapter from disk into CPU memory, and copying one from CPU memory into a GPU slot
    lora_load_s: float = 0.02
    lora_activate_s: float = 0.001
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (the body's ``priority``, lower
    # first, ties by arrival; preemption takes the worst running request instead of the last admitted)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        """Reject limits the scheduler cannot run with (a zero budget would stall it)."""
        minimum = {"block_size": 1, "num_blocks": 2, "max_num_seqs": 1,
                   "max_num_batched_tokens": 1, "max_model_len": 1}
        for name, low in minimum.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if min(self.step_base_s, self.per_prefill_token_s, self.per_decode_s) < 0:
            raise ValueError("step time coefficients must be >= 0")
        if min(self.lora_load_s, self.lora_activate_s) < 0:
            raise ValueError("LoRA load times must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")

    def step_time(self, prefill_tokens: int, decodes: int) -> float:
        """Model-time duration of one engine step."""
        return (
            self.step_base_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_s * decodes
        )

    def with_overrides(self, **overrides: Any) -> Profile:
        """Copy with the non-None overrides applied; max_model_len is capped to KV capacity."""
        p = replace(self, **{k: v for k, v in overrides.items() if v is not None})
        capacity = (p.num_blocks - 1) * p.block_size
        if p.max_model_len > capacity:
            p = replace(p, max_model_len=capacity)
        return p


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="llama-3.1-70b-h100-tp8",
            model="meta-llama/Llama-3.1-70B-Instruct",
            block_size=16,
            num_blocks=84000,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            max_model_len=131072,
            step_base_s=0.012,
            per_prefill_token_s=45e-6,
            per_decode_s=0.05e-3,
            lora_load_s=0.25,
            lora_activate_s=0.003,
        ),
        Profile(  # the same first-order derivation for Llama 3.1 8B on one H100 (docs/simulator.md)
            name="llama-3.1-8b-h100",
            model="meta-llama/Llama-3.1-8B-Instruct",
            block_size=16,
            num_blocks=25000,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            max_model_len=131072,
            step_base_s=0.006,
            per_prefill_token_s=35e-6,
            per_decode_s=0.05e-3,
            lora_load_s=0.05,
            lora_activate_s=0.004,
        ),
        Profile(
            name="tiny",
            model="sim-tiny",
            block_size=16,
            num_blocks=2048,
            max_num_seqs=32,
            max_num_batched_tokens=1024,
            max_model_len=8192,
            step_base_s=0.002,
            per_prefill_token_s=20e-6,
            per_decode_s=0.05e-3,
        ),
    )
}

DEFAULT_PROFILE = "tiny"


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}") from None
