"""How every server of ours (router, simulator, bench backends) learns it should stop."""

from __future__ import annotations

import asyncio
import signal


def stop_on_signals(stop: asyncio.Event | None = None) -> asyncio.Event:
    """An event (``stop``, or a new one) that SIGTERM and SIGINT set, on the running loop."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
