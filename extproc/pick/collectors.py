"""Pick mode's figures read from its state when /metrics is scraped (nothing counted twice on the
ingest or request path): precise mode's subscriber, event index and tokenizers, and the in-flight channel."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.pick.picker import Picker
from extproc.pick.sources.in_flight_bus import InFlightBus
from extproc.pick.sources.shared_in_flight import END, HEARTBEAT, HELD, PICK
from extproc.pick.sources.tokenizer_check import RESULTS


class PreciseCollector(Collector):
    """Precise mode's figures, read from the subscriber, the event index and the tokenizers when
    /metrics is scraped (nothing is counted twice on the ingest or request path)."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        sub, precise = self.picker.subscriber, self.picker.precise
        if sub is None or precise is None:
            return
        s = sub.stats
        for name, doc, value in (
                ("batches", "KV-cache event batches applied (live and replayed)", s.batches),
                ("blocks", "Block hashes in applied BlockStored/BlockRemoved events", s.blocks),
                ("events_skipped", "Events the decoder could not read (unknown type, malformed)", s.events_skipped),
                ("gaps", "Missing event sequence ranges seen", s.gaps),
                ("replays", "Replay requests sent to the replicas' replay sockets", s.replays_asked),
                ("replayed_batches", "Batches applied from replay answers", s.replayed_batches),
                ("bad_frames", "Event frames or payloads that did not decode (skipped)", s.bad_frames),
                ("set_aside_events", "Events of a hybrid model's KV-cache groups the view cannot follow "
                 "(Mamba, a sliding window that does not say its window), set aside", s.set_aside_events)):
            yield CounterMetricFamily(f"prefix_router_kv_{name}", doc, value=value)
        resets = CounterMetricFamily(
            "prefix_router_kv_view_resets", "Replica cache views emptied, by cause: restart (its sequence "
            "went back), gap (events lost beyond the replay buffer), cleared (AllBlocksCleared), left",
            labels=["cause"])
        for cause, n in s.resets.items():
            resets.add_metric([cause], n)
        yield resets
        yield CounterMetricFamily("prefix_router_kv_apply_seconds", "CPU time spent decoding and applying KV-cache "
                                  "event batches: the ingest path's share of the router's core", value=s.apply_s)
        lag = GaugeMetricFamily("prefix_router_kv_lag_seconds", "Per replica: from its last event batch's "
                                "timestamp to its application", labels=["replica"])
        origin = GaugeMetricFamily("prefix_router_kv_view_origin", "Per replica: 1 for where its cache view "
                                   "comes from (events, replayed, partial: events that miss what it held before "
                                   "them, the larger of them and the learned view counts; none: the learned view)",
                                   labels=["replica", "origin"])
        for address, view in list(s.replicas.items()):
            lag.add_metric([address], view.lag)
            origin.add_metric([address, view.origin], 1)
        yield lag
        yield origin
        stats = precise.index.stats()
        yield GaugeMetricFamily("prefix_router_kv_index_blocks", "Event index: resident block copies",
                                value=stats.entries)
        yield GaugeMetricFamily("prefix_router_kv_index_bytes", "Event index: estimated memory", value=stats.bytes)
        hits = CounterMetricFamily("prefix_router_tokenize_cache_segments", "Tokenised prompt segments, by whether "
                                   "the segment cache held them", labels=["model", "result"])
        for model, tok in precise.tokenizers.items():
            hits.add_metric([model, "hit"], tok.cache_hits)
            hits.add_metric([model, "miss"], tok.cache_misses)
        yield hits
        chars = CounterMetricFamily("prefix_router_tokenize_chars", "Prompt characters, by where their token ids "
                                    "came from: a remembered prompt the request extends (memo), the segment "
                                    "cache (segment), or the tokenizer (new)", labels=["model", "source"])
        for model, tok in precise.tokenizers.items():
            for source, n in zip(("memo", "segment", "new"), tok.char_sources(), strict=True):
                chars.add_metric([model, source], n)
        yield chars
        renders = CounterMetricFamily("prefix_router_chat_renders", "Chat templates rendered, by how: spliced (the "
                                      "contents joined into the text the template was proven to write around "
                                      "them, extproc.pick.tokens.chat_splice), jinja, or disagreed (a structure "
                                      "whose first splice differed from Jinja's text: Jinja's since)",
                                      labels=["model", "how"])
        for model, tok in precise.tokenizers.items():
            splice = tok.splice
            renders.add_metric([model, "spliced"], splice.spliced if splice is not None else 0)
            renders.add_metric([model, "jinja"], tok.jinja_renders)
            renders.add_metric([model, "disagreed"], splice.disagreed if splice is not None else 0)
        yield renders
        check = self.picker.tokenizer_check
        if check is not None:
            checks = CounterMetricFamily("prefix_router_tokenizer_checks", "Run-time checks of the router's "
                                         "token ids against a replica's POST /tokenize, by model and result "
                                         "(error: the check itself failed)", labels=["model", "result"])
            trusted = GaugeMetricFamily("prefix_router_tokenizer_trusted", "Per model: 0 while its last "
                                        "tokenizer check disagreed (its requests use the learned view)",
                                        labels=["model"])
            for model, c in list(check.models.items()):
                for result in RESULTS:
                    checks.add_metric([model, result], c.results[result])
                trusted.add_metric([model], 0 if model in precise.distrusted else 1)
            yield checks
            yield trusted
            yield CounterMetricFamily("prefix_router_tokenizer_checks_dropped", "Sampled requests not checked "
                                      "because earlier checks were still waiting", value=check.dropped)


class SharingCollector(Collector):
    """``--share-in-flight``'s figures, read from the bus when /metrics is scraped."""

    def __init__(self, bus: InFlightBus) -> None:
        self.bus = bus

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        bus, remote = self.bus, self.bus.remote
        yield GaugeMetricFamily("prefix_router_in_flight_sharing_connected", "1 while subscribed to the "
                                "--share-in-flight channel", value=int(bus.stats.connected))
        yield GaugeMetricFamily("prefix_router_in_flight_sharing_peers", "Other router replicas heard from "
                                "on the channel lately", value=len(remote.peers))
        yield GaugeMetricFamily("prefix_router_in_flight_sharing_requests", "The other router replicas' "
                                "requests in flight, counted in this router's load and precise views",
                                value=remote.requests())
        yield GaugeMetricFamily("prefix_router_in_flight_sharing_held", "Requests the other router replicas' "
                                "flow control holds, as they last said (this router takes its share of a "
                                "saturated pool's room by them)", value=remote.held_total())
        sent = CounterMetricFamily("prefix_router_in_flight_sharing_messages", "Messages on the channel, by "
                                   "direction and kind (failed: lost to a failed send or a full queue; bad: "
                                   "received and not decoded)", labels=["direction", "kind"])
        sent.add_metric(["sent", "any"], bus.stats.sent)
        sent.add_metric(["sent", "failed"], bus.stats.send_failed)
        for kind, name in ((PICK, "pick"), (END, "end"), (HEARTBEAT, "heartbeat"), (HELD, "held")):
            sent.add_metric(["received", name], remote.stats.received[kind])
        sent.add_metric(["received", "bad"], remote.stats.bad)
        yield sent
        yield CounterMetricFamily("prefix_router_in_flight_sharing_dropped", "Other routers' requests dropped "
                                  "without their end message (missed by a heartbeat, router gone quiet, "
                                  "channel lost)", value=remote.stats.dropped)
        yield CounterMetricFamily("prefix_router_in_flight_sharing_continued", "Other routers' requests ended "
                                  "before their end message arrived, by a request of this router that "
                                  "continues them (holds their whole prompt and more: their answer was out)",
                                  value=remote.stats.continued)
