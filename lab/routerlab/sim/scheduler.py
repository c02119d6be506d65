"""vLLM v1-style scheduler: pure step planning over a :class:`KVCache`, no clock, no I/O.

One step (vLLM's ``schedule()``): running sequences first, in order, each taking what it
still needs (1 token for a decode, the rest of its prompt for a partially prefilled one)
from the ``max_num_batched_tokens`` budget; if a running sequence cannot get a KV block
the *last* running sequence is preempted (blocks freed, recomputed later, put back at the
head of the queue). Then, if nothing was preempted, waiting sequences are admitted FCFS
while there is budget, a free ``max_num_seqs`` slot and enough free blocks; a sequence
that does not fit waits (head-of-line, as vLLM's FCFS policy does). Long prompts are
prefilled in chunks. Prefix-cache counters (queries = prompt tokens looked up, hits =
cached tokens) are counted once, when a new sequence is admitted.

Priority (the profile's ``scheduling_policy`` "priority", vLLM's ``--scheduling-policy priority``):
the waiting queue is kept in (priority, arrival) order, lower first, a preempted sequence goes back
by that key too, and the sequence preempted when a running one cannot get a block is the running
one with the worst (priority, arrival), as vLLM's; nothing running is preempted for a better waiting
sequence (vLLM's V1 scheduler does not either).

LoRA (with an :class:`~routerlab.sim.lora.AdapterCache`): as vLLM's ``schedule()``, a waiting
sequence whose adapter is not among the adapters this step already runs, while those number
``max_loras``, is *skipped*: it stays waiting, at its place, and the sequences behind it may still
be admitted. The step's adapters are then applied to the cache; a load lengthens the step.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from routerlab.sim import tokenizer
from routerlab.sim.kv_cache import KVCache, KvEventListener, extend_block_hashes, root_hash
from routerlab.sim.lora import AdapterCache
from routerlab.sim.profiles import Profile


@dataclass(eq=False)
class Sequence:
    """One engine request (one prompt). ``tokens`` = prompt ids + generated ids."""

    req_id: str
    prompt_ids: list[int]
    max_tokens: int
    extra_keys: bytes
    arrival: float = 0.0
    tokens: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0
    cached_at_arrival: int = 0  # prompt tokens the cache held when the request arrived (a diagnostic)
    admitted: bool = False
    preemptions: int = 0
    scheduled_time: float | None = None  # model time it was first scheduled (vLLM's scheduled_ts)
    first_token_time: float | None = None
    last_token_time: float = 0.0
    finish_time: float | None = None
    finish_reason: str | None = None
    aborted: bool = False
    listener: Any = None
    tenant: str = ""  # the tenant header, only to count cross-tenant hits (a simulator diagnostic)
    cache_salt: str | None = None  # only for KV-cache events (block 0's extra keys); the hash has it in extra_keys
    lora_id: int = 0  # the adapter's lora_int_id (0: the base model); the hash has its name in extra_keys
    lora_name: str | None = None
    slot_waited: bool = False  # skipped at least once because max_loras other adapters were running
    deferred: bool = False  # skipped since it last joined the waiting queue (vLLM's deferred_waiting)
    priority: int = 0  # the body's priority (lower first), used under the priority policy

    @property
    def rank(self) -> tuple[int, float]:
        """The priority policy's order: priority, then arrival."""
        return self.priority, self.arrival

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        self._root = root_hash(self.extra_keys)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update_hashes(self, block_size: int) -> None:
        extend_block_hashes(self.block_hashes, self.tokens, block_size, self._root)


@dataclass
class StepPlan:
    """What one step computes: (sequence, tokens) pairs and its model-time cost."""

    scheduled: list[tuple[Sequence, int]]
    prefill_tokens: int
    decodes: int
    duration: float
    preempted: list[Sequence]


@dataclass
class Counters:
    """Plain engine counters (mirrored into Prometheus by metrics.py)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cross_tenant_hits: int = 0  # hit tokens on blocks another tenant's request computed
    # prompt tokens the cache held when each admitted request arrived (not a vLLM counter): against
    # prefix_cache_hits, what the cache lost or gained while the requests waited for admission
    hits_at_arrival: int = 0
    prefix_cache_requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    lora_loads_disk: int = 0  # adapters read from disk (not in the CPU cache) for a step or a load call
    lora_loads_cpu: int = 0  # adapters copied from the CPU cache into a GPU slot
    lora_slot_waits: int = 0  # sequences skipped at least one step for an adapter slot


def _is_decode(seq: Sequence, n: int) -> bool:
    """Whether ``n`` tokens scheduled for ``seq`` are one decode (not prefill)."""
    return bool(seq.outputs) and n == 1 and seq.num_computed == len(seq.tokens) - 1


def _unschedule(scheduled: list[tuple[Sequence, int]], seq: Sequence) -> int:
    """Take ``seq`` out of a step being planned; the tokens it was scheduled (0: it was not)."""
    for k, (other, n) in enumerate(scheduled):
        if other is seq:
            del scheduled[k]
            return n
    return 0


def seq_lora(seq: Sequence) -> dict[str, Any]:
    """The adapter fields of a sequence's KV events (none for the base model)."""
    return {"lora_id": seq.lora_id, "lora_name": seq.lora_name} if seq.lora_id else {}


class Scheduler:
    """FCFS scheduler with chunked prefill, max_num_seqs and preemption by recompute."""

    def __init__(self, profile: Profile, kv: KVCache | None = None, listener: KvEventListener | None = None,
                 output_ids: Seq[int] | None = None, adapters: AdapterCache | None = None) -> None:
        """``listener`` hears the cache's KV events (see kv_cache.py); ``output_ids`` are the ids
        generated tokens cycle through (default: the stand-in tokenizer's filler); ``adapters``:
        LoRA is enabled, with that many slots (max_loras) and that CPU cache."""
        self.profile = profile
        self.adapters = adapters
        self.kv = kv or KVCache(profile.num_blocks, profile.block_size, listener)
        self.output_ids: tuple[int, ...] = tuple(output_ids) if output_ids else tokenizer.FILLER_IDS
        self.waiting: deque[Sequence] = deque()
        self.deferred = 0  # waiting sequences skipped by a scheduling pass and not scheduled since
        self.running: list[Sequence] = []
        self.counters = Counters()
        self.by_priority = profile.scheduling_policy == "priority"

    # ---- queue management --------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.update_hashes(self.kv.block_size)
        seq.cached_at_arrival = len(self.kv.longest_hit(seq.block_hashes, len(seq.tokens))) * self.kv.block_size
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into the waiting queue: at the back (FCFS), or at its (priority, arrival) place."""
        if not self.by_priority:
            self.waiting.append(seq)
            return
        self.waiting.insert(bisect.bisect_right(self.waiting, seq.rank, key=lambda s: s.rank), seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence (client went away); frees its blocks."""
        if seq.finished:
            return
        seq.aborted = True
        seq.finish_reason = "abort"
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
            self._undefer(seq)
        self.kv.free(seq.req_id)
        self.counters.aborted += 1

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ----------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan one step (allocates KV blocks); an empty plan means nothing can run."""
        kv = self.kv
        budget = self.profile.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        prefill = decodes = 0

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            ok = True
            while not kv.allocate(seq.req_id, seq.num_computed + n, seq.block_hashes, owner=seq.tenant,
                                  token_ids=seq.tokens, cache_salt=seq.cache_salt, **seq_lora(seq)):
                at = self._victim()
                victim = self.running.pop(at)
                if at < i:  # ahead of this one in the step: give back what it was scheduled
                    i -= 1
                    done = _unschedule(scheduled, victim)
                    budget += done
                    if _is_decode(victim, done):
                        decodes -= 1
                    else:
                        prefill -= done
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append((seq, n))
            if _is_decode(seq, n):
                decodes += 1
            else:
                prefill += n
            budget -= n
            i += 1

        loras = {s.lora_id for s, _ in scheduled if s.lora_id}
        if not preempted:
            skipped: list[Sequence] = []
            while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
                seq = self.waiting[0]
                if self._needs_a_slot(seq, loras):
                    skipped.append(self.waiting.popleft())
                    if not seq.slot_waited:
                        seq.slot_waited = True
                        self.counters.lora_slot_waits += 1
                    if not seq.deferred:
                        seq.deferred = True
                        self.deferred += 1
                    continue
                hits = kv.longest_hit(seq.block_hashes, len(seq.tokens))
                hit_tokens = len(hits) * kv.block_size
                n = min(len(seq.tokens) - hit_tokens, budget)
                if not kv.allocate(seq.req_id, hit_tokens + n, seq.block_hashes, hits, owner=seq.tenant,
                                   token_ids=seq.tokens, cache_salt=seq.cache_salt, **seq_lora(seq)):
                    break
                self.waiting.popleft()
                self._undefer(seq)
                if not seq.admitted:
                    seq.admitted = True
                    seq.cached_tokens = hit_tokens
                    c = self.counters
                    c.prefix_cache_requests += 1
                    c.prefix_cache_queries += len(seq.tokens)
                    c.prefix_cache_hits += hit_tokens
                    c.hits_at_arrival += seq.cached_at_arrival
                    c.cross_tenant_hits += kv.block_size * sum(b.owner != seq.tenant for b in hits)
                seq.num_computed = hit_tokens
                self.running.append(seq)
                scheduled.append((seq, n))
                if seq.lora_id:
                    loras.add(seq.lora_id)
                prefill += n
                budget -= n
            self.waiting.extendleft(reversed(skipped))  # back at the head, in their order

        duration = self.profile.step_time(prefill, decodes) if scheduled else 0.0
        if loras:  # the step's adapters are made resident first: a load lengthens the step
            duration += self.load_adapters(s.lora_id for s, _ in scheduled if s.lora_id)
        return StepPlan(scheduled, prefill, decodes, duration, preempted)

    def _undefer(self, seq: Sequence) -> None:
        if seq.deferred:
            seq.deferred = False
            self.deferred -= 1

    def _needs_a_slot(self, seq: Sequence, loras: set[int]) -> bool:
        """vLLM's max_loras rule: the step's adapters are all taken by others."""
        return (self.adapters is not None and seq.lora_id != 0 and len(loras) >= self.adapters.slots
                and seq.lora_id not in loras)

    def load_adapters(self, lora_ids: Iterable[int], reload: bool = False) -> float:
        """Make the adapters resident (a step's batch, or a load request); returns the model seconds
        it takes and counts the loads. ``reload``: read from disk even if cached (load in place)."""
        if self.adapters is None:
            return 0.0
        cost = self.adapters.apply(lora_ids, reload)
        self.counters.lora_loads_disk += cost.from_disk
        self.counters.lora_loads_cpu += cost.from_cpu
        return cost.seconds

    def _victim(self) -> int:
        """Which running sequence to preempt: the last admitted (FCFS), or the worst ranked."""
        if not self.by_priority:
            return len(self.running) - 1
        return max(range(len(self.running)), key=lambda k: self.running[k].rank)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.req_id)
        seq.num_computed = 0
        seq.preemptions += 1
        self.counters.preemptions += 1
        if self.by_priority:
            self._enqueue(seq)
        else:
            self.waiting.appendleft(seq)

    def complete(self, plan: StepPlan, now: float) -> list[Sequence]:
        """Apply a step's results at model time ``now``; returns sequences that got a token."""
        self.counters.steps += 1
        emitted: list[Sequence] = []
        finished_any = False
        bs = self.kv.block_size
        out_ids = self.output_ids
        for seq, n in plan.scheduled:
            if seq.finished:  # aborted while the step ran
                continue
            seq.num_computed += n
            if seq.num_computed < len(seq.tokens):
                continue  # still prefilling (chunked)
            index = len(seq.outputs)
            token_id = out_ids[index % len(out_ids)]
            seq.outputs.append(token_id)
            seq.tokens.append(token_id)
            seq.update_hashes(bs)
            c = self.counters
            c.generation_tokens += 1
            if index == 0:
                seq.first_token_time = now
                c.prompt_tokens += seq.num_prompt
            if len(seq.outputs) >= seq.max_tokens:
                seq.finish_reason = "length"
                seq.finish_time = now
                self.kv.free(seq.req_id)
                c.finished += 1
                finished_any = True
            emitted.append(seq)
        if finished_any:
            self.running = [s for s in self.running if not s.finished]
        return emitted
