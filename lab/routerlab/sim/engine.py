"""One replica's engine: the pure :class:`Scheduler` driven by an asyncio step loop.

Time: each step takes ``profile.step_time(...) * slow_factor`` of *model time*; the loop
sleeps ``model_time / time_scale`` of wall time (``--time-scale 10`` runs 10x faster).
The model clock runs back to back while the engine is busy and sleeps target absolute
wall deadlines, so timer granularity does not accumulate; if the event loop falls more
than ``LAG_TOLERANCE_S`` wall seconds behind (CPU starved; shorter stalls are
caught up by running the next steps without sleeping), the model clock snaps
forward to wall time, so overload shows up as latency rather than being hidden.

KV-cache events: with a ``kv_events`` publisher (:class:`routerlab.sim.kv_events.KvEventPublisher`)
the cache reports to it and the engine flushes one batch per step, after the step's results are
applied (vLLM publishes in ``update_from_output``). A prefix-cache reset is flushed at once as
its own batch (vLLM would send it with the next step's).

LoRA (with an ``adapters`` cache): a step's adapter loads lengthen that step (the scheduler prices
them); a run-time load (``/v1/load_lora_adapter``) runs in the loop between steps, as vLLM's engine
core runs its ``add_lora`` utility call, so it delays the next step. Every step sets
``vllm:lora_requests_info`` from :class:`~routerlab.sim.lora_states.LoraRequestStates`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence as Seq
from dataclasses import fields
from typing import Any

from routerlab.sim.control import Control
from routerlab.sim.lora import AdapterCache
from routerlab.sim.lora_states import LoraRequestStates
from routerlab.sim.metrics import ReplicaMetrics
from routerlab.sim.profiles import Profile
from routerlab.sim.scheduler import Counters, Scheduler, Sequence

log = logging.getLogger(__name__)

LAG_TOLERANCE_S = 0.02


class Listener:
    """Wakes the HTTP handler that owns one or more sequences when they get tokens."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def notify(self) -> None:
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class Engine:
    """Step loop, model clock and metric bookkeeping for one replica."""

    def __init__(
        self, profile: Profile, time_scale: float, control: Control, metrics: ReplicaMetrics,
        kv_events: Any = None, output_ids: Seq[int] | None = None, adapters: AdapterCache | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.profile = profile
        self.time_scale = time_scale
        self.control = control
        self.metrics = metrics
        self.kv_events = kv_events  # a KvEventPublisher (hooks + flush) or None
        self.sched = Scheduler(profile, listener=kv_events, output_ids=output_ids, adapters=adapters)
        self.lora_states = LoraRequestStates() if adapters is not None else None
        self._loads: list[tuple[int, bool, asyncio.Future[None]]] = []
        self._loop = asyncio.get_running_loop()
        self._origin = self._loop.time()
        self._model_now = 0.0
        self._wake = asyncio.Event()
        self._synced = Counters()
        self._task: asyncio.Task[None] | None = None
        self.clock_snaps = 0  # times the loop fell behind and the model clock jumped
        self.snapped_model_s = 0.0

    # ---- clock -------------------------------------------------------------------
    def model_time(self) -> float:
        """Model seconds since the engine started (wall seconds x time_scale)."""
        return (self._loop.time() - self._origin) * self.time_scale

    # ---- lifecycle ---------------------------------------------------------------
    def attach_kv_events(self, publisher: Any) -> None:
        """Report this engine's cache events to ``publisher`` (None: stop reporting)."""
        self.kv_events = publisher
        self.sched.kv.listener = publisher

    def start(self) -> None:
        self._task = self._loop.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.abort_all()
        for _, _, done in self._loads:
            done.cancel()
        self._loads.clear()

    # ---- requests ----------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        seq.arrival = self.model_time()
        self.sched.add(seq)
        self.metrics.waiting.set(len(self.sched.waiting))
        self._wake.set()

    async def add_lora(self, lora_id: int, reload: bool = False) -> None:
        """Load an adapter into the CPU cache and a GPU slot (vLLM's ``add_lora``) between two steps;
        returns once loaded."""
        done: asyncio.Future[None] = self._loop.create_future()
        self._loads.append((lora_id, reload, done))
        self._wake.set()
        await done

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            if self.lora_states is not None:
                self.lora_states.finished(seq.req_id, seq.lora_name)
            self.sched.abort(seq)
            self.metrics.request_success("abort")
            self.refresh_gauges()
            self._wake.set()

    def abort_all(self) -> None:
        """Abort every queued or running sequence and wake its handler (stop, failed step)."""
        for seq in list(self.sched.running) + list(self.sched.waiting):
            self.abort(seq)
            if seq.listener is not None:
                seq.listener.notify()

    def reset_cache(self) -> int:
        n = self.sched.kv.reset()
        self.flush_events()
        return n

    def flush_events(self) -> None:
        """Send the KV events collected so far as one batch (once per step)."""
        if self.kv_events is not None:
            try:
                self.kv_events.flush()
            except Exception:  # a publisher problem must not stop the replica serving
                log.exception("sim: publishing KV-cache events failed")

    # ---- loop --------------------------------------------------------------------
    async def _run(self) -> None:
        idle = True
        while True:
            try:
                if not self.sched.has_work() and not self._loads:
                    self.refresh_gauges()
                    self._wake.clear()
                    await self._wake.wait()
                    idle = True
                    continue
                self._catch_up(idle)
                if self._loads:
                    idle = False
                    await self._load_adapters()
                    continue
                plan = self.sched.schedule()
                if not plan.scheduled:
                    # nothing can run until a request leaves (cannot normally happen)
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                idle = False
                for seq, _ in plan.scheduled:
                    if seq.scheduled_time is None:
                        seq.scheduled_time = self._model_now
                end = await self._advance(plan.duration * self.control.slow_factor)
                emitted = self.sched.complete(plan, end)
                self.flush_events()
                self._account(emitted, end)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Keep the replica serving, but fail what was in flight: retrying the same
                # state would fail the same way, forever.
                log.exception("sim engine step failed; aborting in-flight requests")
                self.abort_all()
                self.flush_events()

    def _catch_up(self, idle: bool) -> None:
        """Start the model clock at wall time after idling; snap it forward when the loop lags."""
        wall_model = self.model_time()
        if idle or wall_model - self._model_now > LAG_TOLERANCE_S * self.time_scale:
            if not idle:
                self.clock_snaps += 1
                self.snapped_model_s += wall_model - self._model_now
            self._model_now = max(self._model_now, wall_model)

    async def _advance(self, model_s: float) -> float:
        """Let ``model_s`` model seconds pass (sleeping towards the absolute wall deadline)."""
        end = self._model_now + model_s
        delay = self._origin + end / self.time_scale - self._loop.time()
        await asyncio.sleep(delay if delay > 0 else 0)
        self._model_now = end
        return end

    async def _load_adapters(self) -> None:
        """Run the pending run-time adapter loads, one after the other, then answer them."""
        loads, self._loads = self._loads, []
        seconds = sum(self.sched.load_adapters([lora_id], reload) for lora_id, reload, _ in loads)
        await self._advance(seconds * self.control.slow_factor)
        self._sync_counters()
        for _, _, done in loads:
            if not done.done():
                done.set_result(None)

    def _account(self, emitted: list[Sequence], now: float) -> None:
        m = self.metrics
        states = self.lora_states
        for seq in emitted:
            n = len(seq.outputs)
            if states is not None and (n == 1 or seq.finished):
                if n == 1:
                    states.first_token(seq.req_id, seq.lora_name)
                if seq.finished:
                    states.finished(seq.req_id, seq.lora_name)
            if n == 1:
                m.ttft.observe(max(0.0, now - seq.arrival))
            else:
                m.itl.observe(max(0.0, now - seq.last_token_time))
            seq.last_token_time = now
            if seq.finished:
                m.e2e.observe(max(0.0, now - seq.arrival))
                self._observe_phases(seq, now)
                m.request_success(seq.finish_reason or "length")
            if seq.listener is not None:
                seq.listener.notify()
        self._sync_counters()
        self.refresh_gauges()
        if states is not None:
            m.lora_requests_info(states.label())

    def _observe_phases(self, seq: Sequence, now: float) -> None:
        """vLLM's per-phase histograms, observed when a request finishes (v1's record_finished_request):
        queue = arrival to first scheduled, prefill = first scheduled to first token."""
        scheduled = seq.scheduled_time if seq.scheduled_time is not None else seq.arrival
        first = seq.first_token_time if seq.first_token_time is not None else now
        self.metrics.queue_time.observe(max(0.0, scheduled - seq.arrival))
        self.metrics.prefill_time.observe(max(0.0, first - scheduled))
        self.metrics.prefill_computed.observe(max(0, seq.num_prompt - seq.cached_tokens))

    def _sync_counters(self) -> None:
        c, s, m = self.sched.counters, self._synced, self.metrics
        pairs = (
            ("prefix_cache_queries", m.prefix_cache_queries),
            ("prefix_cache_hits", m.prefix_cache_hits),
            ("cross_tenant_hits", m.cross_tenant_hits),
            ("hits_at_arrival", m.hits_at_arrival),
            ("prompt_tokens", m.prompt_tokens),
            ("generation_tokens", m.generation_tokens),
            ("preemptions", m.num_preemptions),
        ) + ((("lora_loads_disk", m.lora_loads_disk), ("lora_loads_cpu", m.lora_loads_cpu),
              ("lora_slot_waits", m.lora_slot_waits)) if m.lora_info is not None else ())
        for name, metric in pairs:
            delta = getattr(c, name) - getattr(s, name)
            if delta:
                metric.inc(delta)
        for f in fields(Counters):
            setattr(s, f.name, getattr(c, f.name))

    def refresh_gauges(self) -> None:
        """Set the queue and KV gauges from the scheduler (also before a /metrics scrape)."""
        m = self.metrics
        m.running.set(len(self.sched.running))
        m.waiting.set(len(self.sched.waiting))
        m.waiting_deferred.set(self.sched.deferred)  # vLLM 0.32: skipped by a scheduling pass (here: for a slot)
        m.waiting_capacity.set(len(self.sched.waiting) - self.sched.deferred)
        m.kv_usage.set(self.sched.kv.usage())

    def state(self) -> dict[str, object]:
        """Plain JSON counters for GET /sim/state."""
        c, kv = self.sched.counters, self.sched.kv
        return {
            "prefix_cache_queries": c.prefix_cache_queries,
            "prefix_cache_hits": c.prefix_cache_hits,
            "cross_tenant_hits": c.cross_tenant_hits,
            "hits_at_arrival": c.hits_at_arrival,
            "prefix_cache_requests": c.prefix_cache_requests,
            "prompt_tokens": c.prompt_tokens,
            "generation_tokens": c.generation_tokens,
            "finished": c.finished,
            "aborted": c.aborted,
            "preemptions": c.preemptions,
            "steps": c.steps,
            "running": len(self.sched.running),
            "waiting": len(self.sched.waiting),
            "blocks_total": kv.num_blocks,
            "blocks_free": kv.num_free,
            "blocks_used": kv.num_used,
            "blocks_cached": kv.num_cached_blocks,
            "evictions": kv.evictions,
            "kv_cache_usage": kv.usage(),
            "model_time_s": self.model_time(),
            "clock_snaps": self.clock_snaps,
            "snapped_model_s": self.snapped_model_s,
            **self._lora_state(),
        }

    def _lora_state(self) -> dict[str, object]:
        """The adapter counters and caches (lora_int_ids, oldest first); nothing without LoRA."""
        cache, c = self.sched.adapters, self.sched.counters
        if cache is None:
            return {}
        return {"lora_loads_disk": c.lora_loads_disk, "lora_loads_cpu": c.lora_loads_cpu,
                "lora_slot_waits": c.lora_slot_waits, "lora_cpu_cache": list(cache.cpu),
                "lora_gpu_slots": list(cache.gpu)}
