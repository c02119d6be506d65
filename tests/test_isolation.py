"""Tenant KV isolation: the injected cache_salt (pure core) and its body edit through real Envoy."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.decide import decide
from extproc.core.isolation import salted_body, tenant_salt
from extproc.core.settings import RouteSettings
from routerlab.harness import envoy_config
from routerlab.harness.procs import Process, python_module

from backends import BackendFleet
from conftest import EnvoyFactory
from support import send, start_router

SECRET = b"0123456789abcdef-test-secret"
ISOLATED = RouteSettings(tenant_isolation=True)
TENANT = "x-prefix-aware-id"
SYSTEM = "You are the ACME support assistant. " * 200


def chat(text: str = SYSTEM, **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "system", "content": text},
                                                  {"role": "user", "content": "q"}], **extra}).encode()


def test_salt_follows_vllms_rules_and_separates_tenants_secrets_and_client_salts() -> None:
    salts = {tenant_salt(SECRET, t, c) for t in (None, "a", "b") for c in (None, "x")}
    salts.add(tenant_salt(b"another secret, 16+ bytes", "a", None))
    assert len(salts) == 7
    for s in salts:
        assert 0 < len(s) <= 128 and not set(s) & set("@/\\\x00")
    assert tenant_salt(SECRET, "a", None) == tenant_salt(SECRET, "a", None)


def test_salt_goes_last_so_it_beats_a_clients_and_every_other_byte_stays() -> None:
    body = b'{"model": "m", "cache_salt": "mine", "prompt": "hi"}  \n'
    out = salted_body(body, json.loads(body), "S", complete=True)
    assert out == b'{"model": "m", "cache_salt": "mine", "prompt": "hi","cache_salt":"S"}  \n'
    assert json.loads(out)["cache_salt"] == "S"  # the last duplicate wins, as in vLLM's parser
    assert salted_body(b"{ }", {}, "S", complete=True) == b'{ "cache_salt":"S"}'
    assert salted_body(b'  {"prompt": "x', None, "S", complete=False) == b'  {"cache_salt":"S","prompt": "x'
    assert salted_body(b"[1]", None, "S", complete=True) is None


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(doc=st.dictionaries(st.text(max_size=8), JSON, max_size=5), indent=st.sampled_from([None, 2]))
def test_any_object_gains_exactly_the_salt(doc: dict, indent: int | None) -> None:
    body = json.dumps(doc, indent=indent).encode()
    d = decide(body, {TENANT: "acme"}, ISOLATED, secret=SECRET)
    assert d.isolation == "salted" and d.body is not None
    assert json.loads(d.body) == {**doc, "cache_salt": tenant_salt(SECRET, "acme", doc.get("cache_salt")
                                                                   if isinstance(doc.get("cache_salt"), str) else None)}


def test_identical_text_keys_and_normalises_apart_per_tenant_and_body_tenant_is_not_trusted() -> None:
    a = decide(chat(), {TENANT: "a"}, ISOLATED, secret=SECRET)
    b = decide(chat(), {TENANT: "b"}, ISOLATED, secret=SECRET)
    assert a.normalized != b.normalized  # pick mode's index never sees them as one prefix
    assert tenant_salt(SECRET, "a", None).encode() in a.normalized
    claimed = decide(chat(prompt_cache_key="a"), {}, ISOLATED, secret=SECRET)
    assert claimed.tenant == "a" and b'"cache_salt":"' + tenant_salt(SECRET, None, None).encode() in claimed.body
    no_prompt = decide(b'{"model": "m", "x": 1}', {TENANT: "a"}, ISOLATED, secret=SECRET)
    assert (no_prompt.normalize, no_prompt.fallback, no_prompt.isolation) == ("canonical", "no_prompt_fields", "salted")
    off = decide(chat(), {TENANT: "a"}, RouteSettings(), secret=SECRET)
    assert off.body is None and off.isolation is None
    assert decide(chat(), {TENANT: "a"}, ISOLATED).body is None  # no secret, no edit


@pytest.mark.parametrize("body,headers,outcome", [
    (b"not json", {}, "not_object"), (b"[1,2]", {}, "not_object"),
    (b"\x1f\x8b\x08compressed", {"content-encoding": "gzip"}, "content_encoded"),
])
def test_bodies_that_cannot_be_salted_pass_unchanged(body: bytes, headers: dict, outcome: str) -> None:
    d = decide(body, headers, ISOLATED, secret=SECRET)
    assert d.isolation == outcome and d.body is None and d.key is not None


@pytest.mark.parametrize("flags,env,needle", [
    (["--tenant-isolation", "on"], {}, "--tenant-isolation on needs a secret"),
    (["--tenant-isolation", "maybe"], {}, "--tenant-isolation"),
    (["--tenant-secret-file", "/nonexistent/secret"], {}, "--tenant-secret-file"),
    ([], {"PREFIX_ROUTER_TENANT_SECRET": "short"}, "PREFIX_ROUTER_TENANT_SECRET"),
])
def test_bad_isolation_settings_exit_2_naming_the_setting(flags: list[str], env: dict, needle: str) -> None:
    proc = Process(python_module("extproc", "serve", "--port", "0", "--metrics-port", "0", *flags),
                   name="serve", env=env)
    assert proc.proc.wait(30) == 2
    proc.stop()
    assert needle in proc.output()


def _isolated_router(tmp_path, *flags: str):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    return start_router("--tenant-secret-file", str(secret), *flags)


def test_envoy_delivers_the_salted_body_with_a_matching_length(
        backends: BackendFleet, make_envoy: EnvoyFactory, tmp_path) -> None:
    proc, grpc_port, metrics_port = _isolated_router(tmp_path, "--tenant-isolation", "on")
    try:
        _, port = make_envoy(backends, extproc_port=grpc_port)
        sent = {"a": chat(cache_salt="client"), "b": chat()}
        for tenant, body in sent.items():
            assert send(port, body=body, headers={TENANT: tenant}).status == 200
        got = [seen for b in backends.backends for seen in b.seen_bodies]
        assert len(got) == 2
        salts = {}
        for body, length in got:
            doc = json.loads(body)
            assert length in (None, str(len(body)))  # Envoy re-frames a mutated body (chunked)
            salts[doc["messages"][0]["content"] == SYSTEM and doc.get("cache_salt")] = doc
        assert {tenant_salt(SECRET, "a", "client"), tenant_salt(SECRET, "b", None)} == set(salts)
        metrics = send(metrics_port, "/metrics").body.decode()
        assert 'prefix_router_tenant_isolation_total{outcome="salted"} 2.0' in metrics
    finally:
        proc.stop()


def test_envoy_salts_the_start_of_a_body_over_the_buffer_limit(
        backends: BackendFleet, make_envoy: EnvoyFactory, tmp_path) -> None:
    def small_buffer(cfg: envoy_config.Config) -> None:
        cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] = 1 << 16

    proc, grpc_port, _ = _isolated_router(tmp_path, "--tenant-isolation", "on")
    try:
        _, port = make_envoy(backends, extproc_port=grpc_port, edit=small_buffer)
        big = chat(SYSTEM * 40)
        assert len(big) > 1 << 18
        assert send(port, body=big, headers={TENANT: "a"}).status == 200
        [(body, length)] = [seen for b in backends.backends for seen in b.seen_bodies]
        assert json.loads(body)["cache_salt"] == tenant_salt(SECRET, "a", None)
        assert len(body) == len(big) + len(b'"cache_salt":"",') + 43 and length in (None, str(len(body)))
    finally:
        proc.stop()


def test_isolation_per_route_without_a_secret_is_logged_and_ignored(
        backends: BackendFleet, make_envoy: EnvoyFactory) -> None:
    proc, grpc_port, metrics_port = start_router()
    try:
        _, port = make_envoy(backends, extproc_port=grpc_port, edit=lambda c: envoy_config.set_stream_metadata(
            c, {"x-prefix-router-tenant-isolation": "on"}))
        assert send(port, body=chat(), headers={TENANT: "a"}).status == 200
        [(body, _)] = [seen for b in backends.backends for seen in b.seen_bodies]
        assert body == chat()
        assert "prefix_router_metadata_errors_total 1.0" in send(metrics_port, "/metrics").body.decode()
    finally:
        proc.stop()
    assert "no tenant secret" in proc.output()
