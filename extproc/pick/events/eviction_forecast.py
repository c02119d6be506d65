"""Which blocks a replica will still hold when it admits a request sent to it now (pure).

The event view says what a replica holds now; a request that waits in its queue finds what
is left when it is admitted (vLLM counts prefix-cache hits then). Meanwhile the requests
admitted ahead of it allocate blocks, each from the head of vLLM's free queue, evicting what
that block held; a request's blocks go back to the queue's tail when it ends. So:

- the allocation clock: blocks the replica has allocated so far, as its BlockStored events
  count them (``EventIndex.allocations``);
- when each chain was last in use, as a reading of that clock: when a BlockStored stored its
  last block or chained onto it, read at the end of that event's batch (a request was using it
  through that engine step; vLLM frees a request's blocks to the queue's tail when it ends).
  Every router sees the same events, so router replicas read the same;
- the replica's free queue now, ``free`` blocks (its KV not used by running requests,
  scraped): about ``clock - t`` blocks were freed after a block freed at ``t`` (what is
  allocated is freed again), and vLLM frees a request's blocks tail first, so block ``i`` of a
  chain went in ``i`` places behind the chain's tail: about ``free - (clock - t) - 1 - i``
  blocks are ahead of it;
- the allocations to come before admission: the replica's blocks allocated per finished
  request (its events against its ``vllm:request_success_total``), times the requests that
  finish before it admits this one (those waiting ahead, and one more: a slot to free, or with
  none waiting, the step the replica is running: vLLM evicts while it schedules a step and
  announces the removals after it, so the events run a step behind the cache).

Block ``i`` survives if at least as many blocks are ahead of it as will be allocated first:
``reading - i > clock + ahead - free``. A request that used block j used every block before it,
so along a request's chain block i reads the latest reading at or after it, which never rises:
the blocks that survive are a prefix. Blocks that a request of this router in flight there
shares stay too (it uses them before admission). A chain with no reading at all is taken to
survive: the forecast only lowers what the events say, and only on evidence.

The forecast checks itself against the same events: the blocks it said a request would find
evicted, and as many held blocks before them, are watched until the request ends (a block still
there at admission is in use until then, so it cannot leave in between); the blocks of both that
did leave, against the blocks it said would, is its ``scale``. What the forecast cannot see makes
it take off too much (the requests another router replica has queued there use their blocks
before this one is admitted) or too little (blocks below its boundary that went too). So what it
takes off a prediction is scaled by that, per replica, from the recent requests' outcomes.

No I/O, no clock: counters in, a threshold and a count of blocks out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

DECAY: Final = 0.8  # each scrape keeps this much of the blocks-per-request history (~5 scrapes)
CHECK_DECAY: Final = 0.98  # each checked request keeps this much of the forecast's record (~50 requests)
MIN_CHECKED: Final = 32.0  # blocks checked before the record replaces taking the forecast at its word


@dataclass(slots=True)
class _Rate:
    allocated: int  # the replica's allocation clock at the last scrape
    done: float  # its vllm:request_success_total at the last scrape
    allocated_sum: float = 0.0  # decayed allocations since the first scrape
    done_sum: float = 0.0  # decayed finished requests over the same scrapes


@dataclass(slots=True)
class _Record:
    forecast: float = 0.0  # decayed blocks the forecast said would be evicted
    evicted: float = 0.0  # decayed blocks that were, of them and as many below them


class EvictionForecast:
    """Per replica, the blocks each finished request allocates (from scrapes and the event clock),
    and how much of what the forecast took off was evicted."""

    def __init__(self) -> None:
        self._rates: dict[str, _Rate] = {}
        self._records: dict[str, _Record] = {}

    def on_sample(self, address: str, allocated: int, done: float) -> None:
        """A scrape: ``allocated`` is the replica's allocation clock now, ``done`` its finished requests."""
        rate = self._rates.get(address)
        if rate is None or done < rate.done or allocated < rate.allocated:  # first sight, or a restart
            self._rates[address] = _Rate(allocated, done)
            return
        rate.allocated_sum = rate.allocated_sum * DECAY + (allocated - rate.allocated)
        rate.done_sum = rate.done_sum * DECAY + (done - rate.done)
        rate.allocated, rate.done = allocated, done

    def per_request(self, address: str) -> float:
        """Blocks the replica allocates per request it finishes, lately (0 before two scrapes)."""
        rate = self._rates.get(address)
        return rate.allocated_sum / rate.done_sum if rate is not None and rate.done_sum > 0 else 0.0

    def forget(self, address: str) -> None:
        self._rates.pop(address, None)
        self._records.pop(address, None)

    def on_outcome(self, address: str, forecast: int, evicted: int, missed: int = 0) -> None:
        """A request ended: of the ``forecast`` blocks said to be evicted before its admission,
        ``evicted`` left the replica while it was in flight, and ``missed`` of as many before them."""
        record = self._records.get(address)
        if record is None:
            record = self._records[address] = _Record()
        record.forecast = record.forecast * CHECK_DECAY + forecast
        record.evicted = record.evicted * CHECK_DECAY + min(evicted, forecast) + min(missed, forecast)

    def scale(self, address: str) -> float:
        """Blocks that left ``address`` of those its forecasts watched, per block forecast evicted,
        lately (0 to 2; 1.0 until ``MIN_CHECKED`` blocks were checked): what to scale its forecast by."""
        record = self._records.get(address)
        if record is None or record.forecast < MIN_CHECKED:
            return 1.0
        return record.evicted / record.forecast

    def threshold(self, address: str, clock: int, waiting: float, free_blocks: float) -> float | None:
        """Blocks last freed at or below this reading of the allocation clock are gone by the time the
        replica admits a request sent now (None: its rate is not known yet)."""
        per_request = self.per_request(address)
        if per_request <= 0:
            return None
        return clock + per_request * (waiting + 1) - free_blocks


def surviving(run: Sequence[int], held: int, floor: int, last_use: Callable[[int, None], int | None],
              threshold: float) -> int:
    """How many leading blocks of ``run`` (the first ``held`` held, the first ``floor`` kept by
    requests in flight) are still there: block i if its reading less i is above ``threshold``.

    Readings are sparse (``EventIndex.last_use``): block i reads the largest reading at or after it
    on the run, and blocks after the run's last reading read that one (they were stored or freed
    with it). Scanned from the tail, so the cost is the blocks lost."""
    best: int | None = None
    for i in range(held - 1, floor - 1, -1):
        t = last_use(run[i], None)
        if t is not None and (best is None or t > best):
            if best is None:  # the run's last reading: the blocks after it read it too
                last = math.ceil(t - threshold) - 1  # the last block k with t - k > threshold
                if last > i:
                    return min(held, last + 1)
            best = t
        if best is not None and best - i > threshold:
            return i + 1
    return held if best is None else floor
