"""Load the envoy/*.yaml files and point them at local ports (for tests, demo, benchmark).

Edits are structural (by listener, cluster and filter name), so the YAML files stay the
documented drop-in examples and nobody hand-edits ports.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from routerlab import REPO_DIR

ENVOY_DIR = REPO_DIR / "envoy"
EXT_PROC = "envoy.filters.http.ext_proc"
EXT_AUTHZ = "envoy.filters.http.ext_authz"  # envoy-fast.yaml's shape (extproc.adapters.ext_authz)
ROUTER_FILTERS = (EXT_PROC, EXT_AUTHZ)  # the filters that call the prefix router
SETTINGS_FILTER = "prefix_router.settings"  # envoy-fast.yaml: the header_mutation that sets x-prefix-router-*
ROUTER_CLUSTER = "prefix_router"  # what the router filter calls (gRPC, or HTTP in envoy-fast.yaml and pick-fast.yaml)
LOG_CLUSTER = "prefix_router_log"  # pick-fast.yaml: the router's gRPC port, for the access log (requests' ends)
ROUTER_CLUSTERS = (ROUTER_CLUSTER, LOG_CLUSTER)
Config = dict[str, Any]


def load(name_or_path: str | Path) -> Config:
    path = Path(name_or_path)
    if not path.exists():
        path = ENVOY_DIR / name_or_path
    return yaml.safe_load(path.read_text())


def dump(cfg: Config, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _endpoint(host: str, port: int, hash_key: str | None = None) -> dict[str, Any]:
    endpoint: dict[str, Any] = {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
    if hash_key:
        endpoint["metadata"] = {"filter_metadata": {"envoy.lb": {"hash_key": hash_key}}}
    return endpoint


def cluster(cfg: Config, name: str) -> dict[str, Any]:
    for c in cfg["static_resources"]["clusters"]:
        if c["name"] == name:
            return c
    raise KeyError(f"no cluster {name!r}")


def http_manager(cfg: Config) -> dict[str, Any]:
    chain = cfg["static_resources"]["listeners"][0]["filter_chains"][0]
    return chain["filters"][0]["typed_config"]


def http_filter(cfg: Config, name: str) -> dict[str, Any]:
    for f in http_manager(cfg)["http_filters"]:
        if f["name"] == name:
            return f["typed_config"]
    raise KeyError(f"no http filter {name!r}")


def routes(cfg: Config) -> list[dict[str, Any]]:
    return http_manager(cfg)["route_config"]["virtual_hosts"][0]["routes"]


def set_endpoints(cfg: Config, cluster_name: str, backends: Iterable[tuple[str, int]],
                  hash_key_prefix: str | None = None, standby: bool = False) -> None:
    """Point a cluster at ``backends``; with ``hash_key_prefix``, replica i hashes as PREFIX-i.

    Named replicas make the consistent-hash map independent of ports and addresses, so a
    replica that comes back elsewhere keeps its keys (and tests are repeatable). ``standby``:
    the first backend alone at priority 0, the rest at priority 1 (Envoy fails over to them).
    """
    c = cluster(cfg, cluster_name)
    endpoints = [_endpoint(h, p, f"{hash_key_prefix}-{i}" if hash_key_prefix else None)
                 for i, (h, p) in enumerate(backends)]
    c["load_assignment"]["endpoints"] = (
        [{"lb_endpoints": endpoints[:1]}, {"priority": 1, "lb_endpoints": endpoints[1:]}]
        if standby and len(endpoints) > 1 else [{"lb_endpoints": endpoints}])


def model_clusters(cfg: Config) -> list[dict[str, Any]]:
    """The clusters of replicas (every cluster but the router's)."""
    return [c for c in cfg["static_resources"]["clusters"] if c["name"] not in ROUTER_CLUSTERS]


def pool_cluster(i: int) -> str:
    """The name of the cluster of the ``i``-th model's replicas (``set_model_pools``)."""
    return f"vllm_{i}"


def set_model_pools(cfg: Config, pools: Mapping[str, Sequence[tuple[str, int]]], header: str) -> list[str]:
    """multi-model.yaml's shape for ``pools`` (model -> its replicas): a cluster per model (named
    ``pool_cluster(i)``, copied from the config's first replica cluster), a route per model matching
    ``header`` exactly (copied from its first such route), the default route to the first model's
    cluster. Returns the clusters' names in the pools' order."""
    template_cluster = model_clusters(cfg)[0]
    table = routes(cfg)
    matched = next(r for r in table if r["match"].get("headers"))
    default = next(r for r in table if not r["match"].get("headers"))
    names = [pool_cluster(i) for i in range(len(pools))]
    clusters = []
    table[:] = []
    for name, model in zip(names, pools):
        c = copy.deepcopy(template_cluster)
        c["name"] = c["load_assignment"]["cluster_name"] = name
        clusters.append(c)
        route = copy.deepcopy(matched)
        route["match"]["headers"] = [{"name": header, "string_match": {"exact": model}}]
        route["route"]["cluster"] = name
        table.append(route)
    default = copy.deepcopy(default)
    default["route"]["cluster"] = names[0]
    table.append(default)
    cfg["static_resources"]["clusters"] = [c for c in cfg["static_resources"]["clusters"]
                                           if c["name"] in ROUTER_CLUSTERS] + clusters
    for name, members in zip(names, pools.values()):
        set_endpoints(cfg, name, members, hash_key_prefix=name)
    return names


def keep_client_header(cfg: Config, header: str) -> None:
    """Stop the config from dropping a client's ``header`` (a stock arm routes on the client's)."""
    for f in http_manager(cfg)["http_filters"]:
        mutations = f["typed_config"].get("mutations", {})
        if "request_mutations" in mutations:
            mutations["request_mutations"] = [m for m in mutations["request_mutations"] if m.get("remove") != header]


def set_health_interval(cfg: Config, seconds: float) -> None:
    """Faster health checks for tests: a dead host leaves within ~2 intervals."""
    for c in cfg["static_resources"]["clusters"]:
        for hc in c.get("health_checks", []):
            hc["interval"] = hc["no_traffic_interval"] = f"{seconds}s"
            hc["timeout"] = f"{max(seconds, 0.5)}s"


def router_filter(cfg: Config) -> tuple[str, dict[str, Any]]:
    """The filter that calls the prefix router (ext_proc, or ext_authz in envoy-fast.yaml)."""
    for f in http_manager(cfg)["http_filters"]:
        if f["name"] in ROUTER_FILTERS:
            return f["name"], f["typed_config"]
    raise KeyError("no ext_proc or ext_authz http filter")


def router_over_http(cfg: Config) -> bool:
    """Does the config call the router over HTTP (ext_authz ``http_service``, envoy-fast.yaml)
    rather than gRPC? Such a config's prefix_router cluster is the router's --http-authz-port."""
    try:
        name, filter_config = router_filter(cfg)
    except KeyError:
        return False
    return name == EXT_AUTHZ and "http_service" in filter_config


def logs_ends(cfg: Config) -> bool:
    """Does the config stream its access log to the router (pick-fast.yaml: the ends of picks)?"""
    return any(c["name"] == LOG_CLUSTER for c in cfg["static_resources"]["clusters"])


def drop_prefix_router(cfg: Config) -> Config:
    """``cfg`` without the filter that calls the router (and the one setting its headers), the
    access log to it and its clusters."""
    manager = http_manager(cfg)
    manager["http_filters"] = [f for f in manager["http_filters"]
                               if f["name"] not in (*ROUTER_FILTERS, SETTINGS_FILTER)]
    manager.pop("access_log", None)
    cfg["static_resources"]["clusters"] = [c for c in cfg["static_resources"]["clusters"]
                                           if c["name"] not in ROUTER_CLUSTERS]
    return cfg


def _header_mutations(metadata: Mapping[str, str], action: str) -> dict[str, Any]:
    return {"request_mutations": [{"append": {"header": {"key": k, "value": str(v)}, "append_action": action}}
                                  for k, v in metadata.items()]}


def set_stream_metadata(cfg: Config, metadata: Mapping[str, str]) -> None:
    """Replace the listener-wide x-prefix-router-* settings sent to the router: gRPC initial
    metadata, or over HTTP the request headers the settings filter adds (a route's win)."""
    if router_over_http(cfg):
        http_filter(cfg, SETTINGS_FILTER)["mutations"] = _header_mutations(metadata, "ADD_IF_ABSENT")
        return
    service = router_filter(cfg)[1]["grpc_service"]
    service["initial_metadata"] = [{"key": k, "value": str(v)} for k, v in metadata.items()]


def stream_metadata(cfg: Config) -> dict[str, str]:
    """The listener-wide x-prefix-router-* settings the config sends the router (either shape)."""
    if router_over_http(cfg):
        mutations = http_filter(cfg, SETTINGS_FILTER).get("mutations", {}).get("request_mutations", [])
        return {m["append"]["header"]["key"]: m["append"]["header"]["value"] for m in mutations if "append" in m}
    return {m["key"]: m["value"] for m in router_filter(cfg)[1]["grpc_service"].get("initial_metadata", [])}


def set_route_metadata(cfg: Config, route_index: int, metadata: Mapping[str, str]) -> None:
    """Per-route override of the router's settings: ExtProcPerRoute grpc_initial_metadata; for
    gRPC ext_authz the same keys as ExtAuthzPerRoute context_extensions; over HTTP, the same keys
    as request headers set by the settings filter's HeaderMutationPerRoute."""
    per_filter = routes(cfg)[route_index].setdefault("typed_per_filter_config", {})
    name = router_filter(cfg)[0]
    if router_over_http(cfg):
        per_filter[SETTINGS_FILTER] = {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutationPerRoute",
            "mutations": _header_mutations(metadata, "OVERWRITE_IF_EXISTS_OR_ADD"),
        }
        return
    if name == EXT_AUTHZ:
        per_filter[name] = {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute",
            "check_settings": {"context_extensions": {k: str(v) for k, v in metadata.items()}},
        }
        return
    per_filter[name] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {"grpc_initial_metadata": [{"key": k, "value": str(v)} for k, v in metadata.items()]},
    }


def localize(
    cfg: Config,
    *,
    listener_port: int,
    admin_port: int,
    backends: Sequence[tuple[str, int]],
    extproc_port: int | None = None,
    health_interval: float | None = None,
) -> Config:
    """A copy of ``cfg`` with every address and port pointing at this machine's test setup (pick-fast.yaml's
    log cluster, the router's gRPC port, is left for the caller: ``set_endpoints(cfg, LOG_CLUSTER, ...)``)."""
    cfg = copy.deepcopy(cfg)
    cfg["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin_port}
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listener_port}
    for c in cfg["static_resources"]["clusters"]:
        if c["name"] == ROUTER_CLUSTER:
            if extproc_port is not None:  # the gRPC port, or the HTTP one for a config that calls it over HTTP
                set_endpoints(cfg, ROUTER_CLUSTER, [("127.0.0.1", extproc_port)])
        elif c["name"] != LOG_CLUSTER:
            set_endpoints(cfg, c["name"], backends, hash_key_prefix="vllm")
    if health_interval is not None:
        set_health_interval(cfg, health_interval)
    return cfg
