"""HTTP and Prometheus-text helpers for talking to vLLM-style servers.

Shared by the launcher, the fidelity check and the benchmark. Only the stdlib and
prometheus-client (a dependency of vLLM too), so the launcher runs in either venv.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    value: float = 0.0


def parse_prometheus(text: str) -> list[Sample]:
    """Parse the Prometheus text exposition format into samples (comments skipped)."""
    return [Sample(sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples]


def metric_sum(samples: list[Sample], name: str) -> float:
    """Sum of all samples called ``name`` (over every label set; 0.0 if absent)."""
    return sum(s.value for s in samples if s.name == name)


def metric_labels(samples: list[Sample], name: str) -> dict[str, str] | None:
    """Labels of the first sample called ``name`` (e.g. ``vllm:cache_config_info``)."""
    for s in samples:
        if s.name == name:
            return dict(s.labels)
    return None


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET ``url``; returns (status, body). Connection errors raise ``OSError``."""
    req = urllib.request.Request(url, method="GET", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post_json(url: str, payload: dict, timeout: float = 120.0) -> tuple[int, dict | str]:
    """POST a JSON body; returns (status, parsed JSON or raw text)."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def fetch_metrics(base_url: str, timeout: float = 5.0) -> list[Sample]:
    status, body = http_get(base_url.rstrip("/") + "/metrics", timeout=timeout)
    if status != 200:
        raise OSError(f"GET {base_url}/metrics -> {status}")
    return parse_prometheus(body.decode(errors="replace"))


QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
CACHE_CONFIG = "vllm:cache_config_info"


def served_model(base_url: str, timeout: float = 10.0) -> str:
    """The first model id a server lists at /v1/models."""
    status, body = http_get(base_url.rstrip("/") + "/v1/models", timeout=timeout)
    if status != 200:
        raise RuntimeError(f"GET {base_url}/v1/models -> {status}")
    return json.loads(body)["data"][0]["id"]


def reset_prefix_cache(base_url: str, timeout: float = 30.0) -> bool:
    """POST /reset_prefix_cache (vLLM needs VLLM_SERVER_DEV_MODE=1); whether it worked."""
    try:
        status, _ = http_post_json(base_url.rstrip("/") + "/reset_prefix_cache", {}, timeout=timeout)
    except OSError:
        return False
    return status == 200


def prefix_counters(base_url: str, timeout: float = 5.0) -> tuple[float, float]:
    """(queries, hits) prefix-cache token counters of one server, summed over engines."""
    samples = fetch_metrics(base_url, timeout)
    return metric_sum(samples, QUERIES), metric_sum(samples, HITS)


def cache_config(base_url: str, timeout: float = 5.0) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...); {} if absent."""
    return metric_labels(fetch_metrics(base_url, timeout), CACHE_CONFIG) or {}
