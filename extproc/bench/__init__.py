"""A/B benchmark of prefix-aware routing against stock Envoy routing and peer routers.

Entry points: ``prefix-router bench`` (:mod:`extproc.bench.cli`), ``prefix-router demo``
(:mod:`extproc.bench.demo`) and, from Python, :func:`extproc.bench.runner.run_bench`.
"""
