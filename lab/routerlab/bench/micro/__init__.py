"""The parts of ``prefix-router microbench`` (routerlab.bench.microbench): the bodies it times
(bodies), one request through each adapter shape without I/O (adapters), medians of repeats
(timing), hash and pick mode's figures (hash_pick) and precise mode's (precise)."""
