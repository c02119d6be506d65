"""The ext_authz shape (envoy-fast.yaml): one unary Check per request, over real gRPC.

End to end with a real Envoy it runs in tests/test_envoy_integration.py (the SHAPES tests).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2 as pb
from envoy.service.auth.v3 import external_auth_pb2_grpc as pb_grpc

from extproc import metrics
from extproc.adapters import authz, ext_authz
from extproc.adapters.service import RouterService
from extproc.core.decide import decide
from extproc.core.settings import RouteSettings

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}).encode()


def check_request(body: bytes = BODY, headers: dict[str, str] | None = None,
                  per_route: dict[str, str] | None = None) -> pb.CheckRequest:
    req = pb.CheckRequest()
    http = req.attributes.request.http
    http.raw_body = body
    http.headers.update(headers or {})
    req.attributes.context_extensions.update(per_route or {})
    return req


def key_of(reply: pb.CheckResponse) -> str | None:
    keys = [o.header.value for o in reply.ok_response.headers if o.header.key == "x-prefix-key"]
    assert len(keys) <= 1
    return keys[0] if keys else None


@pytest.fixture(scope="module")
def stub(router) -> Iterator[pb_grpc.AuthorizationStub]:
    with grpc.insecure_channel(f"127.0.0.1:{router[1]}") as ch:
        yield pb_grpc.AuthorizationStub(ch)


def test_check_sets_the_key_of_the_body_and_tenant_and_never_denies(stub: pb_grpc.AuthorizationStub) -> None:
    reply = stub.Check(check_request(headers={"x-prefix-aware-id": "acme", "x-other": "ignored"}), timeout=10)
    assert reply.status.code == grpc.StatusCode.OK.value[0] and reply.WhichOneof("http_response") == "ok_response"
    assert key_of(reply) == decide(BODY, {"x-prefix-aware-id": "acme"}, RouteSettings()).key
    assert key_of(reply) != decide(BODY, {}, RouteSettings()).key  # the tenant counted
    assert {o.header.key: o.header.value for o in reply.ok_response.headers}["x-gateway-model-name"] == "m"
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert {o.append_action for o in reply.ok_response.headers} == {overwrite}  # a client's copy never survives


def test_no_body_removes_the_key_and_model_headers(stub: pb_grpc.AuthorizationStub) -> None:
    reply = stub.Check(check_request(body=b""), timeout=10)
    assert key_of(reply) is None
    assert list(reply.ok_response.headers_to_remove) == ["x-prefix-key", "x-gateway-model-name"]


@pytest.mark.parametrize(("body", "model"), [
    (BODY, "m"), (json.dumps({"model": "x\n", "prompt": "hi"}).encode(), None),  # cannot be a header value
    (json.dumps({"model": 7, "prompt": "hi"}).encode(), None), (b"not json", None)])
def test_the_model_header_carries_the_bodys_model_or_is_removed(stub: pb_grpc.AuthorizationStub, body: bytes,
                                                                model: str | None) -> None:
    reply = stub.Check(check_request(body, per_route={"x-prefix-router-model-header": "x-model"}), timeout=10)
    set_ = {o.header.key: o.header.value for o in reply.ok_response.headers}
    assert set_.get("x-model") == model
    assert ("x-model" in reply.ok_response.headers_to_remove) is (model is None)
    off = stub.Check(check_request(body, per_route={"x-prefix-router-model-header": ""}), timeout=10)
    assert not {"x-model", "x-gateway-model-name"} & {*off.ok_response.headers_to_remove,
                                                       *(o.header.key for o in off.ok_response.headers)}


def test_a_cut_body_is_keyed_as_the_start_of_a_body(stub: pb_grpc.AuthorizationStub) -> None:
    start = BODY[:100]
    reply = stub.Check(check_request(start, {ext_authz.PARTIAL_BODY_HEADER: "true"}), timeout=10)
    partial = decide(start, {}, RouteSettings(), complete=False)
    assert partial.fallback == "truncated" and key_of(reply) == partial.key


def test_a_body_cut_exactly_on_the_limit_is_known_cut_by_its_content_length(
        stub: pb_grpc.AuthorizationStub) -> None:
    """Envoy says partial "false" when its buffer holds exactly max_request_bytes (reads ending on
    the limit): the declared length is what tells the router the body is only its start."""
    whole = BODY + b" " * 200  # trailing whitespace: the cut start still parses as JSON
    start = whole[: len(BODY) + 10]
    sent = {ext_authz.PARTIAL_BODY_HEADER: "false", "content-length": str(len(whole))}
    as_start = decide(start, {}, RouteSettings(), complete=False)
    assert as_start.key != decide(start, {}, RouteSettings()).key  # the two readings differ
    assert key_of(stub.Check(check_request(start, sent), timeout=10)) == as_start.key
    assert key_of(stub.Check(check_request(whole, sent), timeout=10)) == decide(whole, {}, RouteSettings()).key


@pytest.mark.parametrize(("headers", "whole"), [
    ({}, True), ({ext_authz.PARTIAL_BODY_HEADER: "true"}, False), ({ext_authz.PARTIAL_BODY_HEADER: "false"}, True),
    ({"content-length": "100"}, True), ({"content-length": "101"}, False), ({"content-length": "junk"}, True),
    ({ext_authz.PARTIAL_BODY_HEADER: "true", "content-length": "100"}, False),
])
def test_body_is_whole_reads_the_partial_header_and_the_declared_length(headers: dict[str, str],
                                                                        whole: bool) -> None:
    assert ext_authz.body_is_whole(b"x" * 100, headers) is whole


def test_listener_metadata_then_per_route_context_extensions_set_the_settings(
        stub: pb_grpc.AuthorizationStub) -> None:
    listener = (("x-prefix-router-prefix-length", "128"),)
    by_listener = stub.Check(check_request(), metadata=listener, timeout=10)
    by_route = stub.Check(check_request(per_route={"x-prefix-router-prefix-length": "64"}), metadata=listener,
                          timeout=10)
    assert key_of(by_listener) == decide(BODY, {}, RouteSettings(prefix_length=128)).key
    assert key_of(by_route) == decide(BODY, {}, RouteSettings(prefix_length=64)).key != key_of(by_listener)


def test_pick_and_tenant_isolation_asked_of_the_authz_shape_are_ignored_once_counted() -> None:
    service = RouterService(RouteSettings(), secret=b"0123456789abcdef0123456789abcdef")
    asked = [("x-prefix-router-mode", "pick"), ("x-prefix-router-tenant-isolation", "on")]
    before = metrics.METADATA_ERRORS._value.get()
    for _ in range(3):  # the same route's calls: counted once
        settings = service.settings_for(asked, authz.LIMITS)
        assert (settings.mode, settings.tenant_isolation) == ("hash", False)
    assert metrics.METADATA_ERRORS._value.get() - before == 2
    assert service.settings_for(asked[1:]).tenant_isolation  # ext_proc's stream can still isolate
    assert service.settings_for([], authz.LIMITS).tenant_isolation is False


def test_a_process_default_of_tenant_isolation_is_dropped_for_the_authz_shape() -> None:
    service = RouterService(RouteSettings(tenant_isolation=True), secret=b"0123456789abcdef0123456789abcdef")
    assert service.settings_for([], authz.LIMITS).tenant_isolation is False
    assert service.settings_for([]).tenant_isolation is True


def test_an_exception_answers_ok_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the router must cost the request its key, never deny it."""
    service = RouterService(RouteSettings())

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(service, "settings_for", broken)
    before = metrics.ERRORS.labels("authz")._value.get()

    async def run() -> pb.CheckResponse:
        srv = grpc.aio.server()
        ext_authz.add_to_server(service, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await pb_grpc.AuthorizationStub(ch).Check(check_request(), timeout=10)
        finally:
            await srv.stop(None)

    reply = asyncio.run(run())
    assert reply.status.code == 0 and not reply.HasField("denied_response") and key_of(reply) is None
    assert metrics.ERRORS.labels("authz")._value.get() == before + 1
