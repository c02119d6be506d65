"""Pick mode as one object: the request path (``PickCore``) built whole, plus what gathers its state.

``Picker`` builds the cache view the settings ask for (the learned view, or in precise mode the
event view and the learned view combined), the load view, and the in-flight channel, and hands
them to ``PickCore``; endpoint discovery, metric scraping and, in precise mode, every replica's
KV-cache events run as background tasks that ``start`` launches. The request path itself does no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence

from extproc import metrics
from extproc.core.decide import Decision
from extproc.core.settings import RouteSettings, ServerSettings, SettingError, flag, tokenizer_dirs
from extproc.pick.choice.load import LoadTracker
from extproc.pick.choice.pools import Pools
from extproc.pick.core import PickCore, Remote
from extproc.pick.events.eviction_forecast import EvictionForecast
from extproc.pick.events.kv_index import EventIndex
from extproc.pick.sources.endpoints import EndpointWatcher
from extproc.pick.sources.in_flight_bus import InFlightBus
from extproc.pick.sources.kv_subscriber import KvEventSubscriber
from extproc.pick.sources.scrape import Scraper
from extproc.pick.sources.served_models import ModelLister
from extproc.pick.sources.shared_in_flight import RemoteInFlight
from extproc.pick.sources.tokenize_ahead import AheadWork, TokenizeAhead
from extproc.pick.sources.tokenizer_check import TokenizerCheck
from extproc.pick.tokens.prompt_tokens import ModelTokenizer, TokenizerError
from extproc.pick.views.base import CacheView
from extproc.pick.views.event_view import EventView
from extproc.pick.views.learned import LearnedView
from extproc.pick.views.partial import CombinedView
from extproc.pick.views.precise import PreciseView


def load_tokenizers(cfg: ServerSettings) -> dict[str, ModelTokenizer]:
    """``--tokenizer``'s models, read at start-up: a bad directory is a SettingError naming it."""
    loaded: dict[str, ModelTokenizer] = {}
    for name, path in tokenizer_dirs(cfg.tokenizer).items():
        try:
            loaded[name] = ModelTokenizer(path, cache_bytes=cfg.tokenizer_cache_mb << 20)
        except TokenizerError as exc:
            raise SettingError(f"{flag('tokenizer')} {path!r}: {exc}") from None
    return loaded


class Picker(PickCore):
    """PickCore, built from the settings, plus its background tasks: endpoint discovery (per model's
    pool with ``--pools``, and each replica's /v1/models), metric scraping, KV-cache events, the
    in-flight channel, the tokenizer check."""

    def __init__(self, cfg: ServerSettings, tokenizers: dict[str, ModelTokenizer] | None = None) -> None:
        pools = Pools(pool.model for pool in cfg.pools)  # none: one pool, every model
        learned = LearnedView(cfg.chunk_bytes, cfg.bytes_per_token, cfg.kv_capacity_tokens, cfg.index_max_chunks)
        view: CacheView = learned
        self.subscriber: KvEventSubscriber | None = None
        self.precise: PreciseView | None = None
        self.tokenizer_check: TokenizerCheck | None = None
        self.ahead: TokenizeAhead | None = None
        if cfg.kv_events:
            events = EventIndex(cfg.index_max_blocks, stamp_events=cfg.eviction_forecast)
            self.subscriber = KvEventSubscriber(events, cfg.kv_events_port, cfg.kv_replay_port or None,
                                                cfg.kv_events_topic, cfg.kv_dp_ranks,
                                                ports_relative=cfg.kv_ports_relative)
            precise = self.precise = PreciseView(events, tokenizers if tokenizers is not None else load_tokenizers(cfg),
                                                 self.subscriber.stats.replicas, pools.base_of)
            ahead = self.ahead = TokenizeAhead(precise, cfg.tokenize_inline_chars, cfg.tokenize_queue_seconds)
            self.tokenizer_check = TokenizerCheck(precise, cfg.tokenizer_check_every,
                                                  ahead=lambda decision: ahead.prepare(decision, checking=True))
            forecast = EvictionForecast() if cfg.eviction_forecast else None
            view = CombinedView(EventView(precise, forecast, self.tokenizer_check.offer), learned)
        load = LoadTracker(cfg.prefill_tokens_per_s)
        self.bus: InFlightBus | None = None
        if cfg.share_in_flight:
            remote = RemoteInFlight(Remote(load, view), os.urandom(8), time.monotonic, time.time,
                                    metrics.SHARING_DELAY.observe)
            self.bus = InFlightBus(cfg.share_in_flight, cfg.share_in_flight_channel, remote)
        super().__init__(view, load=load, share=self.bus, pools=pools)
        # one endpoint source, or one per model's pool (each replaces only its own pool's replicas)
        self.watchers = [EndpointWatcher(dataclasses.replace(cfg, endpoints=pool.endpoints,
                                                             endpoints_file=pool.endpoints_file,
                                                             endpoints_dns=pool.endpoints_dns),
                                         functools.partial(self.set_pool, pool.model))
                         for pool in cfg.pools] or [EndpointWatcher(cfg, self.set_endpoints)]
        self.scraper = Scraper(self.load, cfg.scrape_interval, self.on_sample)
        self.lister = ModelLister(self.load.addresses, cfg.models_interval, self.on_models) \
            if cfg.models_interval else None

    def ahead_work(self, decision: Decision, settings: RouteSettings) -> AheadWork | None:
        """Precise mode's long new text to tokenise off the event loop before ``pick``
        (extproc.pick.sources.tokenize_ahead), or None."""
        if self.ahead is None or settings.cache_view == "learned":
            return None
        return self.ahead.work(decision)

    async def run_ahead(self, work: object) -> int:
        assert self.ahead is not None and isinstance(work, AheadWork)  # from ahead_work
        return await self.ahead.run(work)

    def set_endpoints(self, addresses: Sequence[str]) -> None:
        super().set_endpoints(addresses)
        if self.subscriber is not None:
            self.subscriber.set_endpoints(addresses)

    async def start(self) -> None:
        if self.bus is not None:
            await self.bus.start()
        if self.subscriber is not None:
            await self.subscriber.start()
        if self.tokenizer_check is not None:
            await self.tokenizer_check.start()
        for watcher in self.watchers:
            await watcher.start()
        polled = bool(self.load.addresses())
        if polled:
            await self.scraper.poll_once()  # first loads and capacities before serving
        self.scraper.start(first_after=self.scraper.interval if polled else 0.0)
        if self.lister is not None:
            self.lister.start()  # its first round now, without holding the start up (a hung replica)

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.stop()
        for watcher in self.watchers:
            await watcher.stop()
        await self.scraper.stop()
        if self.lister is not None:
            await self.lister.stop()
        if self.subscriber is not None:
            await self.subscriber.stop()
        if self.tokenizer_check is not None:
            await self.tokenizer_check.stop()
        if self.ahead is not None:
            self.ahead.close()
