"""LoRA adapters in the choice: what running a request's adapter on each replica adds to its cost.

vLLM runs at most ``max_loras`` distinct adapters in one batch: a waiting request whose adapter is
not among those scheduled this step, when they already number ``max_loras``, is skipped and waits
(vllm/v1/core/sched/scheduler.py). So, in configured-rate prefill tokens like the rest of the cost
(extproc.pick.choice.choose), for adapter ``a`` on replica ``r``:

    a is running on r (or a request of ours for it is in flight there)      0
    r has a free adapter slot                                               adapter_load_tokens
    every slot of r is taken by other adapters                              request time of r + the load

A replica already running the adapter costs nothing extra; a free slot costs the adapter's load;
a full slot set costs the wait for a slot, until one adapter's requests all end (a request's time
there, measured, extproc.pick.choice.speed; the prompt's own prefill until measured), then the
load. The term
adds to the prefix and load terms, so a hot adapter stays on the replicas running it until their
queues cost more than loading it on another, and one spread over every replica is not pushed into
full slot sets. Pure: the scraped ``vllm:lora_requests_info`` and this router's own requests in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from extproc.core.settings import RouteSettings
from extproc.pick.choice.state import ReplicaState, Sample


class AdapterSlots:
    """Each replica's adapters: what its last scrape said runs and waits, and this router's own
    requests in flight per adapter (a request placed since the scrape runs its adapter there too)."""

    def __init__(self) -> None:
        self._scraped: dict[str, Sample] = {}
        self._own: dict[str, Counter[str]] = {}

    def scraped(self, address: str, sample: Sample) -> None:
        self._scraped[address] = sample

    def left(self, address: str) -> None:
        self._scraped.pop(address, None)
        self._own.pop(address, None)

    def assign(self, address: str, adapter: str) -> None:
        self._own.setdefault(address, Counter())[adapter] += 1

    def release(self, address: str, adapter: str) -> None:
        own = self._own.get(address)
        if own is not None and own[adapter] > 0:
            own[adapter] -= 1
            if not own[adapter]:
                del own[adapter]

    def active(self, address: str) -> set[str]:
        """The adapters taking ``address``'s slots: running at its last scrape, and ours in flight."""
        sample = self._scraped.get(address)
        active = set(sample.running_adapters) if sample is not None else set()
        active.update(self._own.get(address, ()))
        return active

    def costs(self, adapter: str, replicas: Sequence[ReplicaState], prompt_tokens: int,
              settings: RouteSettings) -> dict[str, int]:
        """Each replica's adapter term for a request of ``adapter`` (the table above); a replica
        that says nothing of LoRA (no ``vllm:lora_requests_info``) costs nothing extra."""
        out: dict[str, int] = {}
        for r in replicas:
            sample = self._scraped.get(r.address)
            active = self.active(r.address)
            if adapter in active or sample is None or not sample.max_lora:
                out[r.address] = 0
            elif len(active) < sample.max_lora:
                out[r.address] = settings.adapter_load_tokens
            else:
                out[r.address] = (r.request_tokens or prompt_tokens) + settings.adapter_load_tokens
        return out

    def state(self, address: str) -> dict[str, Any]:
        """One replica's adapters as JSON (``/debug/state``)."""
        sample = self._scraped.get(address)
        return {"max_lora": sample.max_lora if sample else 0,
                "running_adapters": sorted(sample.running_adapters) if sample else [],
                "waiting_adapters": sorted(sample.waiting_adapters) if sample else [],
                "own_adapters": dict(sorted(self._own.get(address, Counter()).items()))}
