"""The HTTP ext_authz path's per-request shortcuts give the answers the plain path gives.

The adapter keeps what a set of x-prefix-router-* headers resolves to (settings, answer bytes),
the server hands it headers as the bytes sent, the decision histograms count without a lock and
the GC pause around decide() is inlined. Each is checked against the straightforward version.
"""

from __future__ import annotations

import gc
import json
import re

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from extproc import metrics
from extproc.adapters import authz
from extproc.adapters import service as service_module
from extproc.adapters.ext_authz_http import REMOVE_HEADER, HttpAuthz
from extproc.adapters.service import NO_LIMITS, RouterService
from extproc.core.decide import decide
from extproc.core.settings import RouteSettings
from extproc.process.http1 import header_dict

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}).encode()


def plain_answer(service: RouterService, headers: dict[str, str], body: bytes, cut: bool) -> bytes:
    """The answer as the adapter computed it before the shortcuts: resolve, decide, format, per request."""
    ours = sorted((k, v) for k, v in headers.items() if k.startswith("x-prefix-router-"))
    settings = service.settings_for(ours, authz.LIMITS)
    decision = authz.authz_decision(service, settings, headers, body, authz.DECLARED_LENGTH_HEADER, cut)
    key = decision.key if decision else None
    model = decision.model if decision and settings.model_header else None
    remove = ([name for name, _ in ours] + ([settings.key_header] if key is None else [])
              + ([settings.model_header] if settings.model_header and model is None else []))
    lines = f"{settings.key_header}: {key}\r\n" if key is not None else ""
    lines += f"{settings.model_header}: {model}\r\n" if model is not None else ""
    if remove:
        lines += f"{REMOVE_HEADER}: {','.join(remove)}\r\n"
    return lines.encode("latin-1")


SETTING = st.sampled_from([
    ("x-prefix-router-prefix-length", "64"), ("x-prefix-router-prefix-length", "banana"),
    ("x-prefix-router-normalize", "raw"), ("x-prefix-router-normalize", "canonical"),
    ("x-prefix-router-key-header", "x-other-key"), ("x-prefix-router-mode", "pick"),
    ("x-prefix-router-tenant-isolation", "on"), ("x-prefix-router-unknown", "1"),
    ("x-prefix-router-model-header", ""), ("x-prefix-router-model-header", "x-model")])
OTHER = st.sampled_from([
    ("x-prefix-aware-id", "acme"), ("x-prefix-aware-id", " "), ("content-encoding", "gzip"),
    (authz.PARTIAL_BODY_HEADER, "true"), (authz.PARTIAL_BODY_HEADER, "false"),
    (authz.DECLARED_LENGTH_HEADER, str(len(BODY) + 5)), (authz.DECLARED_LENGTH_HEADER, "x"),
    ("host", "llm")])


@hsettings(max_examples=300, deadline=None)
@given(ours=st.lists(SETTING, max_size=3, unique_by=lambda kv: kv[0]),
       others=st.lists(OTHER, max_size=4, unique_by=lambda kv: kv[0]),
       body=st.sampled_from([BODY, BODY[:60], b"", b"\x1f\x8bnot json"]), cut=st.booleans(), order=st.randoms())
def test_the_answer_is_the_plain_paths_for_any_headers(ours, others, body, cut, order) -> None:  # type: ignore[no-untyped-def]
    service = RouterService(RouteSettings())
    fast = HttpAuthz(service)
    items = [*ours, *others]
    for _ in range(3):  # a cached route answers as the first time, in whatever order the headers come
        order.shuffle(items)
        sent = {k.encode(): v.encode() for k, v in items}
        assert fast.answer(sent, body, cut) == plain_answer(service, dict(items), body, cut)


def test_a_route_is_resolved_once_per_set_and_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    service = RouterService(RouteSettings())
    asked: list[object] = []
    real = service.settings_for
    monkeypatch.setattr(service, "settings_for",
                        lambda pairs, limits=NO_LIMITS: asked.append(pairs) or real(pairs, limits))
    fast = HttpAuthz(service)
    sent = {b"x-prefix-router-prefix-length": b"64", b"x-prefix-router-normalize": b"raw"}
    want = decide(BODY, {}, RouteSettings(prefix_length=64, normalize="raw")).key
    for _ in range(5):
        assert f"x-prefix-key: {want}\r\n".encode() in fast.answer(sent, BODY)
    assert len(asked) == 1
    monkeypatch.setattr("extproc.adapters.ext_authz_http._MAX_ROUTES", 4)
    for n in range(10):
        fast.answer({b"x-prefix-router-prefix-length": str(64 + n).encode()}, BODY)
        assert len(fast._routes) <= 4


def test_headers_are_lower_cased_and_repeats_joined_in_order() -> None:
    pairs = [(b"X-Prefix-Aware-ID", b"a"), (b"host", b"h"), (b"x-prefix-aware-id", b"b"), (b"Content-Length", b"3")]
    assert header_dict(pairs) == {b"x-prefix-aware-id": b"a,b", b"host": b"h", b"content-length": b"3"}
    assert header_dict(pairs[1:2]) == {b"host": b"h"}
    assert header_dict([]) == {}


@given(st.lists(st.one_of(st.floats(min_value=0, max_value=1.0), st.sampled_from([1e-5, 2.5e-5, 0.1, 0.0])),
                max_size=50))
def test_the_loop_histogram_exposes_what_prometheus_clients_histogram_does(values: list[float]) -> None:
    buckets = (1e-5, 2.5e-5, 5e-5, 1e-4, 0.1)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("h_seconds", "doc", buckets=buckets, registry=theirs)
    loop = metrics.LoopHistogram("h_seconds", "doc", buckets, ours)
    for v in values:
        reference.observe(v)
        loop.observe(v)
    created = re.compile(r"(h_seconds_created) \S+")
    assert created.sub(r"\1 T", generate_latest(ours).decode()) == \
        created.sub(r"\1 T", generate_latest(theirs).decode())


@pytest.mark.parametrize("gc_on", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_decide_runs_without_the_gc_and_restores_it(monkeypatch: pytest.MonkeyPatch, gc_on: bool, fails: bool) -> None:
    service = RouterService(RouteSettings())
    seen: list[bool] = []

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(gc.isenabled())
        if fails:
            raise RuntimeError("injected")
        return decide(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(service_module, "decide", spy)
    was = gc.isenabled()
    (gc.enable if gc_on else gc.disable)()
    try:
        decision = service.decide(BODY, {}, RouteSettings(), complete=True)
        assert gc.isenabled() is gc_on
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False] and (decision is None) is fails
