"""deploy/istio-models and deploy/envoy-gateway-models say what envoy/multi-model.yaml says, where the mesh can.

tests/test_manifests.py renders and schema-validates every kustomization (these included); here, as
for the other shapes, each mesh's generation of Envoy config is simulated from the overlay's own
resources, our patches are applied, and the result is held against multi-model.yaml and fed to
`envoy --mode validate`:
- Istio builds the gateway's routes from the VirtualService (one route per http entry, in order;
  the destination's cluster `outbound|PORT||HOST`; the timeout; the retries with its own
  previous_hosts predicate and 5 host selection attempts; the hash policy of the destination's
  DestinationRule); the EnvoyFilter patches the rest, as in tests/test_manifests.py.
- Envoy Gateway 1.7.3 builds an xDS route and a cluster per HTTPRoute rule (`httproute/NS/NAME/rule/I`,
  internal/gatewayapi/helpers.go), in Gateway API precedence (internal/gatewayapi/sort.go: more
  header matches first, a stable sort); the EnvoyExtensionPolicy's ext_proc filter sits in the chain
  disabled, named `envoy.filters.http.ext_proc/envoyextensionpolicy/NS/NAME/extproc/I`, and is
  enabled on each targeted route by an empty FilterConfig (internal/xds/translator/extproc.go); the
  BackendTrafficPolicy gives each route its timeout, retries (buildRetryPolicy: previous_hosts, 5
  attempts) and hash policy, and each cluster a Maglev load_balancing_policy.
Hash mode: multi-model.yaml's pick-mode parts (the stateful_session filter, the strip of a client's
pick header it reads, ext_proc's metadata namespaces for the pick) are left out of the comparison.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest

from extproc.core import settings
from routerlab.harness import envoy_config, envoy_proc

from test_manifests import (
    DEPLOY,
    ROUTER_FILTER,
    Doc,
    _edit,
    apply_envoy_filter,
    apply_envoy_patch_policy,
    eg_ext_proc,
    eg_router_cluster,
    envoy_accepts,
    istio_router_cluster,
    label,
    one,
    quantity,
    render,
    render_dir,
    router_settings,
    schema_errors,
    seconds,
)

ISTIO, ENVOY_GATEWAY = "istio-models", "envoy-gateway-models"
HEADER_MUTATION = "envoy.filters.http.header_mutation"
STATEFUL_SESSION = "envoy.filters.http.stateful_session"
FILTER_CONFIG = "type.googleapis.com/envoy.config.route.v3.FilterConfig"
PREVIOUS_HOSTS = {"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}
Table = list[tuple[str | None, str]]  # per route, in match order: (the model it matches or None, its Service)


def reference() -> envoy_config.Config:
    return envoy_config.load("multi-model.yaml")


def hash_reference() -> envoy_config.Config:
    """multi-model.yaml without what only pick mode uses: the stateful_session filter, the strip of
    the client's copy of the header it reads, and ext_proc's metadata namespaces (the pick's)."""
    cfg = reference()
    pick_header = envoy_config.http_filter(cfg, STATEFUL_SESSION)["session_state"]["typed_config"]["name"]
    hcm = envoy_config.http_manager(cfg)
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != STATEFUL_SESSION]
    mutations = envoy_config.http_filter(cfg, HEADER_MUTATION)["mutations"]
    mutations["request_mutations"] = [m for m in mutations["request_mutations"] if m.get("remove") != pick_header]
    envoy_config.http_filter(cfg, envoy_config.EXT_PROC).pop("metadata_options")
    return cfg


def service_of(cluster: str) -> str:
    """multi-model.yaml's cluster vllm_llama stands for the Service vllm-llama."""
    return cluster.replace("_", "-")


def host_service(host: str) -> str:
    service, namespace, *rest = host.split(".")
    assert namespace == "default" and rest == ["svc", "cluster", "local"], host
    return service


def reference_table(header: str) -> Table:
    out: Table = []
    for route in envoy_config.routes(reference()):
        headers = route["match"].get("headers", [])
        assert [h["name"] for h in headers] in ([], [header])
        out.append((headers[0]["string_match"]["exact"] if headers else None, service_of(route["route"]["cluster"])))
    return out


def model_header(docs: tuple[Doc, ...]) -> str:
    return router_settings(docs)[1].model_header


def bare_models_gateway(ref: envoy_config.Config, router_cluster: str, names: dict[str, str]) -> envoy_config.Config:
    """The reference as a gateway has it before our patches: the router filter alone, no listener
    buffer, no bounded load, the mesh's names for the clusters (``names``: reference name -> the mesh's)."""
    cfg = renamed(ref, router_cluster, names)
    hcm = envoy_config.http_manager(cfg)
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == ROUTER_FILTER]
    cfg["static_resources"]["listeners"][0].pop("per_connection_buffer_limit_bytes")
    for cluster in [c for c in cfg["static_resources"]["clusters"] if c["name"] != router_cluster]:
        cluster["common_lb_config"].pop("consistent_hashing_lb_config")
        cluster["common_lb_config"].pop("update_merge_window")
    return cfg


def renamed(ref: envoy_config.Config, router_cluster: str, names: dict[str, str]) -> envoy_config.Config:
    cfg = copy.deepcopy(ref)
    names = {**names, "prefix_router": router_cluster}
    for cluster in cfg["static_resources"]["clusters"]:
        cluster["name"] = cluster["load_assignment"]["cluster_name"] = names[cluster["name"]]
    for route in envoy_config.routes(cfg):
        route["route"]["cluster"] = names[route["route"]["cluster"]]
    envoy_config.http_filter(cfg, envoy_config.EXT_PROC)["grpc_service"]["envoy_grpc"]["cluster_name"] = router_cluster
    return cfg


def route_settings(timeout: str, hash_header: str, retry_on: str, num_retries: int) -> dict[str, Any]:
    """A route's settings as both meshes build them (their retries: previous_hosts, 5 host selection attempts)."""
    return {"timeout": f"{seconds(timeout):g}s", "hash_policy": [{"header": {"header_name": hash_header}}],
            "retry_policy": {"retry_on": retry_on, "num_retries": num_retries,
                             "retry_host_predicate": [PREVIOUS_HOSTS], "host_selection_retry_max_attempts": 5}}


# ---------------------------------------------------------------------------- Istio

def istio_table(docs: tuple[Doc, ...]) -> Table:
    header = model_header(docs)
    out: Table = []
    for http in one(docs, "VirtualService")["spec"]["http"]:
        [destination] = http["route"]  # one Service per route: no weights
        matches = http.get("match", [])
        assert len(matches) <= 1, http
        model = None
        if matches:
            assert set(matches[0]) == {"headers"} and set(matches[0]["headers"]) == {header}, matches
            [(kind, model)] = matches[0]["headers"][header].items()
            assert kind == "exact", matches
        out.append((model, host_service(destination["destination"]["host"])))
    return out


def istio_cluster(destination: dict[str, Any]) -> str:
    return f"outbound|{destination['port']['number']}||{destination['host']}"  # Istio's outbound cluster name


def istio_routes(docs: tuple[Doc, ...]) -> list[dict[str, Any]]:
    """The gateway's routes Istio builds from the VirtualService and the DestinationRules (the fields ours set)."""
    rules = {d["spec"]["host"]: d["spec"]["trafficPolicy"] for d in docs if d["kind"] == "DestinationRule"}
    out = []
    for http in one(docs, "VirtualService")["spec"]["http"]:
        [destination] = http["route"]
        dest = destination["destination"]
        match: dict[str, Any] = {"prefix": "/"}
        for m in http.get("match", []):
            match["headers"] = [{"name": k, "string_match": v} for k, v in m["headers"].items()]
        retries = http["retries"]
        route = {"cluster": istio_cluster(dest), **route_settings(
            http["timeout"], rules[dest["host"]]["loadBalancer"]["consistentHash"]["httpHeaderName"],
            retries["retryOn"], retries["attempts"])}
        out.append({"match": match, "route": route})
    return out


def istio_names(docs: tuple[Doc, ...]) -> dict[str, str]:
    """multi-model.yaml's cluster names -> Istio's, through the Services the VirtualService routes to."""
    by_service = {host_service(r["destination"]["host"]): istio_cluster(r["destination"])
                  for http in one(docs, "VirtualService")["spec"]["http"] for r in http["route"]}
    return {c["name"]: by_service[service_of(c["name"])] for c in envoy_config.model_clusters(reference())}


def istio_models_gateway(docs: tuple[Doc, ...]) -> envoy_config.Config:
    """The ingress gateway's config: Istio's routes and clusters for our resources, then our EnvoyFilter."""
    names = istio_names(docs)
    cfg = bare_models_gateway(hash_reference(), istio_router_cluster(docs), names)
    envoy_config.routes(cfg)[:] = istio_routes(docs)
    hosts = {c.rpartition("|")[2]: c for c in names.values()}
    apply_envoy_filter(cfg, one(docs, "EnvoyFilter"), hosts)
    return cfg


def test_istio_models_gateway_is_multi_model(tmp_path: Path) -> None:
    docs = render(ISTIO)
    cfg = istio_models_gateway(docs)
    want = renamed(hash_reference(), istio_router_cluster(docs), istio_names(docs))
    # the same filters in the same order with the same settings (route_cache_action CLEAR, the
    # model-header metadata), the same listener, routes and clusters (bounded load on each model's)
    assert envoy_config.http_manager(cfg)["http_filters"] == envoy_config.http_manager(want)["http_filters"]
    assert cfg["static_resources"]["listeners"][0] == want["static_resources"]["listeners"][0]
    assert envoy_config.routes(cfg) == envoy_config.routes(want)
    assert cfg["static_resources"]["clusters"] == want["static_resources"]["clusters"]
    envoy_accepts(cfg, tmp_path)


def test_istio_destination_rules_are_deploy_istios_for_each_model() -> None:
    docs = render(ISTIO)
    single = one(render("istio"), "DestinationRule")["spec"]["trafficPolicy"]
    rules = [d for d in docs if d["kind"] == "DestinationRule"]
    assert sorted(host_service(d["spec"]["host"]) for d in rules) == sorted({s for _, s in istio_table(docs)})
    assert all(d["spec"] == {"host": d["spec"]["host"], "trafficPolicy": single} for d in rules)  # no connectionPool
    # the VirtualService is bound to an Istio Gateway (namespace/name) and serves any host it does
    vs = one(docs, "VirtualService")["spec"]
    [gateway] = vs["gateways"]
    assert gateway.count("/") == 1 and vs["hosts"] == ["*"]


# ---------------------------------------------------------------------------- Envoy Gateway

def eg_gateway_ref(docs: tuple[Doc, ...]) -> tuple[str, str]:
    """The (namespace, name) of the Gateway the HTTPRoute attaches to."""
    route = one(docs, "HTTPRoute")
    [parent] = route["spec"]["parentRefs"]
    assert parent["kind"] == "Gateway" and parent.get("sectionName") is None
    return parent.get("namespace", route["metadata"]["namespace"]), parent["name"]


def eg_rule_order(rules: list[dict[str, Any]]) -> list[int]:
    """Envoy Gateway's route order for rules of one path match each: more header matches first, else as written."""
    assert all(len(r.get("matches", [])) <= 1 and set(m) <= {"headers"} for r in rules for m in r.get("matches", []))
    return sorted(range(len(rules)), key=lambda i: -sum(len(m["headers"]) for m in rules[i].get("matches", [])))


def eg_table(docs: tuple[Doc, ...]) -> Table:
    header = model_header(docs)
    rules = one(docs, "HTTPRoute")["spec"]["rules"]
    out: Table = []
    for i in eg_rule_order(rules):
        [backend] = rules[i]["backendRefs"]  # one Service per rule: no weights
        assert backend["kind"] == "Service" and backend.get("namespace") is None
        model = None
        for m in rules[i].get("matches", []):
            [match] = m["headers"]
            assert match["type"] == "Exact" and match["name"] == header, match
            model = match["value"]
        out.append((model, backend["name"]))
    return out


def eg_filter_name(policy: Doc, index: int = 0) -> str:
    ns, name = policy["metadata"]["namespace"], policy["metadata"]["name"]
    return f"{envoy_config.EXT_PROC}/envoyextensionpolicy/{ns}/{name}/extproc/{index}"


def eg_enabled_rules(policy: Doc, docs: tuple[Doc, ...]) -> set[int]:
    """The rules of the HTTPRoute whose routes enable the policy's ext_proc filter."""
    route = one(docs, "HTTPRoute")
    rules = route["spec"]["rules"]
    out: set[int] = set()
    for target in policy["spec"]["targetRefs"]:
        if target["kind"] == "Gateway" and target["name"] == eg_gateway_ref(docs)[1]:
            out |= set(range(len(rules)))
        elif target["kind"] == "HTTPRoute" and target["name"] == route["metadata"]["name"]:
            section = target.get("sectionName")
            out |= {i for i, r in enumerate(rules) if section is None or r.get("name") == section}
    return out


def eg_cluster_prefix(docs: tuple[Doc, ...]) -> str:
    route = one(docs, "HTTPRoute")
    return f"httproute/{route['metadata']['namespace']}/{route['metadata']['name']}/rule/"


def eg_models_gateway(docs: tuple[Doc, ...], policy: Doc | None = None) -> envoy_config.Config:
    """Envoy Gateway's config for the HTTPRoute and policies (``policy``: another EnvoyExtensionPolicy
    in place of the overlay's), then our EnvoyPatchPolicy."""
    policy = policy or one(docs, "EnvoyExtensionPolicy")
    ref = hash_reference()
    router_cluster = eg_router_cluster(docs)
    rules = one(docs, "HTTPRoute")["spec"]["rules"]
    btp = one(docs, "BackendTrafficPolicy")["spec"]
    ns, gateway = eg_gateway_ref(docs)
    listener_name, filter_name, prefix = f"{ns}/{gateway}/http", eg_filter_name(policy), eg_cluster_prefix(docs)
    by_service = {service_of(c["name"]): c for c in envoy_config.model_clusters(ref)}
    cfg = bare_models_gateway(ref, router_cluster, {c["name"]: c["name"] for c in by_service.values()})
    listener = cfg["static_resources"]["listeners"][0]
    listener["name"] = listener_name
    hcm = envoy_config.http_manager(cfg)
    hcm["http_filters"].insert(0, {"name": filter_name, "disabled": True,
                                   "typed_config": eg_ext_proc(policy, router_cluster)})
    enabled = eg_enabled_rules(policy, docs)
    consistent = btp["loadBalancer"]["consistentHash"]
    [hash_header] = [h["name"] for h in consistent["headers"]]
    clusters = [envoy_config.cluster(cfg, router_cluster)]
    routes = []
    for i in eg_rule_order(rules):
        rule, name = rules[i], f"{prefix}{i}"
        [backend] = rule["backendRefs"]
        cluster = copy.deepcopy(by_service[backend["name"]])
        cluster["name"] = cluster["load_assignment"]["cluster_name"] = name
        cluster.pop("lb_policy")
        cluster["common_lb_config"].pop("consistent_hashing_lb_config")
        cluster["common_lb_config"].pop("update_merge_window")
        cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.maglev",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.maglev.v3.Maglev",
                             "table_size": consistent["tableSize"]}}}]}
        clusters.append(cluster)
        match: dict[str, Any] = {"prefix": "/"}
        for m in rule.get("matches", []):
            match["headers"] = [{"name": h["name"], "string_match": {"exact": h["value"]}} for h in m["headers"]]
        route: dict[str, Any] = {"match": match, "route": {"cluster": name, **route_settings(
            btp["timeout"]["http"]["requestTimeout"], hash_header, ",".join(btp["retry"]["retryOn"]["triggers"]),
            btp["retry"]["numRetries"])}}
        if i in enabled:
            route["typed_per_filter_config"] = {filter_name: {"@type": FILTER_CONFIG, "config": {}}}
        routes.append(route)
    cfg["static_resources"]["clusters"] = clusters
    envoy_config.routes(cfg)[:] = routes
    apply_envoy_patch_policy({("Listener", listener_name): listener,
                              **{("Cluster", c["name"]): c for c in clusters[1:]}}, one(docs, "EnvoyPatchPolicy"))
    return cfg


def by_service(cfg: envoy_config.Config, prefix: str, rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The routes, each cluster named by its Service, without per-filter config: to hold against multi-model.yaml's."""
    services = {f"{prefix}{i}": r["backendRefs"][0]["name"] for i, r in enumerate(rules)}
    out = copy.deepcopy(envoy_config.routes(cfg))
    for route in out:
        route.pop("typed_per_filter_config", None)
        route["route"]["cluster"] = services[route["route"]["cluster"]]
    return out


def test_envoy_gateway_models_is_multi_model(tmp_path: Path) -> None:
    docs = render(ENVOY_GATEWAY)
    cfg = eg_models_gateway(docs)
    ref = hash_reference()
    policy = one(docs, "EnvoyExtensionPolicy")
    router_cluster = eg_router_cluster(docs)
    # ext_proc: the reference's settings, route_cache_action CLEAR included (the patch's), bar the
    # per-stream metadata Envoy Gateway cannot send (the router's env holds those values)
    want = copy.deepcopy(envoy_config.http_filter(ref, envoy_config.EXT_PROC))
    metadata = {m["key"]: m["value"] for m in want["grpc_service"].pop("initial_metadata")}
    want["grpc_service"].pop("timeout")
    want["grpc_service"]["envoy_grpc"]["cluster_name"] = router_cluster
    want["message_timeout"] = f"{seconds(want['message_timeout'])}s"
    [ext_proc] = [f for f in envoy_config.http_manager(cfg)["http_filters"] if f["name"] == eg_filter_name(policy)]
    assert ext_proc["typed_config"] == want
    _, route = router_settings(docs)
    for key, raw in metadata.items():
        name = key.removeprefix(settings.METADATA_PREFIX).replace("-", "_")
        assert settings.parse_value(name, raw, key) == getattr(route, name), f"router env vs {key}"
    # the routes: multi-model.yaml's, model for model, each enabling the ext_proc filter
    rules = one(docs, "HTTPRoute")["spec"]["rules"]
    ref_routes = copy.deepcopy(envoy_config.routes(ref))
    for r in ref_routes:
        r["route"]["cluster"] = service_of(r["route"]["cluster"])
    assert by_service(cfg, eg_cluster_prefix(docs), rules) == ref_routes
    # each rule's cluster: its model's Maglev with the reference's bounded load
    for i, rule in enumerate(rules):
        cluster = envoy_config.cluster(cfg, f"{eg_cluster_prefix(docs)}{i}")
        ref_cluster = envoy_config.cluster(ref, rule["backendRefs"][0]["name"].replace("-", "_"))
        [lb] = cluster["load_balancing_policy"]["policies"]
        assert lb["typed_extension_config"]["typed_config"]["consistent_hashing_lb_config"] == \
            ref_cluster["common_lb_config"]["consistent_hashing_lb_config"]
        assert seconds(cluster["common_lb_config"]["update_merge_window"]) == \
            seconds(ref_cluster["common_lb_config"]["update_merge_window"])
    envoy_accepts(cfg, tmp_path)


def test_envoy_gateway_ext_proc_runs_whatever_rule_a_request_first_matches() -> None:
    """Envoy builds a request's filter chain from its first route: a filter disabled in the chain runs
    only if that route enables it, so every rule's route must (the policy targets the whole HTTPRoute)."""
    docs = render(ENVOY_GATEWAY)
    policy = one(docs, "EnvoyExtensionPolicy")
    name = eg_filter_name(policy)
    [ext_proc] = [f for f in envoy_config.http_manager(eg_models_gateway(docs))["http_filters"] if f["name"] == name]
    assert ext_proc["disabled"] is True  # as Envoy Gateway builds it: enabled per route
    routes = envoy_config.routes(eg_models_gateway(docs))
    assert len(routes) == len(one(docs, "HTTPRoute")["spec"]["rules"])
    assert all(r["typed_per_filter_config"][name] == {"@type": FILTER_CONFIG, "config": {}} for r in routes)
    # the check can fail: a policy on one rule leaves the others' routes without the filter
    narrowed = copy.deepcopy(policy)
    narrowed["spec"]["targetRefs"][0]["sectionName"] = "llama"
    assert [r for r in envoy_config.routes(eg_models_gateway(docs, narrowed)) if "typed_per_filter_config" not in r]


def test_envoy_gateway_models_policies_are_deploy_envoy_gateways() -> None:
    """What does not depend on the models is deploy/envoy-gateway's, which tests/test_manifests.py holds
    against envoy.yaml; multi-model.yaml's clusters and routes are envoy.yaml's but for names."""
    docs, single = render(ENVOY_GATEWAY), render("envoy-gateway")
    for kind in ("BackendTrafficPolicy", "EnvoyExtensionPolicy"):
        assert one(docs, kind)["spec"] == one(single, kind)["spec"], kind
    route = one(docs, "HTTPRoute")["metadata"]["name"]
    gateway = eg_gateway_ref(docs)
    for d in docs:
        if d["kind"] in {"BackendTrafficPolicy", "EnvoyExtensionPolicy"}:
            assert [t["name"] for t in d["spec"]["targetRefs"]] == [route]
        elif d["kind"] in {"ClientTrafficPolicy", "EnvoyPatchPolicy"}:
            targets = d["spec"].get("targetRefs") or [d["spec"]["targetRef"]]
            assert [(d["metadata"]["namespace"], t["kind"], t["name"]) for t in targets] == [
                (gateway[0], "Gateway", gateway[1])], d["kind"]
    single_ref = envoy_config.load("envoy.yaml")
    vllm = envoy_config.cluster(single_ref, "vllm")
    for cluster in envoy_config.model_clusters(reference()):
        assert {k: v for k, v in cluster.items() if k not in {"name", "load_assignment"}} == \
            {k: v for k, v in vllm.items() if k not in {"name", "load_assignment"}}, cluster["name"]
    [single_route] = envoy_config.routes(single_ref)
    for r in envoy_config.routes(reference()):
        assert {k: v for k, v in r["route"].items() if k != "cluster"} == \
            {k: v for k, v in single_route["route"].items() if k != "cluster"}


# ---------------------------------------------------------------------------- both

TABLES = {ISTIO: istio_table, ENVOY_GATEWAY: eg_table}


@pytest.mark.parametrize("variant", sorted(TABLES))
def test_routes_name_the_two_models_and_default_to_the_first(variant: str) -> None:
    docs = render(variant)
    table = TABLES[variant](docs)
    assert table == reference_table(model_header(docs))
    assert [model for model, _ in table] == ["llama-3.1-8b", "qwen2.5-1.5b", None]  # exactly two, the default last
    assert table[-1][1] == table[0][1] != table[1][1]  # the default: the first model's Service


def test_client_model_header_is_removed_before_the_router() -> None:
    # Istio: the header_mutation filter, before ext_proc in the gateway's chain
    docs = render(ISTIO)
    _, route = router_settings(docs)
    filters = envoy_config.http_manager(istio_models_gateway(docs))["http_filters"]
    names = [f["name"] for f in filters]
    assert names.index(HEADER_MUTATION) < names.index(envoy_config.EXT_PROC)
    mutations = filters[names.index(HEADER_MUTATION)]["typed_config"]["mutations"]["request_mutations"]
    removed = [m["remove"] for m in mutations]
    assert removed == [route.key_header, route.model_header]
    ref_mutations = envoy_config.http_filter(hash_reference(), HEADER_MUTATION)["mutations"]["request_mutations"]
    assert removed == [m["remove"] for m in ref_mutations]
    # Envoy Gateway: the Gateway's early request headers, before any filter and the first route match
    docs = render(ENVOY_GATEWAY)
    _, route = router_settings(docs)
    client = one(docs, "ClientTrafficPolicy")["spec"]
    assert client["headers"]["earlyRequestHeaders"] == {"remove": [route.key_header, route.model_header]}
    ref_listener = reference()["static_resources"]["listeners"][0]
    assert quantity(client["connection"]["bufferLimit"]) == ref_listener["per_connection_buffer_limit_bytes"]


def test_route_cache_is_cleared_after_the_router() -> None:
    ext_proc = envoy_config.http_filter(istio_models_gateway(render(ISTIO)), envoy_config.EXT_PROC)
    assert ext_proc["route_cache_action"] == "CLEAR"
    docs = render(ENVOY_GATEWAY)
    name = eg_filter_name(one(docs, "EnvoyExtensionPolicy"))
    [ext_proc] = [f["typed_config"] for f in envoy_config.http_manager(eg_models_gateway(docs))["http_filters"]
                  if f["name"] == name]
    assert ext_proc["route_cache_action"] == "CLEAR"  # the EnvoyPatchPolicy's: the policy cannot say it
    assert "route_cache_action" not in eg_ext_proc(one(docs, "EnvoyExtensionPolicy"), eg_router_cluster(docs))


@pytest.mark.parametrize("field", ["routeCacheAction", "clearRouteCache", "recomputeRoute"])
def test_envoy_gateway_ext_proc_cannot_clear_the_route_cache_without_the_patch(field: str) -> None:
    """The EnvoyExtensionPolicy's extProc has no field for it in the published schema (extAuth's
    recomputeRoute is SecurityPolicy's)."""
    policy = copy.deepcopy(one(render(ENVOY_GATEWAY), "EnvoyExtensionPolicy"))
    policy["spec"]["extProc"][0][field] = True
    errors = schema_errors([("EnvoyExtensionPolicy with " + field, policy)])
    assert any(f'"{field}"' in e for e in errors), errors


BROKEN = {
    ISTIO: ("istio-models/istio-models.yaml", "route_cache_action: CLEAR", "route_cache_actoin: CLEAR",
            "route_cache_actoin"),
    ENVOY_GATEWAY: ("envoy-gateway-models/envoy-gateway-models.yaml", "path: /typed_config/route_cache_action",
                    "path: /typed_config/route_cache_actoin", "route_cache_actoin"),
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_envoy_rejects_a_broken_models_patch(variant: str, tmp_path: Path) -> None:
    rel, old, new, reason = BROKEN[variant]
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, root)
    _edit(rel, old, new)(root)
    docs = tuple(render_dir(root / variant))
    patches = [d for d in docs if d["kind"] in {"EnvoyFilter", "EnvoyPatchPolicy"}]
    assert schema_errors([(label(variant, d), d) for d in patches]) == []  # no CRD schema sees inside
    cfg = (istio_models_gateway if variant == ISTIO else eg_models_gateway)(docs)
    ok, output = envoy_proc.validate(envoy_config.dump(cfg, tmp_path / "broken.yaml"))
    assert not ok and reason in output, output
