"""The HTTP shape of ext_authz (envoy-fast.yaml): Envoy's check request in, the key header out.

Envoy's ext_authz filter with ``http_service`` sends each request's allowed headers and
buffered body as a plain HTTP/1.1 request, and from a 200 answer copies the headers named in
``allowed_upstream_headers`` onto the upstream request (replacing any the client sent) and
removes those listed in ``x-envoy-auth-headers-to-remove``. Envoy applies the removals after
the copies, so an answer either sets the key or removes it, never both. The HTTP hop costs a
fraction of the gRPC one (docs/overhead.md); the decision is the one the gRPC Check shares
(extproc.adapters.authz).

Settings: the process's own, overridden per route by ``x-prefix-router-*`` request headers
that envoy.yaml-style metadata cannot carry here (``context_extensions`` reach gRPC services
only): a per-route ``header_mutation`` sets them before ext_authz, ``allowed_headers`` forwards
them, and the answer asks Envoy to drop them before the request goes upstream. A bad value is
logged once per distinct set and ignored (``PrefixRouter.settings_for``). The answer is always
200: a router that denied a request would fail the user; the server (extproc.process.http1)
answers 400 only to a request it cannot parse, which Envoy never sends.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

from extproc import metrics
from extproc.adapters.authz import DECLARED_LENGTH_HEADER, authz_key
from extproc.adapters.ext_proc import PrefixRouter
from extproc.core.settings import METADATA_PREFIX

log = logging.getLogger("extproc.adapters.ext_authz_http")

REMOVE_HEADER: Final = "x-envoy-auth-headers-to-remove"


class HttpAuthz:
    """Answers Envoy's HTTP check requests; one instance serves every connection."""

    def __init__(self, router: PrefixRouter) -> None:
        self.router = router

    def answer(self, headers: Mapping[str, str], body: bytes, cut: bool = False) -> bytes:
        """The answer's header lines ("name: value\\r\\n" each) for one check request.

        ``headers``: the check request's, lower-case names. ``cut``: the server kept only the
        body's start. Never raises: on a bug the request goes on without a key.
        """
        try:
            return self._answer(headers, body, cut)
        except Exception:  # never let the router fail a request
            log.exception("answering an HTTP check failed; passing the request on without a key")
            metrics.ERRORS.labels("authz_http").inc()
            return f"{REMOVE_HEADER}: {self.router.settings.key_header}\r\n".encode()

    def _answer(self, headers: Mapping[str, str], body: bytes, cut: bool) -> bytes:
        # sorted: one set of settings is one cache entry in settings_for whatever order Envoy sends it in
        # (Envoy 1.36 and 1.38 change the order between requests of one route)
        ours = sorted((name, value) for name, value in headers.items() if name.startswith(METADATA_PREFIX))
        settings = self.router.settings_for(ours, authz=True)
        key = authz_key(self.router, settings, headers, body, DECLARED_LENGTH_HEADER, cut)
        remove = [name for name, _ in ours]
        if key is None:
            remove.append(settings.key_header)
        lines = f"{settings.key_header}: {key}\r\n" if key is not None else ""
        if remove:
            lines += f"{REMOVE_HEADER}: {','.join(remove)}\r\n"
        return lines.encode("latin-1")
