"""Read what each replica serves from its OpenAI ``/v1/models`` in the background.

vLLM lists its served model name(s) (``parent`` null) and every LoRA adapter it has loaded, from
``--lora-modules`` or ``/v1/load_lora_adapter``, with ``parent`` = the base model. A replica that
does not answer keeps what it said last: a slow or restarting replica must not lose its names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import aiohttp
import orjson

from extproc.pick.choice.pools import Served
from extproc.pick.sources.poller import ReplicaPoller

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


class ModelLister(ReplicaPoller):
    """Every ``interval`` seconds, GET http://ADDRESS/v1/models of every replica ``addresses()`` names."""

    def __init__(self, addresses: Callable[[], Sequence[str]], interval: float, on_models: OnModels) -> None:
        super().__init__(addresses, interval)
        self.on_models = on_models

    async def ask(self, session: aiohttp.ClientSession, address: str) -> None:
        try:
            async with session.get(f"http://{address}/v1/models") as resp:
                if resp.status != 200:
                    log.debug("%s/v1/models answered %d", address, resp.status)
                    return
                cards = parse_models(await resp.read())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            log.debug("listing the models of %s failed: %r", address, exc)
            return
        self.on_models(address, cards)
