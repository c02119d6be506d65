"""Who the request belongs to: the tenant id from a header or the body, and whether it is acceptable.

A tenant id separates the prefix keys (and, with tenant isolation, the caches) of identical
prompts from different tenants. Pure: headers and the parsed body in, an id or a reason out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from extproc.core.settings import RouteSettings

TENANT_BODY_FIELD: Final = "prompt_cache_key"
BODY_FIELD_BYTES: Final = TENANT_BODY_FIELD.encode()
MAX_TENANT_CHARS: Final = 256
# Tenant rejection reasons (metrics label values): the request is routed with no tenant.
TENANT_TOO_LONG: Final = "too_long"
TENANT_BAD_CHARS: Final = "bad_chars"
_TENANT_CHARS: Final = frozenset(map(chr, range(0x20, 0x7F)))  # printable ASCII and space


def tenant_problem(value: str) -> str | None:
    """Why ``value`` cannot be a tenant id, or None: at most 256 printable ASCII characters.

    A client can send anything in a tenant header; a refused id routes as no tenant (never
    fails the request), so a megabyte or control characters never reach keys, logs or salts.
    """
    if len(value) > MAX_TENANT_CHARS:
        return TENANT_TOO_LONG
    if not _TENANT_CHARS.issuperset(value):
        return TENANT_BAD_CHARS
    return None


def header_tenant(headers: Mapping[str, str], settings: RouteSettings) -> tuple[str | None, str | None]:
    """The first non-empty configured tenant header (names lower-case) and its name."""
    for name in settings.tenant_headers:
        value = headers.get(name, "").strip()
        if value:
            return value, name
    return None, None


def body_tenant(doc: dict[str, Any] | None) -> str | None:
    value = doc.get(TENANT_BODY_FIELD) if doc else None
    return value.strip() or None if isinstance(value, str) else None
