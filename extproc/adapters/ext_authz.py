"""The ext_authz shape of the hop: one unary Check per request instead of an ext_proc stream.

Envoy's ext_authz filter holds the request headers until its Check call returns and can
send the body with them (``with_request_body``, ``allow_partial_message``: a body above
``max_request_bytes`` arrives cut, never refused), so the key header our reply sets is in
place when the route's hash policy reads it. One unary call is about half the gRPC work of
envoy.yaml's two-message stream (docs/benchmark.md, "Routing overhead").

The decision is the same core as ext_proc's (``PrefixRouter.decide``), and the settings come
the same way: the listener's ``x-prefix-router-*`` gRPC initial metadata, overridden per
route by the same keys in ``check_settings.context_extensions``. What this shape cannot do:
pick mode (Envoy never tells ext_authz when the response ends, so nothing could count
requests in flight) and tenant isolation (ext_authz cannot rewrite a body); a setting that
asks for either is logged once, counted, and ignored. We answer OK to every Check, whatever
happens: a router that denied a request would fail the user.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Final

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2 as pb
from envoy.service.auth.v3 import external_auth_pb2_grpc as pb_grpc

from extproc import metrics
from extproc.adapters.ext_proc import PrefixRouter
from extproc.core.decide import CONTENT_ENCODING

log = logging.getLogger("extproc.adapters.ext_authz")

SERVICE: Final = "envoy.service.auth.v3.Authorization"
PARTIAL_BODY_HEADER: Final = "x-envoy-auth-partial-body"  # Envoy sets it to "true" on a cut body
CONTENT_LENGTH: Final = "content-length"
_OVERWRITE: Final = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


class PrefixAuthz(pb_grpc.AuthorizationServicer):
    """Authorization service that never denies: it only adds (or removes) the key header."""

    def __init__(self, router: PrefixRouter) -> None:
        self.router = router

    async def Check(self, request: pb.CheckRequest, context: grpc.aio.ServicerContext) -> pb.CheckResponse:
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
        settings = self.router.settings_for(
            (*(invocation_metadata or ()), *attributes.context_extensions.items()), authz=True)
        http = attributes.request.http
        sent = http.headers
        headers = {name: sent[name] for name in (*settings.tenant_headers, CONTENT_ENCODING) if name in sent}
        body = http.raw_body or http.body.encode()  # raw_body with pack_as_bytes (as envoy-fast.yaml sets)
        reply = pb.CheckResponse()
        ok = reply.ok_response
        decision = self.router.decide(body, headers, settings, complete=body_is_whole(body, sent)) if body else None
        if decision is None or decision.key is None:
            ok.headers_to_remove.append(settings.key_header)
            if not body:
                metrics.decision_counter(settings.normalize, "empty").inc()
            return reply
        option = ok.headers.add()
        option.header.key = settings.key_header
        option.header.value = decision.key
        option.append_action = _OVERWRITE
        return reply


def body_is_whole(body: bytes, sent: Mapping[str, str]) -> bool:
    """Whether ``body`` is the whole request body, not only the first ``max_request_bytes``.

    Envoy's partial-body header alone is not enough: it says "false" whenever the buffer
    holds exactly ``max_request_bytes`` when Envoy asks (it compares what it sends with what
    it buffered), which happens whenever reads end on that boundary. A declared
    content-length longer than the body tells the truth in that case (envoy-fast.yaml passes
    it in ``allowed_headers``); a chunked body cut on the boundary is still taken as whole and
    is keyed as raw bytes after a parse failure, the same key.
    """
    if sent.get(PARTIAL_BODY_HEADER) == "true":
        return False
    declared = sent.get(CONTENT_LENGTH, "")
    return not (declared.isdigit() and int(declared) > len(body))


def add_to_server(router: PrefixRouter, server: grpc.aio.Server) -> None:
    pb_grpc.add_AuthorizationServicer_to_server(PrefixAuthz(router), server)
