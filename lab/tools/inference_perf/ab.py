"""A/B with inference-perf: the same workload against stock Envoy and Envoy + the router, each arm on a
fresh simulated fleet.

    .venv/bin/python lab/tools/inference_perf/ab.py --arms round-robin,prefix-pick,prefix-precise --out DIR \\
        [--replicas 4] [--time-scale 1] [--seed N] [--num-blocks N] [--max-num-seqs 64] [--smoke] \\
        [inference-perf key=value overrides ...]

For each arm in turn:
1. a fresh `prefix-router sim` fleet as the benchmark starts one for a run with a precise arm
   (routerlab.bench.backends.SimBackend): profile llama-3.1-70b-h100-tp8, the lab's tiny byte-level
   tokenizer (the one run.sh mounts into inference-perf, so prompt lengths are counted in the tokens
   the replicas see), KV-cache events on, max_num_seqs 64, --num-blocks per replica (below);
2. the arm as the benchmark runs it (routerlab.harness.arm.RunningArm): Envoy from the shipped config,
   the router(s) for prefix arms with the benchmark's settings (prefix length of the shared-prefix
   scenario, x-prefix-router-max-num-seqs = the fleet's max_num_seqs, the fleet's event flags for
   precise arms, router /metrics for pick arms);
3. `run.sh <arm url> DIR/<arm> <overrides>`: inference-perf in its container (see README.md);
4. the replicas' counters, the router's decisions and Envoy's ext_proc stats around the run, and one
   probe request shaped like inference-perf's (a chat message with one text part) to read the routing
   header Envoy echoes (ROUTED_HEADER);
5. everything it started stopped, by PID (also on an error, Ctrl-C or SIGTERM).

The workload: config.template.yaml (64 groups x 16 prompts, 2048-token system prompts, 128-token
questions, concurrency 16, 1024 requests, chat wire) with output_len=128 (the template says 256), then
--seed (data.shared_prefix.seed and load.base_seed), then the caller's overrides (driver.py's keys).
--smoke: num_groups=4 num_prompts_per_group=4 output_len=16 concurrency=4 max_seconds=180 and
--time-scale 10 (unless given): about 20 s for two arms on this machine.

KV per replica (--num-blocks, default from the workload): inference-perf's prompt of S system + Q
question tokens becomes S + Q + 5 tokens on the simulator (measured: 2048 + 128 -> 2181 prompt_tokens,
the chat template and the joining space; the random-token text re-tokenises to the same count), and a
group's shared prefix is S tokens plus the template's head. As the lab's shared-prefix scenario sizes it:
every group's system prompt together (groups x blocks(S + 16)) is twice the fleet's KV,
    num_blocks = ceil(groups * blocks(S + 16) / (replicas * 2)) + 1   (1033 for the full workload)
but never less than two whole requests (a small workload still runs; a request larger than a
replica's KV would never be scheduled):
    2 * blocks(S + Q + output + 16) + 1   (277 for --smoke, whose 4 groups would get 66)

Writes DIR/ab.md (a table, one row per arm, the commands, the routing checks) and DIR/ab.json, after
each arm (a long run interrupted keeps the arms done); prints the table at the end.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
RUN_SH = HERE / "run.sh"
sys.path.insert(0, str(HERE))
import driver as ip_driver  # noqa: E402  (the container's config builder: the same overrides, the same config)

from routerlab.assets import TINY_BYTELEVEL  # noqa: E402
from routerlab.bench import arms as arms_mod  # noqa: E402
from routerlab.bench import backends, replica_metrics  # noqa: E402
from routerlab.bench.runner import scrape_fleet  # noqa: E402
from routerlab.bench.scenarios import FleetSpec  # noqa: E402
from routerlab.bench.scenarios import get as get_scenario  # noqa: E402
from routerlab.bench.scenarios.parts import TEMPLATE_TOKENS, blocks  # noqa: E402
from routerlab.bench.scenarios.shared_prompts import groups_kv_blocks  # noqa: E402
from routerlab.harness.arm import ROUTED_HEADER, UPSTREAM_HEADER  # noqa: E402
from routerlab.realvllm.promtext import fetch_metrics  # noqa: E402
from routerlab.sim.profiles import get_profile  # noqa: E402

PROFILE = "llama-3.1-70b-h100-tp8"
PRESSURE = 2.0  # every group's system prompt together / the fleet's KV
AB_DEFAULTS = ("output_len=128",)
SMOKE = ("num_groups=4", "num_prompts_per_group=4", "output_len=16", "concurrency=4", "max_seconds=180")
SMOKE_TIME_SCALE = 10.0
# the workload that mirrors inference-perf's shared_prefix in the lab: its router prefix length
PREFIX_LENGTH = get_scenario("shared-prefix").prefix_length


def say(msg: str) -> None:
    print(f"ab: {msg}", flush=True)


class Stop(BaseException):
    """SIGTERM: unwind like Ctrl-C, so every finally block stops what it started."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Stop()


# --- the workload and the fleet -----------------------------------------------------------------

def workload(overrides: Sequence[str]) -> dict[str, Any]:
    """The effective inference-perf workload (driver.build_config, as the container will build it)."""
    cfg, drv = ip_driver.build_config("http://127.0.0.1:1", list(overrides))
    shared = cfg["data"]["shared_prefix"]
    stage = cfg["load"]["stages"][0]
    return {"num_groups": int(shared["num_groups"]), "num_prompts_per_group": int(shared["num_prompts_per_group"]),
            "system_prompt_len": int(shared["system_prompt_len"]), "question_len": int(shared["question_len"]),
            "output_len": int(shared["output_len"]), "seed": shared.get("seed"), "load_type": cfg["load"]["type"],
            "concurrency": int(stage.get("concurrency_level") or 1), "num_requests": stage.get("num_requests"),
            "wire": drv["wire"], "max_seconds": drv["max_seconds"]}


def merged(overrides: Sequence[str]) -> list[str]:
    """key=value overrides, a later one replacing an earlier one of the same key (in its place)."""
    out: dict[str, str] = {}
    for item in overrides:
        key = item.partition("=")[0]
        out.pop(key, None)
        out[key] = item
    return list(out.values())


def default_num_blocks(w: Mapping[str, Any], replicas: int) -> tuple[int, str]:
    """KV blocks per replica (the null block included) for workload ``w``, and why."""
    prefix = blocks(w["system_prompt_len"] + TEMPLATE_TOKENS)
    request = blocks(w["system_prompt_len"] + w["question_len"] + w["output_len"] + TEMPLATE_TOKENS)
    by_pressure = groups_kv_blocks(w["num_groups"], w["system_prompt_len"], replicas, PRESSURE)
    floor = 2 * request + 1  # two whole requests: a small workload still runs (one request > KV would hang)
    why = (f"{w['num_groups']} groups x {prefix} blocks of system prompt = {w['num_groups'] * prefix} blocks, "
           f"{PRESSURE:g}x the fleet's {replicas} x {by_pressure - 1}")
    if floor > by_pressure:
        why = (f"two whole requests of {request} blocks + 1: the {PRESSURE:g}x-pressure size, {by_pressure}, "
               "would not hold them")
    return max(by_pressure, floor), why


def fleet_spec(args: argparse.Namespace, num_blocks: int) -> FleetSpec:
    """The benchmark's fleet for a run with a precise arm (runner.with_real_tokenizer): the real tiny
    tokenizer and KV-cache events, for every arm alike."""
    return FleetSpec(replicas=args.replicas, profile=PROFILE, time_scale=args.time_scale, num_blocks=num_blocks,
                     max_num_seqs=args.max_num_seqs, tokenizer=str(TINY_BYTELEVEL), kv_events=True)


# --- what the processes counted -----------------------------------------------------------------

ROUTER_FAMILIES = {
    "prefix_router_decisions_total": ("normalize", "fallback"),
    "prefix_router_pick_decisions_total": ("reason",),
    "prefix_router_cache_view_total": ("view", "reason"),
}


def router_counters(ports: Sequence[int]) -> dict[str, float]:
    """The routers' decisions, pick reasons and cache views, summed over the arm's routers:
    ``family{label=value,...}`` -> count."""
    out: dict[str, float] = {}
    for port in ports:
        try:
            samples = fetch_metrics(f"http://127.0.0.1:{port}")
        except OSError:
            continue
        for s in samples:
            labels = ROUTER_FAMILIES.get(s.name)
            if labels is None:
                continue
            key = s.name + "{" + ",".join(f"{k}={s.labels.get(k, '')}" for k in labels) + "}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def counted(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in sorted(after.items()) if v - before.get(k, 0.0)}


def probe(url: str, model: str) -> dict[str, Any]:
    """One request shaped like inference-perf's (a chat message with one text part): which replica
    took it, and the router's routing header Envoy echoes (empty or '-': Envoy sent it on unkeyed)."""
    text = "ab.py probe " + "lorem ipsum dolor sit amet " * 40
    body = json.dumps({"model": model, "max_tokens": 1, "stream": False,
                       "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, headers = resp.status, resp.headers
            resp.read()
    except urllib.error.HTTPError as e:
        status, headers = e.code, e.headers
    except OSError as e:
        return {"error": str(e)}
    routed = headers.get(ROUTED_HEADER)
    return {"status": status, "upstream": headers.get(UPSTREAM_HEADER), "routed_header": routed,
            "routed": bool(routed) and routed != "-", "routed_to": _decoded(routed)}


def _decoded(value: str | None) -> str | None:
    """Pick mode's header is the chosen replica's host:port in base64 (key mode's a key: None)."""
    if not value or value == "-":
        return None
    try:
        text = base64.b64decode(value, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return text if text.isprintable() and ":" in text else None


# --- inference-perf -----------------------------------------------------------------------------

def stop_run(proc: subprocess.Popen[str]) -> None:
    """Stop run.sh (its own process group: sh and the docker client) and its container.

    SIGINT first: the docker client forwards it to the driver (PID 1 in the container), which exits,
    and run.sh's traps remove the container; then SIGTERM, SIGKILL; last, `docker rm -f` of the
    container run.sh named after its PID, if it is still there."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    name = f"routerlab-inference-perf-{proc.pid}"
    found = subprocess.run(["docker", "ps", "-aq", "--filter", f"name=^{name}$"], capture_output=True, text=True,
                           check=False)
    if found.stdout.strip():
        say(f"removing container {name}")
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)


def run_inference_perf(url: str, out: Path, overrides: Sequence[str]) -> int:
    """run.sh against ``url`` into ``out``; its lines echoed (indented) and kept in out/run.log."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(RUN_SH), url, str(out), *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # Ctrl-C reaches us only; stop_run stops it in order
    try:
        assert proc.stdout is not None
        with (out / "run.log").open("w") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                print("    " + line.rstrip(), flush=True)
        return proc.wait()
    finally:
        if proc.poll() is None:
            stop_run(proc)


def ip_summary(out: Path) -> dict[str, Any]:
    """TTFT p50/p90 (ms), req/s, ok/failed, cached share of prompt tokens, from inference-perf's report."""
    reports = sorted((out / "reports").rglob("summary_lifecycle_metrics.json"))
    if not reports:
        return {}
    data = json.loads(reports[-1].read_text())
    ok = data.get("successes") or {}
    ttft = (ok.get("latency") or {}).get("time_to_first_token") or {}
    prompt = ok.get("prompt_tokens") or {}
    line = (out / "summary.txt").read_text().strip() if (out / "summary.txt").exists() else ""

    def ms(key: str) -> float | None:
        return round(ttft[key] * 1000, 1) if ttft.get(key) is not None else None

    return {
        "ttft_p50_ms": ms("median"), "ttft_p90_ms": ms("p90"), "ttft_mean_ms": ms("mean"),
        "requests_per_s": (ok.get("throughput") or {}).get("requests_per_sec"),
        "ok": ok.get("count", 0), "failed": (data.get("failures") or {}).get("count", 0),
        "prompt_tokens": prompt.get("total"), "prompt_tokens_mean": prompt.get("mean"),
        "cached_share": (prompt.get("cached", 0) / prompt["total"]) if prompt.get("total") else None,
        "stopped_at_max_seconds": "stopped at max_seconds" in line,
        "report": str(reports[-1]), "summary_line": line,
    }


# --- one arm ------------------------------------------------------------------------------------

def run_arm(label: str, spec: FleetSpec, overrides: Sequence[str], out: Path, index: str) -> dict[str, Any]:
    arm = arms_mod.get(label)
    settings = {"max-num-seqs": str(spec.max_num_seqs)}  # as runner.run_bench passes it for a sim fleet
    row: dict[str, Any] = {"arm": label, "summary": arm.summary, "out": str(out), "router_settings": settings,
                           "prefix_length": PREFIX_LENGTH}
    started = time.monotonic()
    backend = backends.SimBackend(spec)
    say(f"{index} {label}: starting the fleet ({spec.replicas} x {spec.profile}, num_blocks {spec.num_blocks}, "
        f"max_num_seqs {spec.max_num_seqs}, time scale {spec.time_scale:g}, events on) and the arm ({arm.summary})")
    try:
        backend.start()  # inside the try: an interrupted start still stops what it started
        with arms_mod.RunningArm(arm, backend.urls, prefix_length=PREFIX_LENGTH,
                                 balance_factor=arms_mod.DEFAULT_BALANCE_FACTOR, router_settings=settings,
                                 event_flags=backend.event_flags(), router_metrics=arm.pick) as running:
            row["pids"] = {**backend.pids, **running.pids}
            row["url"] = running.url
            cmd = [str(RUN_SH.relative_to(REPO)), running.url, str(out), *overrides]
            row["command"] = shlex.join(cmd)
            before, router_before = scrape_fleet(backend.urls), router_counters(running.metrics_ports)
            say(f"{label}: inference-perf running against {running.url} (pids {row['pids']}): {row['command']}")
            row["rc"] = run_inference_perf(running.url, out, overrides)
            after, router_after = scrape_fleet(backend.urls), router_counters(running.metrics_ports)
            row["envoy"] = running.envoy_stats()
            row["probe"] = probe(running.url, get_profile(spec.profile).model)
    finally:
        backend.stop()
    row["seconds"] = round(time.monotonic() - started, 1)
    row.update(ip_summary(out))
    if before and after:
        fleet = replica_metrics.delta(before, after)
        requests = sum(r.requests for r in fleet.per_replica)
        row["fleet"] = {"kv_hit_rate": fleet.kv_hit_rate, "requests_per_replica": fleet.requests_per_replica,
                        "prompt_tokens_per_request": (sum(r.prompt_tokens for r in fleet.per_replica) / requests
                                                      if requests else None)}
    row["router"] = counted(router_after, router_before)
    row["routing"] = routing_check(arm, row)
    return row


def routing_check(arm: arms_mod.ArmSpec, row: Mapping[str, Any]) -> str:
    """Whether the router routed every request: its decisions (pick arms serve /metrics) and Envoy's
    ext_proc counters (a request Envoy sent on without the router: failure_mode_allowed), and the probe."""
    if not arm.prefix:
        return "stock Envoy (no router)"
    envoy = row.get("envoy") or {}
    unkeyed = sum(v for k, v in envoy.items() if k.endswith("failure_mode_allowed"))
    streams = sum(v for k, v in envoy.items() if k.endswith("streams_started"))
    served = sum((row.get("fleet") or {}).get("requests_per_replica") or [])
    parts = [f"ext_proc streams {int(streams)}, unkeyed {int(unkeyed)}"]
    router = row.get("router") or {}
    if router:
        fallback: dict[str, int] = {}
        for key, n in router.items():
            if key.startswith("prefix_router_decisions_total{"):
                fb = key.partition("fallback=")[2].split(",")[0].rstrip("}")
                fallback[fb or "none"] = fallback.get(fb or "none", 0) + n
        parts.append("router decisions by fallback: " + ", ".join(f"{k} {v}" for k, v in sorted(fallback.items())))
        picks = {k.partition("reason=")[2].rstrip("}"): v for k, v in router.items()
                 if k.startswith("prefix_router_pick_decisions_total{")}
        if picks:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(picks.items()))
            parts.append(f"picks {sum(picks.values())} by reason: {reasons}")
        views = {k.partition("{")[2].rstrip("}"): v for k, v in router.items()
                 if k.startswith("prefix_router_cache_view_total{")}
        if views:
            parts.append("cache views " + ", ".join(f"{k} {v}" for k, v in sorted(views.items())))
    parts.append(f"replicas served {served} chat requests")
    p = row.get("probe") or {}
    if "routed" in p:
        to = f" = {p['routed_to']}" if p.get("routed_to") else ""
        parts.append(f"probe: {ROUTED_HEADER} {p['routed_header'] or '(absent)'}{to}, {UPSTREAM_HEADER} "
                     f"{p.get('upstream')}")
    return "; ".join(parts)


# --- the outputs --------------------------------------------------------------------------------

def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "n/a"
    return format(v, spec) if spec else str(v)


TABLE_HEAD = ("| arm | TTFT p50 ms | TTFT p90 ms | req/s | ok / failed | cached (inference-perf) | "
              "fleet hit rate | requests per replica | s |")


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [TABLE_HEAD, "|" + " --- |" * (TABLE_HEAD.count("|") - 1)]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['arm']} | failed: {r['error']} |" + " |" * 7)
            continue
        fleet = r.get("fleet") or {}
        cached = r.get("cached_share")
        hit = fleet.get("kv_hit_rate")
        stopped = " (max_seconds)" if r.get("stopped_at_max_seconds") else ""
        lines.append(
            f"| {r['arm']} | {_fmt(r.get('ttft_p50_ms'))} | {_fmt(r.get('ttft_p90_ms'))} | "
            f"{_fmt(r.get('requests_per_s'), '.2f')}{stopped} | {r.get('ok', 0)} / {r.get('failed', 0)} | "
            f"{_fmt(None if cached is None else 100 * cached, '.1f')}% | "
            f"{_fmt(None if hit is None else 100 * hit, '.1f')}% | "
            f"{' '.join(map(str, fleet.get('requests_per_replica') or [])) or 'n/a'} | {_fmt(r.get('seconds'))} |")
    return "\n".join(lines)


def write_outputs(out: Path, meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    tab = table(rows)
    (out / "ab.json").write_text(json.dumps({**meta, "arms": list(rows)}, indent=2, default=str) + "\n")
    w = meta["workload"]
    md = [
        "# inference-perf A/B",
        "",
        f"inference-perf 0.7.0 shared_prefix ({w['wire']} wire, {w['load_type']} load): {w['num_groups']} groups x "
        f"{w['num_prompts_per_group']} prompts, system {w['system_prompt_len']} + question {w['question_len']} "
        f"tokens, output {w['output_len']}, concurrency {w['concurrency']}, {w['num_requests']} requests. "
        f"Fleet per arm: {meta['fleet']['replicas']} x `prefix-router sim` {meta['fleet']['profile']}, tiny "
        f"byte-level tokenizer, KV-cache events, max_num_seqs {meta['fleet']['max_num_seqs']}, "
        f"num_blocks {meta['fleet']['num_blocks']} per replica ({meta['num_blocks_basis']}), time scale "
        f"{meta['fleet']['time_scale']:g}.",
        "",
        tab,
        "",
        "TTFT and req/s are inference-perf's (client side); cached is the share of prompt tokens the replicas "
        "reported as cached in `usage`; fleet hit rate is the replicas' own prefix-cache counters over the run.",
        "",
        "## Routing",
        "",
        *[f"- {r['arm']}: {r.get('routing') or r.get('error', '')}" for r in rows],
        "",
        "## Commands",
        "",
        "```sh",
        meta["command"],
        *[f"# {r['arm']}: {r['command']}" for r in rows if r.get("command")],
        "```",
        "",
    ]
    (out / "ab.md").write_text("\n".join(md))
    return tab


# --- main ---------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="round-robin,prefix-pick,prefix-precise",
                    help="comma-separated arms of routerlab.bench.arms (default %(default)s); NAME#2 runs NAME again")
    ap.add_argument("--out", required=True, type=Path, help="output directory: DIR/<arm>/, DIR/ab.md, DIR/ab.json")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=None, help="the simulator's (default 1; 10 with --smoke)")
    ap.add_argument("--seed", type=int, default=None,
                    help="inference-perf's data.shared_prefix.seed and load.base_seed (default the template's 1)")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks per replica (default: from the workload, see above)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="per replica, and the router's max-num-seqs setting")
    ap.add_argument("--smoke", action="store_true", help="a tiny workload at time scale 10: about a minute")
    ap.add_argument("overrides", nargs="*", help="inference-perf key=value overrides (driver.py), applied last")
    args = ap.parse_args(argv)

    labels = [a.strip() for a in args.arms.split(",") if a.strip()]
    for label in labels:
        try:
            arm = arms_mod.get(label)
        except ValueError as e:
            ap.error(str(e))
        if not arm.available:
            ap.error(f"{label}: not installed (pip install './lab[peers]')")
    if len(set(labels)) != len(labels):
        ap.error("an arm twice: run it again under its own label (NAME#2)")
    if args.time_scale is None:
        args.time_scale = SMOKE_TIME_SCALE if args.smoke else 1.0
    seed = [f"seed={args.seed}", f"load.base_seed={args.seed}"] if args.seed is not None else []
    overrides = merged([*AB_DEFAULTS, *(SMOKE if args.smoke else ()), *seed, *args.overrides])
    w = workload(overrides)  # also rejects a bad override before anything starts
    if args.num_blocks is not None:
        num_blocks, basis = args.num_blocks, "--num-blocks"
    else:
        num_blocks, basis = default_num_blocks(w, args.replicas)
    spec = fleet_spec(args, num_blocks)

    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([".venv/bin/python", str(Path(__file__).resolve().relative_to(REPO)),
                          *(sys.argv[1:] if argv is None else argv)])
    meta = {"command": command, "overrides": overrides, "workload": w, "fleet": dataclasses.asdict(spec),
            "num_blocks_basis": basis, "prefix_length": PREFIX_LENGTH, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    say(f"{len(labels)} arms ({', '.join(labels)}); workload {w['num_groups']} groups x {w['num_prompts_per_group']} "
        f"prompts, system {w['system_prompt_len']} + question {w['question_len']}, output {w['output_len']}, "
        f"concurrency {w['concurrency']}, {w['num_requests']} requests; num_blocks {num_blocks} per replica "
        f"({basis}); out {out}")

    # Ctrl-C and SIGTERM unwind through every finally (also when started with SIGINT ignored: `&` in a script)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_sigterm)
    rows: list[dict[str, Any]] = []
    interrupted = False
    label = ""
    try:
        for i, label in enumerate(labels):
            arm_out = out / label.replace("#", "-")
            try:
                row = run_arm(label, spec, overrides, arm_out, f"[{i + 1}/{len(labels)}]")
            except Exception as e:  # noqa: BLE001  (the next arm still runs; this one says why it did not)
                row = {"arm": label, "out": str(arm_out), "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                say(f"{label}: failed: {row['error']}")
            rows.append(row)
            if not row.get("error"):
                say(f"{label}: done in {row['seconds']:.0f} s: {row.get('summary_line') or 'no summary (see run.log)'}")
                say(f"{label}: fleet hit rate {_fmt((row.get('fleet') or {}).get('kv_hit_rate'), '.1%')}, requests "
                    f"per replica {(row.get('fleet') or {}).get('requests_per_replica')}; routing: {row['routing']}")
            write_outputs(out, meta, rows)
    except (KeyboardInterrupt, Stop):
        interrupted = True
        done = f"the arms done ({', '.join(r['arm'] for r in rows)}) are in ab.md" if rows else "no arm was done"
        say(f"interrupted during {label}: everything it started is stopped; {done}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if rows:
        tab = write_outputs(out, meta, rows)
        print()
        print(tab, flush=True)
        print()
        say(f"wrote {out / 'ab.md'} and {out / 'ab.json'}")
    if interrupted:
        return 130
    return 1 if any(r.get("error") or r.get("rc") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
