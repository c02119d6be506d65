"""Read what each replica serves from its OpenAI ``/v1/models`` in the background.

vLLM lists its served model name(s) (``parent`` null) and every LoRA adapter it has loaded, from
``--lora-modules`` or ``/v1/load_lora_adapter``, with ``parent`` = the base model. A replica that
does not answer keeps what it said last: a slow or restarting replica must not lose its names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import aiohttp
import orjson

from extproc.pick.choice.pools import Served

log = logging.getLogger("extproc.pick.sources.served_models")

OnModels = Callable[[str, Sequence[Served]], None]


def parse_models(body: bytes) -> list[Served]:
    """The model cards of a /v1/models answer (id, parent); anything else in it is ignored.
    Raises ValueError when the answer is not a model list."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError("no data list")
    cards = []
    for card in data:
        if isinstance(card, dict) and isinstance(card.get("id"), str) and card["id"]:
            parent = card.get("parent")
            cards.append(Served(card["id"], parent if isinstance(parent, str) and parent else None))
    return cards


class ModelLister:
    """Every ``interval`` seconds, GET http://ADDRESS/v1/models of every replica ``addresses()`` names."""

    def __init__(self, addresses: Callable[[], Sequence[str]], interval: float, on_models: OnModels) -> None:
        self.addresses = addresses
        self.interval = interval
        self.on_models = on_models
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def list_once(self) -> None:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=max(1.0, min(self.interval, 5.0)))
            self._session = aiohttp.ClientSession(timeout=timeout)
        await asyncio.gather(*(self._one(a) for a in self.addresses()))

    async def _one(self, address: str) -> None:
        try:
            assert self._session is not None
            async with self._session.get(f"http://{address}/v1/models") as resp:
                if resp.status != 200:
                    log.debug("%s/v1/models answered %d", address, resp.status)
                    return
                cards = parse_models(await resp.read())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            log.debug("listing the models of %s failed: %r", address, exc)
            return
        self.on_models(address, cards)

    async def _loop(self) -> None:
        while True:
            try:
                await self.list_once()
            except Exception:  # the loop must outlive any one bad round
                log.exception("listing the replicas' models failed")
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session:
            await self._session.close()
