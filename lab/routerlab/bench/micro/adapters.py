"""One request through each of the router's adapter shapes as Envoy drives it, minus the I/O:
ext_proc's two messages (envoy.yaml), ext_authz's gRPC Check, and the HTTP check (envoy-fast.yaml)
through the HTTP port's own connection code."""

from __future__ import annotations

from envoy.service.auth.v3 import external_auth_pb2 as authz_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.ext_authz import PrefixAuthz
from extproc.adapters.ext_authz_http import HttpAuthz
from extproc.adapters.ext_proc import PrefixRouter
from extproc.adapters.service import RouterService
from extproc.process.http1 import Http1Protocol
from routerlab.harness.extproc_messages import body_message, headers_message

# What Envoy 1.40 sends with envoy.yaml for a wrk request (Envoy adds the x-forwarded-* and x-request-id),
# content-length aside.
_WIRE_HEADERS = (":authority", "127.0.0.1:10000"), (":path", "/v1/chat/completions"), (":method", "POST"), \
    (":scheme", "http"), ("content-type", "application/json"), \
    ("x-forwarded-proto", "http"), ("x-request-id", "5b0c8f0e-4d1e-4f7a-9d7b-0a3c2f1e6d5c")


class StubContext:
    """The one thing the adapter asks of grpc's ServicerContext."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


def wire_messages(body: bytes) -> list[bytes]:
    """envoy.yaml's two ext_proc messages for one request, serialised as Envoy sends them."""
    headers = headers_message((*_WIRE_HEADERS, ("content-length", str(len(body)))))
    return [headers.SerializeToString(), body_message(body).SerializeToString()]


def check_message(body: bytes) -> bytes:
    """envoy-fast.yaml's one Check for the same request (allowed_headers: none of wrk's are sent)."""
    message = authz_pb.CheckRequest()
    http = message.attributes.request.http
    http.method, http.path, http.host, http.protocol = "POST", "/v1/chat/completions", "127.0.0.1:10000", "HTTP/1.1"
    http.size, http.raw_body = len(body), body
    return message.SerializeToString()


def check_once(authz: PrefixAuthz, raw: bytes, context: StubContext) -> int:
    """The ext_authz shape's adapter: parse the Check, answer it, serialise the answer."""
    return len(authz.check(authz_pb.CheckRequest.FromString(raw), context.invocation_metadata()).SerializeToString())


def http_check(body: bytes) -> bytes:
    """envoy-fast.yaml's HTTP check for the same request, as Envoy 1.40 sends it (its listener-wide settings
    as headers, the partial-body flag, the declared length)."""
    head = ("POST /check/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:10000\r\n"
            f"content-length: {len(body)}\r\nx-prefix-router-prefix-length: 4096\r\n"
            "x-prefix-router-normalize: prompt\r\nx-envoy-auth-partial-body: false\r\n"
            f"x-prefix-declared-length: {len(body)}\r\nx-envoy-internal: true\r\n"
            "x-envoy-expected-rq-timeout-ms: 500\r\n\r\n")
    return head.encode() + body


class _Sink:
    """A transport that keeps only the number of bytes written."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)


def http_server(service: RouterService) -> Http1Protocol:
    """The HTTP port's connection code (extproc.process.http1) with the adapter, on a transport that writes nowhere."""
    authz = HttpAuthz(service)
    server = type("Server", (), {"connections": set(), "now": staticmethod(lambda: 0.0),
                                 "handler": staticmethod(lambda r: (200, authz.answer(r.headers, r.body, r.cut)))})()
    protocol = Http1Protocol(server)  # type: ignore[arg-type]
    protocol.connection_made(_Sink())  # type: ignore[arg-type]
    return protocol


def adapter_once(router: PrefixRouter, wire: list[bytes], context: StubContext) -> int:
    """One request through the adapter as grpc drives it (parse, Process, serialise), minus the I/O.

    The request iterator never waits, so the async generator runs to its end without a loop.
    """
    async def requests():  # type: ignore[no-untyped-def]
        for raw in wire:
            yield pb.ProcessingRequest.FromString(raw)

    stream = router.Process(requests(), context)  # type: ignore[arg-type]
    sent = 0
    while True:
        try:
            stream.__anext__().send(None)  # type: ignore[attr-defined]  # the async generator's: a coroutine
        except StopIteration as reply:
            sent += len(reply.value.SerializeToString())
        except StopAsyncIteration:
            return sent
