"""One source of truth for settings: defaults, flags, env vars and per-stream metadata.

Every setting has one spec (parser + allowed values). The same spec checks a CLI flag
(``--prefix-length``), an environment variable (``PREFIX_ROUTER_PREFIX_LENGTH``) and, for
routing settings, the gRPC metadata key envoy.yaml sets per listener or per route
(``x-prefix-router-prefix-length``). Start-up errors are fatal and name the setting;
metadata errors are reported to the caller, which logs them and keeps the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from extproc.core.isolation import MIN_SECRET_BYTES
from extproc.core.normalize import MODES

ROUTING_MODES: Final = ("hash", "pick")
# pick mode's view of each replica's cache, per route: auto = the events when the process
# subscribes to them (--kv-events on), else what the router learned from its own picks
CACHE_VIEWS: Final = ("auto", "learned", "events")
ENDPOINT_SOURCES: Final = ("endpoints", "endpoints_file", "endpoints_dns")  # ServerSettings fields; one at most
# where pick mode's replicas come from, as the errors name them
ENDPOINT_FLAGS: Final = "--endpoints, --endpoints-file, --endpoints-dns or --pools"

ENV_PREFIX: Final = "PREFIX_ROUTER_"
TENANT_SECRET_ENV: Final = "PREFIX_ROUTER_TENANT_SECRET"
METADATA_PREFIX: Final = "x-prefix-router-"
DEFAULT_TENANT_HEADERS: Final = ("x-prefix-aware-id", "x-amzn-sagemaker-prefix-aware-id")
PREFIX_LENGTH_RANGE: Final = (64, 65536)
_HEADER_NAME = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")


class SettingError(ValueError):
    """A setting value outside what is allowed; the message names the setting."""


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """What decides a request's key; overridable per stream by envoy.yaml metadata."""

    prefix_length: int = 4096
    normalize: str = "prompt"
    key_header: str = "x-prefix-key"
    tenant_headers: tuple[str, ...] = DEFAULT_TENANT_HEADERS
    mode: str = "hash"  # hash: Envoy hashes the key; pick: the router names the replica
    pick_header: str = "x-prefix-pick"  # pick mode: base64(ip:port) for Envoy's stateful_session
    concurrency_threshold: int = 0  # pick mode: SageMaker's per-replica cap on requests in flight; 0 = none
    load_tokens: int = 0  # pick mode: a flat cost per request in flight, in prefill tokens
    backlog_weight: float = 1.0  # pick mode: weight of the prefill already queued on a replica
    stall_weight: float = 0.25  # pick mode: weight of the delay a request's prefill gives each request in flight there
    tie_tokens: int = 0  # pick mode: costs this close count as equal (rendezvous decides: router replicas agree)
    max_num_seqs: int = 256  # pick mode: vLLM's --max-num-seqs on the replicas (beyond it, a request waits for a slot)
    slot_weight: float = 1.0  # pick mode: weight of the wait for a slot on a replica whose slots are all taken
    eviction_weight: float = 1.0  # pick mode: weight of the prefill the pool's evictions bring back
    adapter_affinity: bool = True  # pick mode: price a LoRA adapter's slot in the choice (extproc.pick.choice.adapters)
    # pick mode: the cost of loading an adapter into a free slot, in prefill tokens: its load and the adapter it
    # evicts, loaded again later (16384: fewer loads than 1024 at the same TTFT on multi-lora, docs/results/multi-lora)
    adapter_load_tokens: int = 16384
    # pick mode: where an adapter must be loaded, up to this much more the farther the replica is in the
    # adapter's rendezvous order (its home first), so each adapter loads on a few replicas, the same on every router
    adapter_home_tokens: int = 65536
    tenant_isolation: bool = False  # write a per-tenant vLLM cache_salt into the body (needs a tenant secret)
    cache_view: str = "auto"  # pick mode: auto (events when the process subscribes), learned, or events
    # the body's model, copied into this header for Envoy's route table (the Gateway API Inference
    # Extension's name); "": no header
    model_header: str = "x-gateway-model-name"
    # Flow control (pick mode over ext_proc, extproc.pick.flow): while every replica of the request's
    # pool is saturated, hold requests in the router, release them fairly, shed them with 429 past a bound
    flow_control: bool = False
    flow_queue_tokens: int = 2048  # a replica is saturated with more prefill queued than this (prefill tokens) ...
    # ... or, for a request while a better class than its own is active in its pool, more than this: a worse
    # class takes only what the better leaves and never queues ahead of it on a replica
    flow_worse_queue_tokens: int = 0
    # ... and leaves this many of the pool's replicas free for the better class (at most all but one; 0: in
    # `priority` the better class keeps within 1.5x of its p90 either way, and 18 % more is served without)
    flow_reserve_replicas: int = 0
    flow_in_flight: int = 0  # ... or this many requests in flight (0: max_num_seqs)
    flow_max_wait: float = 10.0  # seconds a request may be held; then 429 (keep under Envoy's max_message_timeout)
    flow_max_queue: int = 1024  # requests held per pool at most; beyond it the lowest priority is shed
    # tokens a tenant back from idle may be behind those waiting: a burst of a tenant under its share goes first
    # (65536: measured on noisy-tenant, docs/results/overload)
    flow_burst_tokens: int = 65536
    priority: int = 0  # the route's priority class: lower is served first (vLLM's convention)
    priority_header: str = ""  # a header the mesh sets that overrides ``priority`` per request; "": none trusted
    vllm_priority: bool = False  # write the priority class into the body as vLLM's ``priority`` (ext_proc only)
    tenant_weights: tuple[tuple[str, float], ...] = ()  # flow control's share per tenant (default weight 1)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One model's replicas (``--pools``): the served model name requests ask for, and exactly one
    endpoint source, as ``--endpoints``, ``--endpoints-file`` or ``--endpoints-dns`` give the one pool."""

    model: str
    endpoints: tuple[str, ...] = ()
    endpoints_file: str = ""
    endpoints_dns: str = ""


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Process-wide settings of ``prefix-router serve``."""

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9464
    # Envoy's ext_authz over plain HTTP/1.1 (envoy-fast.yaml); 0: off. Off by default so a
    # router for envoy.yaml or pick.yaml opens no port it does not use (envoy-fast.yaml: 50052).
    http_authz_port: int = 0
    drain_seconds: float = 10.0
    # Pick mode over ext_authz (pick-fast.yaml): a pick whose end Envoy's access log never reports is
    # released after this long (the configs' route timeout)
    pick_end_timeout: float = 600.0
    log_level: str = "INFO"
    metadata_namespace: str = "prefix_router"
    # Pick mode: where the replicas are (the same ip:port hosts as Envoy's cluster) and how
    # the router learns their state. Exactly one endpoint source may be set.
    endpoints: tuple[str, ...] = ()
    endpoints_file: str = ""
    endpoints_dns: str = ""  # name:port, e.g. a Kubernetes headless service
    # Several models: each model's replicas (MODEL=SOURCE;...), instead of the three sources above
    pools: tuple[PoolSpec, ...] = ()
    models_interval: float = 10.0  # seconds between reads of every replica's /v1/models (its adapters); 0: never
    dns_interval: float = 5.0
    scrape_interval: float = 1.0
    chunk_bytes: int = 512  # the learned index cuts the normalised prompt into chunks of this size
    bytes_per_token: float = 4.0  # normalised prompt bytes per model token, to size chunks in tokens
    kv_capacity_tokens: int = 0  # per replica; 0 = read vllm:cache_config_info (num_gpu_blocks x block_size)
    prefill_tokens_per_s: float = 20000.0  # per replica, drains the queued-prefill estimate; 0 = no estimate
    index_max_chunks: int = 2_000_000  # memory bound of the learned index over all replicas
    # Precise mode: the cache view from vLLM's KV-cache events (--kv-events-config on each replica),
    # matched against the request's own token ids (the model's chat template and tokenizer).
    kv_events: bool = False
    tokenizer: str = ""  # DIR (every model) or NAME=DIR,NAME=DIR (per served model name)
    kv_events_port: int = 5557  # each endpoint's publisher, on the endpoint's host
    kv_replay_port: int = 5558  # its replay socket; 0: none (a gap then resets the replica's view)
    kv_events_topic: str = "kv"
    kv_dp_ranks: int = 1  # data-parallel ranks per endpoint: rank r publishes on port + r
    kv_ports_relative: bool = False  # the two ports are offsets from each endpoint's port (one host, many replicas)
    index_max_blocks: int = 8_000_000  # memory bound of the event view over all replicas
    tokenizer_check_every: int = 100  # check each model's first request, then 1 in N, against vLLM's /tokenize; 0: off
    tokenizer_cache_mb: int = 64  # each model's segment cache, and as much again for its prompt memo; 0: neither
    # New text longer than this is tokenised on a worker thread before the pick (extproc.pick.sources.tokenize_ahead),
    # so the event loop keeps serving, unless the word cache does it on the loop in less of the tokenizer's
    # time (in parts of this many characters' worth); 0: every request's text on the loop, in its pick.
    tokenize_inline_chars: int = 2048
    tokenize_queue_seconds: float = 0.1  # a request that would wait longer for the worker uses the learned view
    # Predict for each replica only the blocks it will not have evicted before it admits the request
    # (extproc.pick.events.eviction_forecast; the choice still ranks by what replicas hold now); off: predict those too.
    eviction_forecast: bool = True
    # Pick mode with several router replicas: tell each other the requests in flight (their load, and in
    # precise mode their blocks being computed) over this Redis (redis://HOST:PORT/DB); "": each alone.
    share_in_flight: str = ""
    share_in_flight_channel: str = "prefix-router:in-flight"  # the pub/sub channel (one per router fleet)
    # Tenant isolation's HMAC key: this file, else the env var TENANT_SECRET_ENV (never a flag:
    # command lines are visible to every local user).
    tenant_secret_file: str = ""


@dataclass(frozen=True, slots=True)
class _Spec:
    parse: Callable[[str], Any]
    allowed: str


def _number_in(kind: Callable[[str], Any], lo: float, hi: float) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        value = kind(raw.strip())
        if not lo <= value <= hi:
            raise ValueError
        return value
    return parse


_SWITCH: Final = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def _switch(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in _SWITCH:
        raise ValueError
    return _SWITCH[value]


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError
        return value
    return parse


def _header_name(raw: str) -> str:
    value = raw.strip().lower()
    if not _HEADER_NAME.match(value):
        raise ValueError
    return value


def _header_list(raw: str) -> tuple[str, ...]:
    names = tuple(_header_name(part) for part in raw.split(",") if part.strip())
    if not names:
        raise ValueError
    return names


def _host_and_port(raw: str) -> tuple[str, int]:
    host, sep, port = raw.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError
    return host, int(port)


def host_address(ip: str, port: int) -> str:
    """``ip:port`` (IPv6 as ``[ip]:port``), the way Envoy names a cluster host."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _address(raw: str) -> str:
    host, port = _host_and_port(raw)
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError from None
    return host_address(str(ip), port)


def _address_list(raw: str) -> tuple[str, ...]:
    return tuple(_address(part) for part in raw.replace("\n", ",").split(",") if part.strip())


def _dns_target(raw: str) -> str:
    host, port = _host_and_port(raw)
    if " " in host:
        raise ValueError
    return f"{host}:{port}"


def _redis_url(raw: str) -> str:
    """A URL redis-py connects to (checked for shape here; the connection is made after start-up)."""
    value = raw.strip()
    parts = urllib.parse.urlsplit(value)
    if parts.scheme in ("redis", "rediss"):
        if not parts.hostname or (parts.port is not None and not 0 < parts.port < 65536):
            raise ValueError
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError
    elif parts.scheme != "unix" or not parts.path:
        raise ValueError
    return value


_POOL_FILE: Final = "file:"
_POOL_DNS: Final = "dns:"


def _pools(raw: str) -> tuple[PoolSpec, ...]:
    """``MODEL=SOURCE`` entries separated by ``;`` or newlines; SOURCE is ``ip:port,ip:port``,
    ``file:PATH`` or ``dns:NAME:PORT``. A model named twice is refused; nothing at all is no pools."""
    pools: dict[str, PoolSpec] = {}
    for entry in raw.replace("\n", ";").split(";"):
        if not entry.strip():
            continue
        model, sep, source = entry.strip().partition("=")
        model, source = model.strip(), source.strip()
        if not sep or not model or not source or model in pools or " " in model or len(model) > 256:
            raise ValueError
        if source.startswith(_POOL_FILE) and source[len(_POOL_FILE):].strip():
            pools[model] = PoolSpec(model, endpoints_file=source[len(_POOL_FILE):].strip())
        elif source.startswith(_POOL_DNS):
            pools[model] = PoolSpec(model, endpoints_dns=_dns_target(source[len(_POOL_DNS):]))
        else:
            endpoints = _address_list(source)
            if not endpoints:
                raise ValueError
            pools[model] = PoolSpec(model, endpoints=endpoints)
    return tuple(pools.values())


def _tenant_weights(raw: str) -> tuple[tuple[str, float], ...]:
    """``TENANT=WEIGHT`` pairs separated by commas, each weight in 0.01..100; empty: every tenant 1."""
    pairs: dict[str, float] = {}
    for part in raw.split(","):
        if not part.strip():
            continue
        tenant, sep, weight = part.strip().rpartition("=")
        if not sep or not tenant.strip() or tenant.strip() in pairs:
            raise ValueError
        pairs[tenant.strip()] = _number_in(float, 0.01, 100.0)(weight)
    return tuple(pairs.items())


def _nonempty(raw: str) -> str:
    if not raw.strip():
        raise ValueError
    return raw.strip()


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda raw: parse(raw) if raw.strip() else ""


def _tokenizer_dirs(raw: str) -> str:
    """DIR, or NAME=DIR pairs separated by commas (checked for shape here, read at start-up)."""
    for part in raw.split(","):
        name, sep, path = part.strip().rpartition("=")
        if not path.strip() or (sep and not name.strip()):
            raise ValueError
    return raw.strip()


def tokenizer_dirs(raw: str) -> dict[str, str]:
    """``--tokenizer``'s value as served model name -> directory ("*": every model)."""
    dirs: dict[str, str] = {}
    for part in raw.split(",") if raw.strip() else ():
        name, sep, path = part.strip().rpartition("=")
        dirs[name.strip() if sep else "*"] = path.strip()
    return dirs


def _non_empty(raw: str) -> str:
    if not raw.strip():
        raise ValueError
    return raw.strip()


SPECS: Final[dict[str, _Spec]] = {
    "prefix_length": _Spec(_number_in(int, *PREFIX_LENGTH_RANGE), "an integer in 64..65536 (bytes)"),
    "normalize": _Spec(_choice(*MODES), "one of " + ", ".join(MODES)),
    "key_header": _Spec(_header_name, "a lower-case HTTP header name"),
    "tenant_headers": _Spec(_header_list, "a comma-separated list of HTTP header names"),
    "host": _Spec(_non_empty, "an address to bind, e.g. 127.0.0.1"),
    "port": _Spec(_number_in(int, 0, 65535), "a TCP port in 0..65535"),
    "metrics_port": _Spec(_number_in(int, 0, 65535), "a TCP port in 0..65535 (0 disables metrics)"),
    "http_authz_port": _Spec(_number_in(int, 0, 65535),
                             "a TCP port in 1..65535 for ext_authz over HTTP (envoy-fast.yaml), or 0 for off"),
    "drain_seconds": _Spec(_number_in(float, 0.0, 3600.0), "seconds in 0..3600"),
    "pick_end_timeout": _Spec(_number_in(float, 1.0, 86400.0), "seconds in 1..86400"),
    "log_level": _Spec(_choice("debug", "info", "warning", "error"), "one of debug, info, warning, error"),
    "metadata_namespace": _Spec(_non_empty, "a non-empty dynamic metadata namespace"),
    "mode": _Spec(_choice(*ROUTING_MODES), "one of " + ", ".join(ROUTING_MODES)),
    "pick_header": _Spec(_header_name, "a lower-case HTTP header name"),
    "concurrency_threshold": _Spec(_number_in(int, 0, 1024),
                                   "an integer in 1..1024 (requests in flight), or 0 for none"),
    "load_tokens": _Spec(_number_in(int, 0, 1_000_000),
                         "an integer in 0..1000000 (prefill tokens per request in flight)"),
    "backlog_weight": _Spec(_number_in(float, 0.0, 4.0), "a number in 0..4"),
    "stall_weight": _Spec(_number_in(float, 0.0, 4.0), "a number in 0..4"),
    "tie_tokens": _Spec(_number_in(int, 0, 1_000_000), "an integer in 0..1000000 (prefill tokens)"),
    "max_num_seqs": _Spec(_number_in(int, 0, 1_000_000), "an integer in 0..1000000 (0: no slot limit known)"),
    "slot_weight": _Spec(_number_in(float, 0.0, 4.0), "a number in 0..4"),
    "eviction_weight": _Spec(_number_in(float, 0.0, 4.0), "a number in 0..4"),
    "adapter_affinity": _Spec(_switch, "on or off"),
    "adapter_load_tokens": _Spec(_number_in(int, 0, 1_000_000), "an integer in 0..1000000 (prefill tokens)"),
    "adapter_home_tokens": _Spec(_number_in(int, 0, 1_000_000), "an integer in 0..1000000 (prefill tokens)"),
    "endpoints": _Spec(_address_list, "a comma-separated list of ip:port"),
    "endpoints_file": _Spec(_optional(str.strip), "a file path"),
    "endpoints_dns": _Spec(_optional(_dns_target), "name:port"),
    "pools": _Spec(_pools, "MODEL=SOURCE entries separated by ';', SOURCE one of ip:port,ip:port or "
                   "file:PATH or dns:NAME:PORT, each model once (empty: one pool, --endpoints*)"),
    "models_interval": _Spec(_number_in(float, 0.0, 3600.0), "seconds in 0..3600 (0: never read /v1/models)"),
    "dns_interval": _Spec(_number_in(float, 0.1, 3600.0), "seconds in 0.1..3600"),
    "scrape_interval": _Spec(_number_in(float, 0.05, 60.0), "seconds in 0.05..60"),
    "chunk_bytes": _Spec(_number_in(int, 16, 65536), "an integer in 16..65536 (bytes)"),
    "bytes_per_token": _Spec(_number_in(float, 0.5, 64.0), "a number in 0.5..64"),
    "kv_capacity_tokens": _Spec(_number_in(int, 0, 10**10), "tokens per replica (0: read from vLLM's metrics)"),
    "prefill_tokens_per_s": _Spec(_number_in(float, 0.0, 1e9), "tokens per second, 0 or more (0: no backlog estimate)"),
    "index_max_chunks": _Spec(_number_in(int, 1, 10**9), "an integer in 1..1000000000"),
    "tenant_isolation": _Spec(_switch, "on or off"),
    "cache_view": _Spec(_choice(*CACHE_VIEWS), "one of " + ", ".join(CACHE_VIEWS)),
    "model_header": _Spec(_optional(_header_name), "a lower-case HTTP header name, or empty for none"),
    "flow_control": _Spec(_switch, "on or off"),
    "flow_queue_tokens": _Spec(_number_in(int, 0, 10**9), "an integer in 0..1000000000 (prefill tokens)"),
    "flow_worse_queue_tokens": _Spec(_number_in(int, 0, 10**9), "an integer in 0..1000000000 (prefill tokens)"),
    "flow_reserve_replicas": _Spec(_number_in(int, 0, 1_000_000), "an integer in 0..1000000 (replicas)"),
    "flow_in_flight": _Spec(_number_in(int, 0, 1_000_000),
                            "an integer in 1..1000000 (requests in flight per replica), or 0 for max_num_seqs"),
    "flow_max_wait": _Spec(_number_in(float, 0.0, 3600.0), "seconds in 0..3600"),
    "flow_max_queue": _Spec(_number_in(int, 0, 1_000_000), "an integer in 0..1000000 (requests held per pool)"),
    "flow_burst_tokens": _Spec(_number_in(int, 0, 100_000_000), "an integer in 0..100000000 (tokens)"),
    "priority": _Spec(_number_in(int, -1000, 1000), "an integer in -1000..1000 (lower is served first)"),
    "priority_header": _Spec(_optional(_header_name), "a lower-case HTTP header name, or empty for none"),
    "vllm_priority": _Spec(_switch, "on or off"),
    "tenant_weights": _Spec(_tenant_weights, "TENANT=WEIGHT pairs separated by commas, weights in 0.01..100"),
    "kv_events": _Spec(_switch, "on or off"),
    "tokenizer": _Spec(_optional(_tokenizer_dirs), "a model directory (tokenizer.json, tokenizer_config.json), "
                       "or NAME=DIR,... per served model name"),
    "kv_events_port": _Spec(_number_in(int, 1, 65535), "a TCP port in 1..65535"),
    "kv_replay_port": _Spec(_number_in(int, 0, 65535), "a TCP port in 1..65535, or 0 for none"),
    "kv_events_topic": _Spec(str.strip, "a ZMQ topic (vLLM's kv-events-config topic; may be empty)"),
    "kv_dp_ranks": _Spec(_number_in(int, 1, 1024), "an integer in 1..1024"),
    "kv_ports_relative": _Spec(_switch, "on or off"),
    "index_max_blocks": _Spec(_number_in(int, 1, 10**10), "an integer in 1..10000000000"),
    "tokenizer_check_every": _Spec(_number_in(int, 0, 10**9),
                                   "an integer in 0..1000000000 (requests per check; 0: off)"),
    "tokenizer_cache_mb": _Spec(_number_in(int, 0, 65536), "an integer in 0..65536 (megabytes; 0: no cache)"),
    "tokenize_inline_chars": _Spec(_number_in(int, 0, 10**9),
                                   "an integer in 0..1000000000 (characters; 0: all inline)"),
    "tokenize_queue_seconds": _Spec(_number_in(float, 0.0, 60.0), "seconds in 0..60"),
    "eviction_forecast": _Spec(_switch, "on or off"),
    "share_in_flight": _Spec(_optional(_redis_url), "a Redis URL (redis://HOST:PORT/DB, rediss://..., "
                             "unix:///PATH), or empty for none"),
    "share_in_flight_channel": _Spec(_nonempty, "a non-empty Redis channel name"),
    "tenant_secret_file": _Spec(_optional(str.strip), "a file holding the tenant isolation secret"),
}
ROUTE_FIELDS: Final = tuple(f.name for f in dataclasses.fields(RouteSettings))
SERVER_FIELDS: Final = tuple(f.name for f in dataclasses.fields(ServerSettings))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def metadata_key(name: str) -> str:
    return METADATA_PREFIX + name.replace("_", "-")


def parse_value(name: str, raw: str, source: str) -> Any:
    """Parse one setting or raise SettingError naming ``source`` and the allowed values."""
    try:
        return SPECS[name].parse(raw)
    except (ValueError, TypeError):
        raise SettingError(f"invalid {source} {raw!r}: must be {SPECS[name].allowed}") from None


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Flags for ``names``, kept as raw strings (default None) so env vars can fill gaps."""
    for name in names:
        default = getattr(RouteSettings(), name, None) if name in ROUTE_FIELDS else getattr(ServerSettings(), name)
        shown = ",".join(default) if isinstance(default, tuple) else default
        parser.add_argument(
            flag(name), dest=name, default=None, metavar=name.upper(),
            help=f"{SPECS[name].allowed} (default {shown}; env {env_var(name)})",
        )


_Settings = TypeVar("_Settings", RouteSettings, ServerSettings)


def _resolve(cls: type[_Settings], args: argparse.Namespace | None, env: Mapping[str, str]) -> _Settings:
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw = getattr(args, field.name, None) if args is not None else None
        if raw is not None:
            values[field.name] = parse_value(field.name, str(raw), flag(field.name))
        elif env_var(field.name) in env:
            values[field.name] = parse_value(field.name, env[env_var(field.name)], env_var(field.name))
    return cls(**values)


def route_settings(args: argparse.Namespace | None, env: Mapping[str, str]) -> RouteSettings:
    """Flags win over env vars, which win over defaults. Raises SettingError."""
    return _resolve(RouteSettings, args, env)


def server_settings(args: argparse.Namespace | None, env: Mapping[str, str]) -> ServerSettings:
    """Like route_settings; also refuses more than one pick-mode endpoint source."""
    cfg: ServerSettings = _resolve(ServerSettings, args, env)
    sources = [flag(n) for n in (*ENDPOINT_SOURCES, "pools") if getattr(cfg, n)]
    if len(sources) > 1:
        raise SettingError(f"{' and '.join(sources)} both set: give pick mode one endpoint source")
    if cfg.kv_events and not (has_endpoints(cfg) and cfg.tokenizer):
        raise SettingError(f"{flag('kv_events')} on needs the replicas' endpoints ({ENDPOINT_FLAGS}) "
                           f"and {flag('tokenizer')}")
    if cfg.share_in_flight and not has_endpoints(cfg):
        raise SettingError(f"{flag('share_in_flight')} is for pick mode: it needs the replicas' endpoints "
                           f"({ENDPOINT_FLAGS})")
    return cfg


def tenant_secret(cfg: ServerSettings, route: RouteSettings, env: Mapping[str, str]) -> bytes | None:
    """Tenant isolation's secret (``--tenant-secret-file``, else $PREFIX_ROUTER_TENANT_SECRET), or None.

    Raises SettingError if the file cannot be read, the secret is under 16 bytes, or
    ``--tenant-isolation on`` has no secret at all.
    """
    if cfg.tenant_secret_file:
        try:
            with open(cfg.tenant_secret_file, "rb") as f:
                secret: bytes | None = f.read().strip()
        except OSError as exc:
            raise SettingError(f"{flag('tenant_secret_file')} {cfg.tenant_secret_file!r}: {exc.strerror}") from None
        source = flag("tenant_secret_file")
    else:
        secret = env[TENANT_SECRET_ENV].strip().encode() if env.get(TENANT_SECRET_ENV, "").strip() else None
        source = TENANT_SECRET_ENV
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise SettingError(f"{source}: the tenant secret must be at least {MIN_SECRET_BYTES} bytes")
    if secret is None and route.tenant_isolation:
        raise SettingError(f"{flag('tenant_isolation')} on needs a secret: {flag('tenant_secret_file')} "
                           f"or {TENANT_SECRET_ENV}")
    return secret


def has_endpoints(cfg: ServerSettings) -> bool:
    return bool(cfg.pools) or any(getattr(cfg, n) for n in ENDPOINT_SOURCES)


_METADATA_FIELDS: Final = {metadata_key(name): name for name in ROUTE_FIELDS}


def with_metadata(
    base: RouteSettings, metadata: Iterable[tuple[str, str | bytes]]
) -> tuple[RouteSettings, list[str]]:
    """Apply ``x-prefix-router-*`` gRPC metadata; bad values are skipped and reported."""
    changes: dict[str, Any] = {}
    errors: list[str] = []
    for key, raw in metadata:
        name = _METADATA_FIELDS.get(key.lower())
        if name is None:
            continue
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        try:
            changes[name] = parse_value(name, text, f"metadata {key}")
        except SettingError as exc:
            errors.append(str(exc))
    return (dataclasses.replace(base, **changes) if changes else base), errors
