"""What both ext_authz shapes (gRPC Check, HTTP) share: one decision from the sent headers and body.

Envoy's ext_authz filter sends the same things either way (the allowed headers, the buffered
body, a partial-body flag); only the envelope differs. So reading a check lives here once (is the
body whole, which headers count, what the shape cannot do: ``LIMITS``), the key comes from the
router service (extproc.adapters.service), and ``ext_authz`` (gRPC) and ``ext_authz_http``
(HTTP/1.1) only unpack and pack.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from extproc.adapters.service import Limits, RouterService
from extproc.core.decide import CONTENT_ENCODING, Decision
from extproc.core.settings import RouteSettings

PARTIAL_BODY_HEADER: Final = "x-envoy-auth-partial-body"  # Envoy sets it to "true" on a cut body
CONTENT_LENGTH: Final = "content-length"
# Over HTTP the check request's own content-length is the length of the body sent, so the
# client's declared length comes under this name (envoy-fast.yaml: authorization_request
# headers_to_add, %REQ(content-length)%).
DECLARED_LENGTH_HEADER: Final = "x-prefix-declared-length"
# Envoy never tells ext_authz when the response ends (nothing could count the request in flight)
# unless its access log streams to the router (pick-fast.yaml, over HTTP), and ext_authz cannot
# rewrite a body: a setting that asks for either is logged, counted and ignored.
_NO_BODY_EDIT: Final = "the ext_authz shape cannot rewrite the body (use envoy.yaml)"
_NO_HOLD: Final = "the ext_authz shape cannot hold a request past its fixed timeout (flow control needs pick.yaml)"
LIMITS: Final = Limits(cannot_pick="the ext_authz shape picks only over HTTP with Envoy's access log streaming to "
                                   "the router (pick-fast.yaml), and no access-log stream is connected",
                       cannot_edit_body=_NO_BODY_EDIT, cannot_hold=_NO_HOLD)
LOGGED_LIMITS: Final = Limits(cannot_edit_body=_NO_BODY_EDIT, cannot_hold=_NO_HOLD)  # over HTTP, the log connected


def is_whole(body_bytes: int, partial: bool, declared: str | bytes | None) -> bool:
    """Whether a body of ``body_bytes`` is the whole request body, from Envoy's partial-body flag
    (``partial``) and the client's declared length (``declared``, as sent; None when absent).

    Envoy's partial-body header alone is not enough: it says "false" whenever the buffer
    holds exactly ``max_request_bytes`` when Envoy asks (it compares what it sends with what
    it buffered), which happens whenever reads end on that boundary. A declared length longer
    than the body tells the truth in that case; a chunked body cut on the boundary is still
    taken as whole and is keyed as raw bytes after a parse failure, the same key.
    """
    if partial:
        return False
    return not (declared is not None and declared.isdigit() and int(declared) > body_bytes)


def body_is_whole(body: bytes, sent: Mapping[str, str], length_header: str = CONTENT_LENGTH) -> bool:
    """Whether ``body`` is the whole request body, not only the first ``max_request_bytes``
    (``sent``: the call's headers, lower-case names; ``length_header``: where the declared length is)."""
    return is_whole(len(body), sent.get(PARTIAL_BODY_HEADER) == "true", sent.get(length_header))


def decision_for(service: RouterService, settings: RouteSettings, tenant_headers: Mapping[str, str], body: bytes,
                 complete: bool) -> Decision | None:
    """The decision for one ext_authz call (its key, its model), or None: the caller then removes
    any client-sent key and model header.

    ``tenant_headers``: the sent headers ``decide()`` reads (the tenant headers, content-encoding),
    lower-case names; ``complete``: the body is the whole request body (``is_whole``).
    """
    if not body:
        service.no_body(settings)
        return None
    return service.decide(body, tenant_headers, settings, complete=complete)


def authz_decision(service: RouterService, settings: RouteSettings, sent: Mapping[str, str], body: bytes,
                   length_header: str = CONTENT_LENGTH, cut: bool = False) -> Decision | None:
    """``decision_for`` from the call's headers as a str mapping (the gRPC Check's).

    ``sent``: the call's headers, lower-case names. ``cut``: the server itself kept only the
    start of the body (its own size limit), so it is not whole whatever Envoy said.
    """
    headers = {name: sent[name] for name in (*settings.tenant_headers, CONTENT_ENCODING) if name in sent}
    return decision_for(service, settings, headers, body, not cut and body_is_whole(body, sent, length_header))
