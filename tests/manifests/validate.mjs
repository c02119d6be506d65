// Validates Kubernetes custom resources against the schemas published for them, offline
// (Istio, Envoy Gateway, Gateway API, prometheus-operator's PrometheusRule).
// Used by tests/test_manifests.py; install the schemas once with `npm ci --prefix tests/manifests`.
//
// stdin:  {"documents": [{"where": "<label>", "doc": {<one resource>}}, ...]}
// stdout: {"packages": {name: version}, "results": [{"where", "model", "errors": [...]}]}
//
// Two checks per resource, both from @kubernetes-models packages generated from the
// projects' published CRDs / API types:
//  1. the package's JSON-schema validator (Ajv, compiled from the CRD's openAPIV3Schema):
//     types, enums, required fields, patterns, numeric ranges, formats;
//  2. the package's TypeScript declarations, generated from the same schema: the resource
//     becomes an object literal of the resource's interface type and `tsc` type-checks it.
//     Excess-property checks reject unknown fields (what the API server's strict field
//     validation, kubectl's default, rejects); schema parts marked
//     x-kubernetes-preserve-unknown-fields (EnvoyFilter patch values, EnvoyPatchPolicy values)
//     are typed `{}`/any and accept any object, as the API server does.
// Not checked: CEL rules (x-kubernetes-validations) and anything only a controller checks.
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import ts from "typescript";

const here = dirname(fileURLToPath(import.meta.url));

// API group -> the npm package holding its published schema.
const PACKAGES = {
  "networking.istio.io": "@kubernetes-models/istio",
  "security.istio.io": "@kubernetes-models/istio",
  "telemetry.istio.io": "@kubernetes-models/istio",
  "extensions.istio.io": "@kubernetes-models/istio",
  "gateway.envoyproxy.io": "@kubernetes-models/envoy-gateway",
  "gateway.networking.k8s.io": "@kubernetes-models/gateway-api",
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
};

function modelModule(doc) {
  const [group, version] = String(doc.apiVersion || "").split("/");
  const pkg = PACKAGES[group];
  if (!pkg || !version || !doc.kind) return null;
  return `${pkg}/${group}/${version}/${doc.kind}`;
}

function packageVersions() {
  const out = {};
  for (const name of [...new Set(Object.values(PACKAGES)), "typescript"]) {
    out[name] = JSON.parse(readFileSync(join(here, "node_modules", name, "package.json"), "utf8")).version;
  }
  return out;
}

function ajvErrors(err) {
  const list = Array.isArray(err?.errors) ? err.errors : null;
  if (!list) return [String(err?.message || err)];
  return list.map((e) => `${e.instancePath || "/"} ${e.message}${e.params ? " " + JSON.stringify(e.params) : ""}`);
}

async function schemaCheck(items) {
  for (const item of items) {
    if (!item.model) continue;
    let mod;
    try {
      mod = await import(item.model);
    } catch (err) {
      item.errors.push(`no published schema module ${item.model}: ${err.message}`);
      item.model = null;
      continue;
    }
    const Model = mod[item.doc.kind];
    if (typeof Model !== "function") {
      item.errors.push(`${item.model} exports no model ${item.doc.kind}`);
      item.model = null;
      continue;
    }
    try {
      new Model(item.doc).validate();
    } catch (err) {
      item.errors.push(...ajvErrors(err).map((e) => `schema: ${e}`));
    }
  }
}

function typeCheck(items) {
  const checked = items.filter((i) => i.model);
  if (checked.length === 0) return;
  const lines = [];
  const spans = []; // [first line, last line, item]
  checked.forEach((item, n) => {
    lines.push(`import type { I${item.doc.kind} as T${n} } from "${item.model}";`);
  });
  checked.forEach((item, n) => {
    const body = JSON.stringify(item.doc, null, 1).split("\n");
    const first = lines.length;
    lines.push(`export const d${n}: T${n} = ${body[0]}`, ...body.slice(1));
    lines[lines.length - 1] += ";";
    spans.push([first, lines.length - 1, item]);
  });
  const file = join(here, "__manifests__.mts"); // virtual: resolves node_modules from here
  const source = lines.join("\n");
  const options = {
    strict: true, noEmit: true, skipLibCheck: true, types: [],
    target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.NodeNext, moduleResolution: ts.ModuleResolutionKind.NodeNext,
  };
  const host = ts.createCompilerHost(options);
  const getSourceFile = host.getSourceFile.bind(host);
  const fileExists = host.fileExists.bind(host);
  const readFile = host.readFile.bind(host);
  host.getSourceFile = (name, lang, ...rest) =>
    name === file ? ts.createSourceFile(name, source, lang, true) : getSourceFile(name, lang, ...rest);
  host.fileExists = (name) => name === file || fileExists(name);
  host.readFile = (name) => (name === file ? source : readFile(name));
  const program = ts.createProgram([file], options, host);
  for (const diag of ts.getPreEmitDiagnostics(program)) {
    const text = ts.flattenDiagnosticMessageText(diag.messageText, "\n");
    if (!diag.file || diag.file.fileName !== file || diag.start === undefined) {
      for (const item of checked) item.errors.push(`types: ${text}`);
      continue;
    }
    const { line } = diag.file.getLineAndCharacterOfPosition(diag.start);
    const span = spans.find(([a, b]) => line >= a && line <= b);
    const where = diag.file.text.split("\n")[line].trim();
    (span ? [span[2]] : checked).forEach((item) => item.errors.push(`types: ${text} (at ${where})`));
  }
}

const input = JSON.parse(readFileSync(0, "utf8"));
const items = input.documents.map(({ where, doc }) => ({ where, doc, model: modelModule(doc), errors: [] }));
for (const item of items) {
  if (!item.model) item.errors.push(`no published schema known for ${item.doc.apiVersion} ${item.doc.kind}`);
}
await schemaCheck(items);
typeCheck(items);
process.stdout.write(JSON.stringify({
  packages: packageVersions(),
  results: items.map(({ where, model, errors }) => ({ where, model, errors })),
}));
