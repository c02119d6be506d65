"""Pick mode as one object: the request path (``PickCore``) plus what gathers its state.

Endpoint discovery and metric scraping run as background tasks that ``start`` launches;
the request path itself does no I/O.
"""

from __future__ import annotations

from extproc.core.settings import ServerSettings
from extproc.pick.core import PickCore
from extproc.pick.endpoints import EndpointWatcher
from extproc.pick.scrape import Scraper


class Picker(PickCore):
    """PickCore plus its background tasks: endpoint discovery and metric scraping."""

    def __init__(self, cfg: ServerSettings) -> None:
        super().__init__(cfg.chunk_bytes, cfg.bytes_per_token, cfg.kv_capacity_tokens, cfg.index_max_chunks,
                         cfg.prefill_tokens_per_s)
        self.watcher = EndpointWatcher(cfg, self.set_endpoints)
        self.scraper = Scraper(self.load, cfg.scrape_interval, self.on_sample)

    async def start(self) -> None:
        await self.watcher.start()
        if self.load.addresses():
            await self.scraper.scrape_once()  # first loads and capacities before serving
        self.scraper.start()

    async def stop(self) -> None:
        await self.watcher.stop()
        await self.scraper.stop()
