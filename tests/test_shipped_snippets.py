"""The README's "Drop into an existing Envoy" snippet is a part of envoy/envoy.yaml, the
file `envoy --mode validate` accepts and the end-to-end tests run, so it cannot drift."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from routerlab.harness import envoy_config

ROOT = Path(__file__).resolve().parents[1]


def readme_block(heading: str) -> Any:
    """The first ```yaml block after ``heading`` in README.md."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(f"\n{heading}\n"):]
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))


def contained(part: Any, whole: Any) -> bool:
    """``part`` is ``whole`` with some keys or list items left out."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and contained(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and all(any(contained(p, w) for w in whole) for p in part)
    return part == whole


def test_drop_in_snippet_is_part_of_the_shipped_config() -> None:
    snippet = readme_block("## Drop into an existing Envoy")
    cfg = envoy_config.load("envoy.yaml")
    listener = cfg["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert set(snippet) == {"http_filters", "route", "clusters"}
    for item in snippet["http_filters"]:
        assert contained(item, hcm["http_filters"][names.index(item["name"])]), item["name"]
    assert [n for n in names if n in {f["name"] for f in snippet["http_filters"]}] == \
        [f["name"] for f in snippet["http_filters"]]
    assert names.index("envoy.filters.http.ext_proc") < names.index("envoy.filters.http.router")
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert contained(snippet["route"], route)
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    for cluster in snippet["clusters"]:
        assert contained(cluster, clusters[cluster["name"]]), cluster["name"]


def test_containment_notices_a_changed_value() -> None:
    assert contained({"a": [{"b": 1}]}, {"a": [{"b": 1, "c": 2}], "d": 3})
    assert not contained({"a": [{"b": 2}]}, {"a": [{"b": 1, "c": 2}]})
    assert not contained({"e": 1}, {"a": 1})
