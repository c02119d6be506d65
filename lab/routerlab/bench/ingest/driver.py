"""The event driver: one process publishing every replica's KV-cache events at the rate it is told.

Each replica gets the simulator's publisher (routerlab.sim.kv_events: vLLM's wire format, live PUB
and replay ROUTER sockets, seq from 0) on ``base + events_offset + i`` and ``base + replay_offset +
i`` (replica i's HTTP port being ``base + i``, as ``--kv-ports-relative`` reads them). At start it
publishes each replica's warm-up batch (seq 0, kept for replay), then the replicas' cycles of
precomputed batches (routerlab.bench.ingest.workload), round robin, paced to the asked rate of
blocks/s (stored + removed hashes, what ``prefix_router_kv_blocks_total`` counts).

Its own process, so the pacing competes with nothing of the load client's and its CPU is its own.
Controlled over stdin, one command a line; answers on stdout, one JSON line each:

* ``rate N``: send N blocks/s from now on (0: stop sending);
* ``stats``: ``{"sent_blocks", "sent_batches", "subscribed", "cpu_s"}`` (subscribed: the fewest
  subscriptions any replica's PUB socket has seen);
* ``quit``.

Run by ``routerlab.bench.ingest``; not meant to be started by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import sys
import time
from pathlib import Path
from typing import Final

from routerlab.bench.ingest.workload import ReplicaStream, build
from routerlab.sim.kv_events import KvEventPublisher

MAX_BACKLOG_S: Final = 0.5  # after a stall, catch up at most this much of the rate, not the whole stall
TICK_S: Final = 0.002
REPLAY_STEPS: Final = 256  # replay buffer per replica: seq 0 (the warm-up) is asked for at the router's connect
SNDHWM: Final = 2_000  # a subscriber far behind loses batches (seen as gaps): the driver does not buffer without end


class Driver:
    """The publishers and their cycles, paced to one rate over all replicas."""

    def __init__(self, streams: list[ReplicaStream], publishers: list[KvEventPublisher]) -> None:
        self.streams = streams
        self.publishers = publishers
        self.cursor = [0] * len(streams)
        self.next_replica = 0
        self.rate = 0.0
        self.since = time.monotonic()
        self.owed_from = 0  # sent_blocks when the rate last changed
        self.sent_blocks = 0
        self.sent_batches = 0

    def warm_up(self) -> None:
        for stream, pub in zip(self.streams, self.publishers):
            pub.publish_payload(stream.warmup.stamped(time.time()))

    def set_rate(self, rate: float) -> None:
        self.rate = max(0.0, rate)
        self.since = time.monotonic()
        self.owed_from = self.sent_blocks

    def send_due(self, limit: int = 2_000) -> None:
        """Send the batches the rate owes by now (at most ``limit``, so commands are read in between)."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        due = self.rate * (now - self.since) - (self.sent_blocks - self.owed_from)
        if due > self.rate * MAX_BACKLOG_S:  # the machine stalled us: do not burst the whole stall
            self.since = now - MAX_BACKLOG_S
            self.owed_from = self.sent_blocks
            due = self.rate * MAX_BACKLOG_S
        ts = time.time()
        for _ in range(limit):
            if due <= 0:
                return
            i = self.next_replica
            self.next_replica = (i + 1) % len(self.streams)
            cycle = self.streams[i].cycle
            batch = cycle[self.cursor[i]]
            self.cursor[i] = (self.cursor[i] + 1) % len(cycle)
            self.publishers[i].publish_payload(batch.stamped(ts))
            self.sent_blocks += batch.blocks
            self.sent_batches += 1
            due -= batch.blocks

    def stats(self) -> dict[str, float]:
        times = os.times()
        return {"sent_blocks": self.sent_blocks, "sent_batches": self.sent_batches,
                "subscribed": min(p.subscriptions() for p in self.publishers),
                "cpu_s": times.user + times.system, "t": time.monotonic()}


def serve(driver: Driver) -> None:
    sel = selectors.DefaultSelector()
    fd = sys.stdin.fileno()
    sel.register(fd, selectors.EVENT_READ)
    pending = b""
    while True:
        driver.send_due()
        if not sel.select(timeout=TICK_S):
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return  # the parent went away
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            cmd, _, arg = line.decode().strip().partition(" ")
            if cmd == "rate":
                driver.set_rate(float(arg))
                print(json.dumps({"rate": driver.rate}), flush=True)
            elif cmd == "stats":
                print(json.dumps(driver.stats()), flush=True)
            elif cmd == "quit":
                return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-port", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--events-offset", type=int, required=True)
    p.add_argument("--replay-offset", type=int, required=True)
    p.add_argument("--hot", type=Path, required=True, help="JSON list of token-id lists (the hot prefixes)")
    p.add_argument("--hot-per-replica", type=int, default=2)
    p.add_argument("--capacity", type=int, default=4096, help="tail blocks each replica holds")
    p.add_argument("--step-blocks", type=int, default=32, help="mean blocks stored per engine step")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    hot: list[list[int]] = json.loads(a.hot.read_text())
    streams = []
    for i in range(a.replicas):  # replica i holds hot prefixes i, i+1, ... (mod len(hot))
        mine = [hot[(i + k) % len(hot)] for k in range(min(a.hot_per_replica, len(hot)))] if hot else []
        streams.append(build(i, mine, a.capacity, a.step_blocks, a.seed))
    publishers: list[KvEventPublisher] = []
    try:
        for i in range(a.replicas):
            port = a.base_port + i
            publishers.append(KvEventPublisher(events_port=port + a.events_offset, replay_port=port + a.replay_offset,
                                               buffer_steps=REPLAY_STEPS, encoding="map", hwm=SNDHWM))
        driver = Driver(streams, publishers)
        driver.warm_up()
        print(json.dumps({"ready": True, "held": [s.held for s in streams],
                          "cycle_batches": [len(s.cycle) for s in streams]}), flush=True)
        serve(driver)
    finally:
        for pub in publishers:
            pub.close()


if __name__ == "__main__":
    main()
