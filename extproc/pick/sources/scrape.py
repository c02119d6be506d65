"""Scrape each replica's vLLM /metrics in the background (never on the request path).

Only a few families matter here, so the text is scanned line by line for them instead of
parsed whole: a vLLM /metrics page is tens of kilobytes of histograms, and a full parse
per replica per interval would take event-loop time from the requests.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Final

import aiohttp

from extproc import metrics
from extproc.pick.choice.load import LoadTracker
from extproc.pick.choice.state import Sample
from extproc.pick.sources.poller import ReplicaPoller

log = logging.getLogger("extproc.pick.sources.scrape")

RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
CACHE_INFO: Final = "vllm:cache_config_info"
CACHE_HITS: Final = "vllm:prefix_cache_hits_total"
SUCCESS: Final = "vllm:request_success_total"
PROMPT_TOKENS: Final = "vllm:prompt_tokens_total"
PREFILL_TOKENS: Final = "vllm:request_prefill_kv_computed_tokens_sum"
PREFILL_SECONDS: Final = "vllm:request_prefill_time_seconds_sum"
TTFT_SECONDS: Final = "vllm:time_to_first_token_seconds_sum"
FIRST_TOKENS: Final = "vllm:time_to_first_token_seconds_count"
LORA_INFO: Final = "vllm:lora_requests_info"
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _value(line: str) -> float:
    try:
        return float(line.rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return 0.0


# The families summed over engines (KV usage is averaged, cache_config_info read for its labels).
_SUMMED: Final = (RUNNING, WAITING, CACHE_HITS, SUCCESS, PROMPT_TOKENS, PREFILL_TOKENS, PREFILL_SECONDS,
                  TTFT_SECONDS, FIRST_TOKENS)


def parse_metrics(text: str) -> Sample:
    """Sum over engines of the load gauges, cache hits, finished requests, prompt tokens, the
    prompt tokens computed and seconds spent in prefill by finished requests, and the time to first
    token of the requests that had theirs (sum and count); KV usage is the mean;
    capacity from cache_config_info; the LoRA adapters running and waiting from lora_requests_info.

    ``seen`` is False when the text has no vLLM load gauges (then the load is unknown, 0)."""
    sums = dict.fromkeys(_SUMMED, 0.0)
    usage = 0.0
    engines = capacity = block_size = 0
    seen = False
    lora: dict[str, tuple[float, dict[str, str]]] = {}  # engine -> its latest lora_requests_info (value, labels)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        seen = seen or name in (RUNNING, WAITING)
        if name in sums:
            sums[name] += _value(line)
        elif name == KV_USAGE:
            usage += _value(line)
            engines += 1
        elif name == LORA_INFO:
            labels = dict(_LABEL.findall(line))
            value = _value(line)
            engine = labels.get("engine", "")
            if engine not in lora or value >= lora[engine][0]:
                lora[engine] = (value, labels)
        elif name == CACHE_INFO:
            labels = dict(_LABEL.findall(line))
            try:
                block_size = int(labels.get("block_size", "0"))
                capacity += int(labels.get("num_gpu_blocks", "0")) * block_size
            except ValueError:
                pass
    max_lora, running, waiting = _adapters([labels for _, labels in lora.values()])
    return Sample(sums[RUNNING], sums[WAITING], usage / engines if engines else 0.0, capacity, seen, sums[CACHE_HITS],
                  block_size, sums[SUCCESS], sums[PROMPT_TOKENS], sums[PREFILL_TOKENS], sums[PREFILL_SECONDS],
                  max_lora, running, waiting, sums[TTFT_SECONDS], sums[FIRST_TOKENS])


def _adapters(samples: list[dict[str, str]]) -> tuple[int, frozenset[str], frozenset[str]]:
    """vLLM's lora_requests_info, its latest sample per engine (its value is when it was set: the label
    set is the information): the adapters per batch, and the adapters running and waiting, over engines."""
    max_lora = 0
    running: set[str] = set()
    waiting: set[str] = set()
    for labels in samples:
        try:
            max_lora = max(max_lora, int(labels.get("max_lora", "0")))
        except ValueError:
            continue
        running.update(name for name in labels.get("running_lora_adapters", "").split(",") if name)
        waiting.update(name for name in labels.get("waiting_lora_adapters", "").split(",") if name)
    return max_lora, frozenset(running), frozenset(waiting)


class Scraper(ReplicaPoller):
    """Every ``interval`` seconds, GET http://ADDRESS/metrics of every replica at once."""

    def __init__(self, tracker: LoadTracker, interval: float,
                 on_sample: Callable[[str, Sample | None], None] | None = None) -> None:
        super().__init__(tracker.addresses, interval)
        self.tracker = tracker
        self.on_sample = on_sample

    async def ask(self, session: aiohttp.ClientSession, address: str) -> None:
        own = self.tracker.own(address)
        sample: Sample | None = None
        refused = False
        try:
            async with session.get(f"http://{address}/metrics") as resp:
                # A server that answers without vLLM metrics is up but its load unknown.
                text = await resp.text() if resp.status == 200 else ""
                sample = parse_metrics(text)
        except TimeoutError:
            log.debug("scrape of %s timed out", address)
        except (aiohttp.ClientError, OSError, UnicodeError) as exc:
            refused = True  # nothing listening, or the connection broke: down at once
            log.debug("scrape of %s failed: %r", address, exc)
        if sample is None or not sample.seen:
            metrics.SCRAPE_ERRORS.labels(address).inc()
        # Requests of ours that ended while the scrape was under way may or may not be in it;
        # assume they are not (the smaller own count), so a replica never looks idler than it is.
        self.tracker.scraped(address, sample, min(own, self.tracker.own(address)), refused, time.monotonic())
        if self.on_sample:
            self.on_sample(address, sample)
