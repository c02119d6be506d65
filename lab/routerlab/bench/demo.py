"""`prefix-router demo` (`make demo`): a short sagemaker-8k A/B, round robin vs precise mode.

Precise mode (pick mode on the replicas' own KV-cache events, matched against the requests'
exact token ids) is the mode to recommend where the replicas can publish events: every router
replica then sees the same cache view. The simulated replicas tokenise with the tiny real
tokenizer and publish events, for both arms. Sized to finish in about a minute on a 2-core
machine, and bounded by ``--duration`` (75 s) per arm: 7 simulated Llama-3.1-70B replicas, 35
shared 8000-token prefixes of which each replica caches 8, sustained closed-loop load. Prints
the comparison table and where the report is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEMO_PARAMS = {"requests": 350, "prefixes": 35, "kv_prefixes_per_replica": 8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench-out/demo", help="output directory (default bench-out/demo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=DEMO_PARAMS["requests"], help="requests per arm")
    parser.add_argument("--duration", type=float, default=75.0, help="time bound per arm, seconds")


def run(args: argparse.Namespace) -> int:
    from routerlab.bench import progress
    from routerlab.bench.report import markdown_table
    from routerlab.bench.runner import BenchConfig, run_bench

    out = Path(args.out)
    print("prefix-router demo: sagemaker-8k, stock Envoy round robin vs precise mode (pick mode on the replicas' "
          "KV-cache events; real Envoy, real ext_proc server, 7 simulated vLLM replicas on loopback)\n", flush=True)
    report = run_bench(BenchConfig(
        scenario="sagemaker-8k", arms=("round-robin", "prefix-precise"), seed=args.seed, out=out,
        params={**DEMO_PARAMS, "requests": args.requests}, duration_s=args.duration, progress=progress.default(),
    ))
    print()
    print(markdown_table(report))
    print(f"\noracle hit rate of the trace: {report.oracle_hit_rate:.0%}")
    for note in report.notes:
        print(f"note: {note}")
    print(f"\nreport: {out / 'report.md'}\njson:   {out / 'report.json'}\nplots:  "
          + ", ".join(str(out / p) for p in ("ttft_cdf.png", "hit_rate.png", "requests_per_replica.png")))
    return 0
