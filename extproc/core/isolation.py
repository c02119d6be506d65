"""Tenant KV isolation: a vLLM ``cache_salt`` derived from the tenant, written into the body (pure).

vLLM shares KV blocks between requests with the same tokens and the same ``cache_salt``, and
prefix-cache timing then tells one tenant whether another sent a prompt. With isolation on,
the router sets ``cache_salt`` to HMAC-SHA256(secret, tenant, client's salt), so two tenants
never share a block, while each tenant still shares its own prefixes (and a client's own
salt still splits its cache further: it is folded in, never trusted alone). The tenant is
the configured tenant header only, never a body field: the client controls the body, and
the header should be set by what authenticates it.

The salt is 43 characters of URL-safe base64 (vLLM's rules: at most 128 characters, none of
``@ / \\`` or NUL). The edit keeps every other byte: ``,"cache_salt":"..."`` goes in before
the closing ``}``, so it is the last ``cache_salt`` and wins over a client's (JSON parsers
vLLM uses keep the last duplicate). When Envoy sends only the start of a body over its
buffer limit, the salt goes in after the opening ``{`` instead: a ``cache_salt`` in the part
the router never saw would then win (documented limit; such bodies are counted).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any, Final

SALT_FIELD: Final = "cache_salt"
_CONTEXT: Final = b"prefix-router cache_salt v1\x00"
MIN_SECRET_BYTES: Final = 16

# Outcomes (metrics label values).
SALTED: Final = "salted"
SALTED_PARTIAL: Final = "salted_partial"  # only the body's start was seen: salt put first
NOT_OBJECT: Final = "not_object"  # not a JSON object (vLLM would refuse it): left as is
ENCODED: Final = "content_encoded"  # compressed: cannot be edited, left as is
_WHITESPACE: Final = b" \t\r\n"


def tenant_salt(secret: bytes, tenant: str | None, client_salt: str | None) -> str:
    """The cache_salt of ``tenant`` (None: the anonymous pool), folding in the client's own."""
    message = _CONTEXT + (tenant or "").encode() + b"\x00" + (client_salt or "").encode("utf-8", "surrogatepass")
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def with_member(body: bytes, doc: dict[str, Any] | None, name: str, value: bytes, complete: bool) -> bytes | None:
    """``body`` with ``"name": value`` (``value``: JSON text) as that field's effective value, or None if
    it cannot be edited. The member goes last (the last duplicate wins), or first in a body's start.

    ``doc`` is the parsed body (None when it is not a JSON object); a complete body must parse.
    """
    member = b'"' + name.encode() + b'":' + value
    if complete:
        end = len(body.rstrip(_WHITESPACE))
        if doc is None or end == 0 or body[end - 1:end] != b"}":
            return None
        comma = b"," if doc else b""
        return body[:end - 1] + comma + member + body[end - 1:]
    start = len(body) - len(body.lstrip(_WHITESPACE))
    if body[start:start + 1] != b"{":
        return None
    return body[:start + 1] + member + b"," + body[start + 1:]


def salted_body(body: bytes, doc: dict[str, Any] | None, salt: str, complete: bool) -> bytes | None:
    """``body`` with ``salt`` as its effective cache_salt, or None if it cannot be edited."""
    return with_member(body, doc, SALT_FIELD, b'"' + salt.encode() + b'"', complete)
