"""Pick mode over ext_authz (envoy/pick-fast.yaml): real Envoy 1.40, the router's HTTP check and its
access-log service, loopback backends. The end of each request comes from Envoy's access log."""

from __future__ import annotations

import http.client
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from extproc.pick.choice.choose import Choice
from extproc.pick.request_ends import RequestEnds
from routerlab.harness import envoy_config
from routerlab.harness.procs import wait_until

from backends import BackendFleet
from conftest import EnvoyFactory
from test_pick_envoy import PickRouter, chat, overflow_at_the_threshold_and_back_home, served_by, write_endpoints

# --- the held picks, alone ------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def choice(address: str) -> Choice:
    return Choice(address=address, reason="cheapest", prompt_tokens=100, candidates=())


def test_a_held_pick_ends_once_by_its_log_entry_or_its_timeout_or_the_last_stream() -> None:
    released: list[str | None] = []
    clock = Clock()
    ends = RequestEnds(lambda c: released.append(c.address), timeout=10.0, clock=clock)
    assert not ends.live
    ends.opened()
    ends.opened()
    assert ends.live
    ends.hold("a", choice("r0"))
    clock.now = 5.0
    ends.hold("b", choice("r1"))
    assert ends.ended("a") and not ends.ended("a") and not ends.ended("never-held")
    assert released == ["r0"]
    ends.hold("b", choice("r2"))  # the same id again: the first one's end can no longer be told apart
    assert released == ["r0", "r1"] and len(ends) == 1
    clock.now = 15.1
    ends.hold("c", choice("r3"))  # "b" (held at 5.0) is past its 10 s; "c" is not
    assert released == ["r0", "r1", "r2"] and len(ends) == 1
    ends.closed()
    assert ends.live and len(ends) == 1  # one stream still connected: "c" can still be told
    ends.closed()
    assert not ends.live and released == ["r0", "r1", "r2", "r3"] and len(ends) == 0


# --- end to end -----------------------------------------------------------------------------------

@pytest.fixture()
def fast_router(backends: BackendFleet, tmp_path: Path) -> Iterator[PickRouter]:
    path = tmp_path / "endpoints"
    write_endpoints(path, backends, [0, 1, 2, 3])
    router = PickRouter(path, over_http=True)
    router.wait_endpoints(4)
    yield router
    router.proc.stop()


def fast_envoy(make_envoy: EnvoyFactory, backends: BackendFleet, router: PickRouter, log: bool = True,
               **settings: str) -> tuple[object, int]:
    def edit(cfg: envoy_config.Config) -> None:
        envoy_config.set_stream_metadata(cfg, {**envoy_config.stream_metadata(cfg), **settings})
        if log:
            envoy_config.set_endpoints(cfg, envoy_config.LOG_CLUSTER, [("127.0.0.1", router.grpc_port)])
        else:  # the config without its access log: nothing could tell the router a request's end
            envoy_config.http_manager(cfg).pop("access_log")
    return make_envoy(backends, "pick-fast.yaml", http_port=router.http_port, edit=edit)


def connect_log(port: int, router: PickRouter) -> None:
    """Envoy opens its access-log stream with the first entry: one request, then the stream."""
    served_by(port, chat("hello"))
    wait_until(lambda: router.metric("prefix_router_access_log_streams") == 1, 10, "Envoy's access-log stream")


def test_requests_count_in_flight_until_the_access_log_reports_their_end(
        backends: BackendFleet, make_envoy: EnvoyFactory, fast_router: PickRouter) -> None:
    """The concurrency threshold spills only while the held requests are in flight: so the router
    counted them from the check until their log entries, and picked each time."""
    _, port = fast_envoy(make_envoy, backends, fast_router, **{"x-prefix-router-concurrency-threshold": "2"})
    connect_log(port, fast_router)

    def two_held() -> None:
        assert fast_router.metric("prefix_router_picks_held") == 2
    overflow_at_the_threshold_and_back_home(port, backends, fast_router, while_held=two_held)
    assert fast_router.metric("prefix_router_pick_ends_total", how="logged") >= 5
    assert fast_router.metric("prefix_router_pick_ends_total", how="expired") == 0
    assert fast_router.metric("prefix_router_pick_decisions_total") >= 5


def test_without_the_access_log_requests_are_keyed_not_picked(
        backends: BackendFleet, make_envoy: EnvoyFactory, fast_router: PickRouter) -> None:
    _, port = fast_envoy(make_envoy, backends, fast_router, log=False)
    served = {served_by(port, chat("same prompt")) for _ in range(6)}
    assert len(served) == 1  # the key still keeps the prefix on one replica (Envoy's Maglev)
    assert fast_router.metric("prefix_router_pick_decisions_total") == 0
    assert fast_router.metric("prefix_router_decisions_total") >= 6
    assert fast_router.metric("prefix_router_picks_held") == 0


def test_picks_still_held_when_the_log_stream_closes_are_released(
        backends: BackendFleet, make_envoy: EnvoyFactory, fast_router: PickRouter) -> None:
    envoy, port = fast_envoy(make_envoy, backends, fast_router)
    connect_log(port, fast_router)
    backends.close_gate()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(lambda: served_by(port, chat("a long one", hold=True)))
        wait_until(lambda: fast_router.metric("prefix_router_picks_held") == 1, 10, "the request held")
        envoy.process.signal(signal.SIGKILL)  # type: ignore[attr-defined]  # no entry flushed: no end told
        wait_until(lambda: fast_router.metric("prefix_router_access_log_streams") == 0, 10, "the stream closed")
        backends.open_gate()
        with pytest.raises((OSError, http.client.HTTPException)):
            held.result(10)  # Envoy is gone, so is the client's request
    assert fast_router.metric("prefix_router_picks_held") == 0 and fast_router.own_in_flight() == 0
    assert fast_router.metric("prefix_router_pick_ends_total", how="log_closed") == 1
