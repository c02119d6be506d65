"""A request's token ids as vLLM computes them: chat rendering, tokenising, and the caches that make it cheap (pure)."""
