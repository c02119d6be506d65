"""deploy/istio-fast and deploy/envoy-gateway-fast say what envoy/envoy-fast.yaml says, where the mesh can.

tests/test_manifests.py renders and schema-validates every kustomization (these included); here,
as it does for the ext_proc shape, each mesh's generation of Envoy config is simulated from the
mesh's own source, our patches are applied, and the result is held against envoy-fast.yaml and
fed to `envoy --mode validate`:
- Istio 1.29 builds the ext_authz filter from a mesh-config extension provider (envoyExtAuthzHttp:
  pilot/pkg/security/authz/builder/extauthz.go, generateHTTPConfig) wherever an
  AuthorizationPolicy with action CUSTOM names it. The mesh config is no Kubernetes resource, so
  no CRD schema covers it: its provider is checked against the fields of Istio's MeshConfig
  (mesh/v1alpha1/config.proto of istio/api 1.29.6, transcribed below).
- Envoy Gateway 1.7 builds it from a SecurityPolicy's extAuth (internal/gatewayapi/securitypolicy.go,
  internal/xds/translator/extauth.go): a filter disabled in the chain, enabled on the route.
What a mesh cannot say is asserted too (it is what docs/deployment.md tells users).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.core import settings
from routerlab.harness import envoy_config, envoy_proc

from test_manifests import (
    DEPLOY,
    ROUTER_FILTER,
    Doc,
    _edit,
    apply_envoy_filter,
    apply_envoy_patch_policy,
    bare_gateway,
    envoy_accepts,
    label,
    one,
    quantity,
    render,
    render_dir,
    router_service,
    router_settings,
    schema_errors,
    seconds,
)

EXT_AUTHZ_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz"
HEADER_MUTATION = "envoy.filters.http.header_mutation"
RBAC = "envoy.filters.http.rbac"
MESH_CONFIG = DEPLOY / "istio-fast" / "mesh-config.yaml"


def reference() -> envoy_config.Config:
    return envoy_config.load("envoy-fast.yaml")


def ref_ext_authz() -> dict[str, Any]:
    return envoy_config.http_filter(reference(), envoy_config.EXT_AUTHZ)


def patterns(matcher: dict[str, Any] | None) -> set[tuple[str, str]]:
    """A ListStringMatcher as (kind, value) pairs; ignore_case aside (header names are lower-case in Envoy)."""
    out = set()
    for p in (matcher or {}).get("patterns", []):
        kinds = [k for k in ("exact", "prefix", "suffix") if k in p]
        assert len(kinds) == 1, p
        out.add((kinds[0], p[kinds[0]]))
    return out


def ref_headers_to_router() -> list[dict[str, str]]:
    """What envoy-fast.yaml adds to every check request: its own headers_to_add (the declared
    length) and the x-prefix-router-* settings its prefix_router.settings filter sets."""
    added = ref_ext_authz()["http_service"]["authorization_request"]["headers_to_add"]
    return [*added, *({"key": k, "value": v} for k, v in envoy_config.stream_metadata(reference()).items())]


def assert_router_env_says(docs: tuple[Doc, ...], headers: dict[str, str]) -> None:
    """The router's environment holds the same settings the mesh sends it as x-prefix-router-* headers
    (the default for any header a request lacks)."""
    _, route = router_settings(docs)
    assert headers, "no settings sent"
    for key, raw in headers.items():
        name = key.removeprefix(settings.METADATA_PREFIX).replace("-", "_")
        assert settings.metadata_key(name) == key
        assert settings.parse_value(name, raw, key) == getattr(route, name), key


def assert_router_http_port(docs: tuple[Doc, ...], host: str, port: int) -> None:
    server, _ = router_settings(docs)
    svc = one(docs, "Service", "prefix-router")
    [http] = [p for p in svc["spec"]["ports"] if p["name"] == "http-authz"]
    assert (http["port"], http["targetPort"], http["appProtocol"]) == (port, "http-authz", "http")
    assert server.http_authz_port == port and host == router_service(docs)[0].split(".svc")[0] + ".svc.cluster.local"


# ---------------------------------------------------------------------------- Istio

# EnvoyExternalAuthorizationHttpProvider and EnvoyExternalAuthorizationRequestBody in istio/api
# 1.29.6 mesh/v1alpha1/config.proto (JSON names), with the JSON type each takes.
ISTIO_HTTP_PROVIDER: dict[str, type | dict[str, type]] = {
    "service": str, "port": int, "timeout": str, "pathPrefix": str, "failOpen": bool, "clearRouteCache": bool,
    "statusOnError": str, "includeHeadersInCheck": list, "includeRequestHeadersInCheck": list,
    "includeAdditionalHeadersInCheck": dict,
    "includeRequestBodyInCheck": {"maxRequestBytes": int, "allowPartialMessage": bool, "packAsBytes": bool},
    "headersToUpstreamOnAllow": list, "headersToDownstreamOnDeny": list, "headersToDownstreamOnAllow": list,
}


def istio_field_errors(value: dict[str, Any], fields: dict[str, Any] = ISTIO_HTTP_PROVIDER, at: str = "") -> list[str]:
    errors = []
    for key, got in value.items():
        want = fields.get(key)
        if want is None:
            errors.append(f"{at}{key}: no such field in Istio's MeshConfig")
        elif isinstance(want, dict):
            errors += (istio_field_errors(got, want, f"{at}{key}.") if isinstance(got, dict)
                       else [f"{at}{key}: not an object"])
        elif not isinstance(got, want) or (want is int and isinstance(got, bool)):
            errors.append(f"{at}{key}: {type(got).__name__}, not {want.__name__}")
        elif want is list and not all(isinstance(v, str) for v in got):
            errors.append(f"{at}{key}: not a list of strings")
        elif want is dict and not all(isinstance(v, str) for v in got.values()):
            errors.append(f"{at}{key}: not a map of strings")
    return errors


def mesh_provider(path: Path = MESH_CONFIG) -> dict[str, Any]:
    mesh = yaml.safe_load(path.read_text())
    [provider] = mesh["meshConfig"]["extensionProviders"]
    assert set(provider) == {"name", "envoyExtAuthzHttp"}, provider
    return provider


def istio_matchers(names: list[str] | None) -> dict[str, Any] | None:
    """generateHeaders: "*x" a suffix, "x*" a prefix, else exact; always ignore_case."""
    if not names:
        return None
    out = []
    for name in names:
        kind, value = ("suffix", name[1:]) if name.startswith("*") else (
            ("prefix", name[:-1]) if name.endswith("*") else ("exact", name))
        out.append({kind: value, "ignore_case": True})
    return {"patterns": out}


def istio_ext_authz(provider: dict[str, Any], host: str, cluster: str) -> dict[str, Any]:
    """generateHTTPConfig (Istio 1.29.6) for an envoyExtAuthzHttp provider, as Envoy YAML."""
    p = provider["envoyExtAuthzHttp"]
    service: dict[str, Any] = {"path_prefix": p.get("pathPrefix", ""),
                               "server_uri": {"uri": f"http://{host}", "cluster": cluster,
                                              "timeout": p.get("timeout", "600s")}}
    added = p.get("includeAdditionalHeadersInCheck", {})
    if added:
        service["authorization_request"] = {"headers_to_add": [{"key": k, "value": added[k]} for k in sorted(added)]}
    response = {"allowed_upstream_headers": istio_matchers(p.get("headersToUpstreamOnAllow")),
                "allowed_client_headers": istio_matchers(p.get("headersToDownstreamOnDeny")),
                "allowed_client_headers_on_success": istio_matchers(p.get("headersToDownstreamOnAllow"))}
    if any(response.values()):
        service["authorization_response"] = {k: v for k, v in response.items() if v}
    out: dict[str, Any] = {
        "@type": EXT_AUTHZ_TYPE, "failure_mode_allow": p.get("failOpen", False), "transport_api_version": "V3",
        "http_service": service,
        "filter_enabled_metadata": {"filter": RBAC, "path": [{"key": "istio_ext_authz_shadow_effective_policy_id"}],
                                    "value": {"string_match": {"prefix": "istio-ext-authz"}}},
    }
    body = p.get("includeRequestBodyInCheck")
    if body is not None:
        out["with_request_body"] = {"max_request_bytes": body.get("maxRequestBytes", 0),
                                    "allow_partial_message": body.get("allowPartialMessage", False),
                                    "pack_as_bytes": body.get("packAsBytes", False)}
    allowed = istio_matchers(p.get("includeRequestHeadersInCheck"))
    if allowed:
        out["allowed_headers"] = allowed
    return out


def istio_fast_gateway(docs: tuple[Doc, ...], provider: dict[str, Any]) -> envoy_config.Config:
    """The ingress gateway's config: Istio's RBAC shadow filter and ext_authz for the CUSTOM policy
    (before the router), then our EnvoyFilter."""
    p = provider["envoyExtAuthzHttp"]
    cluster = f"outbound|{p['port']}||{p['service']}"  # Istio's name for an outbound service cluster
    cfg = bare_gateway(reference(), cluster)
    filters = envoy_config.http_manager(cfg)["http_filters"]
    policy = one(docs, "AuthorizationPolicy")
    rbac = {"@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
            "shadow_rules": {"policies": {
                f"istio-ext-authz-ns[{policy['metadata']['namespace']}]-policy[{policy['metadata']['name']}]-rule[0]":
                    {"permissions": [{"any": True}], "principals": [{"any": True}]}}},
            "shadow_rules_stat_prefix": "istio_ext_authz_"}
    at = [f["name"] for f in filters].index(ROUTER_FILTER)
    filters[at:at] = [{"name": RBAC, "typed_config": rbac},
                      {"name": envoy_config.EXT_AUTHZ,
                       "typed_config": istio_ext_authz(provider, p["service"], cluster)}]
    apply_envoy_filter(cfg, one(docs, "EnvoyFilter"), one(docs, "DestinationRule")["spec"]["host"])
    return cfg


def test_the_istio_provider_uses_only_istios_fields() -> None:
    provider = mesh_provider()
    assert istio_field_errors(provider["envoyExtAuthzHttp"]) == []
    broken = copy.deepcopy(provider["envoyExtAuthzHttp"])  # the check can fail: what Istio has no field for
    broken["includeRequestBodyInCheck"]["allowPartialMesage"] = True
    broken["port"] = "50052"
    broken["perRouteHeaders"] = {}
    assert sorted(istio_field_errors(broken)) == [
        "includeRequestBodyInCheck.allowPartialMesage: no such field in Istio's MeshConfig",
        "perRouteHeaders: no such field in Istio's MeshConfig", "port: str, not int"]


def test_istio_fast_gateway_is_envoy_fast(tmp_path: Path) -> None:
    docs = render("istio-fast")
    provider = mesh_provider()
    cfg = istio_fast_gateway(docs, provider)
    ref = reference()
    names = [f["name"] for f in envoy_config.http_manager(cfg)["http_filters"]]
    assert names == [HEADER_MUTATION, RBAC, envoy_config.EXT_AUTHZ, ROUTER_FILTER]  # the strip before Istio's ext_authz
    assert envoy_config.http_manager(cfg)["http_filters"][0] == envoy_config.http_manager(ref)["http_filters"][0]
    assert cfg["static_resources"]["listeners"][0] == ref["static_resources"]["listeners"][0] | {
        "filter_chains": cfg["static_resources"]["listeners"][0]["filter_chains"]}
    assert envoy_config.cluster(cfg, "vllm") == envoy_config.cluster(ref, "vllm")
    envoy_accepts(cfg, tmp_path)

    # the ext_authz Istio builds says what envoy-fast.yaml's says, the settings filter's headers included
    ours, theirs = envoy_config.http_filter(cfg, envoy_config.EXT_AUTHZ), ref_ext_authz()
    for key in ("failure_mode_allow", "transport_api_version", "with_request_body"):
        assert ours[key] == theirs[key], key
    service, ref_service = ours["http_service"], theirs["http_service"]
    assert service["path_prefix"] == ref_service["path_prefix"]
    assert seconds(service["server_uri"]["timeout"]) == seconds(ref_service["server_uri"]["timeout"])
    assert patterns(service["authorization_response"]["allowed_upstream_headers"]) == \
        patterns(ref_service["authorization_response"]["allowed_upstream_headers"])
    assert sorted(service["authorization_request"]["headers_to_add"], key=lambda h: h["key"]) == \
        sorted(ref_headers_to_router(), key=lambda h: h["key"])
    # what envoy-fast.yaml forwards, bar the client's x-prefix-router-* (here the provider adds the settings)
    assert patterns(ours["allowed_headers"]) == patterns(theirs["allowed_headers"]) - {
        ("prefix", settings.METADATA_PREFIX)}

    # the DestinationRule: the reference's hash and outlier ejection
    rule = one(docs, "DestinationRule")["spec"]["trafficPolicy"]
    assert envoy_config.routes(ref)[0]["route"]["hash_policy"] == [
        {"header": {"header_name": rule["loadBalancer"]["consistentHash"]["httpHeaderName"]}}]
    outlier = envoy_config.cluster(ref, "vllm")["outlier_detection"]
    assert rule["outlierDetection"]["consecutive5xxErrors"] == outlier["consecutive_5xx"]
    assert seconds(rule["outlierDetection"]["baseEjectionTime"]) == seconds(outlier["base_ejection_time"])


def test_istio_fast_policy_names_the_provider_of_the_routers_http_port() -> None:
    docs = render("istio-fast")
    provider = mesh_provider()
    p = provider["envoyExtAuthzHttp"]
    policy = one(docs, "AuthorizationPolicy")
    assert policy["spec"]["action"] == "CUSTOM" and policy["spec"]["provider"] == {"name": provider["name"]}
    assert policy["spec"]["rules"] == [{}]  # every request
    envoy_filter = one(docs, "EnvoyFilter")
    assert policy["metadata"]["namespace"] == envoy_filter["metadata"]["namespace"]
    assert policy["spec"]["selector"]["matchLabels"] == envoy_filter["spec"]["workloadSelector"]["labels"]
    assert_router_http_port(docs, p["service"], p["port"])
    settings_headers = {k: v for k, v in p["includeAdditionalHeadersInCheck"].items()
                        if k.startswith(settings.METADATA_PREFIX)}
    assert_router_env_says(docs, settings_headers)
    # the tenant headers the provider forwards are the ones the router reads
    _, route = router_settings(docs)
    assert set(route.tenant_headers) <= set(p["includeRequestHeadersInCheck"])


def test_envoy_rejects_a_broken_istio_fast_patch(tmp_path: Path) -> None:
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, root)
    _edit("istio-fast/istio-fast.yaml", "remove_on_match:", "remove_on_mach:")(root)
    docs = tuple(render_dir(root / "istio-fast"))
    assert schema_errors([(label("istio-fast", d), d) for d in docs if d["kind"] == "EnvoyFilter"]) == []
    ok, output = envoy_proc.validate(envoy_config.dump(istio_fast_gateway(docs, mesh_provider()), tmp_path / "b.yaml"))
    assert not ok and "remove_on_mach" in output, output


# ---------------------------------------------------------------------------- Envoy Gateway

EG_FILTER = f"{envoy_config.EXT_AUTHZ}/securitypolicy/default/prefix-router"


def eg_names(docs: tuple[Doc, ...]) -> tuple[str, str, str, str]:
    """(listener, vLLM cluster, ext_authz filter, router cluster) as Envoy Gateway names them
    (irListenerName, irRouteDestinationName, perRouteFilterName(irConfigName), irIndexedExtServiceDestinationName)."""
    policy = one(docs, "SecurityPolicy")
    [route] = {t["name"] for d in docs if d["kind"] in {"SecurityPolicy", "BackendTrafficPolicy"}
               for t in d["spec"]["targetRefs"]}
    [gateway] = {(d["metadata"]["namespace"], t["name"]) for d in docs if d["kind"] == "ClientTrafficPolicy"
                 for t in d["spec"]["targetRefs"]}
    ns, name = policy["metadata"]["namespace"], policy["metadata"]["name"]
    return (f"{gateway[0]}/{gateway[1]}/http", f"httproute/{gateway[0]}/{route}/rule/0",
            f"{envoy_config.EXT_AUTHZ}/securitypolicy/{ns}/{name}", f"securitypolicy/{ns}/{name}/extauth/0")


def eg_ext_authz(ext: dict[str, Any], cluster: str, namespace: str) -> dict[str, Any]:
    """extAuthConfig + httpService (Envoy Gateway 1.7.3) for a SecurityPolicy's extAuth.http."""
    http = ext["http"]
    [backend] = http["backendRefs"]
    path = http.get("path", "")
    out: dict[str, Any] = {"@type": EXT_AUTHZ_TYPE, "transport_api_version": "V3",
                           "failure_mode_allow": ext.get("failOpen", False)}
    if "bodyToExtAuth" in ext:
        out["with_request_body"] = {"max_request_bytes": ext["bodyToExtAuth"]["maxRequestBytes"]}
    if ext.get("headersToExtAuth"):
        out["allowed_headers"] = {"patterns": [{"exact": h, "ignore_case": True} for h in ext["headersToExtAuth"]]}
    service: dict[str, Any] = {"path_prefix": path, "server_uri": {
        "uri": f"http://{backend['name']}.{namespace}:{backend['port']}{path}", "cluster": cluster,
        "timeout": f"{seconds(ext.get('timeout', '10s'))}s"}}
    if http.get("headersToBackend"):
        service["authorization_response"] = {"allowed_upstream_headers": {
            "patterns": [{"exact": h, "ignore_case": True} for h in http["headersToBackend"]]}}
    out["http_service"] = service
    return out


def eg_fast_gateway(docs: tuple[Doc, ...]) -> envoy_config.Config:
    """Envoy Gateway's config for these policies (its ext_authz disabled in the chain and enabled on
    the route, its cluster for the router with the SecurityPolicy's health check), then our
    EnvoyPatchPolicy."""
    listener_name, vllm_name, filter_name, router_name = eg_names(docs)
    policy = one(docs, "SecurityPolicy")
    cfg = bare_gateway(reference(), router_name)
    listener = cfg["static_resources"]["listeners"][0]
    listener["name"] = listener_name
    hcm = envoy_config.http_manager(cfg)
    ext = policy["spec"]["extAuth"]
    at = [f["name"] for f in hcm["http_filters"]].index(ROUTER_FILTER)
    hcm["http_filters"].insert(at, {"name": filter_name, "disabled": True,
                                    "typed_config": eg_ext_authz(ext, router_name, policy["metadata"]["namespace"])})
    route = envoy_config.routes(cfg)[0]
    route["route"]["cluster"] = vllm_name
    route["typed_per_filter_config"] = {filter_name: {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute",
        "check_settings": {}}}
    active = ext["http"]["backendSettings"]["healthCheck"]["active"]
    router = envoy_config.cluster(cfg, router_name)
    router["health_checks"] = [{"timeout": active["timeout"], "interval": active["interval"],
                                "unhealthy_threshold": active["unhealthyThreshold"],
                                "healthy_threshold": active["healthyThreshold"],
                                "http_health_check": {"path": active["http"]["path"]}}]
    vllm = envoy_config.cluster(cfg, "vllm")
    vllm["name"] = vllm["load_assignment"]["cluster_name"] = vllm_name
    vllm.pop("lb_policy")
    table = one(docs, "BackendTrafficPolicy")["spec"]["loadBalancer"]["consistentHash"]["tableSize"]
    vllm["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.maglev",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.maglev.v3.Maglev",
                         "table_size": table}}}]}
    apply_envoy_patch_policy({("Listener", listener_name): listener, ("Cluster", vllm_name): vllm},
                             one(docs, "EnvoyPatchPolicy"))
    return cfg


def test_envoy_gateway_fast_is_envoy_fast(tmp_path: Path) -> None:
    docs = render("envoy-gateway-fast")
    ref = reference()
    cfg = eg_fast_gateway(docs)
    envoy_accepts(cfg, tmp_path)
    _, vllm_name, filter_name, router_name = eg_names(docs)
    [ours] = [f["typed_config"] for f in envoy_config.http_manager(cfg)["http_filters"] if f["name"] == filter_name]
    theirs = ref_ext_authz()
    assert ours["failure_mode_allow"] == theirs["failure_mode_allow"] is True
    # the body: the patch adds what bodyToExtAuth cannot say (pack_as_bytes is gRPC's only)
    assert ours["with_request_body"] == {k: v for k, v in theirs["with_request_body"].items() if k != "pack_as_bytes"}
    service, ref_service = ours["http_service"], theirs["http_service"]
    assert service["path_prefix"] == ref_service["path_prefix"]
    assert seconds(service["server_uri"]["timeout"]) == seconds(ref_service["server_uri"]["timeout"])
    assert patterns(service["authorization_response"]["allowed_upstream_headers"]) == \
        patterns(ref_service["authorization_response"]["allowed_upstream_headers"])
    assert service["authorization_request"] == ref_service["authorization_request"]  # the declared length
    assert patterns(ours["allowed_headers"]) == patterns(theirs["allowed_headers"]) - {
        ("prefix", settings.METADATA_PREFIX)}  # no per-route settings headers: the router's env instead
    # the router's health check, the vLLM cluster's bounded load
    [hc], [ref_hc] = envoy_config.cluster(cfg, router_name)["health_checks"], envoy_config.cluster(
        ref, "prefix_router")["health_checks"]
    assert hc["http_health_check"] == ref_hc["http_health_check"]
    for key in ("timeout", "interval"):
        assert seconds(hc[key]) == seconds(ref_hc[key]), key
    assert (hc["unhealthy_threshold"], hc["healthy_threshold"]) == (ref_hc["unhealthy_threshold"],
                                                                    ref_hc["healthy_threshold"])
    [policy_lb] = envoy_config.cluster(cfg, vllm_name)["load_balancing_policy"]["policies"]
    assert policy_lb["typed_extension_config"]["typed_config"]["consistent_hashing_lb_config"] == \
        envoy_config.cluster(ref, "vllm")["common_lb_config"]["consistent_hashing_lb_config"]
    # the listener buffer and the early strip of a client's key
    client = one(docs, "ClientTrafficPolicy")["spec"]
    assert quantity(client["connection"]["bufferLimit"]) == \
        ref["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == \
        ours["with_request_body"]["max_request_bytes"]
    assert "x-prefix-key" in client["headers"]["earlyRequestHeaders"]["remove"]


def test_envoy_gateway_fast_settings_come_from_the_routers_env() -> None:
    docs = render("envoy-gateway-fast")
    ext = one(docs, "SecurityPolicy")["spec"]["extAuth"]
    [backend] = ext["http"]["backendRefs"]
    assert_router_http_port(docs, f"{backend['name']}.default.svc.cluster.local", backend["port"])
    assert_router_env_says(docs, envoy_config.stream_metadata(reference()))
    _, route = router_settings(docs)
    assert set(route.tenant_headers) <= set(ext["headersToExtAuth"])


@pytest.mark.parametrize(("field", "value"), [("allowPartialMessage", True), ("headersToAdd", [])])
def test_envoy_gateway_cannot_say_it_without_the_patch(tmp_path: Path, field: str, value: Any) -> None:
    """What the EnvoyPatchPolicy adds has no field in the SecurityPolicy's published schema."""
    policy = copy.deepcopy(one(render("envoy-gateway-fast"), "SecurityPolicy"))
    policy["spec"]["extAuth"]["bodyToExtAuth"][field] = value
    errors = schema_errors([("SecurityPolicy with " + field, policy)])
    assert any(f'"{field}"' in e for e in errors), errors


def test_envoy_rejects_a_broken_envoy_gateway_fast_patch(tmp_path: Path) -> None:
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, root)
    _edit("envoy-gateway-fast/envoy-gateway-fast.yaml", "with_request_body/allow_partial_message",
          "with_request_body/allow_partial_mesage")(root)
    docs = tuple(render_dir(root / "envoy-gateway-fast"))
    ok, output = envoy_proc.validate(envoy_config.dump(eg_fast_gateway(docs), tmp_path / "b.yaml"))
    assert not ok and "allow_partial_mesage" in output, output
