"""`prefix-router bench`: run a scenario against each arm, write report.json/.md and plots."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from routerlab.bench import loadgen, progress
from routerlab.bench.arms import ARMS, DEFAULT_BALANCE_FACTOR
from routerlab.bench.scenarios import SCENARIOS

DRILLS = {
    "faults": "each fault (router killed/frozen, one of two routers killed, replica killed/hung/500s, "
              "scale-in/out) under load, hash and pick mode; --param faults=a,b modes=hash warm_s= fault_s= after_s=",
    "soak": "bounded open-loop load for --duration (600 s) per arm, the router's RSS every 30 s and its open "
            "streams after; --arms, --rate, --param sample_s= prefixes=",
    "overhead": "the hop's cost: Envoy alone vs a do-nothing server (the floor) vs the router, per "
                "shipped config and body size, wrk at 1/16/64 connections in interleaved rounds, CPU per request; "
                "--replicas (backends), --param rounds= phase_s= sizes=2,32 configs= arms= connections=16,64 "
                "warmup_s= threads= envoy_concurrency= floor_shape=aio-uvloop|aio-asyncio|sync "
                "http_floor=server|bare processes=",
}


def _scenario_help() -> str:
    return "; ".join(f"{s.name}: {s.summary}" for s in SCENARIOS.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "scenarios:\n" + "\n".join(
        f"  {s.name:14s} {s.summary}\n  {'':14s} params: " + ", ".join(f"{k}={v}" for k, v in s.params.items())
        for s in SCENARIOS.values()) + "\narms:\n" + "\n".join(f"  {a.name:15s} {a.summary}" for a in ARMS.values())
    parser.add_argument("--scenario", default="sagemaker-8k", choices=sorted([*SCENARIOS, *DRILLS]),
                        help="traffic scenario, or a drill: " + "; ".join(f"{k}: {v}" for k, v in DRILLS.items()))
    parser.add_argument("--arms", default=None,
                        help="comma-separated arms (default: the scenario's; 'all' adds installed peers); "
                             "NAME#2 runs NAME again under its own label (an A-A control)")
    parser.add_argument("--out", default="bench-out", help="output directory (default bench-out/SCENARIO)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (same traffic for every arm)")
    parser.add_argument("--seeds", default=None, metavar="A-B|A,B,...",
                        help="run the arms on each of these seeds, their order rotated a seed (OUT/seed-N; a seed "
                             "already there with every arm and the same scenario parameters is read, not re-run) "
                             "and write OUT/seeds.md/.json/.png: each arm's difference from the first per seed, "
                             "and its mean with a 95%% t interval")
    parser.add_argument("--quick", action="store_true", help="small scale (seconds): the tests' settings")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override a scenario parameter (repeatable; see the list below)")
    scale = parser.add_argument_group("scale")
    scale.add_argument("--replicas", type=int, help="replicas in the fleet")
    scale.add_argument("--requests", type=int, help="requests in the trace")
    scale.add_argument("--time-scale", type=float, help="simulator speed-up (durations divided by this)")
    scale.add_argument("--load", dest="load_mode", choices=loadgen.MODES,
                       help="closed loop (concurrency), open loop (Poisson rate), or scheduled (the scenario's "
                            "send times)")
    scale.add_argument("--concurrency", type=int, help="closed loop: sessions in flight")
    scale.add_argument("--rate", type=float, help="open loop: sessions started per second")
    scale.add_argument("--duration", type=float, dest="duration_s", help="hard time bound per arm, seconds")
    scale.add_argument("--num-blocks", type=int, help="per-replica KV blocks (overrides the scenario's sizing)")
    scale.add_argument("--profile", help="simulator profile (default llama-3.1-70b-h100-tp8)")
    routing = parser.add_argument_group("routing")
    routing.add_argument("--prefix-length", type=int, help="router PrefixLength in bytes (default: the scenario's)")
    routing.add_argument("--router-setting", action="append", default=[], metavar="NAME=VALUE",
                         help="a router setting for the prefix arms, sent as x-prefix-router-NAME stream metadata "
                              "(e.g. load-tokens=2048, concurrency-threshold=8; repeatable)")
    routing.add_argument("--router-flag", action="append", default=[], metavar="--FLAG=VALUE",
                         help="a process flag for every prefix arm's router, e.g. --bytes-per-token=1.9 "
                              "(what stream metadata cannot set; repeatable)")
    routing.add_argument("--balance-factor", type=int, default=DEFAULT_BALANCE_FACTOR,
                         help=f"hash_balance_factor of the prefix-bounded arm "
                              f"(default {DEFAULT_BALANCE_FACTOR}, as shipped)")
    backend = parser.add_argument_group("backend")
    backend.add_argument("--backend", choices=("sim", "vllm-cpu"), default="sim",
                         help="sim (default) or real vLLM on CPU (routerlab.realvllm)")
    backend.add_argument("--backend-url", action="append", default=[],
                         help="use running OpenAI-compatible servers (repeatable) instead of a fleet")
    backend.add_argument("--vllm-model", help="--backend vllm-cpu: model directory (default: make the tiny one)")
    backend.add_argument("--vllm-python", default=None, help="--backend vllm-cpu: python of the vLLM venv")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG figures")


def _params(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--param needs KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _arms(text: str | None) -> list[str] | None:
    if not text:
        return None
    if text == "all":
        return [a.name for a in ARMS.values() if a.available]
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a.partition("#")[0] not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if len(set(names)) < len(names):
        raise ValueError("an arm named twice: run it again as NAME#2 (an A-A control under its own label)")
    return names


def _out_dir(args: argparse.Namespace) -> Path:
    """``--out``, or bench-out/SCENARIO when it was left at its default."""
    return Path(args.out) / args.scenario if args.out == "bench-out" else Path(args.out)


def config_from_args(args: argparse.Namespace):
    from routerlab.bench.runner import BenchConfig

    return BenchConfig(
        scenario=args.scenario, arms=_arms(args.arms), seed=args.seed, out=_out_dir(args), quick=args.quick,
        params=_params(args.param), replicas=args.replicas, requests=args.requests, time_scale=args.time_scale,
        load_mode=args.load_mode, concurrency=args.concurrency, rate=args.rate, duration_s=args.duration_s,
        num_blocks=args.num_blocks, profile=args.profile, prefix_length=args.prefix_length,
        balance_factor=args.balance_factor, router_settings=_params(args.router_setting),
        router_flags=tuple(args.router_flag),
        backend_urls=list(args.backend_url), plots=not args.no_plots,
        progress=progress.default(),
    )


def run(args: argparse.Namespace) -> int:
    from routerlab.bench.report import markdown_table
    from routerlab.bench.runner import run_bench

    if args.scenario in DRILLS:
        import importlib

        from routerlab.bench.drill import run_from_args

        module = importlib.import_module(f"routerlab.bench.{args.scenario}")
        try:
            if args.seeds:
                raise ValueError(f"--seeds is for the scenarios, not the {args.scenario} drill")
            if args.arms and "arms" not in module.FLAGS:
                raise ValueError(f"the {args.scenario} drill takes no --arms"
                                 + (" (its arms: --param arms=...)" if "arms" in module.PARAMS else ""))
            params, arms = _params(args.param), _arms(args.arms)
        except ValueError as exc:
            print(f"prefix-router bench: {exc}", file=sys.stderr)
            return 2
        return run_from_args(args.scenario, module, args, _out_dir(args), params, arms, progress.default())
    try:
        cfg = config_from_args(args)
        seeds = None
        if args.seeds:  # scipy's import (~1 s) only for a campaign
            from routerlab.bench.seeds import parse_seeds, run_seeds

            seeds = parse_seeds(args.seeds)
        if seeds and (args.backend != "sim" or args.backend_url):
            raise ValueError("--seeds runs the simulated fleet (each seed starts its own)")
    except (ValueError, KeyError) as exc:
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 2
    if seeds:
        try:
            run_seeds(cfg, seeds)
        except (ValueError, KeyError) as exc:
            print(f"prefix-router bench: {exc}", file=sys.stderr)
            return 2
        print()
        print((cfg.out / "seeds.md").read_text())
        print(f"report: {cfg.out / 'seeds.md'} (and seeds.json, seeds.png, seed-N/) in {cfg.out}")
        return 0
    if args.backend == "vllm-cpu":
        from routerlab.bench.vllm_backend import run_with_vllm_cpu

        report = run_with_vllm_cpu(cfg, model=args.vllm_model, python=args.vllm_python)
    else:
        try:
            report = run_bench(cfg)
        except (ValueError, KeyError) as exc:
            print(f"prefix-router bench: {exc}", file=sys.stderr)
            return 2
    print()
    print(markdown_table(report))
    for note in report.notes:
        print(f"note: {note}")
    print(f"\nreport: {cfg.out / 'report.md'} (and report.json, PNG plots) in {cfg.out}")
    return 0

