"""Runs inside the inference-perf image (run.sh starts it): config, run, one-line summary.

    python3 driver.py --base-url URL --out /out [--shown-out HOSTDIR] [key=value ...]

1. Reads config.template.yaml (beside this file), sets server.base_url, applies the overrides and
   writes OUT/config.yaml.
2. Runs `inference-perf --config_file OUT/config.yaml`, its stdout and stderr into
   OUT/inference-perf.log, bounded by max_seconds of wall clock (then SIGINT, which makes
   inference-perf stop the stage and still write its reports; SIGKILL 60 s later).
3. Prints one line from OUT/reports/summary_lifecycle_metrics.json: TTFT p50 and p90 (ms),
   requests/s, successes and failures, the prompt tokens the server reported as cached, the path.

Overrides (value parsed as YAML: 8, 0.5, true, null, chat):
    num_groups, num_prompts_per_group, system_prompt_len, question_len, output_len, seed
                        data.shared_prefix.*
    concurrency         load.stages.0.concurrency_level (closed loop: requests in flight)
    num_requests        load.stages.0.num_requests (default num_groups * num_prompts_per_group)
    num_workers         load.num_workers
    request_timeout     load.request_timeout (seconds per request)
    model               server.model_name (default null: the first id of GET /v1/models)
    streaming           api.streaming (TTFT needs true)
    wire                chat (default) or completions; see below
    max_seconds         the wall-clock bound of the whole run (default 900)
    a.b.c               any dotted path of inference-perf's config (a number indexes a list)

wire: inference-perf 0.7.0's shared_prefix generator sends text-only prompts to /v1/completions
(prefix + " " + question as `prompt`) whatever api.type says; it builds chat requests only when
a multimodal block is configured. wire=chat adds an empty one (data.shared_prefix.multimodal: {}:
no media), so each request is a /v1/chat/completions call with one user message whose content is
one text part (prefix + " " + question). wire=completions leaves the config as an operator would
write it from the docs, and the requests go to /v1/completions.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "config.template.yaml"
SHORT = {
    "num_groups": "data.shared_prefix.num_groups",
    "num_prompts_per_group": "data.shared_prefix.num_prompts_per_group",
    "system_prompt_len": "data.shared_prefix.system_prompt_len",
    "question_len": "data.shared_prefix.question_len",
    "output_len": "data.shared_prefix.output_len",
    "seed": "data.shared_prefix.seed",
    "concurrency": "load.stages.0.concurrency_level",
    "num_requests": "load.stages.0.num_requests",
    "num_workers": "load.num_workers",
    "request_timeout": "load.request_timeout",
    "model": "server.model_name",
    "streaming": "api.streaming",
}
DRIVER_KEYS = {"wire", "max_seconds"}


def say(msg: str) -> None:
    print(f"inference-perf driver: {msg}", flush=True)


def set_path(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    node: Any = cfg
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            idx = int(part)
            if last:
                node[idx] = value
            else:
                node = node[idx]
        else:
            if last:
                node[part] = value
            else:
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]


def build_config(base_url: str, overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg = yaml.safe_load(TEMPLATE.read_text())
    cfg["server"]["base_url"] = base_url.rstrip("/")
    driver: dict[str, Any] = {"wire": "chat", "max_seconds": 900}
    explicit_requests = False
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"override {item!r} is not key=value")
        value = yaml.safe_load(raw) if raw else ""
        if key in DRIVER_KEYS:
            driver[key] = value
            continue
        path = SHORT.get(key, key)
        if "." not in path:
            raise SystemExit(f"unknown override {key!r}: use {', '.join(sorted([*SHORT, *DRIVER_KEYS]))} "
                             "or a dotted path of the inference-perf config")
        explicit_requests |= path == "load.stages.0.num_requests"
        set_path(cfg, path, value)
    shared = cfg["data"]["shared_prefix"]
    if not explicit_requests and cfg["load"]["type"] == "concurrent":
        cfg["load"]["stages"][0]["num_requests"] = int(shared["num_groups"]) * int(shared["num_prompts_per_group"])
    if driver["wire"] == "chat":
        cfg["api"]["type"] = "chat"
        shared.setdefault("multimodal", {})
    elif driver["wire"] == "completions":
        cfg["api"]["type"] = "completion"
        shared.pop("multimodal", None)
    else:
        raise SystemExit(f"wire={driver['wire']!r}: chat or completions")
    return cfg, driver


def run(cmd: list[str], log_path: Path, max_seconds: float, interrupted: threading.Event) -> int:
    """Run cmd with output into log_path; echo the lines worth seeing; SIGINT at max_seconds.

    After the SIGINT inference-perf ends the stage, writes its reports and prints its summary
    tables; it may then hang while stopping its worker processes, so once the tables are out
    (or 120 s after the SIGINT) the whole process group gets SIGKILL.
    """
    reports_out = threading.Event()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "COLUMNS": "120"})
        assert proc.stdout is not None

        def bound() -> None:
            try:
                proc.wait(timeout=max_seconds)
                return
            except subprocess.TimeoutExpired:
                say(f"max_seconds={max_seconds:g} reached: SIGINT (inference-perf still writes its reports)")
                interrupted.set()
                os.kill(proc.pid, signal.SIGINT)
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline and not reports_out.is_set():
                time.sleep(0.5)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                say("inference-perf did not exit after its reports (or 120 s after SIGINT): SIGKILL")
                os.killpg(proc.pid, signal.SIGKILL)

        watchdog = threading.Thread(target=bound, daemon=True)
        watchdog.start()
        tail: list[str] = []
        table_rows = 0
        for line in proc.stdout:
            log.write(line)
            log.flush()
            tail = [*tail[-29:], line]
            if worth_echoing(line):
                print("  | " + line.rstrip()[:240], flush=True)
            # The last table inference-perf prints: "Request Error Summary", then its rows.
            if "Request Error Summary" in line:
                table_rows = 1
            elif table_rows and line.startswith("\u2514"):  # the table's bottom border
                reports_out.set()
        rc = proc.wait()
        watchdog.join(timeout=1)
        if rc != 0 and not interrupted.is_set():
            say(f"inference-perf exited {rc}; the end of its log:")
            sys.stdout.write("".join("  | " + t for t in tail))
        return rc


def worth_echoing(line: str) -> bool:
    """inference-perf's own log lines (`date - logger - LEVEL - msg`) that tell where the run is."""
    parts = line.split(" - ", 3)
    if len(parts) < 4:
        return False
    level, msg = parts[2], parts[3]
    if level in ("WARNING", "ERROR", "CRITICAL"):
        return True
    return level == "INFO" and any(w in msg for w in ("Stage", "Inferred model", "timed out", "SIGINT", "Loadgen"))


def ms(summary: dict[str, Any] | None, key: str) -> str:
    if not summary or summary.get(key) is None:
        return "n/a"
    return f"{summary[key] * 1000:.1f}"


def summarize(report: Path, shown: Path) -> str:
    data = json.loads(report.read_text())
    ok = data.get("successes") or {}
    failed = (data.get("failures") or {}).get("count", 0)
    ttft = (ok.get("latency") or {}).get("time_to_first_token")
    rps = (ok.get("throughput") or {}).get("requests_per_sec")
    prompt = ok.get("prompt_tokens") or {}
    cached = ""
    if prompt.get("total"):
        cached = f"; prompt tokens cached {100 * prompt.get('cached', 0) / prompt['total']:.1f}%"
    rps_s = f"{rps:.2f}" if isinstance(rps, (int, float)) else "n/a"
    return (f"TTFT p50 {ms(ttft, 'median')} ms, p90 {ms(ttft, 'p90')} ms; {rps_s} req/s; "
            f"{ok.get('count', 0)} ok, {failed} failed{cached}; report {shown}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--out", default="/out", type=Path)
    ap.add_argument("--shown-out", default=None, help="OUT as the caller sees it (for the printed paths)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    out: Path = args.out
    shown = Path(args.shown_out) if args.shown_out else out
    cfg, driver = build_config(args.base_url, args.overrides)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    stage = cfg["load"]["stages"][0]
    shared = cfg["data"]["shared_prefix"]
    say(f"{cfg['api']['type']} ({'/v1/chat/completions' if driver['wire'] == 'chat' else '/v1/completions'}) "
        f"to {cfg['server']['base_url']}; shared_prefix {shared['num_groups']} groups x "
        f"{shared['num_prompts_per_group']} prompts, system {shared['system_prompt_len']} + question "
        f"{shared['question_len']} tokens, output {shared['output_len']}; load {cfg['load']['type']} "
        f"{stage}; max {driver['max_seconds']} s; config {shown / 'config.yaml'}")

    started = time.monotonic()
    interrupted = threading.Event()
    rc = run(["inference-perf", "--config_file", str(out / "config.yaml")], out / "inference-perf.log",
             float(driver["max_seconds"]), interrupted)
    took = time.monotonic() - started
    say(f"inference-perf exited {rc} after {took:.0f} s; log {shown / 'inference-perf.log'}")
    reports = sorted((out / "reports").rglob("summary_lifecycle_metrics.json"))
    if not reports:
        say("no summary_lifecycle_metrics.json was written: see the log")
        return rc or 1
    line = summarize(reports[-1], shown / reports[-1].relative_to(out))
    if interrupted.is_set():
        line += f" (stopped at max_seconds={driver['max_seconds']})"
        rc = 0  # a bounded run that wrote its reports is a result, not a failure
    (out / "summary.txt").write_text(line + "\n")
    print(f"inference-perf summary: {line}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
