"""The ext_authz shape of the hop: one unary Check per request instead of an ext_proc stream.

Envoy's ext_authz filter holds the request headers until its Check call returns and can
send the body with them (``with_request_body``, ``allow_partial_message``: a body above
``max_request_bytes`` arrives cut, never refused), so the key header our reply sets is in
place when the route's hash policy reads it. One unary call is about half the gRPC work of
envoy.yaml's two-message stream (docs/overhead.md).

The reading of a check is the one both ext_authz shapes share (extproc.adapters.authz, also
behind the HTTP shape of envoy-fast.yaml, extproc.adapters.ext_authz_http), and the key and the
settings come from the router service (extproc.adapters.service), as for ext_proc: the settings
from the listener's ``x-prefix-router-*`` gRPC initial metadata, overridden per route by the
same keys in ``check_settings.context_extensions``. What this shape cannot do (``authz.LIMITS``):
pick mode (Envoy never tells ext_authz when the response ends, so nothing could count
requests in flight) and tenant isolation (ext_authz cannot rewrite a body); a setting that
asks for either is logged once, counted, and ignored. We answer OK to every Check, whatever
happens: a router that denied a request would fail the user.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Final

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2 as pb
from envoy.service.auth.v3 import external_auth_pb2_grpc as pb_grpc

from extproc import metrics
from extproc.adapters.authz import LIMITS, PARTIAL_BODY_HEADER, authz_decision, body_is_whole
from extproc.adapters.service import RouterService

log = logging.getLogger("extproc.adapters.ext_authz")

SERVICE: Final = "envoy.service.auth.v3.Authorization"
__all__ = ["SERVICE", "PARTIAL_BODY_HEADER", "PrefixAuthz", "add_to_server", "body_is_whole"]
_OVERWRITE: Final = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


class PrefixAuthz(pb_grpc.AuthorizationServicer):  # type: ignore[misc]  # xds-protos ship no types
    """Authorization service that never denies: it only adds (or removes) the key and model headers."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    async def Check(self, request: pb.CheckRequest,
                    context: grpc.aio.ServicerContext[pb.CheckRequest, pb.CheckResponse]) -> pb.CheckResponse:
        try:
            return self.check(request, context.invocation_metadata())
        except Exception:  # never let the router fail a request
            log.exception("answering a Check failed; passing the request on without a key")
            metrics.ERRORS.labels("authz").inc()
            return pb.CheckResponse()

    def check(self, request: pb.CheckRequest,
              invocation_metadata: Iterable[tuple[str, str | bytes]] | None) -> pb.CheckResponse:
        attributes = request.attributes
        # the route's context_extensions come after the listener's metadata, so they win
        service = self.service
        settings = service.settings_for(
            (*(invocation_metadata or ()), *attributes.context_extensions.items()), LIMITS)
        http = attributes.request.http
        body = http.raw_body or http.body.encode()  # raw_body with pack_as_bytes
        decision = authz_decision(service, settings, http.headers, body)
        reply = pb.CheckResponse()
        ok = reply.ok_response
        key = decision.key if decision else None
        model = decision.model if decision else None
        if key is None:
            ok.headers_to_remove.append(settings.key_header)
        else:
            _set(ok, settings.key_header, key)
        if settings.model_header:  # for a route table that matches it (the filter's clear_route_cache)
            if model is None:
                ok.headers_to_remove.append(settings.model_header)
            else:
                _set(ok, settings.model_header, model)
        return reply


def _set(ok: pb.OkHttpResponse, name: str, value: str) -> None:
    option = ok.headers.add()
    option.header.key = name
    option.header.value = value
    option.append_action = _OVERWRITE


def add_to_server(service: RouterService, server: grpc.aio.Server) -> None:
    pb_grpc.add_AuthorizationServicer_to_server(PrefixAuthz(service), server)
