"""Pick mode: the router chooses the replica from what each one holds and how busy it is.

Pure parts (no I/O, no clock): ``chunks`` (prompt -> chained chunk hashes), ``state``
(a frozen snapshot of the replicas), ``choose`` (snapshot + request -> a replica) and
``index`` (the learned, capacity-bounded prefix index, a plain data structure). Around
them: ``endpoints`` (where the replicas are), ``scrape`` (their vLLM metrics, in the
background), ``load`` (scraped load + this router's own requests in flight), and
``picker``, which composes them for the gRPC adapter.
"""
