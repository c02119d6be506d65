"""Prefix-aware routing for vLLM fleets behind Envoy (ext_proc server, simulator, benchmark)."""

__version__ = "0.1.0"
