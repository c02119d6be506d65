"""A request's priority class (pure): the route's, or the integer in a header the mesh sets.

Lower is served first (vLLM's convention). Clients must not choose their own class, so a header is
read only when the route names it (``priority_header``), and only a value that is an integer in
-1000..1000 counts; anything else leaves the route's class (``priority``). Flow control orders held
requests by it (extproc.pick.flow); with ``vllm_priority`` it is also written into the body as
vLLM's ``priority`` field, for a replica run with ``--scheduling-policy priority``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from extproc.core.settings import RouteSettings

FIELD: Final = "priority"  # vLLM's request field
_INTEGER: Final = re.compile(r"-?[0-9]{1,6}")  # ASCII digits only (str.isdigit takes superscripts)


def priority_of(settings: RouteSettings, headers: Mapping[str, str]) -> int:
    """The route's priority class, or the trusted header's when it holds an integer in -1000..1000."""
    if settings.priority_header:
        raw = headers.get(settings.priority_header, "").strip()
        if _INTEGER.fullmatch(raw) and -1000 <= int(raw) <= 1000:
            return int(raw)
    return settings.priority


def priority_headers(settings: RouteSettings) -> tuple[str, ...]:
    """The header an adapter must pass on for ``priority_of``, when a setting reads it."""
    wanted = settings.priority_header and (settings.flow_control or settings.vllm_priority)
    return (settings.priority_header,) if wanted else ()
