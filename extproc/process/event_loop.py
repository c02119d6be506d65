"""How every asyncio program of ours runs: on uvloop when installed, else asyncio's own loop.

uvloop gave grpc.aio the lowest CPU per request measured here (design.md section 4), and a
lighter load client; a bare install without it still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
