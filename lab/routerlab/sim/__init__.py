"""Simulated vLLM replica fleet: enough of vLLM's HTTP API, prefix cache and scheduler to
test and benchmark prefix-aware routing without a GPU.

Entry points: ``prefix-router sim`` (see :mod:`routerlab.sim.cli`) and
:func:`routerlab.sim.fleet.start_fleet`. Names below are imported lazily so that importing
the pure modules (tokenizer, kv_cache, scheduler) does not pull in aiohttp.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Fleet", "SimConfig", "start_fleet", "run_fleet_in_thread"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from routerlab.sim import fleet

        return getattr(fleet, name)
    raise AttributeError(name)
