"""A/B benchmark of prefix-aware routing against stock Envoy routing and peer routers.

Entry points: ``prefix-router bench`` (:mod:`routerlab.bench.cli`), ``prefix-router demo``
(:mod:`routerlab.bench.demo`) and, from Python, :func:`routerlab.bench.runner.run_bench`.
"""
