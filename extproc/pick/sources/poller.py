"""Ask every replica one thing at once, every ``interval`` seconds, in the background.

The metrics scrape and the model list both poll each replica over HTTP on their own period;
this is their loop, their session and their lifecycle, so each says only what it asks and
what it does with the answer (``ask``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import aiohttp

log = logging.getLogger("extproc.pick.sources.poller")


class ReplicaPoller:
    """``poll_once`` asks every replica ``addresses()`` names at once (``ask``); ``start`` repeats
    it every ``interval`` seconds until ``stop``."""

    def __init__(self, addresses: Callable[[], Sequence[str]], interval: float) -> None:
        self.addresses = addresses
        self.interval = interval
        # A loaded vLLM can be slow to answer; a slow answer is not a dead replica.
        self.timeout = max(1.0, min(interval, 5.0))
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def ask(self, session: aiohttp.ClientSession, address: str) -> None:
        raise NotImplementedError

    async def poll_once(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        session = self._session
        await asyncio.gather(*(self.ask(session, a) for a in self.addresses()))

    async def _loop(self, first_after: float) -> None:
        await asyncio.sleep(first_after)
        while True:
            try:
                await self.poll_once()
            except Exception:  # the loop must outlive any one bad round
                log.exception("%s round failed", type(self).__name__)
            await asyncio.sleep(self.interval)

    def start(self, first_after: float = 0.0) -> None:
        """Poll every ``interval`` seconds, the first round ``first_after`` seconds from now (a caller
        that has just polled waits an interval)."""
        self._task = asyncio.get_running_loop().create_task(self._loop(first_after))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session:
            await self._session.close()
