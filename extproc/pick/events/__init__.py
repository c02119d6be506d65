"""vLLM's KV-cache events: decoding, the exact per-replica block index, and the eviction forecast (pure)."""
