"""The HTTP shape of ext_authz (envoy-fast.yaml): Envoy's check request in, the key and model headers out.

Envoy's ext_authz filter with ``http_service`` sends each request's allowed headers and
buffered body as a plain HTTP/1.1 request, and from a 200 answer copies the headers named in
``allowed_upstream_headers`` onto the upstream request (replacing any the client sent) and
removes those listed in ``x-envoy-auth-headers-to-remove``. Envoy applies the removals after
the copies, so an answer either sets a header (the key, the model) or removes it, never both. The
HTTP hop costs a fraction of the gRPC one (docs/overhead.md); the reading of a check is the one the
gRPC Check shares (extproc.adapters.authz), the decision and the settings the router service's
(extproc.adapters.service), as for every adapter.

Settings: the process's own, overridden per route by ``x-prefix-router-*`` request headers
that envoy.yaml-style metadata cannot carry here (``context_extensions`` reach gRPC services
only): a per-route ``header_mutation`` sets them before ext_authz, ``allowed_headers`` forwards
them, and the answer asks Envoy to drop them before the request goes upstream. A bad value is
logged once per distinct set and ignored (``RouterService.settings_for``). The answer is always
200: a router that denied a request would fail the user; the server (extproc.process.http1)
answers 400 only to a request it cannot parse, which Envoy never sends.

Pick mode (pick-fast.yaml): while Envoy's access log streams to the router (extproc.adapters.access_log),
a route whose settings say ``mode: pick`` also gets the replica in the pick header
(``allowed_upstream_headers``; Envoy's stateful_session filter sends the request there if it is
healthy), and the pick is held under the request's ``x-request-id`` until the log reports its end
(extproc.pick.request_ends). Without a connected log stream, or without the id, the request
is keyed as in hash mode and Envoy's load balancer chooses.

Per request the adapter does only what differs between requests: every check of a route carries
the same ``x-prefix-router-*`` headers, so what they resolve to (the settings, the headers
``decide()`` reads, the answer's constant bytes) is kept per distinct set (``_Route``); headers
stay the bytes the server parsed until one is read.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Awaitable, Mapping
from typing import Final

from extproc import metrics
from extproc.adapters.authz import (
    DECLARED_LENGTH_HEADER,
    LIMITS,
    LOGGED_LIMITS,
    PARTIAL_BODY_HEADER,
    decision_for,
    is_whole,
)
from extproc.adapters.service import RouterService
from extproc.core.decide import CONTENT_ENCODING, Decision
from extproc.core.settings import METADATA_PREFIX, RouteSettings
from extproc.pick.request_ends import RequestEnds

log = logging.getLogger("extproc.adapters.ext_authz_http")

REMOVE_HEADER: Final = "x-envoy-auth-headers-to-remove"
_PREFIX: Final = METADATA_PREFIX.encode()
_PARTIAL: Final = PARTIAL_BODY_HEADER.encode()
_DECLARED: Final = DECLARED_LENGTH_HEADER.encode()
_TRUE: Final = b"true"
_REQUEST_ID: Final = b"x-request-id"
_CRLF: Final = b"\r\n"
_MAX_ROUTES: Final = 1024  # distinct x-prefix-router-* sets (in the order sent) kept; then forgotten at once

Headers = Mapping[bytes, bytes]  # lower-case names, as extproc.process.http1 parses them


class _Route:
    """What one set of x-prefix-router-* headers resolves to, built once per set."""

    __slots__ = ("settings", "wanted", "keyed", "modeled", "picked", "removals")

    def __init__(self, settings: RouteSettings, ours: list[str]) -> None:
        self.settings = settings
        # the sent headers decide() reads: (name as parsed, name as decide() asks for it)
        self.wanted = tuple((name.encode("latin-1"), name) for name in (*settings.tenant_headers, CONTENT_ENCODING))
        self.keyed = f"{settings.key_header}: ".encode("latin-1")  # the key follows, then CRLF
        self.modeled = f"{settings.model_header}: ".encode("latin-1")  # the model follows, then CRLF
        self.picked = f"{settings.pick_header}: ".encode("latin-1")  # base64(ip:port) follows, then CRLF
        # the removal line, by (keyed, modeled): the route's own headers, and what the answer does not set
        self.removals: dict[tuple[bool, bool], bytes] = {}
        for keyed in (False, True):
            for modeled in (False, True):
                drop = [*ours, *(() if keyed else (settings.key_header,)),
                        *(() if modeled or not settings.model_header else (settings.model_header,))]
                self.removals[keyed, modeled] = f"{REMOVE_HEADER}: {','.join(drop)}\r\n".encode(
                    "latin-1") if drop else b""


class HttpAuthz:
    """Answers Envoy's HTTP check requests; one instance serves every connection. ``ends``: where
    picks wait for their request's end (None: the router cannot pick, it has no replicas)."""

    def __init__(self, service: RouterService, ends: RequestEnds | None = None) -> None:
        self.service = service
        self.ends = ends
        self._routes: dict[tuple[bool, tuple[tuple[bytes, bytes], ...]], _Route] = {}

    def answer(self, headers: Headers, body: bytes, cut: bool = False) -> bytes | Awaitable[bytes]:
        """The answer's header lines ("name: value\\r\\n" each) for one check request; awaitable
        when a pick must first await precise mode's tokenising off the loop (``RouterService.run_ahead``).

        ``headers``: the check request's, lower-case names, bytes as sent. ``cut``: the server
        kept only the body's start. Never raises: on a bug the request goes on without a key.
        """
        try:
            return self._answer(headers, body, cut)
        except Exception:  # never let the router fail a request
            log.exception("answering an HTTP check failed; passing the request on without a key")
            metrics.ERRORS.labels("authz_http").inc()
            settings = self.service.settings
            names = ",".join(name for name in (settings.key_header, settings.model_header) if name)
            return f"{REMOVE_HEADER}: {names}\r\n".encode()

    def _answer(self, headers: Headers, body: bytes, cut: bool) -> bytes | Awaitable[bytes]:
        ours = tuple([item for item in headers.items() if item[0].startswith(_PREFIX)])
        can_pick = self.ends is not None and self.ends.live
        route = self._routes.get((can_pick, ours)) or self._route(ours, can_pick)
        sent = {name: value.decode("latin-1") for raw, name in route.wanted if (value := headers.get(raw)) is not None}
        complete = not cut and is_whole(len(body), headers.get(_PARTIAL) == _TRUE, headers.get(_DECLARED))
        decision = decision_for(self.service, route.settings, sent, body, complete)
        key = decision.key if decision else None
        model = decision.model if decision and route.settings.model_header else None
        lines: list[bytes] = []
        if key is not None:
            lines += (route.keyed, key.encode("latin-1"), _CRLF)
        if model is not None:
            lines += (route.modeled, model.encode("latin-1"), _CRLF)
        lines.append(route.removals[key is not None, model is not None])
        request_id = headers.get(_REQUEST_ID)
        if decision is None or route.settings.mode != "pick" or request_id is None:
            return b"".join(lines)  # no pick (without the id nothing would name its end): Envoy's LB chooses
        work = self.service.ahead_work(decision, route.settings)
        if work is not None:
            return self._pick_later(decision, route, request_id, lines, work)
        lines.append(self._pick(decision, route, request_id))
        return b"".join(lines)

    async def _pick_later(self, decision: Decision, route: _Route, request_id: bytes, lines: list[bytes],
                          work: object) -> bytes:
        """The answer once precise mode's long new text is tokenised off the loop, then picked."""
        try:
            max_new_chars = await self.service.run_ahead(work)  # never raises
            lines.append(self._pick(decision, route, request_id, max_new_chars))
        except Exception:  # never let the router fail a request: the key alone, Envoy's LB chooses
            log.exception("picking for an HTTP check failed; the request goes on keyed")
            metrics.ERRORS.labels("authz_http").inc()
        return b"".join(lines)

    def _pick(self, decision: Decision, route: _Route, request_id: bytes, max_new_chars: int = 0) -> bytes:
        """The pick header's line, the pick held until the request's end; b"" when not picked."""
        if self.ends is None or not self.ends.live:  # the log closed meanwhile: nothing would tell the end
            return b""
        choice = self.service.pick(decision, route.settings, max_new_chars)
        if choice is None or choice.address is None:
            return b""
        self.ends.hold(request_id.decode("latin-1"), choice)
        return route.picked + base64.b64encode(choice.address.encode()) + _CRLF

    def _route(self, ours: tuple[tuple[bytes, bytes], ...], can_pick: bool) -> _Route:
        # sorted: one set of settings is one entry (and one log line) in settings_for whatever order
        # Envoy sends it in (Envoy 1.36 and 1.38 change the order between requests of one route)
        pairs = sorted((name.decode("latin-1"), value.decode("latin-1")) for name, value in ours)
        route = _Route(self.service.settings_for(pairs, LOGGED_LIMITS if can_pick else LIMITS),
                       [name for name, _ in pairs])
        if len(self._routes) >= _MAX_ROUTES:
            self._routes.clear()
        self._routes[can_pick, ours] = route
        return route
