"""A do-nothing ext_proc (and ext_authz) server: the protocol's floor for the ``overhead`` scenario.

It answers every message at once with a reply serialised in advance, and never parses a
request: the phase is read from the message's first byte (the tag of the ``request``
oneof, the lowest field number Envoy writes), so what it costs is the gRPC stack and the
protocol, not our work. It speaks whatever shape the Envoy config asks for: a headers reply
and a body reply for envoy.yaml and pick.yaml; a body reply alone if the headers are
skipped; a canned OK to ext_authz's unary Check (envoy-fast.yaml); and, for a STREAMED body
sent without waiting for the headers reply (a shape measured and rejected,
docs/results/overhead-streamed), one delayed headers reply after the body's chunks. Like the
router in hash mode it ends the RPC after the body reply; with ``--hold`` it keeps the
stream open until Envoy ends it with the HTTP response, as the router does in pick mode.
Same server shape as ``prefix-router serve``: grpc.aio on uvloop, gRPC health, the same
message size limits.

With ``--http-port`` it also answers ext_authz over HTTP (envoy-fast.yaml) there: an empty 200
to every check, unparsed beyond what the router's own HTTP server parses (the same server,
extproc.process.http1), so the floor of the HTTP shape is that server and the protocol. With
``--http-shape bare`` the HTTP port is instead the barest server httptools allows (no callback
but the one that ends a request, nothing kept; health checks counted too): what Envoy and the
protocol cost on this machine with no server code to speak of.

Run: ``python -m routerlab.bench.noop_extproc --port 50061 --metrics-port 9470 [--hold] [--http-port 50062]``;
``/metrics`` on the metrics port counts streams and messages (an HTTP check is a stream of one).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Final

import grpc
import httptools
from aiohttp import web
from envoy.service.auth.v3 import external_auth_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health as health_sync
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from extproc.adapters.ext_authz import SERVICE as AUTHZ_SERVICE
from extproc.process import event_loop
from extproc.process.health import SERVICE
from extproc.process.http1 import Answer, Http1Server, Request
from extproc.process.serve import HTTP_HEALTH_PATH, SERVER_OPTIONS
from extproc.process.signals import stop_on_signals

SHAPES = ("aio-uvloop", "aio-asyncio", "sync")
HTTP_SHAPES = ("server", "bare")  # the HTTP port: the router's own server code, or the barest one
STREAMS_METRIC = "noop_extproc_streams_total"
MESSAGES_METRIC = "noop_extproc_messages_total"
_LENGTH_DELIMITED = 2  # protobuf wire type of a sub-message


def _empty_reply(phase: str) -> bytes:
    """The serialised ProcessingResponse that answers ``phase`` and changes nothing."""
    reply = pb.ProcessingResponse()
    part = getattr(reply, phase)
    # headers and body replies carry a CommonResponse (it must be present, even empty); trailers do not
    (part.response if "response" in part.DESCRIPTOR.fields_by_name else part).SetInParent()
    return reply.SerializeToString()


def replies() -> dict[int, bytes]:
    """First byte of a ProcessingRequest (its phase's tag) -> the reply to send."""
    phases = pb.ProcessingRequest.DESCRIPTOR.oneofs_by_name["request"].fields
    return {(f.number << 3) | _LENGTH_DELIMITED: _empty_reply(f.name) for f in phases}


REPLIES = replies()
CHECK_OK = external_auth_pb2.CheckResponse().SerializeToString()  # status OK, nothing changed
BODY_TAG = (pb.ProcessingRequest.DESCRIPTOR.fields_by_name["request_body"].number << 3) | _LENGTH_DELIMITED
HEADERS_TAG = (pb.ProcessingRequest.DESCRIPTOR.fields_by_name["request_headers"].number << 3) | _LENGTH_DELIMITED
# protocol_config (field 11) is the last field Envoy writes, and send_body_without_waiting_for_header_response
# (its field 3, true) the last of it: a first message ending so may ask for the delayed-headers shape.
_SENDS_BODY_WITHOUT_WAITING = b"\x18\x01"


def delays_headers(raw: bytes) -> bool:
    """Does this first message ask for one delayed headers reply (STREAMED body, sent without
    waiting for it: Envoy's ext_proc filter, source/extensions/filters/http/ext_proc/ext_proc.cc)?
    A byte check, and a parse only if it may."""
    return bool(raw) and raw[0] == HEADERS_TAG and raw.endswith(_SENDS_BODY_WITHOUT_WAITING) and \
        pb.ProcessingRequest.FromString(raw).protocol_config.send_body_without_waiting_for_header_response


class Noop:
    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.streams = 0
        self.messages = 0

    def answer(self, raw: bytes) -> tuple[bytes, bool]:
        """The canned reply to one message, and whether the stream ends after it."""
        self.messages += 1
        tag = raw[0] if raw else BODY_TAG
        return REPLIES.get(tag, REPLIES[BODY_TAG]), tag == BODY_TAG and not self.hold

    def stream(self) -> Callable[[bytes], tuple[list[bytes], bool]]:
        """One stream's answers: message -> (replies to send now, whether the stream ends).

        Usually one canned reply per message. In the delayed-headers shape nothing is sent until
        the body's last chunk; then the headers reply and one reply per chunk, in order.
        """
        held: int | None = None  # body chunks waiting for the delayed headers reply
        first = True

        def feed(raw: bytes) -> tuple[list[bytes], bool]:
            nonlocal held, first
            if first and delays_headers(raw):
                self.messages += 1
                first, held = False, 0
                return [], False
            first = False
            if held is None:
                reply, last = self.answer(raw)
                return [reply], last
            self.messages += 1
            held += 1
            if not pb.ProcessingRequest.FromString(raw).request_body.end_of_stream:
                return [], False
            replies, held = [REPLIES[HEADERS_TAG], *[REPLIES[BODY_TAG]] * held], None  # later messages: one each
            return replies, not self.hold

        return feed

    async def process(self, requests: AsyncIterator[bytes], _: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self.streams += 1
        feed = self.stream()
        async for raw in requests:
            replies, last = feed(raw)
            for reply in replies:
                yield reply
            if last:
                return

    def process_sync(self, requests: Iterator[bytes], _: grpc.ServicerContext) -> Iterator[bytes]:
        """The same replies from grpc's thread-pool server (the ``sync`` shape)."""
        self.streams += 1
        feed = self.stream()
        for raw in requests:
            replies, last = feed(raw)
            yield from replies
            if last:
                return

    def check(self, _: bytes, __: object) -> bytes:
        """ext_authz's Check (envoy-fast.yaml): OK, unparsed; counted as a stream of one message."""
        self.streams += 1
        self.messages += 1
        return CHECK_OK

    async def check_async(self, raw: bytes, context: object) -> bytes:
        return self.check(raw, context)

    def check_http(self, request: Request) -> Answer:
        """ext_authz over HTTP: an empty 200 (Envoy's health checks answered, not counted)."""
        if request.path != HTTP_HEALTH_PATH:
            self.streams += 1
            self.messages += 1
        return 200, b""

    def handlers(self, sync: bool) -> tuple[grpc.GenericRpcHandler, ...]:
        """Raw-bytes handlers (no (de)serialisers) for ext_proc's Process and ext_authz's Check."""
        return (grpc.method_handlers_generic_handler(SERVICE, {"Process": grpc.stream_stream_rpc_method_handler(
                    self.process_sync if sync else self.process)}),
                grpc.method_handlers_generic_handler(AUTHZ_SERVICE, {"Check": grpc.unary_unary_rpc_method_handler(
                    self.check if sync else self.check_async)}))

    def metrics(self) -> str:
        return f"{STREAMS_METRIC} {self.streams}\n{MESSAGES_METRIC} {self.messages}\n"


def serve_sync(port: int, metrics_port: int, hold: bool, workers: int = 128) -> None:
    """grpc's synchronous server: a thread per open stream instead of one event loop."""
    noop = Noop(hold)
    server = grpc.server(ThreadPoolExecutor(max_workers=workers), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers(noop.handlers(sync=True))
    health = health_sync.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if server.add_insecure_port(f"127.0.0.1:{port}") == 0:
        raise OSError(f"cannot bind 127.0.0.1:{port}")

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = noop.metrics().encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", metrics_port), Metrics)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    server.start()
    for name in ("", SERVICE):
        health.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"noop-extproc (sync) ready on 127.0.0.1:{port} (hold={hold})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1)
    http.shutdown()


_OK: Final = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


class BareHttp(asyncio.Protocol):
    """An empty 200 per request and nothing else: httptools told only where a request ends."""

    def __init__(self, noop: Noop) -> None:
        self.noop = noop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_complete(self) -> None:
        self.noop.streams += 1
        self.noop.messages += 1
        if self.transport is not None:
            self.transport.write(_OK)


async def serve(port: int, metrics_port: int, hold: bool, http_port: int = 0, http_shape: str = "server") -> None:
    noop = Noop(hold)
    http_authz = Http1Server(noop.check_http)
    bare: asyncio.Server | None = None
    if http_port and http_shape == "bare":
        bare = await asyncio.get_running_loop().create_server(lambda: BareHttp(noop), "127.0.0.1", http_port)
    elif http_port:
        await http_authz.start("127.0.0.1", http_port)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers(noop.handlers(sync=False))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound == 0:
        raise OSError(f"cannot bind 127.0.0.1:{port}")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=noop.metrics(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", metrics_port).start()
    await server.start()
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"noop-extproc ready on 127.0.0.1:{bound} (hold={hold})", flush=True)
    await stop_on_signals().wait()
    await server.stop(grace=1)
    await http_authz.stop()
    if bare is not None:
        bare.close()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--hold", action="store_true", help="keep each stream open until Envoy ends it")
    parser.add_argument("--http-port", type=int, default=0,
                        help="also answer ext_authz over HTTP on this port (envoy-fast.yaml); aio shapes only")
    parser.add_argument("--http-shape", choices=HTTP_SHAPES, default="server",
                        help="the HTTP port: the router's own server code (extproc.process.http1), or the barest "
                             "httptools server (counts health checks too)")
    parser.add_argument("--shape", choices=SHAPES, default="aio-uvloop",
                        help="server shape: grpc.aio on uvloop (as `serve`), on asyncio's loop, "
                             "or grpc's thread-pool server")
    args = parser.parse_args()
    if args.shape == "sync":
        if args.http_port:
            parser.error("--http-port needs an aio shape")
        serve_sync(args.port, args.metrics_port, args.hold)
        return
    if args.shape == "aio-asyncio":
        asyncio.run(serve(args.port, args.metrics_port, args.hold, args.http_port, args.http_shape))
        return
    event_loop.run(serve(args.port, args.metrics_port, args.hold, args.http_port, args.http_shape))


if __name__ == "__main__":
    main()
