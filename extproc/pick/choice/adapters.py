"""LoRA adapters in the choice: what running a request's adapter on each replica adds to its cost.

vLLM runs at most ``max_loras`` distinct adapters in one batch: a waiting request whose adapter is
not among those scheduled this step, when they already number ``max_loras``, is skipped and waits
(vllm/v1/core/sched/scheduler.py). So, in configured-rate prefill tokens like the rest of the cost
(extproc.pick.choice.choose), for adapter ``a`` on replica ``r``:

    a holds one of r's slots (running there, or ours in flight within them),
      or is still in one (among the last max_loras r ran) and a slot is free 0
    r has a free adapter slot                                               adapter_load_tokens
                                                                            + request time of r / max_loras
                                                                            + home(a, r)
    every slot of r is taken by other adapters                              request time of r + the load
                                                                            + adapter_home_tokens

    home(a, r) = adapter_home_tokens x r's place in a's rendezvous order of the pool's replicas
                 / (replicas - 1): 0 at the adapter's home, adapter_home_tokens at its last

A replica already running the adapter costs nothing extra; a free slot costs the adapter's load
and the share of r's adapter slots the request then holds for its time (other adapters' requests
find one slot fewer); a full slot set costs the wait for a slot, until one adapter's requests all
end (a request's time there, measured, extproc.pick.choice.speed; the prompt's own prefill until
measured), then the load. The term adds to the prefix and load terms, so a hot adapter stays on
the replicas running it until their queues cost more than loading it on another, and one spread
over every replica is not pushed into full slot sets. Where the adapter must be loaded anyway, its
home term orders the replicas the same way for every request of it and on every router (a
rendezvous hash of adapter and replica, as KubeAI hashes the adapter): an adapter whose requests
come and go loads again where it loaded before, whose slot it is likely still in, instead of
wherever the load is lightest at that moment. Pure: the scraped ``vllm:lora_requests_info`` and
this router's own requests in.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

from extproc.core.settings import RouteSettings
from extproc.pick.choice.choose import rendezvous
from extproc.pick.choice.state import ReplicaState, Sample

_RECENT = 64  # adapters remembered per replica (far above any max_loras)


def home_order(adapter: str, addresses: Sequence[str]) -> dict[str, int]:
    """Each replica's place in ``adapter``'s rendezvous order (0: its home), the same on every router."""
    ranked = sorted(addresses, key=lambda address: -rendezvous(adapter, address))
    return {address: place for place, address in enumerate(ranked)}


class AdapterSlots:
    """Each replica's adapters: what its last scrape said runs and waits, and this router's own
    requests in flight per adapter (a request placed since the scrape runs its adapter there too)."""

    def __init__(self) -> None:
        self._scraped: dict[str, Sample] = {}
        self._own: dict[str, Counter[str]] = {}
        # per replica, the adapters it ran, least recently first: vLLM keeps the last max_loras of them
        # in its GPU slots (an LRU), so one of those runs again without a load
        self._recent: dict[str, OrderedDict[str, None]] = {}

    def scraped(self, address: str, sample: Sample) -> None:
        self._scraped[address] = sample
        for adapter in sorted(sample.running_adapters):
            self._touch(address, adapter)

    def left(self, address: str) -> None:
        self._scraped.pop(address, None)
        self._own.pop(address, None)
        self._recent.pop(address, None)

    def assign(self, address: str, adapter: str) -> None:
        self._own.setdefault(address, Counter())[adapter] += 1
        self._touch(address, adapter)

    def _touch(self, address: str, adapter: str) -> None:
        recent = self._recent.setdefault(address, OrderedDict())
        recent[adapter] = None
        recent.move_to_end(adapter)
        if len(recent) > _RECENT:
            recent.popitem(last=False)

    def resident(self, address: str, max_lora: int) -> list[str]:
        """The adapters most likely in ``address``'s GPU slots: the last ``max_lora`` it ran."""
        recent = self._recent.get(address)
        return list(recent)[-max_lora:] if recent and max_lora > 0 else []

    def release(self, address: str, adapter: str) -> None:
        own = self._own.get(address)
        if own is not None and own[adapter] > 0:
            own[adapter] -= 1
            if not own[adapter]:
                del own[adapter]

    def slots(self, address: str, max_lora: int) -> tuple[list[str], int]:
        """The adapters holding ``address``'s ``max_lora`` slots, and how many adapters want one:
        those running at its last scrape first, then ours in flight there, the busiest first (an
        adapter of ours beyond the slots waits, however many requests it has in flight)."""
        sample = self._scraped.get(address)
        running = sorted(sample.running_adapters) if sample is not None else []
        own = self._own.get(address, Counter())
        ours = [a for a, _ in own.most_common() if a not in running]
        wanting = running + ours
        return wanting[:max_lora], len(wanting)

    def costs(self, adapter: str, replicas: Sequence[ReplicaState], prompt_tokens: int,
              settings: RouteSettings) -> dict[str, int]:
        """Each replica's adapter term for a request of ``adapter`` (the table above); a replica
        that says nothing of LoRA (no ``vllm:lora_requests_info``) costs nothing extra."""
        out: dict[str, int] = {}
        home = home_order(adapter, [r.address for r in replicas]) if settings.adapter_home_tokens else {}
        last = max(len(replicas) - 1, 1)
        load, home_tokens = settings.adapter_load_tokens, settings.adapter_home_tokens
        for r in replicas:
            sample = self._scraped.get(r.address)
            if sample is None or not sample.max_lora:
                out[r.address] = 0
                continue
            holding, wanting = self.slots(r.address, sample.max_lora)
            if adapter in holding or (adapter in self.resident(r.address, sample.max_lora)
                                      and wanting < sample.max_lora):
                out[r.address] = 0
            elif wanting < sample.max_lora:  # the load, and one of its slots taken for a request's time
                out[r.address] = (load + home_tokens * home.get(r.address, 0) // last
                                  + (r.request_tokens or prompt_tokens) // sample.max_lora)
            else:  # never cheaper than a free slot anywhere
                out[r.address] = (r.request_tokens or prompt_tokens) + load + home_tokens
        return out

    def state(self, address: str) -> dict[str, Any]:
        """One replica's adapters as JSON (``/debug/state``)."""
        sample = self._scraped.get(address)
        return {"max_lora": sample.max_lora if sample else 0,
                "running_adapters": sorted(sample.running_adapters) if sample else [],
                "waiting_adapters": sorted(sample.waiting_adapters) if sample else [],
                "own_adapters": dict(sorted(self._own.get(address, Counter()).items()))}
