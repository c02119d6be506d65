"""Precise mode's KV-event ingest while the router serves requests (issue 17's "event ingest
sustains at least 50,000 blocks/s on one core while serving requests").

A real ``prefix-router serve`` in precise mode over n replicas (zero-work HTTP backends for its
scraper); one driver process publishes every replica's KV-cache events in vLLM 0.32's wire format
at a controlled rate of blocks/s (``driver``, ``workload``), while this process sends chat bodies
straight to the router's ext_proc gRPC, at a fixed rate and then closed loop (``client``). Per
step of offered rate: blocks applied from the router's own counters, whether it kept up, its CPU
(and the ingest path's share of it), and the requests' latency and throughput (``run``).

Run: ``python -m routerlab.bench.ingest --out DIR`` (see ``--help``).
"""
