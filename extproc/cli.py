"""`prefix-router` command line: one subcommand per module, imported only when used.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int`` so that
starting the server never pays for importing the simulator or the plotting stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from extproc import extras

# name -> (module, help, the extra it needs beyond the slim install)
COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "serve": ("extproc.serve", "run the ext_proc gRPC server Envoy consults", None),
    "health": ("extproc.health", "ask a running router its gRPC health (exit 0: serving), for probes", None),
    "explain": ("extproc.explain", "show how a request body becomes a prefix key", None),
    "sim": ("extproc.sim.cli", "run simulated vLLM replicas on loopback ports", "sim"),
    "bench": ("extproc.bench.cli", "A/B benchmark: stock Envoy routing vs prefix routing", "bench"),
    "microbench": ("extproc.bench.microbench", "the router's own work per request (pure core, no gRPC)", None),
    "demo": ("extproc.bench.demo", "short sagemaker-8k comparison (round robin vs pick mode)", "bench"),
    "fuzz": ("extproc.fuzz", "hostile-input run over normalise, key and pick: exceptions, time and memory per body",
             None),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Parser for all subcommands; only ``command``'s module is imported (for its flags)."""
    parser = argparse.ArgumentParser(prog="prefix-router", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    extra = COMMANDS[command][2] if command in COMMANDS else None
    if extra and (absent := extras.missing(extra)):
        print(extras.install_hint(command, extra, absent), file=sys.stderr)
        return 2
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    return int(args._run(args) or 0)
