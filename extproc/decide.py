"""The routing core: body bytes + headers + settings in, a prefix-key decision out.

Pure and synchronous (no I/O, no clocks), so the gRPC adapter, ``explain`` and the
tests all share it and it is testable in microseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
import xxhash

from extproc.normalize import normalize
from extproc.settings import RouteSettings

TENANT_SEPARATOR: Final = b"\x00"
TENANT_BODY_FIELD: Final = "prompt_cache_key"


@dataclass(frozen=True, slots=True)
class Decision:
    """What the router decided for one request, and enough to explain why."""

    key: str | None  # None: no key, Envoy picks a host at random
    tenant: str | None
    tenant_source: str | None  # header name, "body", or None
    normalize: str  # the mode actually used, after any fallback
    fallback: str | None  # why the requested mode was not used, or None
    prefix_bytes: int  # how many bytes of the normalised form were hashed
    normalized_bytes: int  # length of the whole normalised form
    preview: bytes  # the start of the hashed bytes, for `explain`
    normalized: bytes = field(default=b"", repr=False)  # the whole normalised form (pick mode chunks it)


def prefix_key(tenant: str | None, prefix: bytes) -> str:
    """xxh3-64 hex over tenant, a separator, and the prefix bytes."""
    h = xxhash.xxh3_64()
    if tenant:
        h.update(tenant.encode("utf-8", "surrogatepass"))
    h.update(TENANT_SEPARATOR)
    h.update(prefix)
    return h.hexdigest()


def header_tenant(headers: Mapping[str, str], settings: RouteSettings) -> tuple[str | None, str | None]:
    """The first non-empty configured tenant header (names lower-case) and its name."""
    for name in settings.tenant_headers:
        value = headers.get(name, "").strip()
        if value:
            return value, name
    return None, None


def _body_tenant(doc: dict[str, Any] | None, body: bytes) -> str | None:
    if doc is None and b"prompt_cache_key" in body:  # raw mode did not parse the body
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        doc = parsed if isinstance(parsed, dict) else None
    value = doc.get(TENANT_BODY_FIELD) if doc else None
    return value if isinstance(value, str) and value else None


def decide(body: bytes, headers: Mapping[str, str], settings: RouteSettings, preview_bytes: int = 160,
           complete: bool = True) -> Decision:
    """Compute the prefix key of one request. Never raises for any body or headers.

    ``complete=False`` when ``body`` is only the start of the request body.
    """
    norm = normalize(body, settings.normalize, complete)
    tenant, source = header_tenant(headers, settings)
    if tenant is None and body and complete:
        tenant = _body_tenant(norm.document, body)
        source = "body" if tenant else None
    if not norm.data:
        return Decision(None, tenant, source, norm.mode, norm.fallback, 0, 0, b"")
    prefix = norm.data[: settings.prefix_length]
    return Decision(
        key=prefix_key(tenant, prefix),
        tenant=tenant,
        tenant_source=source,
        normalize=norm.mode,
        fallback=norm.fallback,
        prefix_bytes=len(prefix),
        normalized_bytes=len(norm.data),
        preview=prefix[:preview_bytes],
        normalized=norm.data,
    )
