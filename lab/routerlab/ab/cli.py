"""``prefix-router ab``: analyse an A/B run (``analyze``), drive a switchback and analyse it
(``switchback``), or record a split's counters per window for ``analyze`` (``record``).

Exit codes: 0 a verdict (a significant change, or "no significant difference yet"); 2 bad
arguments or unreadable input; 3 no verdict possible (no traffic in an arm, too few windows or
sessions, Envoy's admin or the replicas' metrics unreachable at the start); 4 a TTFT verdict
but no hit-rate comparison although counters were asked for.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from routerlab.ab import accesslog, analysis, driver, prometheus, record, report
from routerlab.ab import windows as windows_file
from routerlab.ab.counters import Delta, Source
from routerlab.ab.stats import DRAWS

EXIT_BAD_INPUT = 2


def _labelled_urls(values: list[str]) -> dict[str, list[str]]:
    """``--metrics-url`` values: URL or ARM=URL, comma-separated, repeatable; a label holds for the
    URLs after it in the same value (``prefix=URL,URL``); unlabelled URLs go under ""."""
    out: dict[str, list[str]] = {}
    for value in values:
        label = ""
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            if "=" in item.split("://")[0]:
                label, _, item = item.partition("=")
                label = label.strip()
            out.setdefault(label, [])
            if item not in out[label]:
                out[label].append(item)
    return out


def _metrics_urls(values: list[str]) -> list[str]:
    """Every URL of ``--metrics-url`` (in a switchback every replica serves the running arm, so the
    arm labels only say which pool a URL is in)."""
    return list(dict.fromkeys(u for urls in _labelled_urls(values).values() for u in urls))


def _selectors(values: list[str]) -> dict[str, str]:
    """``--selector ARM=MATCHERS`` values: arm -> label matchers, braces optional (``pod=~"a.*"`` or
    ``{pod=~"a.*"}``); a value that starts with a matcher (no ARM=) goes under "". DriverError for
    an arm given twice."""
    out: dict[str, str] = {}
    for value in values:
        arm, sep, selector = value.partition("=")
        if not sep or not arm.strip().isidentifier() or selector.lstrip().startswith(('"', "~")):
            # 'pod="x"', 'pod=~"x"' or '{pod="x"}': a matcher, no arm named
            arm, selector = "", value
        arm = arm.strip()
        if arm in out:
            raise driver.DriverError(f"--selector {arm or '(unlabelled)'} given twice")
        out[arm] = selector.strip().removeprefix("{").removesuffix("}").strip()
    return out


def _add_auth(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prometheus-auth-file", metavar="FILE",
                   help="with --prometheus: the credentials to send, one line: Bearer TOKEN, Basic B64, "
                        "user:password, or a bare token (bearer); user:password@ in the URL works too")


def _add_analysis_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="write the report as JSON (to compare runs)")
    p.add_argument("--plots", metavar="DIR", help="write ttft_cdf.png and over_time.png (needs the [bench] extra)")
    p.add_argument("--draws", type=int, default=DRAWS, help=f"bootstrap draws (default {DRAWS})")
    p.add_argument("--prometheus", metavar="URL", help="read the counters' increases from this Prometheus server "
                   "instead of (or besides) the windows file's edges")
    p.add_argument("--selector", action="append", default=[], metavar="ARM=MATCHERS",
                   help="with --prometheus: the label matchers of an arm's pool (pools, shared), or fleet=MATCHERS "
                        "for the whole fleet (switchback); default: every series")
    _add_auth(p)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ab_command", required=True)
    a = sub.add_parser("analyze", help="per-arm TTFT, errors, hit rate and the difference with a 95 %% CI",
                       description="Analyse an A/B run from Envoy's JSON access log (and the windows file).")
    a.add_argument("--access-log", required=True, metavar="FILE", help="Envoy's JSON access log")
    a.add_argument("--design", required=True, choices=analysis.DESIGNS,
                   help="switchback (interval over windows), pools or shared (interval over sessions)")
    a.add_argument("--windows", metavar="FILE",
                   help="the windows file (switchback: required, written by `ab switchback`; pools and shared: "
                        "optional, windows whose counters are keyed by arm give each pool's hit rate)")
    a.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    _add_analysis_arguments(a)
    s = sub.add_parser("switchback", help="flip the whole fleet between the arms in randomised windows, then analyse",
                       description="Drive Envoy's ab.prefix_share between 100 and 0 in randomised windows "
                                   "(balanced pairs), record the windows, restore the share, analyse.")
    s.add_argument("--admin", required=True, metavar="URL", help="Envoy's admin, e.g. http://127.0.0.1:9901")
    s.add_argument("--duration", type=float, required=True, metavar="S", help="bound on the whole run (seconds)")
    s.add_argument("--window-min", type=float, default=60.0, metavar="S", help="shortest window (default 60)")
    s.add_argument("--window-max", type=float, default=120.0, metavar="S", help="longest window (default 120)")
    s.add_argument("--burn-in", type=float, default=20.0, metavar="S",
                   help="seconds discarded after each switch (default 20; longer than your cache turnover)")
    s.add_argument("--access-log", required=True, metavar="FILE", help="the access log Envoy writes")
    s.add_argument("--windows", metavar="FILE", help="where to write the windows (default: ab-windows.jsonl)",
                   default="ab-windows.jsonl")
    s.add_argument("--metrics-url", action="append", default=[], metavar="[ARM=]URL,...",
                   help="the replicas' base URLs (their /metrics are read at each window's edges); repeatable; "
                        "or --prometheus URL --selector fleet=MATCHERS: the fleet's counters from Prometheus")
    s.add_argument("--seed", type=int, default=0, help="seed of the plan and the bootstrap (default 0)")
    _add_analysis_arguments(s)
    _add_record(sub)


def _add_record(sub: Any) -> None:
    r = sub.add_parser("record", help="pool or shared split: record each pool's counters per window (nothing is "
                       "flipped), for analyze", description="Read each pool's vLLM counters at fixed window edges "
                       "for a bounded time and write the windows file `ab analyze --windows` reads, so the splits "
                       "get a KV hit rate per arm per window.")
    r.add_argument("--design", choices=record.DESIGNS, default="pools",
                   help="pools (each arm's replicas: prefix=URL,... stock=URL,...) or shared (every replica, "
                        "unlabelled: the counters cannot split a shared fleet by arm); default pools")
    r.add_argument("--metrics-url", action="append", default=[], metavar="[ARM=]URL,...",
                   help="the replicas' base URLs (their /metrics), labelled by pool: prefix=URL,URL; repeatable")
    r.add_argument("--prometheus", metavar="URL", help="read the counters from this Prometheus server instead "
                   "(an instant query at each edge's time); each pool named by --selector")
    r.add_argument("--selector", action="append", default=[], metavar="ARM=MATCHERS",
                   help="with --prometheus: a pool's replicas as Prometheus sees them, label matchers "
                        "(prefix='pod=~\"vllm-prefix-.*\"', stock='...'; shared: fleet='...'); repeatable")
    _add_auth(r)
    r.add_argument("--duration", type=float, required=True, metavar="S", help="bound on the whole run (seconds)")
    r.add_argument("--window", type=float, default=60.0, metavar="S",
                   help="seconds between counter reads (default 60; at least 2 windows in --duration)")
    r.add_argument("--windows", metavar="FILE", default="ab-windows.jsonl",
                   help="where to write the windows (default: ab-windows.jsonl)")


def _record_source(args: argparse.Namespace) -> tuple[dict[str, list[str]] | None, Source | None]:
    """The pools of --metrics-url, or a Prometheus source of --prometheus and --selector (exactly one).
    DriverError for anything else."""
    server = _server(args)
    if bool(args.prometheus) == bool(args.metrics_url):
        raise driver.DriverError("give the replicas' --metrics-url, or --prometheus URL with a --selector per pool "
                                 "(one of the two)")
    if not args.prometheus:
        if args.selector:
            raise driver.DriverError("--selector names pools in Prometheus: it needs --prometheus URL")
        return record.pools_for(args.design, _labelled_urls(args.metrics_url)), None
    return None, prometheus.PrometheusSource(server, record.selectors_for(args.design, _selectors(args.selector)))


def _record(args: argparse.Namespace) -> int:
    def fail(e: Exception, code: int) -> int:
        print(f"prefix-router ab record: {e}", file=sys.stderr)
        return code

    try:
        pools, source = _record_source(args)
        record.window_count(args.duration, args.window)
    except driver.DriverError as e:
        return fail(e, EXIT_BAD_INPUT)
    t0 = time.monotonic()

    def progress(text: str) -> None:
        print(f"[ab] {time.monotonic() - t0:6.1f}s {text}", file=sys.stderr, flush=True)

    recorder = record.Recorder(args.design, pools, args.windows, source=source)
    try:
        if isinstance(source, prometheus.PrometheusSource):
            source.open(args.window)
            progress(f"Prometheus {source.base} scrapes these series every {source.interval:.3g} s: each edge "
                     f"is read {prometheus.SETTLE_INTERVALS * source.interval:.3g} s after it, at its own time")
        recorder.open()
    except driver.BadInput as e:
        return fail(e, EXIT_BAD_INPUT)
    except driver.DriverError as e:
        return fail(e, analysis.EXIT_NO_VERDICT)
    progress(f"recording {', '.join(f'{g}: {len(u)} replicas' for g, u in recorder.pools.items())} every "
             f"{args.window:g} s for {args.duration:g} s into {args.windows}")
    header = recorder.record(args.duration, args.window, progress)
    windows_file.append(args.windows, header)
    progress(f"done: {header['windows_done']} windows"
             + (f" (interrupted: {header['interrupted']})" if "interrupted" in header else "")
             + f"; analyse with: prefix-router ab analyze --design {args.design} --windows {args.windows} "
               "--access-log FILE")
    if "stopped" in header:
        return fail(driver.DriverError(f"stopped: {header['stopped']}; the {header['windows_done']} windows "
                                       f"before it are in {args.windows}"), analysis.EXIT_NO_VERDICT)
    return 0


def _server(args: argparse.Namespace) -> prometheus.Server:
    """--prometheus with its credentials (--prometheus-auth-file, or user:password@ in the URL)."""
    if args.prometheus_auth_file and not args.prometheus:
        raise driver.BadInput("--prometheus-auth-file goes with --prometheus URL")
    return prometheus.server(args.prometheus or "", args.prometheus_auth_file)


def _prometheus(args: argparse.Namespace):
    server = _server(args)
    if not args.prometheus:
        return None
    selectors = _selectors(args.selector)
    try:
        prometheus.query(server, "time()")  # credentials refused: the user's to fix, before any analysis
    except (OSError, ValueError):
        pass  # unreachable or odd: the analysis notes it per read

    def read(arm: str, start: float, end: float) -> Delta:
        return prometheus.increase(server, selectors.get(arm, ""), start, end)

    return read


def _analyse(args: argparse.Namespace, design: str, windows_path: str | None) -> int:
    try:
        log = accesslog.read(args.access_log)
    except (OSError, ValueError) as e:
        print(f"prefix-router ab: cannot read the access log: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    wf = None
    if windows_path:
        try:
            wf = windows_file.read(windows_path)
        except OSError as e:
            print(f"prefix-router ab: cannot read the windows file: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if log.lines and log.garbage == log.lines:
        print(f"prefix-router ab: {args.access_log}: all {log.lines} lines are garbage (not Envoy's JSON access "
              f"log?); first: {log.garbage_examples[0]}", file=sys.stderr)
        return analysis.EXIT_NO_VERDICT
    try:
        read = _prometheus(args)
    except driver.DriverError as e:
        print(f"prefix-router ab: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    result = analysis.analyze(log, design, wf, read, seed=args.seed, draws=args.draws)
    print(report.text(result, args.access_log), end="")
    if args.json:
        report.write_json(result, args.json, {"access_log": str(args.access_log), "windows_file": windows_path})
    if args.plots and result.ttft and any(result.ttft.values()):
        try:
            from routerlab.ab import plots
        except ImportError as e:
            print(f"prefix-router ab: no plots ({e}): pip install './lab[bench]'", file=sys.stderr)
        else:
            for path in plots.write_all(result, args.plots).values():
                print(f"plot: {path}")
    if result.fatal:
        for f in result.fatal:
            print(f"prefix-router ab: no verdict: {f}", file=sys.stderr)
    return result.exit_code


def _switchback(args: argparse.Namespace) -> int:
    try:
        planned = driver.plan(args.duration, args.window_min, args.window_max, args.seed)
        if args.burn_in >= args.window_min:
            raise driver.DriverError(f"--burn-in {args.burn_in:g} s must be shorter than --window-min "
                                     f"{args.window_min:g} s, or a window measures nothing")
    except driver.DriverError as e:
        print(f"prefix-router ab switchback: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    t0 = time.monotonic()

    def progress(text: str) -> None:
        print(f"[ab] {time.monotonic() - t0:6.1f}s {text}", file=sys.stderr, flush=True)

    try:
        source = _switchback_source(args)
        if source is not None:
            source.open(args.window_min - args.burn_in, "the measured part of the shortest window (--window-min - "
                        "--burn-in)")
            progress(f"Prometheus {source.base} scrapes the fleet's series every {source.interval:.3g} s: each "
                     f"edge is read at its own time, {prometheus.SETTLE_INTERVALS * source.interval:.3g} s after it")
        header = driver.run(driver.Admin(args.admin), args.windows, planned, args.burn_in,
                            _metrics_urls(args.metrics_url), progress, seed=args.seed, source=source)
    except driver.BadInput as e:
        print(f"prefix-router ab switchback: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except driver.DriverError as e:
        print(f"prefix-router ab switchback: {e}", file=sys.stderr)
        return analysis.EXIT_NO_VERDICT
    progress(f"done: {header['windows_done']} windows, share restored to "
             f"{header['restored'] if header['restored'] is not None else 'the config default'}")
    if "interrupted" in header:
        progress(f"interrupted ({header['interrupted']}): analysing the windows that ended")
    windows_file.append(args.windows, {"kind": "run", **header})
    if "stopped" in header:
        print(f"prefix-router ab switchback: stopped: {header['stopped']}; the {header['windows_done']} windows "
              f"before it are in {args.windows}", file=sys.stderr)
        return analysis.EXIT_NO_VERDICT
    last_end = max((w.end for w in windows_file.read(args.windows).windows), default=time.time())
    if not driver.wait_for_log(args.access_log, last_end):
        progress("the access log was not written after the last window (is Envoy logging to it?)")
    return _analyse(args, "switchback", args.windows)


def _switchback_source(args: argparse.Namespace) -> prometheus.PrometheusSource | None:
    """With --prometheus, the fleet's counters from it (--selector fleet=MATCHERS, required: every
    vLLM series a Prometheus holds may be more than this fleet); BadInput with --metrics-url too."""
    server = _server(args)
    if not args.prometheus:
        return None
    if args.metrics_url:
        raise driver.BadInput("give the replicas' --metrics-url or --prometheus URL --selector fleet=MATCHERS, "
                              "not both (each window's counters come from one of them)")
    try:
        matchers = record.selectors_for("shared", _selectors(args.selector))
    except driver.DriverError as e:
        raise driver.BadInput(str(e).replace("a shared split", "a switchback")) from None
    return prometheus.PrometheusSource(server, matchers)


def run(args: argparse.Namespace) -> int:
    if args.ab_command == "switchback":
        return _switchback(args)
    if args.ab_command == "record":
        return _record(args)
    return _analyse(args, args.design, args.windows)
