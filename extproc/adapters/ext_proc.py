"""The gRPC adapter: speaks Envoy's ext_proc protocol and only translates messages.

Per stream: the request-headers message gives the tenant headers (reply at once, removing
any client-sent key header); the request-body message gives the body, the core decides,
and the reply sets the key header (and the same key as dynamic metadata, for configs that
skip the header phase). In hash mode the RPC then ends: Envoy needs nothing more from us.
In pick mode the reply also names the replica, and the RPC stays open until Envoy ends it
with the HTTP response: that end is how the picker learns the request is no longer in
flight (one open stream per request in flight is the price).

The settings, the decision and the pick are the router service's (extproc.adapters.service),
which the ext_authz adapters call too; this module only reads Envoy's messages and writes its
replies.
"""

from __future__ import annotations

import base64
import logging
import math
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Final

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc import metrics
from extproc.adapters.service import RouterService
from extproc.core.decide import CONTENT_ENCODING, Decision
from extproc.core.priority import priority_headers
from extproc.core.settings import RouteSettings
from extproc.pick.choice.choose import Choice
from extproc.pick.flow.gate import Ticket

log = logging.getLogger("extproc.adapters.ext_proc")

_OVERWRITE: Final = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_ATTR_HEADER_PREFIX: Final = "request.headers['"
LB_NAMESPACE: Final = "envoy.lb"
DESTINATION_ENDPOINT: Final = "x-gateway-destination-endpoint"  # Gateway API Inference Extension
SHED_HEADER: Final = "x-prefix-router-shed"  # on a 429 of flow control's: why (waited, queue_full)
__all__ = ["DESTINATION_ENDPOINT", "LB_NAMESPACE", "PrefixRouter", "read_attribute_headers", "read_headers"]


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


class PrefixRouter(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # xds-protos ship no types
    """ExternalProcessor service; one instance serves every stream, through the router ``service``.

    With a picker in the service (pick mode configured for the process), a stream whose settings
    say ``mode: pick`` also names the replica, and stays open until Envoy ends it (when the HTTP
    response ends), so the picker counts the request as in flight until then. ``metadata_namespace``:
    where the replies' dynamic metadata goes.
    """

    def __init__(self, service: RouterService, metadata_namespace: str = "prefix_router") -> None:
        self.service = service
        self.namespace = metadata_namespace
        self._headers_replies: dict[tuple[str, str, str], pb.ProcessingResponse] = {}
        self.open_streams = 0  # `serve` has the streams_active gauge read it at scrape time

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        self.open_streams += 1
        service = self.service
        try:
            settings = service.settings_for(context.invocation_metadata())
        except Exception:  # never let the router fail a request
            log.exception("reading stream metadata failed")
            metrics.ERRORS.labels("metadata").inc()
            settings = service.settings
        wanted = (*settings.tenant_headers, CONTENT_ENCODING, *priority_headers(settings))
        headers: dict[str, str] = {}
        try:
            async for request in request_iterator:
                phase = request.WhichOneof("request")
                if phase == "request_headers":
                    headers = self.safe_headers(request.request_headers, wanted)
                    yield self.headers_reply(settings)
                    if request.request_headers.end_of_stream:
                        service.no_body(settings)
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
                    decision = service.decide(body.body, headers, settings, body.end_of_stream)
                    # Flow control: while the pool is saturated the request waits here (Envoy told to wait
                    # longer for this answer), then is picked, or answered 429.
                    ticket = service.hold(decision, settings, headers)
                    try:
                        if ticket is not None:
                            if ticket.held:
                                yield _wait_longer(settings.flow_max_wait)
                                await service.wait(ticket)
                            if ticket.shed:
                                yield self.shed_reply(ticket)
                                return
                        if ticket is not None:  # a worse class's pick keeps a better class's headroom
                            settings = ticket.settings
                        reply, picked = self.pick_reply(decision, settings, await service.prepare(decision, settings),
                                                        avoid_saturated=ticket is not None and ticket.avoid_saturated)
                    finally:
                        if ticket is not None:
                            service.done(ticket)
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
                        service.release(picked)
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
        """A client-sent key, pick or model header must never choose the host or the cluster:
        remove them.

        The replies never ask Envoy to choose the route again (``clear_route_cache``): a config that
        routes on the model header says so itself (``route_cache_action: CLEAR``, multi-model.yaml),
        and one that splits traffic at random (ab.yaml) must keep the route it drew.
        Built once per set of names and shared by every stream (grpc only serialises it).
        """
        names = (settings.key_header, settings.pick_header, settings.model_header)
        reply = self._headers_replies.get(names)
        if reply is None:
            reply = pb.ProcessingResponse()
            reply.request_headers.response.header_mutation.remove_headers.extend(name for name in names if name)
            self._headers_replies[names] = reply
        return reply

    def body_reply(self, body: bytes, headers: Mapping[str, str], settings: RouteSettings,
                   complete: bool = True) -> pb.ProcessingResponse:
        decision = self.service.decide(body, headers, settings, complete)
        return _empty_body_reply() if decision is None else self.decision_reply(decision, settings)

    def pick_reply(self, decision: Decision | None, settings: RouteSettings, max_new_chars: int = 0,
                   avoid_saturated: bool = False) -> tuple[pb.ProcessingResponse, Choice | None]:
        """The hash-mode reply plus the picked replica: Envoy's stateful_session reads the
        pick header (and sends the request there only if that host is healthy, else its
        own LB hashes the key header); ``envoy.lb`` metadata carries the same host for
        override_host configs (the Gateway API Inference Extension convention)."""
        if decision is None:
            return _empty_body_reply(), None
        reply = self.decision_reply(decision, settings)
        choice = self.service.pick(decision, settings, max_new_chars, avoid_saturated)
        if choice is None or choice.address is None:
            return reply, None
        _set_header(reply.request_body.response.header_mutation, settings.pick_header,
                    base64.b64encode(choice.address.encode()))
        fields = reply.dynamic_metadata.fields
        ours = fields[self.namespace].struct_value.fields
        ours["picked"].string_value = choice.address
        ours["pick_reason"].string_value = choice.reason
        fields[LB_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT].string_value = choice.address
        return reply, choice

    def shed_reply(self, ticket: Ticket) -> pb.ProcessingResponse:
        """429 with ``retry-after``, answered by Envoy without an upstream (OpenAI's error shape)."""
        reply = pb.ProcessingResponse()
        answer = reply.immediate_response
        answer.status.code = 429
        retry_after = self.service.retry_after(ticket)
        _set_header(answer.headers, "retry-after", str(retry_after).encode())
        _set_header(answer.headers, "content-type", b"application/json")
        _set_header(answer.headers, SHED_HEADER, ticket.state.encode())
        answer.body = orjson.dumps({"error": {
            "message": f"the model's replicas are saturated ({ticket.state}); retry after {retry_after} s",
            "type": "overloaded", "code": 429}})
        answer.details = "prefix_router_shed_" + ticket.state
        return reply

    def decision_reply(self, decision: Decision, settings: RouteSettings) -> pb.ProcessingResponse:
        reply = pb.ProcessingResponse()
        response = reply.request_body.response
        mutation = response.header_mutation
        if decision.body is not None:  # tenant isolation: the body with the tenant's cache_salt
            response.body_mutation.body = decision.body  # Envoy drops content-length and re-frames it
        if decision.key is None:
            mutation.remove_headers.append(settings.key_header)
        else:
            _set_header(mutation, settings.key_header, decision.key.encode())
            reply.dynamic_metadata.fields[self.namespace].struct_value.fields["prefix_key"].string_value = decision.key
        if settings.model_header:  # the body's model, for a route table that matches it
            if decision.model is None:
                mutation.remove_headers.append(settings.model_header)
            else:
                _set_header(mutation, settings.model_header, decision.model.encode())
        return reply


def _set_header(mutation: pb.HeaderMutation, name: str, value: bytes) -> None:
    option = mutation.set_headers.add()
    option.header.key = name
    option.header.raw_value = value
    option.append_action = _OVERWRITE


def _wait_longer(seconds: float) -> pb.ProcessingResponse:
    """Ask Envoy to wait for the body's answer up to ``seconds`` and one more (within the filter's
    ``max_message_timeout``; beyond it Envoy ignores this, and at ``message_timeout`` sends the
    request on unpicked)."""
    reply = pb.ProcessingResponse()
    whole = math.ceil(seconds) + 1
    reply.override_message_timeout.seconds = whole
    return reply


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
