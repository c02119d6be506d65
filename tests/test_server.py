"""The gRPC adapter and the CLI: settings, health, metrics, drain, errors (real gRPC)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import metrics
from extproc.adapters import ext_proc
from extproc.adapters import service as service_module
from extproc.adapters.service import RouterService
from extproc.core.decide import decide
from extproc.core.settings import RouteSettings, SettingError, route_settings, with_metadata
from routerlab.harness import envoy_config, envoy_proc
from routerlab.harness.extproc_messages import body_message, headers_message
from routerlab.harness.procs import wait_until

from support import send, start_router

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}).encode()
MODEL = "x-gateway-model-name"


def headers_msg(headers: dict[str, str], end_of_stream: bool = False) -> pb.ProcessingRequest:
    return headers_message(headers.items(), end_of_stream)


def key_set(reply: pb.ProcessingResponse) -> str | None:
    for opt in reply.request_body.response.header_mutation.set_headers:
        if opt.header.key == "x-prefix-key":
            return opt.header.raw_value.decode()
    return None


@pytest.fixture(scope="module")
def channel(router) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{router[1]}") as ch:
        yield ch


def process(channel: grpc.Channel, messages: list[pb.ProcessingRequest],
            metadata: tuple[tuple[str, str], ...] = ()) -> list[pb.ProcessingResponse]:
    return list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), metadata=metadata, timeout=10))


def test_headers_then_body_sets_the_key_and_strips_the_client_copy(channel: grpc.Channel) -> None:
    replies = process(channel, [headers_msg({":path": "/v1/chat/completions", "x-prefix-aware-id": "acme",
                                             "x-prefix-key": "spoof"}), body_message(BODY)])
    assert len(replies) == 2
    first = replies[0].request_headers.response
    assert list(first.header_mutation.remove_headers) == ["x-prefix-key", "x-prefix-pick", MODEL]
    # never a new route draw from the router (an A/B split would re-roll): the config asks for it (CLEAR)
    assert not first.clear_route_cache
    expected = decide(BODY, {"x-prefix-aware-id": "acme"}, RouteSettings()).key
    assert key_set(replies[1]) == expected
    body = replies[1].request_body.response
    assert {h.header.key: h.header.raw_value for h in body.header_mutation.set_headers}[MODEL] == b"m"
    assert not body.clear_route_cache
    fields = replies[1].dynamic_metadata.fields["prefix_router"].struct_value.fields
    assert fields["prefix_key"].string_value == expected


def test_body_without_header_phase_reads_tenant_from_attributes(channel: grpc.Channel) -> None:
    msg = body_message(BODY)
    msg.attributes["envoy.filters.http.ext_proc"].fields["request.headers['x-prefix-aware-id']"].string_value = "acme"
    (reply,) = process(channel, [msg])
    assert key_set(reply) == decide(BODY, {"x-prefix-aware-id": "acme"}, RouteSettings()).key


def test_metadata_overrides_per_stream_and_bad_values_are_ignored(channel: grpc.Channel) -> None:
    default = key_set(process(channel, [body_message(BODY)])[0])
    short = key_set(process(channel, [body_message(BODY)], (("x-prefix-router-prefix-length", "64"),))[0])
    bad = key_set(process(channel, [body_message(BODY)], (("x-prefix-router-prefix-length", "9"),))[0])
    assert short == decide(BODY, {}, RouteSettings(prefix_length=64)).key != default
    assert bad == default
    header = process(channel, [body_message(BODY)], (("x-prefix-router-key-header", "x-route-key"),))[0]
    assert header.request_body.response.header_mutation.set_headers[0].header.key == "x-route-key"


def test_pick_mode_asked_of_a_router_without_endpoints_falls_back_to_hash_once_counted() -> None:
    service = RouterService(RouteSettings())
    before = metrics.METADATA_ERRORS._value.get()
    for _ in range(3):  # the same route's streams: counted once
        assert service.settings_for([("x-prefix-router-mode", "pick")]).mode == "hash"
    assert metrics.METADATA_ERRORS._value.get() - before == 1


class _NoMetadata:
    def invocation_metadata(self) -> tuple:
        return ()


@pytest.mark.parametrize("close_after", [1, 2], ids=["at-the-pick-reply", "while-held"])
def test_a_pick_stream_closed_at_any_point_releases_the_replica(close_after: int) -> None:
    """Envoy may end the stream (a fast response) before the router resumes after its pick
    reply; the generator is then closed at that yield, and the pick must still be released."""
    from extproc.pick.core import PickCore
    from extproc.pick.views.learned import LearnedView

    core = PickCore(LearnedView(chunk_bytes=64))
    core.set_endpoints(["127.0.0.1:9001", "127.0.0.1:9002"])
    router = ext_proc.PrefixRouter(RouterService(RouteSettings(mode="pick"), picker=core))

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        yield body_message(BODY)
        await asyncio.sleep(3600)  # the HTTP response is still on its way

    async def run() -> list[int]:
        stream = router.Process(requests(), _NoMetadata())
        reply = await stream.__anext__()
        picked = reply.dynamic_metadata.fields[ext_proc.LB_NAMESPACE].struct_value.fields[ext_proc.DESTINATION_ENDPOINT]
        held = [core.load.own(picked.string_value)]
        if close_after == 2:
            pending = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        await stream.aclose()
        return held + [core.load.own(picked.string_value)]

    assert asyncio.run(run()) == [1, 0]


@pytest.mark.parametrize("body", [b"not json", b'{"model": 7, "prompt": "hi"}', b'{"model": "a\\u0000b"}'])
def test_a_body_without_a_usable_model_removes_the_model_header(channel: grpc.Channel, body: bytes) -> None:
    (reply,) = process(channel, [body_message(body)])
    response = reply.request_body.response
    assert MODEL in response.header_mutation.remove_headers and not response.clear_route_cache
    assert MODEL not in {h.header.key for h in response.header_mutation.set_headers}
    (off,) = process(channel, [body_message(BODY)], (("x-prefix-router-model-header", ""),))
    mutation = off.request_body.response.header_mutation
    assert MODEL not in {*mutation.remove_headers, *(h.header.key for h in mutation.set_headers)}


def test_get_without_body_gets_no_key(channel: grpc.Channel) -> None:
    (reply,) = process(channel, [headers_msg({":path": "/v1/models"}, end_of_stream=True)])
    assert reply.WhichOneof("response") == "request_headers"
    assert list(reply.request_headers.response.header_mutation.remove_headers) == ["x-prefix-key", "x-prefix-pick",
                                                                                   MODEL]


def test_grpc_health_is_serving(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def health_command(port: int, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "extproc", "health", *flags] + (["--port", str(port)] if port else []),
                          capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})})


def test_health_command_answers_for_probes(router) -> None:
    done = health_command(router[1])
    assert done.returncode == 0 and done.stdout.strip().endswith(": SERVING"), done.stderr
    # the same PREFIX_ROUTER_* variables as `serve`: the Docker HEALTHCHECK relies on it
    via_env = health_command(0, env={"PREFIX_ROUTER_PORT": str(router[1]), "PREFIX_ROUTER_HOST": "0.0.0.0"})
    assert via_env.returncode == 0, via_env.stderr
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed = free.getsockname()[1]
    down = health_command(closed, "--timeout", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    assert health_command(router[1], "--service", "no.such.Service").returncode == 1


def test_metrics_count_decisions_by_mode_and_fallback(router, channel: grpc.Channel) -> None:
    process(channel, [body_message(b"\xff\xfe")])
    text = send(router[2], "/metrics").body.decode()
    assert 'prefix_router_decisions_total{fallback="not_utf8",normalize="raw"}' in text
    assert "prefix_router_decision_seconds_bucket" in text


def test_an_exception_in_the_router_passes_the_request_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the core must cost the request its key, never the request."""
    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(service_module, "decide", broken)
    before = metrics.ERRORS.labels("decide")._value.get()

    async def run() -> list[pb.ProcessingResponse]:
        srv = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(ext_proc.PrefixRouter(RouterService(RouteSettings())), srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = pb_grpc.ExternalProcessorStub(ch).Process(iter([headers_msg({}), body_message(BODY)]))
                return [r async for r in call]
        finally:
            await srv.stop(None)

    replies = asyncio.run(run())
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    assert not replies[1].request_body.response.HasField("header_mutation")
    assert metrics.ERRORS.labels("decide")._value.get() == before + 1


def test_sigterm_drains_an_open_stream_then_exits() -> None:
    proc, port, _ = start_router("--drain-seconds", "10")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            body_sent = threading.Event()

            def requests() -> Iterator[pb.ProcessingRequest]:
                yield headers_msg({":path": "/v1/completions"})
                body_sent.wait(10)
                yield body_message(BODY)

            call = pb_grpc.ExternalProcessorStub(ch).Process(requests(), timeout=20)
            first = next(call)
            assert first.WhichOneof("response") == "request_headers"
            proc.signal(signal.SIGTERM)  # the stream is open: the server must finish it
            def failing() -> bool:  # NOT_SERVING, then new RPCs refused while the open stream finishes
                h = health_command(port)
                return h.returncode == 1 and ("NOT_SERVING" in h.stdout or "UNAVAILABLE" in h.stderr)

            wait_until(failing, 10, "the health check to fail in the drain", interval=0.2)
            body_sent.set()
            second = next(call)
            assert key_set(second) == decide(BODY, {}, RouteSettings()).key
        proc.proc.wait(15)
        assert proc.proc.returncode == 0
        assert "draining" in proc.output()
    finally:
        proc.stop()


@pytest.mark.parametrize("argv,env,needle", [
    (["--prefix-length", "32"], {}, "--prefix-length"),
    (["--normalize", "fancy"], {}, "--normalize"),
    (["--port", "70000"], {}, "--port"),
    ([], {"PREFIX_ROUTER_PREFIX_LENGTH": "100000"}, "PREFIX_ROUTER_PREFIX_LENGTH"),
    ([], {"PREFIX_ROUTER_TENANT_HEADERS": " , "}, "PREFIX_ROUTER_TENANT_HEADERS"),
])
def test_bad_startup_settings_exit_non_zero_naming_the_setting(argv: list[str], env: dict[str, str],
                                                               needle: str) -> None:
    import os
    done = subprocess.run([sys.executable, "-m", "extproc", "serve", *argv], capture_output=True, text=True,
                          timeout=30, env={**os.environ, **env})
    assert done.returncode == 2
    assert needle in done.stderr and "must be" in done.stderr


def test_flags_beat_env_and_metadata_beats_both() -> None:
    import argparse
    args = argparse.Namespace(prefix_length="8192", normalize=None, key_header=None, tenant_headers=None)
    s = route_settings(args, {"PREFIX_ROUTER_PREFIX_LENGTH": "1024", "PREFIX_ROUTER_NORMALIZE": "raw"})
    assert (s.prefix_length, s.normalize) == (8192, "raw")
    s2, errors = with_metadata(s, [("x-prefix-router-normalize", "canonical"),
                                   ("x-prefix-router-tenant-headers", "a,B")])
    assert (s2.normalize, s2.tenant_headers, errors) == ("canonical", ("a", "b"), [])
    with pytest.raises(SettingError, match="PREFIX_ROUTER_KEY_HEADER"):
        route_settings(None, {"PREFIX_ROUTER_KEY_HEADER": "bad header"})


def test_explain_json_matches_the_server_decision(tmp_path) -> None:
    path = tmp_path / "body.json"
    path.write_bytes(BODY)
    done = subprocess.run([sys.executable, "-m", "extproc", "explain", str(path), "--json",
                           "-H", "X-Prefix-Aware-Id: acme", "--prefix-length", "128"],
                          capture_output=True, text=True, timeout=30)
    info = json.loads(done.stdout)
    assert info["key"] == decide(BODY, {"x-prefix-aware-id": "acme"}, RouteSettings(prefix_length=128)).key
    assert (info["tenant"], info["normalize"], info["fallback"], info["prefix_bytes"]) == ("acme", "prompt", None, 128)
    text = subprocess.run([sys.executable, "-m", "extproc", "explain"], input=b"\xff", capture_output=True, timeout=30)
    assert b"fallback from prompt: not_utf8" in text.stdout


def test_envoy_files_exist():
    assert {"envoy.yaml", "ab.yaml"} <= {p.name for p in envoy_config.ENVOY_DIR.glob("*.yaml")}


@pytest.mark.parametrize("name", sorted(p.name for p in envoy_config.ENVOY_DIR.glob("*.yaml")))
def test_every_envoy_file_validates(name: str) -> None:
    ok, output = envoy_proc.validate(envoy_config.ENVOY_DIR / name)
    assert ok, output


def test_explain_compares_two_bodies(tmp_path) -> None:
    from extproc.process.explain import compare

    system = "You answer questions about ACME. " * 10
    a = json.dumps({"model": "m", "temperature": 1, "messages": [{"role": "system", "content": system},
                                                                  {"role": "user", "content": "one"}]}).encode()
    b = json.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "two"}],
                    "model": "m"}).encode()
    near = compare(a, b, {}, RouteSettings())
    assert not near["same_key"] and "inside the first 4096" in near["reason"]
    assert near["context_a"] != near["context_b"] and "one" in near["context_a"]
    far = compare(a, b, {}, RouteSettings(prefix_length=128))
    assert far["same_key"] and "after the hashed prefix" in far["reason"]
    assert far["first_difference"] == near["first_difference"] > 128
    raw = compare(a, b"\xff", {}, RouteSettings())
    assert "different normalisation" in raw["reason"]
    (tmp_path / "a.json").write_bytes(a)
    (tmp_path / "b.json").write_bytes(b)
    done = subprocess.run([sys.executable, "-m", "extproc", "explain", str(tmp_path / "a.json"),
                           str(tmp_path / "b.json"), "--json", "-H", "x-prefix-aware-id: t"],
                          capture_output=True, text=True, timeout=30)
    out = json.loads(done.stdout)
    assert out["same_key"] is False and out["a"]["tenant"] == out["b"]["tenant"] == "t"
