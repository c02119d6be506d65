"""The gRPC adapter: speaks Envoy's ext_proc protocol and only translates messages.

Per stream: the request-headers message gives the tenant headers (reply at once, removing
any client-sent key header); the request-body message gives the body, the core decides,
and the reply sets the key header (and the same key as dynamic metadata, for configs that
skip the header phase). In hash mode the RPC then ends: Envoy needs nothing more from us.
In pick mode the reply also names the replica, and the RPC stays open until Envoy ends it
with the HTTP response: that end is how the picker learns the request is no longer in
flight (one open stream per request in flight is the price).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Final

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import metrics
from extproc.core.decide import CONTENT_ENCODING, Decision, decide
from extproc.core.settings import METADATA_PREFIX, RouteSettings, with_metadata
from extproc.pick.choice.choose import Choice
from extproc.pick.core import PickCore

log = logging.getLogger("extproc.adapters.ext_proc")

_OVERWRITE: Final = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_ATTR_HEADER_PREFIX: Final = "request.headers['"
_MAX_CACHED_METADATA: Final = 1024
LB_NAMESPACE: Final = "envoy.lb"
DESTINATION_ENDPOINT: Final = "x-gateway-destination-endpoint"  # Gateway API Inference Extension


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


def read_headers(http_headers: pb.HttpHeaders, wanted: Iterable[str]) -> dict[str, str]:
    """The wanted headers (lower-case names) of an ext_proc headers message."""
    wanted = set(wanted)
    out: dict[str, str] = {}
    for h in http_headers.headers.headers:
        if h.key in wanted:
            out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def read_attribute_headers(request: pb.ProcessingRequest) -> dict[str, str]:
    """Headers Envoy sent as ``request_attributes`` (used when the header phase is skipped)."""
    out: dict[str, str] = {}
    for struct in request.attributes.values():
        for name, value in struct.fields.items():
            if name.startswith(_ATTR_HEADER_PREFIX) and name.endswith("']"):
                out[name[len(_ATTR_HEADER_PREFIX):-2].lower()] = value.string_value
    return out


class PrefixRouter(pb_grpc.ExternalProcessorServicer):
    """ExternalProcessor service; one instance serves every stream.

    With a ``picker`` (pick mode configured for the process), a stream whose settings say
    ``mode: pick`` also names the replica, and stays open until Envoy ends it (when the
    HTTP response ends), so the picker counts the request as in flight until then.
    """

    def __init__(self, settings: RouteSettings, metadata_namespace: str = "prefix_router",
                 picker: PickCore | None = None, secret: bytes | None = None) -> None:
        self.settings = settings
        self.namespace = metadata_namespace
        self.picker = picker
        self.secret = secret  # tenant isolation's HMAC key; None: isolation cannot be turned on
        self._by_metadata: dict[tuple[bool | tuple[str, str], ...], RouteSettings] = {}
        self._headers_replies: dict[tuple[str, str], pb.ProcessingResponse] = {}
        self.open_streams = 0  # `serve` has the streams_active gauge read it at scrape time

    def settings_for(self, invocation_metadata: Iterable[tuple[str, str | bytes]] | None,
                     authz: bool = False) -> RouteSettings:
        """Process settings overridden by this stream's x-prefix-router-* metadata.

        Metadata is the same for every stream of a route, so results are cached and a bad
        value is logged once per distinct metadata set, not once per request. ``authz``: the
        caller is the ext_authz shape (extproc.adapters.ext_authz), which can neither pick nor rewrite a body.
        """
        ours = tuple(
            (k, v if isinstance(v, str) else v.decode("utf-8", "replace"))
            for k, v in (invocation_metadata or ())
            if k.startswith(METADATA_PREFIX)
        )
        if not ours and not authz:
            return self.settings
        cache_key = (authz, *ours)
        cached = self._by_metadata.get(cache_key)
        if cached is None:
            cached, errors = with_metadata(self.settings, ours)
            if cached.mode == "pick" and (authz or self.picker is None):
                errors.append("x-prefix-router-mode pick: " + (
                    "the ext_authz shape cannot pick (it never sees the response end)" if authz else
                    "the router has no endpoints (--endpoints, --endpoints-file or --endpoints-dns)")
                    + "; using hash mode")
                cached = dataclasses.replace(cached, mode="hash")
            if cached.tenant_isolation and (authz or self.secret is None):
                errors.append("x-prefix-router-tenant-isolation on: " + (
                    "the ext_authz shape cannot rewrite the body (use envoy.yaml)" if authz else
                    "the router has no tenant secret (--tenant-secret-file or PREFIX_ROUTER_TENANT_SECRET)")
                    + "; isolation stays off")
                cached = dataclasses.replace(cached, tenant_isolation=False)
            for error in errors:
                metrics.METADATA_ERRORS.inc()
                log.warning("ignoring per-stream setting (using the process default): %s", error)
            if len(self._by_metadata) >= _MAX_CACHED_METADATA:
                self._by_metadata.clear()
            self._by_metadata[cache_key] = cached
        return cached

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        self.open_streams += 1
        try:
            settings = self.settings_for(context.invocation_metadata())
        except Exception:  # never let the router fail a request
            log.exception("reading stream metadata failed")
            metrics.ERRORS.labels("metadata").inc()
            settings = self.settings
        wanted = (*settings.tenant_headers, CONTENT_ENCODING)
        headers: dict[str, str] = {}
        try:
            async for request in request_iterator:
                phase = request.WhichOneof("request")
                if phase == "request_headers":
                    headers = self.safe_headers(request.request_headers, wanted)
                    yield self.headers_reply(settings)
                    if request.request_headers.end_of_stream:
                        metrics.decision_counter(settings.normalize, "empty").inc()
                        return
                elif phase == "request_body":
                    # BUFFERED: the whole body. BUFFERED_PARTIAL: the whole body, or its first
                    # buffer-limit bytes (end_of_stream false) while Envoy streams the rest on.
                    if not headers:
                        headers = read_attribute_headers(request)
                    body = request.request_body
                    if settings.mode != "pick":
                        yield self.body_reply(body.body, headers, settings, complete=body.end_of_stream)
                        return
                    decision = self.decide(body.body, headers, settings, body.end_of_stream)
                    reply, picked = self.pick_reply(decision, settings, await self.prepare(decision, settings))
                    if picked is None:
                        yield reply
                        return
                    # Hold the picked replica's in-flight count until Envoy closes the stream. The
                    # release covers the reply's own yield: Envoy may end the stream (a fast response)
                    # before we resume after it, and the generator is then closed right there.
                    try:
                        yield reply
                        async for request in request_iterator:
                            yield _pass_through(request.WhichOneof("request"))
                    finally:
                        self.picker.release(picked)
                    return
                else:
                    yield _pass_through(phase)
        finally:
            self.open_streams -= 1

    @staticmethod
    def safe_headers(http_headers: pb.HttpHeaders, wanted: Iterable[str]) -> dict[str, str]:
        try:
            return read_headers(http_headers, wanted)
        except Exception:
            log.exception("reading request headers failed; deciding without a header tenant")
            metrics.ERRORS.labels("headers").inc()
            return {}

    def headers_reply(self, settings: RouteSettings) -> pb.ProcessingResponse:
        """A client-sent key or pick header must never choose the host: remove both.

        Built once per header pair and shared by every stream (grpc only serialises it).
        """
        names = (settings.key_header, settings.pick_header)
        reply = self._headers_replies.get(names)
        if reply is None:
            reply = pb.ProcessingResponse()
            reply.request_headers.response.header_mutation.remove_headers.extend(names)
            self._headers_replies[names] = reply
        return reply

    def decide(self, body: bytes, headers: Mapping[str, str], settings: RouteSettings,
                complete: bool) -> Decision | None:
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
        return decision

    def body_reply(self, body: bytes, headers: Mapping[str, str], settings: RouteSettings,
                   complete: bool = True) -> pb.ProcessingResponse:
        decision = self.decide(body, headers, settings, complete)
        return _empty_body_reply() if decision is None else self.decision_reply(decision, settings)

    async def prepare(self, decision: Decision | None, settings: RouteSettings) -> int:
        """What the picker does off the event loop before ``pick_reply`` (precise mode's long new
        text tokenised on its worker); returns the pick's ``max_new_chars``. Never raises."""
        if decision is None or self.picker is None:
            return 0
        try:
            return await self.picker.prepare(decision, settings)
        except Exception:
            log.exception("tokenizing ahead failed; the pick tokenises on the loop")
            metrics.ERRORS.labels("tokenize_ahead").inc()
            return 0

    def pick_reply(self, decision: Decision | None, settings: RouteSettings,
                   max_new_chars: int = 0) -> tuple[pb.ProcessingResponse, Choice | None]:
        """The hash-mode reply plus the picked replica: Envoy's stateful_session reads the
        pick header (and sends the request there only if that host is healthy, else its
        own LB hashes the key header); ``envoy.lb`` metadata carries the same host for
        override_host configs (the Gateway API Inference Extension convention)."""
        if decision is None:
            return _empty_body_reply(), None
        reply = self.decision_reply(decision, settings)
        assert self.picker is not None
        try:
            choice = self.picker.pick(decision, settings, max_new_chars)
        except Exception:
            log.exception("picking a replica failed; Envoy's load balancer chooses")
            metrics.ERRORS.labels("pick").inc()
            return reply, None
        if choice.address is None:
            return reply, None
        _set_header(reply.request_body.response.header_mutation, settings.pick_header,
                    base64.b64encode(choice.address.encode()))
        fields = reply.dynamic_metadata.fields
        ours = fields[self.namespace].struct_value.fields
        ours["picked"].string_value = choice.address
        ours["pick_reason"].string_value = choice.reason
        fields[LB_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT].string_value = choice.address
        return reply, choice

    def decision_reply(self, decision: Decision, settings: RouteSettings) -> pb.ProcessingResponse:
        reply = pb.ProcessingResponse()
        response = reply.request_body.response
        mutation = response.header_mutation
        if decision.body is not None:  # tenant isolation: the body with the tenant's cache_salt
            response.body_mutation.body = decision.body  # Envoy drops content-length and re-frames it
        if decision.key is None:
            mutation.remove_headers.append(settings.key_header)
            return reply
        _set_header(mutation, settings.key_header, decision.key.encode())
        reply.dynamic_metadata.fields[self.namespace].struct_value.fields["prefix_key"].string_value = decision.key
        return reply


def _set_header(mutation: pb.HeaderMutation, name: str, value: bytes) -> None:
    option = mutation.set_headers.add()
    option.header.key = name
    option.header.raw_value = value
    option.append_action = _OVERWRITE


def _empty_body_reply() -> pb.ProcessingResponse:
    reply = pb.ProcessingResponse()
    reply.request_body.response.SetInParent()
    return reply


def _pass_through(phase: str | None) -> pb.ProcessingResponse:
    """An empty reply for phases we do not use (if a config sends them anyway)."""
    reply = pb.ProcessingResponse()
    if phase in ("response_headers", "response_body"):
        getattr(reply, phase).response.SetInParent()
    elif phase in ("request_trailers", "response_trailers"):
        getattr(reply, phase).SetInParent()
    return reply
