"""The overhead report: its notes (what may have limited a phase), its Markdown tables, its files."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from routerlab.bench import drill
from routerlab.bench.overhead.events import NOT_COVERED, has_events
from routerlab.bench.overhead.figures import median
from routerlab.bench.overhead.plan import LATENCY_CONNECTIONS, Config

SATURATED_SHARE = 0.85  # of one core: a process this busy may be the limit
FOREIGN_CORES = 0.25  # other processes' CPU (in cores) above which the report warns


def notes(report: Mapping[str, Any], cfg: Config) -> list[str]:
    out = []
    phases = report["phases"]
    errors = sum(sum(p["errors"].values()) for p in phases)
    if errors:
        out.append(f"{errors} requests failed or timed out (wrk errors); see report.json phases[].errors.")
    for key, what in (("failure_mode_allowed", "went on without the router's answer (failure_mode_allow)"),
                      ("message_timeouts", "hit the ext_proc message timeout"),
                      ("spurious_msgs_received", "got a reply Envoy did not expect (spurious message)")):
        n = sum(p["counts"].get(key, 0) for p in phases)
        if n:
            out.append(f"{n:.0f} requests {what}: those phases do not measure the full hop.")
    for config in dict.fromkeys(p["config"] for p in phases if has_events(p["config"])):
        mine = [p for p in phases if p["config"] == config and p["arm"] == "router"]
        taken = sum(p["counts"].get("events_covered", 0) for p in mine)
        other = sum(p["counts"].get("not_covered", 0) for p in mine)
        why: Counter[str] = Counter()
        for p in mine:
            why.update({k.removeprefix(NOT_COVERED): n for k, n in p["counts"].items()
                        if k.startswith(NOT_COVERED) and n})
        reasons = ", ".join(f"{k} {n:.0f}" for k, n in why.most_common())
        out.append(f"{config}: the router's requests in its phases took the events view (prefix_router_cache_view_total"
                   f"{{view=\"events\",reason=\"covered\"}}) {taken:.0f} times, another view {other:.0f} times"
                   + (f" ({reasons})" if reasons else "")
                   + (": those phases do not measure precise mode alone." if other else "."))
    limit = SATURATED_SHARE * cfg.threads
    busy_wrk = [p for p in phases if p["cpu_share"]["generator"] >= limit]
    if busy_wrk:
        worst = max(busy_wrk, key=lambda p: p["cpu_share"]["generator"])
        out.append(f"wrk used >= {limit:.0%} of a core in {len(busy_wrk)} phases "
                   f"(worst {worst['cpu_share']['generator']:.0%}, {worst['config']} {worst['size_kb']} KB "
                   f"c={worst['connections']} {worst['arm']}): there it may be the limit; raise --param threads.")
    busy_backend = [p for p in phases if p["backend_max_share"] >= SATURATED_SHARE]
    if busy_backend:
        out.append(f"a zero-work backend process used >= {SATURATED_SHARE:.0%} of a core in {len(busy_backend)} "
                   f"phases: add backends (--replicas).")
    foreign = [p["other_cores"] for p in phases if p["other_cores"] is not None]
    foreign_median = median(foreign)  # None without a phase that measured it
    if foreign_median is not None and foreign_median > FOREIGN_CORES:
        out.append(f"other processes on this machine used {foreign_median:.2f} cores (median over phases; max "
                   f"{max(foreign):.2f}) while it ran: figures include their noise, compare rows of one run.")
    wake = report["setup"].get("wake_round_trip_us") or {}
    if wake.get("across_cpus") is not None:
        out.append(f"A one-byte round trip between two processes took {wake['same_cpu']} us on one CPU and "
                   f"{wake['across_cpus']} us across two (routerlab.bench.overhead.wake, before the run): at one "
                   "connection each hop of a request may pay the second (a process woken on the other CPU).")
    if cfg.http_floor == "bare":
        out.append("The HTTP floor is the barest httptools server (--param http_floor=bare), not the router's own "
                   "server code: it shows what Envoy and the protocol cost alone; its calls/req count health checks "
                   "too.")
    out.append("On this machine everything (wrk, Envoy, the ext_proc server, the backends) shares the same "
               f"{os.cpu_count()} cores: requests/s at 16 and 64 connections is bounded by the CPU per request of "
               "all of them together, which the CPU columns break down.")
    return out


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown(report: Mapping[str, Any]) -> str:
    params = report["params"]
    levels = [str(LATENCY_CONNECTIONS), *(str(c) for c in params["connections"] if c != LATENCY_CONNECTIONS)]
    throughput = levels[1:]
    cpu_at = throughput[0] if throughput else levels[0]
    head = ["config", "body", "arm", "p50 ms @1", "added p50 ms @1", "added p99 ms @1"]
    for c in throughput:
        head += [f"req/s @{c}", f"vs alone @{c}"]
    head += [f"ext_proc us CPU/req @{cpu_at}", f"Envoy us CPU/req @{cpu_at}", f"backends us CPU/req @{cpu_at}"]
    head += [f"wrk CPU @{c}" for c in throughput]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|" + "---:|" * (len(head) - 3)]
    for row in report["cells"]:
        by = row["by_connections"]
        cells = [row["config"], f"{row['size_kb']} KB", row["arm"], _fmt(row["p50_ms"], 3),
                 _fmt(row["added_p50_ms"], 3), _fmt(row["added_p99_ms"], 3)]
        for c in throughput:
            cells += [_fmt(by[c]["rps"], 0), _fmt(by[c]["ratio_to_alone"], 2)]
        cpu = by[cpu_at]["cpu_us_per_request"]
        cells += [_fmt(cpu.get("ext_proc"), 0), _fmt(cpu.get("envoy"), 0), _fmt(cpu.get("backends"), 0)]
        cells += [_fmt(_pct(by[c]["cpu_share"].get("generator")), 0, "%") for c in throughput]
        lines.append("| " + " | ".join(cells) + " |")
    detail = ["| config | body | arm | connections | req/s | p50 ms | p99 ms | ext_proc us/req | Envoy us/req "
              "| backends us/req | wrk us/req | ext_proc / Envoy / backends / wrk CPU, % of a core | busiest backend "
              "| machine busy | other load (cores) | router calls/req | messages/call |",
              "|---|---:|---|---:|" + "---:|" * 13]
    for row in report["cells"]:
        for c in levels:
            lv = row["by_connections"][c]
            cpu, share = lv["cpu_us_per_request"], lv["cpu_share"]
            shares = " / ".join(_fmt(_pct(share.get(k)), 0) for k in ("ext_proc", "envoy", "backends", "generator"))
            detail.append(
                f"| {row['config']} | {row['size_kb']} KB | {row['arm']} | {c} | {_fmt(lv['rps'], 0)} "
                f"| {_fmt(lv['p50_ms'], 3)} | {_fmt(lv['p99_ms'], 3)} | {_fmt(cpu.get('ext_proc'), 0)} "
                f"| {_fmt(cpu.get('envoy'), 0)} | {_fmt(cpu.get('backends'), 0)} | {_fmt(cpu.get('generator'), 0)} "
                f"| {shares} | {_fmt(_pct(lv['backend_max_share']), 0, '%')} "
                f"| {_fmt(_pct(lv['machine_busy']), 0, '%')} "
                f"| {_fmt(lv['other_cores'], 2)} | {_fmt(lv['ext_proc_streams_per_request'], 2)} "
                f"| {_fmt(lv['messages_per_stream'], 2)} |")
    setup = report["setup"]
    parts = [
        f"{params['rounds']} interleaved rounds of {params['phase_s']} s phases; medians over rounds "
        "(added latency and ratios paired per round with the same round's Envoy alone). Zero-work backends "
        f"({params['replicas']} processes), {params.get('processes', 1)} ext_proc server process(es) per arm, "
        f"Envoy --concurrency {setup['envoy_concurrency']}, load from "
        f"{setup['generator']} ({setup['wrk_threads']} thread(s)); latency at 1 connection is wrk's. CPU per request: "
        "/proc/PID/stat utime+stime over the phase / requests Envoy served; wrk's from its rusage.",
        "",
        *(f"- `{a}`: {s}" for a, s in report["arms"].items()),
        "",
        "\n".join(lines),
        "",
        "## Every connection level",
        "",
        "\n".join(detail),
    ]
    if report.get("notes"):
        parts += ["", "## Notes", "", *(f"- {n}" for n in report["notes"])]
    parts += ["", f"wrk command per phase (see report.json setup): `{setup.get('wrk_example', '')}`"]
    return "\n".join(parts)


def _pct(share: float | None) -> float | None:
    return None if share is None else share * 100


def write(report: dict[str, Any], out: Path) -> None:
    from routerlab.bench import plots

    report.setdefault("files", {})
    out.mkdir(parents=True, exist_ok=True)
    report["files"]["overhead.png"] = str(plots.overhead(report, out / "overhead.png"))
    drill.write(report, out, "Routing overhead: Envoy alone, the ext_proc floor, the router", markdown(report))
