"""The router service: what every Envoy adapter asks of the router, whatever the transport.

Three adapters speak to Envoy (``ext_proc``: envoy.yaml, pick.yaml; ``ext_authz``: the gRPC
Check; ``ext_authz_http``: envoy-fast.yaml). Each only translates its transport's messages and
calls one ``RouterService`` as a peer of the others; none imports another. The service holds
what they share:

- the settings: the process defaults, overridden by a stream's or a request's
  ``x-prefix-router-*`` metadata (``settings_for``; a bad value is logged once per distinct
  set, counted and ignored), checked against what the router has (a picker, a tenant secret)
  and what the transport can carry out (``Limits``, data the adapter passes);
- the decision (``decide``: the prefix key, timed and counted, the GC paused around it);
- pick mode's request path (``prepare``, ``pick``, ``release``) through the picker, when the
  process has one;
- the metrics and logs of all of it, and the fallbacks that never fail a request: a failed
  decision or pick costs the request its key or its pick, never the request.

It is plain synchronous code (``prepare`` aside, which awaits the picker's worker) with no
knowledge of gRPC or HTTP, and adds no layer on the request path: an adapter calls it directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

from extproc import metrics
from extproc.core.decide import Decision, decide
from extproc.core.model import MODEL_ABSENT
from extproc.core.priority import priority_of
from extproc.core.settings import ENDPOINT_FLAGS, METADATA_PREFIX, RouteSettings, with_metadata
from extproc.pick.choice.choose import Choice
from extproc.pick.core import PickCore
from extproc.pick.flow.gate import FlowGate, Ticket
from extproc.pick.flow.request import tenant_of, tokens_of

log = logging.getLogger("extproc.adapters.service")

_MAX_CACHED_METADATA: Final = 1024

Metadata = Iterable[tuple[str, str | bytes]]  # (name, value) pairs as a transport sends them


@dataclasses.dataclass(frozen=True, eq=False)
class Limits:
    """What a transport cannot carry out, each with why (None: it can), as ``settings_for`` logs it
    when a setting asks for it. Compared and hashed by identity: an adapter passes one constant."""

    cannot_pick: str | None = None  # pick mode needs the request's end (to count it in flight)
    cannot_edit_body: str | None = None  # tenant isolation rewrites the body
    cannot_hold: str | None = None  # flow control holds a request and may answer it 429


NO_LIMITS: Final = Limits()  # a transport that can do all the router does (ext_proc)


@contextlib.contextmanager
def without_gc() -> Iterator[None]:
    """Pause the cyclic GC while one body is decided.

    A body of millions of tiny JSON containers makes the parse allocate them all at once, and
    the GC would walk them again and again (measured here: 8 MiB of ``[],`` took 0.78 s with it,
    0.23 s without). The parsed document holds no cycles, so reference counting frees it all anyway.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class RouterService:
    """One instance serves every adapter, stream and request of the process.

    ``settings``: the process's route settings; ``picker``: pick mode's request path when the
    process has endpoints, else None (a ``mode: pick`` setting then falls back to hash mode);
    ``secret``: tenant isolation's HMAC key, None when isolation cannot be turned on.
    """

    def __init__(self, settings: RouteSettings, picker: PickCore | None = None, secret: bytes | None = None) -> None:
        self.settings = settings
        self.picker = picker
        self.secret = secret
        self.gate: FlowGate | None = None
        if picker is not None:  # several routers sharing their requests take turns at a saturated pool's room
            shared = picker.share is not None
            self.gate = FlowGate(picker.room, elsewhere=picker.held_elsewhere if shared else None,
                                 tell=picker.held_here if shared else None)
        self._by_metadata: dict[tuple[Limits | tuple[str, str], ...], RouteSettings] = {}

    def settings_for(self, metadata: Metadata | None, limits: Limits = NO_LIMITS) -> RouteSettings:
        """The process settings overridden by ``metadata``'s ``x-prefix-router-*`` pairs (later
        pairs win), within what the router has and what the transport can do (``limits``).

        Metadata is the same for every request of a route, so results are cached and a bad
        value is logged once per distinct metadata set, not once per request.
        """
        ours = tuple(
            (k, v if isinstance(v, str) else v.decode("utf-8", "replace"))
            for k, v in (metadata or ())
            if k.startswith(METADATA_PREFIX)
        )
        if not ours and limits is NO_LIMITS:
            return self.settings
        cache_key: tuple[Limits | tuple[str, str], ...] = (limits, *ours)
        cached = self._by_metadata.get(cache_key)
        if cached is None:
            cached = self._resolve(ours, limits)
            if len(self._by_metadata) >= _MAX_CACHED_METADATA:
                self._by_metadata.clear()
            self._by_metadata[cache_key] = cached
        return cached

    def _resolve(self, ours: tuple[tuple[str, str], ...], limits: Limits) -> RouteSettings:
        settings, errors = with_metadata(self.settings, ours)
        if settings.mode == "pick" and (limits.cannot_pick or self.picker is None):
            errors.append("x-prefix-router-mode pick: " + (
                limits.cannot_pick
                or f"the router has no endpoints ({ENDPOINT_FLAGS})")
                + "; using hash mode")
            settings = dataclasses.replace(settings, mode="hash")
        if settings.flow_control and (limits.cannot_hold or settings.mode != "pick"):
            errors.append("x-prefix-router-flow-control on: " + (
                limits.cannot_hold or "flow control holds requests in pick mode only") + "; flow control stays off")
            settings = dataclasses.replace(settings, flow_control=False)
        if settings.vllm_priority and limits.cannot_edit_body:
            errors.append(f"x-prefix-router-vllm-priority on: {limits.cannot_edit_body}; the body is left as sent")
            settings = dataclasses.replace(settings, vllm_priority=False)
        if settings.tenant_isolation and (limits.cannot_edit_body or self.secret is None):
            errors.append("x-prefix-router-tenant-isolation on: " + (
                limits.cannot_edit_body
                or "the router has no tenant secret (--tenant-secret-file or PREFIX_ROUTER_TENANT_SECRET)")
                + "; isolation stays off")
            settings = dataclasses.replace(settings, tenant_isolation=False)
        for error in errors:
            metrics.METADATA_ERRORS.inc()
            log.warning("ignoring per-stream setting (using the process default): %s", error)
        return settings

    @staticmethod
    def no_body(settings: RouteSettings) -> None:
        """Count a request that has no body to key (a GET, an empty POST)."""
        metrics.decision_counter(settings.normalize, "empty").inc()
        if settings.model_header:
            metrics.MODEL_HEADER.labels(MODEL_ABSENT).inc()

    def decide(self, body: bytes, headers: Mapping[str, str], settings: RouteSettings,
               complete: bool) -> Decision | None:
        """The request's decision (``headers``: the ones ``decide()`` reads, lower-case names;
        ``complete``: ``body`` is the whole body), timed and counted; None if deciding failed
        (logged and counted): the request then goes on without a key. Never raises."""
        started = time.perf_counter()
        gc_was_on = gc.isenabled()  # without_gc(), inlined: its context manager cost ~1 us a request
        gc.disable()
        try:
            decision = decide(body, headers, settings, complete=complete, secret=self.secret)
        except Exception:
            log.exception("deciding a prefix key failed; passing the request on without one")
            metrics.ERRORS.labels("decide").inc()
            return None
        finally:
            if gc_was_on:
                gc.enable()
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        metrics.BODY_BYTES.observe(len(body))
        metrics.decision_counter(decision.normalize, decision.fallback or "none").inc()
        if decision.tenant_rejected:
            metrics.TENANTS_REJECTED.labels(decision.tenant_rejected).inc()
        if decision.isolation:
            metrics.ISOLATION.labels(decision.isolation).inc()
        if settings.model_header:
            metrics.MODEL_HEADER.labels(decision.model_outcome).inc()
        return decision

    def ahead_work(self, decision: Decision | None, settings: RouteSettings) -> object | None:
        """What the picker must do off the event loop before ``pick`` (precise mode's long new text,
        tokenised on its worker: ``run_ahead``), or None: pick at once. Never raises."""
        if decision is None or self.picker is None:
            return None
        try:
            return self.picker.ahead_work(decision, settings)
        except Exception:
            log.exception("tokenizing ahead failed; the pick tokenises on the loop")
            metrics.ERRORS.labels("tokenize_ahead").inc()
            return None

    async def run_ahead(self, work: object) -> int:
        """Do ``ahead_work``'s ``work``; returns the pick's ``max_new_chars``. Never raises."""
        assert self.picker is not None  # ahead_work found work
        try:
            return await self.picker.run_ahead(work)
        except Exception:
            log.exception("tokenizing ahead failed; the pick tokenises on the loop")
            metrics.ERRORS.labels("tokenize_ahead").inc()
            return 0

    async def prepare(self, decision: Decision | None, settings: RouteSettings) -> int:
        """``ahead_work`` then ``run_ahead``: the pick's ``max_new_chars``. Never raises."""
        work = self.ahead_work(decision, settings)
        return 0 if work is None else await self.run_ahead(work)

    def pick(self, decision: Decision, settings: RouteSettings, max_new_chars: int = 0,
             avoid_saturated: bool = False) -> Choice | None:
        """The replica for the request, counted in flight until ``release``; None when there is
        none to name (no picker, no replica, or picking failed: logged and counted), and Envoy's
        load balancer chooses. Never raises."""
        if self.picker is None:
            return None
        try:
            choice = self.picker.pick(decision, settings, max_new_chars, avoid_saturated)
        except Exception:
            log.exception("picking a replica failed; Envoy's load balancer chooses")
            metrics.ERRORS.labels("pick").inc()
            return None
        return None if choice.address is None else choice

    def release(self, choice: Choice) -> None:
        """The request ``pick`` chose ``choice`` for has ended (its response is over): flow control may
        let a held request out into the room it leaves."""
        assert self.picker is not None and self.gate is not None  # pick named a replica, so there is a picker
        self.picker.release(choice)
        if self.gate.queues:
            try:
                self.gate.kick()
            except Exception:  # the ticker lets them out in 10 ms anyway
                log.exception("flow control failed to let held requests out")
                metrics.ERRORS.labels("flow").inc()

    # --- flow control (extproc.pick.flow): hold while the pool is saturated, then pick --------------
    def hold(self, decision: Decision | None, settings: RouteSettings, headers: Mapping[str, str]) -> Ticket | None:
        """The request's ticket through flow control (held while its pool is saturated, or let out at
        once), or None: no flow control for it (off, not picked, or the gate failed: logged and counted).
        The caller ends every ticket with ``done``. Never raises."""
        if not settings.flow_control or decision is None or self.picker is None or self.gate is None:
            return None
        try:
            pool = self.picker.pool_of(decision)
            if pool is None:
                return None
            return self.gate.enter(pool, tenant_of(decision), priority_of(settings, headers), tokens_of(decision),
                                   settings)
        except Exception:
            log.exception("flow control failed; the request goes on at once")
            metrics.ERRORS.labels("flow").inc()
            return None

    async def wait(self, ticket: Ticket) -> str:
        """Until a held ``ticket`` is let out or shed: its state (extproc.pick.flow.gate)."""
        assert self.gate is not None  # hold made the ticket
        return await self.gate.wait(ticket)

    def retry_after(self, ticket: Ticket) -> int:
        """Seconds a shed request's client should wait before it retries."""
        assert self.gate is not None  # hold made the ticket
        return self.gate.retry_after(ticket)

    def done(self, ticket: Ticket) -> None:
        """The request through ``ticket`` is picked, or gone. Never raises."""
        assert self.gate is not None  # hold made the ticket
        try:
            self.gate.done(ticket)
        except Exception:
            log.exception("ending a flow-control ticket failed")
            metrics.ERRORS.labels("flow").inc()

