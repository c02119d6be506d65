"""How every asyncio program of ours runs: on uvloop when installed, else asyncio's own loop.

grpc.aio's CPU per request measured alike on the two loops, within the run-to-run spread (374-472
us on uvloop, 370-518 on asyncio's, on the do-nothing floor: docs/results/history/overhead.md,
"Rejected: server shapes", its reports under docs/results/overhead-shapes/); a bare install
without uvloop still runs.
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
