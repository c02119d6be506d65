"""`prefix-router ab`: the A/B analysis of a live fleet (prefix routing vs stock Envoy routing).

One idea per module: ``accesslog`` reads Envoy's JSON access log, ``counters`` reads vLLM's
counters and their deltas (a replica's /metrics, or a Prometheus server), ``windows`` the
switchback windows file and which request belongs to which window, ``stats`` the cluster
bootstrap, ``analysis`` puts them together per arm, ``verdict`` says it in one line,
``report`` writes the text and JSON, ``plots`` the figures, ``driver`` flips Envoy's runtime
share in randomised windows, ``record`` reads a split's pools at fixed window edges without
flipping anything, and ``cli`` is the command.
"""
