"""ext_authz over HTTP (envoy-fast.yaml): the router's HTTP port, spoken to as Envoy does, over real sockets.

End to end with a real Envoy it runs in tests/test_envoy_integration.py (the SHAPES tests and
the HTTP shape's own). Here: the answers (key, removals, settings from headers, cut bodies) and
the server's manners (keep-alive, pipelining, malformed requests, half-sent ones, health).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from extproc import metrics
from extproc.adapters import authz
from extproc.adapters.ext_authz_http import REMOVE_HEADER, HttpAuthz
from extproc.adapters.service import RouterService
from extproc.core.decide import decide
from extproc.core.settings import RouteSettings, ServerSettings
from extproc.process import http1, serve
from routerlab.harness.procs import Process

from support import send, until

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}).encode()
KEY = "x-prefix-key"
MODEL = "x-gateway-model-name"


def check(body: bytes = BODY, headers: dict[str, str] | None = None, path: str = "/check/v1/chat/completions",
          extra: bytes = b"") -> bytes:
    """One check request's bytes, as Envoy's ext_authz http_service sends it."""
    lines = [f"POST {path} HTTP/1.1", "host: llm", f"content-length: {len(body)}",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n").encode() + extra + b"\r\n" + body


def read_answers(sock: socket.socket, n: int, timeout: float = 10.0) -> list[tuple[int, dict[str, str]]]:
    """``n`` answers (status, headers) read from ``sock``; every answer has an empty body."""
    sock.settimeout(timeout)
    data = b""
    answers: list[tuple[int, dict[str, str]]] = []
    while len(answers) < n:
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            if not more:
                raise ConnectionError(f"closed after {len(answers)} answers")
            data += more
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        assert headers["content-length"] == "0"
        answers.append((int(status_line.split()[1]), headers))
    return answers


def ask(port: int, request: bytes) -> tuple[int, dict[str, str]]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        return read_answers(sock, 1)[0]


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def metric(metrics_port: int, line_start: str) -> float:
    text = send(metrics_port, "/metrics").body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


@pytest.fixture(scope="module")
def port(router: tuple[Process, int, int, int]) -> int:
    return router[3]


def test_a_check_gets_the_key_of_the_body_and_tenant(port: int) -> None:
    status, headers = ask(port, check(headers={"x-prefix-aware-id": "acme", "x-other": "ignored"}))
    assert status == 200
    assert headers[KEY] == decide(BODY, {"x-prefix-aware-id": "acme"}, RouteSettings()).key
    assert headers[KEY] != decide(BODY, {}, RouteSettings()).key  # the tenant counted
    assert headers[MODEL] == json.loads(BODY)["model"]
    assert REMOVE_HEADER not in headers  # setting a header replaces a client's; removing it would undo that


def test_no_body_removes_the_key_and_model_headers(port: int) -> None:
    status, headers = ask(port, check(body=b"", path="/check/v1/models"))
    assert status == 200 and KEY not in headers and MODEL not in headers
    assert headers[REMOVE_HEADER] == f"{KEY},{MODEL}"


def test_settings_come_from_the_route_headers_which_envoy_is_asked_to_drop(port: int) -> None:
    sent = {"x-prefix-router-prefix-length": "64", "x-prefix-router-normalize": "raw"}
    _, headers = ask(port, check(headers=sent))
    assert headers[KEY] == decide(BODY, {}, RouteSettings(prefix_length=64, normalize="raw")).key
    assert headers[KEY] != decide(BODY, {}, RouteSettings()).key
    assert sorted(headers[REMOVE_HEADER].split(",")) == sorted(sent)


def test_a_bad_route_value_is_ignored_logged_once_and_counted(router: tuple[Process, int, int, int]) -> None:
    before = metric(router[2], "prefix_router_metadata_errors_total")
    sent = {"x-prefix-router-prefix-length": "banana", "x-prefix-router-normalize": "canonical"}
    for i in range(4):  # in either order (Envoy 1.36 and 1.38 vary it): one set of settings, one log line
        _, headers = ask(router[3], check(headers=dict(reversed(sent.items())) if i % 2 else sent))
        assert headers[KEY] == decide(BODY, {}, RouteSettings(normalize="canonical")).key  # the good one applies
        assert sorted(headers[REMOVE_HEADER].split(",")) == sorted(sent)
    assert metric(router[2], "prefix_router_metadata_errors_total") - before == 1


def test_a_cut_body_is_keyed_as_the_start_of_a_body(port: int) -> None:
    start = BODY[:100]
    _, headers = ask(port, check(start, {authz.PARTIAL_BODY_HEADER: "true"}))
    partial = decide(start, {}, RouteSettings(), complete=False)
    assert partial.fallback == "truncated" and headers[KEY] == partial.key


def test_a_body_cut_on_the_limit_is_known_cut_by_the_declared_length(port: int) -> None:
    """Envoy says partial "false" when its buffer holds exactly max_request_bytes; the check's own
    content-length is what it sent, so the client's length comes as x-prefix-declared-length."""
    whole = BODY + b" " * 200
    start = whole[: len(BODY) + 10]
    sent = {authz.PARTIAL_BODY_HEADER: "false", authz.DECLARED_LENGTH_HEADER: str(len(whole))}
    as_start = decide(start, {}, RouteSettings(), complete=False)
    assert as_start.key != decide(start, {}, RouteSettings()).key
    assert ask(port, check(start, sent))[1][KEY] == as_start.key
    assert ask(port, check(whole, sent))[1][KEY] == decide(whole, {}, RouteSettings()).key


def test_a_compressed_body_is_keyed_as_raw_bytes(port: int) -> None:
    body = b"\x1f\x8b\x08\x00 not really gzip"
    _, headers = ask(port, check(body, {"content-encoding": "gzip"}))
    decision = decide(body, {"content-encoding": "gzip"}, RouteSettings())
    assert decision.normalize == "raw" and headers[KEY] == decision.key


def test_keep_alive_and_pipelining_answer_in_order(port: int) -> None:
    bodies = [json.dumps({"messages": [{"role": "user", "content": f"prompt {i} " * 30}]}).encode() for i in range(5)]
    want = [decide(b, {}, RouteSettings()).key for b in bodies]
    assert len(set(want)) == 5
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"".join(check(b) for b in bodies))  # all at once: pipelined
        assert [h[KEY] for _, h in read_answers(sock, 5)] == want
        for b, key in zip(bodies, want):  # then one by one on the same connection: kept alive
            sock.sendall(check(b))
            assert read_answers(sock, 1)[0][1][KEY] == key
        sock.sendall(check(bodies[0])[:40])  # a request split across writes
        sock.sendall(check(bodies[0])[40:])
        assert read_answers(sock, 1)[0][1][KEY] == want[0]


def test_a_chunked_body_is_read_whole(port: int) -> None:
    head = b"POST /check/x HTTP/1.1\r\nhost: llm\r\ntransfer-encoding: chunked\r\n\r\n"
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (BODY[:50], BODY[50:])) + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + chunks)
        assert read_answers(sock, 1)[0][1][KEY] == decide(BODY, {}, RouteSettings()).key


def test_connection_close_is_honoured(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(check(extra=b"connection: close\r\n"))
        status, headers = read_answers(sock, 1)[0]
        assert status == 200 and headers["connection"] == "close" and headers[KEY]
        assert closed_by_peer(sock)


@pytest.mark.parametrize("junk", [b"GARBAGE\r\n\r\n", b"POST / HTTP/1.1\r\ncontent-length: nope\r\n\r\n",
                                  b"\x00\x01\x02\x03" * 20, b"GET / HTTP/1.1\r\nbad header line\r\n\r\n"])
def test_a_malformed_request_gets_400_and_a_counter_and_the_server_goes_on(
        router: tuple[Process, int, int, int], junk: bytes) -> None:
    before = metric(router[2], "prefix_router_http_malformed_total")
    with socket.create_connection(("127.0.0.1", router[3]), timeout=10) as sock:
        sock.sendall(check() + junk)  # a good request, then junk on the same connection
        answers = read_answers(sock, 2)
        assert answers[0][0] == 200 and answers[0][1][KEY]
        assert answers[1][0] == 400 and answers[1][1]["connection"] == "close"
        assert closed_by_peer(sock)
    assert metric(router[2], "prefix_router_http_malformed_total") - before == 1
    assert ask(router[3], check())[1][KEY]  # and the next client is served


def test_a_half_sent_request_stalls_nobody(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        slow.sendall(check()[:-20])  # headers and most of the body, then nothing
        t0 = time.monotonic()
        for _ in range(20):
            assert ask(port, check())[0] == 200
        assert time.monotonic() - t0 < 5
        slow.sendall(check()[-20:])  # the rest comes: it is answered too
        assert read_answers(slow, 1)[0][1][KEY] == decide(BODY, {}, RouteSettings()).key


def test_health_answers_on_its_path_and_is_not_a_check(router: tuple[Process, int, int, int]) -> None:
    before = metric(router[2], "prefix_router_decisions_total")
    status, headers = ask(router[3], b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status == 200 and KEY not in headers and REMOVE_HEADER not in headers
    assert metric(router[2], "prefix_router_decisions_total") == before


# --- in-process: the parts a running router cannot show ------------------------------------------

def test_an_exception_answers_200_removing_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    service = RouterService(RouteSettings())

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(service, "settings_for", broken)
    before = metrics.ERRORS.labels("authz_http")._value.get()
    assert HttpAuthz(service).answer({}, BODY) == f"{REMOVE_HEADER}: {KEY},{MODEL}\r\n".encode()
    assert metrics.ERRORS.labels("authz_http")._value.get() == before + 1


async def _answers(port: int, request: bytes) -> bytes:
    """Everything the server sends back on one connection until it closes it (or 10 s pass)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def in_process(body, serving: dict[str, bool] | None = None) -> None:  # type: ignore[no-untyped-def]
    """Run ``body(server)`` against start_http_authz in this process, on a fresh event loop."""
    async def main() -> None:
        server = await serve.start_http_authz(RouterService(RouteSettings()), ServerSettings(http_authz_port=0),
                                              serving if serving is not None else {"ok": True})
        try:
            await body(server)
        finally:
            await server.stop()

    asyncio.run(main())


def test_health_says_503_once_draining() -> None:
    serving = {"ok": True}

    async def body(server: http1.Http1Server) -> None:
        port = server.port
        health = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        assert (await _answers(port, health)).startswith(b"HTTP/1.1 200 OK\r\n")
        serving["ok"] = False
        assert (await _answers(port, health)).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert KEY.encode() + b": " in await _answers(port, check(extra=b"connection: close\r\n"))  # checks go on

    in_process(body, serving)


def test_a_body_above_the_servers_limit_is_keyed_by_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "MAX_BODY", 120)
    want = decide(BODY[:120], {}, RouteSettings(), complete=False).key

    async def body(server: http1.Http1Server) -> None:
        answer = await _answers(server.port, check(extra=b"connection: close\r\n"))
        assert f"{KEY}: {want}\r\n".encode() in answer

    in_process(body)


def test_a_request_left_half_sent_loses_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "REQUEST_TIMEOUT_S", 0.2)
    monkeypatch.setattr(http1, "SWEEP_S", 0.05)

    async def body(server: http1.Http1Server) -> None:
        port = server.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(check()[:-10])
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, unanswered
        writer.close()
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)  # between requests: kept
        idle_writer.write(check())
        assert b"200 OK" in await asyncio.wait_for(idle_reader.readuntil(b"\r\n\r\n"), 10)
        swept = server.sweeps
        await until(lambda: server.sweeps >= swept + 3, "three sweeps over an idle kept-alive connection")
        idle_writer.write(check())
        assert b"200 OK" in await asyncio.wait_for(idle_reader.readuntil(b"\r\n\r\n"), 10)
        idle_writer.close()

    in_process(body)


def test_answers_awaited_by_the_handler_go_out_in_arrival_order() -> None:
    """A check whose pick awaits tokenising off the loop answers later; pipelined answers behind it
    wait for it, a handler's awaitable that fails still answers 200, and a lone one answers alone."""
    release = asyncio.Event()

    async def later(tag: bytes) -> http1.Answer:
        await release.wait()
        return 200, b"x-tag: " + tag + b"\r\n"

    async def broken() -> http1.Answer:
        raise RuntimeError("a bug")

    def handle(request: http1.Request) -> http1.Answer | asyncio.Future[http1.Answer]:
        tag = request.path.rsplit("/", 1)[1].encode()
        if tag == b"slow":
            return asyncio.ensure_future(later(tag))
        if tag == b"broken":
            return asyncio.ensure_future(broken())
        return 200, b"x-tag: " + tag + b"\r\n"

    async def main() -> None:
        server = http1.Http1Server(handle)
        port = await server.start("127.0.0.1", 0)
        errors = metrics.ERRORS.labels("http")._value.get()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(check(path="/check/slow") + check(path="/check/quick") + check(path="/check/broken"))
            with pytest.raises(asyncio.TimeoutError):  # nothing overtakes the awaited answer
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.3)
            release.set()
            heads = [await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) for _ in range(3)]
            assert [h.split(b"\r\n")[0] for h in heads] == [b"HTTP/1.1 200 OK"] * 3
            assert b"x-tag: slow" in heads[0] and b"x-tag: quick" in heads[1] and b"x-tag" not in heads[2]
            assert metrics.ERRORS.labels("http")._value.get() == errors + 1
            writer.write(check(path="/check/quick"))  # and the connection goes on, answering at once
            assert b"x-tag: quick" in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.close()
        finally:
            await server.stop()

    asyncio.run(main())
